"""Per-peer budgets and the node's fair share, sans-I/O: how many PULLs and how many requested bytes
per second one authenticated peer may cost a server, as token buckets keyed by the peer's node name;
and what all peers together may cost it (bytes served, handshakes begun), shared fairly.

    server, per PULL:   admit_pull(peer, now) ─► Verdict.OK | PULLS | BYTES
                        (a refused PULL is answered ERROR overloaded, never silently dropped)
    server, per batch:  charge_bytes(peer, n, now)    bytes served for that peer's PULLs
    after a refusal:    wait_s(peer, now)             until its next PULL would be admitted: the
                        server stops reading that peer meanwhile, so a flood is slowed by the
                        transport's own flow control instead of being read and refused at full speed

A bucket holds at most `burst` tokens and refills at `rate` per second; a PULL takes one token of
the PULL bucket. Bytes are known only once blocks are read, so they are charged afterwards and the
byte bucket may go into debt: a peer in debt gets no new PULL until the refill pays it back. A
bucket is created full, so a peer that was idle starts with its whole burst. Buckets left full
(they would be created the same way) are forgotten once more than MAX_TRACKED peers are known.
Every call is O(1), except that sweep: O(peers), at most once per MAX_TRACKED new peers.

Beside them, node-wide (`SharedBudget`): one bucket for the bytes all peers are served and one for
the handshakes all sources begin. While a shared bucket has tokens, everyone is admitted; once it is
empty (the node is contended), a key is admitted only while its recent use (decayed with a half-life
of `SHARE_HALF_LIFE_S`) is at most the average of the keys active lately: the heaviest users are
refused first and a light peer still gets its share, so many certificates (or addresses) together
cannot crowd one good client out. That check is O(keys active lately), only while contended.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fabric import config as defaults
from fabric.config import TransportConfig

MAX_TRACKED = 4096   # peers whose buckets are kept before the full ones are swept
SHARE_HALF_LIFE_S = 1.0   # how fast a key's recent use of a shared budget is forgotten


@dataclass(frozen=True, slots=True)
class PeerRates:
    """What one peer may cost per second. The defaults are far above what a pulling node asks for
    (a pull of 64 addresses per QUIC stream, 1,024 per TLS-TCP PULL)."""

    pulls_per_s: float = defaults.PEER_PULLS_PER_S
    pull_burst: float = defaults.PEER_PULL_BURST
    bytes_per_s: float = defaults.PEER_BYTES_PER_S
    bytes_burst: float = defaults.PEER_BYTES_BURST
    node_bytes_per_s: float = defaults.NODE_BYTES_PER_S   # all peers together, shared fairly (module docstring)
    node_bytes_burst: float = defaults.NODE_BYTES_BURST
    handshakes_per_s: float = defaults.NODE_HANDSHAKES_PER_S   # handshakes begun, all sources, shared fairly
    handshake_burst: float = defaults.NODE_HANDSHAKE_BURST

    def __post_init__(self) -> None:
        for name in ("pulls_per_s", "pull_burst", "bytes_per_s", "bytes_burst", "node_bytes_per_s",
                     "node_bytes_burst", "handshakes_per_s", "handshake_burst"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PeerRates.{name} must be > 0, got {getattr(self, name)}")


def peer_rates(config: TransportConfig) -> PeerRates:
    """The [transport] section's per-peer rates."""
    return PeerRates(config.peer_pulls_per_s, config.peer_pull_burst, config.peer_bytes_per_s,
                     config.peer_bytes_burst, config.node_bytes_per_s, config.node_bytes_burst,
                     config.node_handshakes_per_s, config.node_handshake_burst)


@dataclass(slots=True)
class TokenBucket:
    """`tokens` refill at `rate` per second up to `burst`; `updated` is when they were last counted."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, rate: float, burst: float, now: float) -> TokenBucket:
        return cls(rate, burst, burst, now)

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now

    def take(self, amount: float, now: float) -> bool:
        """Take `amount` tokens if there are that many; False (nothing taken) if not."""
        self._refill(now)
        if self.tokens < amount:
            return False
        self.tokens -= amount
        return True

    def charge(self, amount: float, now: float) -> None:
        """Take `amount` tokens even if that leaves the bucket in debt."""
        self._refill(now)
        self.tokens -= amount

    def in_debt(self, now: float) -> bool:
        self._refill(now)
        return self.tokens < 0

    def available(self, now: float) -> float:
        """The tokens there are at `now` (negative while in debt)."""
        self._refill(now)
        return self.tokens

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until the bucket holds `amount` tokens (0: it does now)."""
        self._refill(now)
        return max(0.0, (amount - self.tokens) / self.rate)

    def is_full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst


class Verdict(enum.Enum):
    OK = "ok"
    PULLS = "pulls"   # over its PULLs per second
    BYTES = "bytes"   # over its requested bytes per second
    SHARE = "fair_share"   # the node is contended and this peer used more than its fair share lately


class SharedBudget:
    """A node-wide token bucket that keys (peers, source addresses) share fairly (module docstring)."""

    def __init__(self, rate: float, burst: float, now: float = 0.0, *, half_life_s: float = SHARE_HALF_LIFE_S) -> None:
        self.bucket = TokenBucket.full(rate, burst, now)
        self.half_life_s = half_life_s
        self._use: dict[str, tuple[float, float]] = {}   # key -> (recent use, when it was counted)

    def _recent(self, key: str, now: float) -> float:
        found = self._use.get(key)
        if found is None:
            return 0.0
        value, updated = found
        return value * float(0.5 ** (max(0.0, now - updated) / self.half_life_s))

    def admit(self, key: str, now: float) -> bool:
        """May `key` take more now? Yes while the bucket has tokens; when it has none, only a key
        whose recent use is at most the average of the keys active lately."""
        if self.bucket.take(0, now) and self.bucket.tokens > 0:
            return True
        uses = [self._recent(k, now) for k in self._use]
        active = [u for u in uses if u > 1e-9 * max(uses, default=0.0)]
        if not active:
            return True
        return self._recent(key, now) * len(active) <= sum(active)

    def charge(self, key: str, amount: float, now: float) -> None:
        """`key` took `amount` (the bucket may go into debt: bytes are known only once read)."""
        self.bucket.charge(amount, now)
        self._use[key] = (self._recent(key, now) + amount, now)
        if len(self._use) > MAX_TRACKED:   # forget the keys that used least lately
            keep = sorted(self._use, key=lambda k: self._recent(k, now), reverse=True)[:MAX_TRACKED // 2]
            self._use = {k: self._use[k] for k in keep}


@dataclass(slots=True)
class _Buckets:
    pulls: TokenBucket
    bytes: TokenBucket


class PeerBudgets:
    """The buckets of every peer of one server."""

    def __init__(self, rates: PeerRates | None = None, now: float = 0.0) -> None:
        self.rates = r = rates or PeerRates()
        self._peers: dict[str, _Buckets] = {}
        self._sweep_at = MAX_TRACKED
        self.shared_bytes = SharedBudget(r.node_bytes_per_s, r.node_bytes_burst, now)
        self.handshakes = SharedBudget(r.handshakes_per_s, r.handshake_burst, now)

    def _of(self, peer: str, now: float) -> _Buckets:
        found = self._peers.get(peer)
        if found is None:
            if len(self._peers) >= self._sweep_at:
                self._sweep(now)
            r = self.rates
            found = self._peers[peer] = _Buckets(TokenBucket.full(r.pulls_per_s, r.pull_burst, now),
                                                 TokenBucket.full(r.bytes_per_s, r.bytes_burst, now))
        return found

    def admit_pull(self, peer: str, now: float) -> Verdict:
        """May `peer` start one more PULL now? OK takes its token."""
        buckets = self._of(peer, now)
        if buckets.bytes.in_debt(now):
            return Verdict.BYTES
        if not self.shared_bytes.admit(peer, now):
            return Verdict.SHARE
        return Verdict.OK if buckets.pulls.take(1, now) else Verdict.PULLS

    def charge_bytes(self, peer: str, num_bytes: int, now: float) -> None:
        """`num_bytes` payload bytes were served for `peer`'s PULLs."""
        if num_bytes:
            self._of(peer, now).bytes.charge(num_bytes, now)
            self.shared_bytes.charge(peer, num_bytes, now)

    def admit_handshake(self, source: str, now: float) -> bool:
        """May a handshake from `source` (an address: the peer is not authenticated yet) begin now?
        An admitted one is charged."""
        if not self.handshakes.admit(source, now):
            return False
        self.handshakes.charge(source, 1, now)
        return True

    def wait_s(self, peer: str, now: float) -> float:
        """Seconds until `peer` would be admitted a PULL (0: now)."""
        buckets = self._of(peer, now)
        shared = self.shared_bytes.bucket.wait_s(0, now) if not self.shared_bytes.admit(peer, now) else 0.0
        return max(buckets.pulls.wait_s(1, now), buckets.bytes.wait_s(0, now), shared)

    @property
    def num_tracked(self) -> int:
        return len(self._peers)

    def _sweep(self, now: float) -> None:
        self._peers = {p: b for p, b in self._peers.items() if not (b.pulls.is_full(now) and b.bytes.is_full(now))}
        self._sweep_at = len(self._peers) + MAX_TRACKED
