"""Live estimates a node decides with, pure: the caller passes measurements and `now`.

    PeerEstimates     per peer: EWMA of pull bandwidth (bytes/s) and round trip (s), recent failures
    PrefillEstimate   this node's engines: EWMA of prefill tokens/s
    plan_by_deadline  which owner runs of a load pay: expected arrival before the engine could compute

A pull of `n` bytes from a peer is expected to take `rtt + n / bandwidth`; computing the same
tokens takes `tokens / prefill rate`. A run pays when its pull is expected to land first, by a
margin (`PULL_MARGIN`, because a pull that arrives just in time still costs the engine a copy and
a verification). Runs are planned in prefix order: the engine can use only a leading run, so the
first run that does not pay ends the plan. Until a peer has been measured the node assumes it is
worth trying (`DEFAULT_BANDWIDTH`); a peer with recent failures is treated as slower, and the
estimate recovers as its pulls succeed again.

EWMA: each sample moves the estimate by `alpha` of the difference, so the last ~1/alpha samples
dominate; O(1) per sample and per query. An estimate not refreshed for STALE_S is dropped, so a
peer judged too slow is tried (and measured) again once in a while.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_BANDWIDTH = 1e9      # bytes/s assumed for a peer never measured: try it, then learn
DEFAULT_RTT_S = 0.001
PULL_MARGIN = 0.8            # a pull pays when it is expected to take < this share of the recompute
FAILURE_PENALTY = 2.0        # each recent failure doubles a peer's expected time ...
FAILURE_MEMORY_S = 30.0      # ... and is forgotten after this long
MIN_PREFILL_TOKENS = 128     # a shorter prefill is mostly per-call overhead: it says little about the rate
STALE_S = 60.0               # a peer not pulled from this long is assumed fast again (and so measured again)


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


@dataclass(slots=True)
class PeerEstimate:
    bandwidth: float | None = None      # bytes/s of completed pulls
    rtt_s: float | None = None          # time to the first byte (or of a pull too small to time bandwidth)
    failures: list[float] = field(default_factory=list)   # when recent failures happened
    num_pulls: int = 0
    updated_at: float = 0.0


class PeerEstimates:
    """Per-peer pull bandwidth, round trip and recent failures, from completed pulls."""

    def __init__(self, alpha: float = 0.3) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._peers: dict[str, PeerEstimate] = {}

    def record_pull(self, peer: str, num_bytes: int, seconds: float, rtt_s: float | None = None,
                    now: float = 0.0, cut: bool = False) -> None:
        """A pull that moved `num_bytes` in `seconds` (its first answer after `rtt_s`), ending at `now`.
        A `cut` pull (stopped at its deadline) replaces the bandwidth estimate instead of moving it:
        it proves the peer slower than the plan assumed, and the next load must not repeat the bet."""
        if num_bytes < 0 or seconds < 0:
            raise ValueError("num_bytes and seconds must be >= 0")
        est = self._peers.setdefault(peer, PeerEstimate())
        est.num_pulls += 1
        est.updated_at = now
        if rtt_s is not None:
            est.rtt_s = _ewma(est.rtt_s, rtt_s, self.alpha)
        # Bandwidth over the whole pull, round trip included: the first answer is a whole frame
        # (up to ~1 MiB), so subtracting it would overstate a slow link. Errs on the slow side.
        if num_bytes > 0 and seconds > 0:
            est.bandwidth = num_bytes / seconds if cut else _ewma(est.bandwidth, num_bytes / seconds, self.alpha)

    def record_failure(self, peer: str, now: float) -> None:
        self._peers.setdefault(peer, PeerEstimate()).failures.append(now)

    def expected_s(self, peer: str, num_bytes: int, now: float) -> float:
        """Expected seconds to pull `num_bytes` from `peer`."""
        est = self._peers.get(peer) or PeerEstimate()
        est.failures[:] = [t for t in est.failures if now - t < FAILURE_MEMORY_S]
        # A slow estimate that nothing has refreshed for STALE_S is dropped: a peer judged too slow is
        # never pulled from, so without this it could never be measured again once its link recovers.
        fresh = now - est.updated_at < STALE_S
        bandwidth = est.bandwidth if est.bandwidth and fresh else DEFAULT_BANDWIDTH
        rtt = est.rtt_s if est.rtt_s is not None and fresh else DEFAULT_RTT_S
        base = rtt + num_bytes / bandwidth
        return base * FAILURE_PENALTY ** len(est.failures)

    def snapshot(self, now: float) -> dict[str, dict[str, float]]:
        """For stats and metrics: per peer bandwidth (MB/s), rtt (ms), recent failures, pulls."""
        out = {}
        for peer, est in self._peers.items():
            recent = sum(1 for t in est.failures if now - t < FAILURE_MEMORY_S)
            out[peer] = {"bandwidth_mb_s": (est.bandwidth or 0.0) / 1e6, "rtt_ms": (est.rtt_s or 0.0) * 1e3,
                         "recent_failures": float(recent), "pulls": float(est.num_pulls)}
        return out


class PrefillEstimate:
    """Prefill tokens/s of this node's engines, from the prefills they report."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self.tokens_per_s: float | None = None
        self.num_samples = 0

    def record(self, num_tokens: int, seconds: float) -> None:
        if num_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return   # too short to time (a prompt's suffix after a hit): says little about the rate
        self.tokens_per_s = _ewma(self.tokens_per_s, num_tokens / seconds, self.alpha)
        self.num_samples += 1

    def compute_s(self, num_tokens: int) -> float | None:
        """Expected seconds to prefill `num_tokens`; None until an engine reported a prefill."""
        return None if not self.tokens_per_s else num_tokens / self.tokens_per_s


class PrefillRates:
    """A `PrefillEstimate` per model (namespace root): each model prefills at its own rate."""

    def __init__(self, alpha: float = 0.3) -> None:
        self.alpha = alpha
        self._by_ns: dict[bytes, PrefillEstimate] = {}

    def of(self, ns_root: bytes) -> PrefillEstimate:
        est = self._by_ns.get(ns_root)
        if est is None:
            est = self._by_ns[ns_root] = PrefillEstimate(self.alpha)
        return est

    def snapshot(self) -> dict[str, float]:
        """Tokens/s per namespace (its root's first 8 bytes in hex)."""
        return {root[:8].hex(): est.tokens_per_s or 0.0 for root, est in self._by_ns.items()}


@dataclass(frozen=True, slots=True)
class RunCost:
    """One owner run of a load: who holds it, how many blocks, their bytes and tokens."""

    node_id: str
    num_blocks: int
    num_bytes: int
    num_tokens: int


def plan_by_deadline(runs: Sequence[RunCost], peers: PeerEstimates, prefill: PrefillEstimate, now: float,
                     deadline_s: float | None = None) -> tuple[int, float | None]:
    """How many of `runs` (in prefix order) to pull, and the deadline for them (seconds from now).

    Runs are pulled concurrently, so the first k runs land after the slowest of them. A `deadline_s`
    of infinity pulls every run and never cuts (what a caller asks for when it wants the KV whatever it
    costs). Without a
    prefill estimate every run is pulled (nothing to compare with) under `deadline_s`. Otherwise
    the first k runs are pulled for the largest k whose slowest expected pull stays below
    PULL_MARGIN of the time to compute their tokens (and within `deadline_s` when given); the
    deadline is then PULL_MARGIN of that compute time (or `deadline_s`, if smaller): a pull that
    overruns it is cancelled and the engine computes from the leading run that did arrive."""
    if prefill.compute_s(1) is None or deadline_s == math.inf:   # nothing to compare with, or no limit asked
        return len(runs), None if deadline_s == math.inf else deadline_s
    slowest = 0.0
    tokens = 0
    taken, taken_tokens = 0, 0
    for k, run in enumerate(runs, start=1):
        slowest = max(slowest, peers.expected_s(run.node_id, run.num_bytes, now))
        tokens += run.num_tokens
        compute = prefill.compute_s(tokens)
        assert compute is not None, "a prefill estimate exists here"
        if slowest < PULL_MARGIN * compute and (deadline_s is None or slowest <= deadline_s):
            taken, taken_tokens = k, tokens
    if taken == 0:
        return 0, None
    budget = PULL_MARGIN * (prefill.compute_s(taken_tokens) or 0.0)
    return taken, budget if deadline_s is None else min(budget, deadline_s)
