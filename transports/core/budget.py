"""Per-peer budgets, sans-I/O: how many PULLs and how many requested bytes per second one
authenticated peer may cost a server, as token buckets keyed by the peer's node name.

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
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fabric.config import TransportConfig

MAX_TRACKED = 4096   # peers whose buckets are kept before the full ones are swept


@dataclass(frozen=True, slots=True)
class PeerRates:
    """What one peer may cost per second. The defaults are far above what a pulling node asks for
    (a pull of 64 addresses per QUIC stream, 1,024 per TLS-TCP PULL)."""

    pulls_per_s: float = 1000.0
    pull_burst: float = 2000.0
    bytes_per_s: float = 4.0 * (1 << 30)
    bytes_burst: float = 4.0 * (1 << 30)

    def __post_init__(self) -> None:
        for name in ("pulls_per_s", "pull_burst", "bytes_per_s", "bytes_burst"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PeerRates.{name} must be > 0, got {getattr(self, name)}")


def peer_rates(config: TransportConfig) -> PeerRates:
    """The [transport] section's per-peer rates."""
    return PeerRates(config.peer_pulls_per_s, config.peer_pull_burst, config.peer_bytes_per_s,
                     config.peer_bytes_burst)


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


@dataclass(slots=True)
class _Buckets:
    pulls: TokenBucket
    bytes: TokenBucket


class PeerBudgets:
    """The buckets of every peer of one server."""

    def __init__(self, rates: PeerRates | None = None) -> None:
        self.rates = rates or PeerRates()
        self._peers: dict[str, _Buckets] = {}
        self._sweep_at = MAX_TRACKED

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
        return Verdict.OK if buckets.pulls.take(1, now) else Verdict.PULLS

    def charge_bytes(self, peer: str, num_bytes: int, now: float) -> None:
        """`num_bytes` payload bytes were served for `peer`'s PULLs."""
        if num_bytes:
            self._of(peer, now).bytes.charge(num_bytes, now)

    def wait_s(self, peer: str, now: float) -> float:
        """Seconds until `peer` would be admitted a PULL (0: now)."""
        buckets = self._of(peer, now)
        return max(buckets.pulls.wait_s(1, now), buckets.bytes.wait_s(0, now))

    @property
    def num_tracked(self) -> int:
        return len(self._peers)

    def _sweep(self, now: float) -> None:
        self._peers = {p: b for p, b in self._peers.items() if not (b.pulls.is_full(now) and b.bytes.is_full(now))}
        self._sweep_at = len(self._peers) + MAX_TRACKED
