"""What the transport servers share besides the sessions: reading blocks from the store in
batches (on the loop or in a thread pool), pacing egress and each peer's budget.

`fetch` calls the store (I/O); the sessions never do. Timers are `timer.DeadlineTimer`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from fabric.keys import BlockAddress
from transports.core.base import BlockSource
from transports.core.budget import PeerBudgets, Verdict
from transports.core.metrics import TransportMetrics
from transports.core.session import Fetched, ServerSession
from transports.trust.tenant_tokens import pull_authoriser

logger = logging.getLogger(__name__)

BATCH_BYTES = 1024 * 1024         # a server fetches up to this many payload bytes per batch
INLINE_FETCH_S = 0.001            # a get_block slower than this on the loop counts as slow …
SLOW_STREAK = 3                   # … this many in a row send fetching to the thread pool …
SLOW_SOURCE_HOLD_S = 1.0          # … for this long
PACED_BATCH_S = 0.05              # a server with a capped egress sends batches of this long at its rate
THROTTLE_MIN_S = 0.05             # a peer refused over its budget is not read for at least this long …
THROTTLE_MAX_S = 1.0              # … and at most this long at a time (far below the frame and idle timeouts)


class EgressPacer:
    """Caps what a server sends to `rate` bytes/s, over all its connections (a node's egress): each
    batch may leave once the batches before it have had their time. Pure: `now` comes in."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate}")
        self.rate = rate
        self._free_at = 0.0

    def batch_bytes(self, most: int) -> int:
        """A batch worth at most PACED_BATCH_S of the rate (and `most`): a capped server sends small
        batches often rather than a burst and then a long pause."""
        return max(1, min(most, int(self.rate * PACED_BATCH_S)))

    def wait_s(self, num_bytes: int, now: float) -> float:
        """Seconds to wait before sending the next batch, after one of `num_bytes` was sent now."""
        self._free_at = max(now, self._free_at) + num_bytes / self.rate
        return max(0.0, self._free_at - now)


def payload_bytes(fetched: Sequence[Fetched]) -> int:
    return sum(memoryview(f.payload).nbytes for f in fetched if f is not None and not isinstance(f, Exception))


class ServingServer:
    """What TLS-TCP and QUIC servers share: where store reads run, counting what was served, and
    each peer's budget. Subclasses set `executor` (a thread pool, or None: always on the loop),
    `metrics`, `transport`, `budgets` and `max_connections_per_peer`."""

    source: BlockSource
    executor: Executor | None
    metrics: TransportMetrics
    transport: str
    budgets: PeerBudgets
    max_connections_per_peer: int
    slow_until: float = 0.0   # loop time until which store reads run in the thread pool
    slow_streak: int = 0
    pacer: EgressPacer | None = None   # `[transport] send_rate_mb_s`, when set
    # True: PULLs that name no namespace root get misses (connections and streams opened from then on)
    require_pull_namespace: bool = False
    # The tenants whose namespace a root is (None: not bound here), set by the node: a peer whose
    # certificate is restricted to tenants reads only their roots (`tenant_tokens.pull_authoriser`).
    tenant_roots: Callable[[bytes], frozenset[str] | None] | None = None

    def authoriser(self, peer_tenants: frozenset[str]) -> Callable[[bytes], bool] | None:
        """Which namespace roots a peer restricted to `peer_tenants` may read (None: every root)."""
        return pull_authoriser(self.tenant_roots, peer_tenants)

    def fetches_inline(self, now: float) -> bool:
        """Where the next batch is read: on the loop (True: RAM-resident blocks answer in microseconds),
        or in the thread pool (False) for SLOW_SOURCE_HOLD_S after SLOW_STREAK slow reads in a row
        (disk, not a one-off preemption). Both servers place their reads by this one rule."""
        return self.executor is None or now >= self.slow_until

    def fetch_inline(self, addresses: Sequence[BlockAddress], budget: int) -> list[Fetched]:
        """Read a batch on the loop (see `fetches_inline`), noting whether the store was slow."""
        fetched, slow = fetch(self.source, addresses, budget, INLINE_FETCH_S)
        self.note_fetch(slow, asyncio.get_running_loop().time())
        return fetched

    async def fetch_in_pool(self, addresses: Sequence[BlockAddress], budget: int) -> list[Fetched]:
        """Read a batch in the thread pool (see `fetches_inline`)."""
        assert self.executor is not None, "fetching in a thread needs the pool"
        fetched, _ = await asyncio.get_running_loop().run_in_executor(self.executor, fetch, self.source,
                                                                      addresses, budget)
        return fetched

    def note_fetch(self, slow: bool, now: float) -> None:
        """After SLOW_STREAK slow batches in a row, reads move to the pool for SLOW_SOURCE_HOLD_S."""
        self.slow_streak = self.slow_streak + 1 if slow else 0
        if self.slow_streak >= SLOW_STREAK and self.executor is not None:
            self.slow_until = now + SLOW_SOURCE_HOLD_S
            self.slow_streak = 0

    def admit_pull(self, peer: str, now: float) -> bool:
        """May `peer` start one more PULL now? A refusal is counted and logged (the caller answers
        it ERROR overloaded)."""
        verdict = self.budgets.admit_pull(peer, now)
        if verdict is Verdict.OK:
            return True
        self.count_overloaded(peer, verdict.value)
        return False

    def admit_handshake(self, source: str, now: float) -> bool:
        """May a handshake from the address `source` begin now (the node's fair share of handshakes,
        `budget.SharedBudget`)? A refusal is counted (budget `handshakes`); the caller drops it."""
        if self.budgets.admit_handshake(source, now):
            return True
        self.count_overloaded(source, "handshakes")
        return False

    def throttle_s(self, peer: str, now: float) -> float:
        """How long to stop reading `peer` after refusing it: until its budget admits a PULL again,
        at least THROTTLE_MIN_S (each resumed read of a flooding peer costs a batch of refusals) and
        at most THROTTLE_MAX_S (a partly read frame or a QUIC connection must not time out meanwhile)."""
        return min(THROTTLE_MAX_S, max(THROTTLE_MIN_S, self.budgets.wait_s(peer, now)))

    def count_overloaded(self, peer: str, budget: str) -> None:
        self.metrics.child(self.metrics.overloaded, self.transport, peer, budget).inc()
        logger.debug("%s peer %s is over its %s budget", self.transport, peer, budget)

    def count_served(self, session: ServerSession, now: float) -> None:
        """The session's answers since the last call: hits, bytes, and misses by reason; the bytes
        are charged to the peer's budget."""
        stats, metrics = session.take_stats(), self.metrics
        if stats.num_hits:
            metrics.child(metrics.served, self.transport, "hit").inc(stats.num_hits)
            metrics.child(metrics.served_bytes, self.transport).inc(stats.num_bytes)
            self.budgets.charge_bytes(session.peer_node, stats.num_bytes, now)
        for reason, count in stats.misses.items():
            metrics.child(metrics.served, self.transport, reason.value).inc(count)
        if stats.num_unauthorised:
            metrics.child(metrics.unauthorised_pulls, self.transport, session.peer_node).inc(stats.num_unauthorised)
            logger.warning("%s peer %s asked under a namespace root its tenants may not read (%d pulls)",
                           self.transport, session.peer_node, stats.num_unauthorised)


def fetch(source: BlockSource, addresses: Sequence[BlockAddress], budget: int,
          slow_s: float = float("inf")) -> tuple[list[Fetched], bool]:
    """Read blocks from the start of `addresses` until `budget` payload bytes; stops early, and says
    so, after a read slower than `slow_s` (disk). A read that raises becomes that exception (the
    session answers MISS(source_error)); nothing else is caught."""
    out: list[Fetched] = []
    get = source.get_block
    for address in addresses:
        start = time.perf_counter()
        got: Fetched
        try:
            got = get(address)
        except Exception as e:  # any failure behind the store is that block's miss, logged once
            logger.error("block source failed reading %s: %r", address, e)
            got = e
        out.append(got)
        if got is not None and not isinstance(got, Exception):
            budget -= len(got.payload)
        if time.perf_counter() - start > slow_s:
            return out, True
        if budget <= 0:
            break
    return out, False
