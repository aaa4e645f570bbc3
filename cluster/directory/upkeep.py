"""Keeping the directory told: heartbeats, ordered batches, epochs and resyncs of one node incarnation.

    store events ──record()──► DirectorySync (pure queue) ──tick()──► DirectoryApi.report(signed Report)
                                                                 ├─ Heartbeat every heartbeat_s (GAP: resync)
                                                                 ├─ Apply: one batch in flight per shard
                                                                 └─ resync: BeginResync → ResyncBatch* → EndResync

`DirectoryUpkeep` carries out what `DirectorySync` decides and reacts to the answers: a GAP,
a CONFLICT or a failed call marks a resync; a shard whose epoch changed (it restarted empty) is
resynced after a random delay of up to `resync_jitter_s`, so a cluster does not resync all at once;
a resync that fails is retried a heartbeat later. It owns no Ray handle and no clock: the directory
comes in as a `DirectoryApi` (the `DirectoryClient` of directory/client.py in a node; real
`DirectoryGate`s behind an in-memory adapter in tests), time as `clock`, the node's held hashes
as `held` (a mapping to their block versions, where known). Every report is built and signed by
`reports` (directory/report.py). A call to a shard that does not answer raises `ShardUnavailable`;
the other shards carry on. In a node, `run_forever` is the background pass that drives it all.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Protocol

from cluster.directory.report import Apply, BeginResync, Body, EndResync, Heartbeat, Report, ReportSigner, ResyncBatch
from cluster.directory.sync import DirectorySync
from cluster.directory.types import ApplyOutcome, NodeAddress
from cluster.errors import ClusterError
from cluster.node.metrics import ClusterMetrics
from fabric.config import ClusterConfig

logger = logging.getLogger(__name__)


class ShardUnavailable(ClusterError):
    """A directory shard did not answer (dead, restarting, stalled past the call timeout)."""


class DirectoryApi(Protocol):
    """The directory as a node sees it: `report` hands a signed report to its shard (raising
    `ShardUnavailable` when the shard does not answer); `epoch(shard)` is the epoch the shard's last
    answer carried (None before any)."""

    def epoch(self, shard: int) -> str | None: ...

    async def report(self, report: Report) -> ApplyOutcome: ...


class DirectoryUpkeep:
    """One node incarnation's reports to every shard; `reports` names the node and its incarnation."""

    def __init__(self, directory: DirectoryApi, config: ClusterConfig, *, address: NodeAddress,
                 reports: ReportSigner, held: Callable[[], Awaitable[Collection[bytes]]], metrics: ClusterMetrics,
                 clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.directory = directory
        self.config = config
        self.address = address
        self.reports = reports
        self.held = held
        self.metrics = metrics
        self.clock = clock
        self.rng = rng or random.Random()
        self.sync = self._new_sync()
        self._resync_at = [0.0] * config.directory_shards
        self._epochs: dict[int, str] = {}
        self._next_heartbeat = 0.0

    def _new_sync(self) -> DirectorySync:
        c = self.config
        sync = DirectorySync(c.directory_shards, flush_s=c.flush_ms / 1000, flush_blocks=c.flush_blocks,
                             queue_max=c.queue_max)
        sync.mark_all_resync()   # a new incarnation starts by telling the directory all it holds
        return sync

    # ---- what the node feeds in ----------------------------------------------------------------------

    def record(self, ops: Collection[tuple[bytes, bool]], overflowed: bool = False,
               versions: Mapping[bytes, bytes] | None = None) -> None:
        """Hash operations from the store, in order: (hash, stored?); `versions`: stored blocks' versions."""
        if overflowed:
            logger.warning("store event queue overflowed; resyncing the directory")
            self.metrics.resyncs.labels("store_overflow").inc()
            self.sync.mark_all_resync()
        self.sync.record(ops, self.clock(), versions)

    def reset(self) -> None:
        """After a failed pass: start over from a full resync of every shard."""
        self.metrics.resyncs.labels("sync_error").inc()
        self.sync = self._new_sync()

    def pending(self) -> int:
        return self.sync.pending()

    def num_overflows(self) -> int:
        """Times the event queue overflowed (each one a resync) since this node's last reset."""
        return self.sync.num_overflows

    # ---- the passes --------------------------------------------------------------------------------

    async def run_forever(self, feed: Callable[[], None], on_heartbeat: Callable[[], None]) -> None:
        """The node's background pass, every few ms until cancelled: `feed()` hands the store's new
        events to `record`, then one `tick`; `on_heartbeat()` runs after each pass that heartbeated.
        This loop is the node's liveness: a pass that fails is logged and starts a full resync, and the
        next pass runs as usual."""
        c = self.config
        period = min(c.flush_ms / 1000, c.heartbeat_s / 4)
        while True:
            try:
                feed()
                if await self.tick():
                    on_heartbeat()
            except Exception:
                logger.exception("directory sync pass failed; resyncing every shard")
                self.reset()
            await asyncio.sleep(period)

    async def tick(self) -> bool:
        """Heartbeat when due, then flush or resync each shard as due; True when it heartbeated."""
        now = self.clock()
        beat = now >= self._next_heartbeat
        shards = range(self.config.directory_shards)
        if beat:   # shards are independent: one that stalls does not hold up the others
            self._next_heartbeat = now + self.config.heartbeat_s
            # A shard about to resync hears BeginResync instead, which renews the lease and address as a
            # heartbeat does but keeps a restarted node's entries listed until EndResync replaces them
            # (a new incarnation's heartbeat drops them: it may no longer hold them).
            await asyncio.gather(*(self._heartbeat(k) for k in shards if not self._resync_due(k, now)))
        await asyncio.gather(*(self._flush(k, now) for k in shards))
        return beat

    def _resync_due(self, shard: int, now: float) -> bool:
        return self.sync.resync_wanted(shard) and now >= self._resync_at[shard]

    async def _report(self, shard: int, body: Body) -> ApplyOutcome | None:
        """Sign and send one report; None when the shard did not answer."""
        try:
            outcome = await self.directory.report(self.reports.sign(shard, body))
        except ShardUnavailable:
            return None
        self._check_epoch(shard)
        return outcome

    async def _heartbeat(self, shard: int) -> None:
        outcome = await self._report(shard, Heartbeat(self.address, self.sync.acked_seq(shard)))
        if outcome is ApplyOutcome.GAP and not self.sync.resync_wanted(shard) and \
                not self.sync.resyncing(shard):
            logger.info("directory shard %d lost this node's entries (lease lapsed?); resyncing", shard)
            self.metrics.resyncs.labels("lease_lapsed").inc()
            self.sync.mark_resync(shard)
        elif outcome is ApplyOutcome.REFUSED:
            logger.error("directory shard %d refused this node's heartbeat (see the shard's log)", shard)
        elif outcome is ApplyOutcome.STALE:
            logger.error("directory shard %d knows a newer incarnation of node %s than %d", shard,
                         self.reports.node_id, self.reports.incarnation)

    def _check_epoch(self, shard: int) -> None:
        epoch = self.directory.epoch(shard)
        known = self._epochs.get(shard)
        self._epochs[shard] = epoch or ""
        if known is not None and epoch != known:
            logger.info("directory shard %d restarted (epoch %s -> %s); resyncing", shard, known, epoch)
            self.metrics.resyncs.labels("directory_restart").inc()
            self.sync.mark_resync(shard)
            self._resync_at[shard] = self.clock() + self.rng.uniform(0, self.config.resync_jitter_s)

    async def _flush(self, shard: int, now: float) -> None:
        if self.sync.resync_wanted(shard):
            if self._resync_due(shard, now):
                await self._resync(shard)
            return
        if not self.sync.due(shard, now):
            return
        batch = self.sync.take_batch(shard)
        outcome = await self._report(shard, Apply(batch.seq, batch.stored, batch.removed, self.address,
                                                  batch.versions))
        self.sync.answered(batch, outcome)
        self.metrics.batches.labels(outcome.value if outcome else "failed").inc()
        if outcome is ApplyOutcome.GAP:
            self.metrics.resyncs.labels("gap").inc()

    async def _resync(self, shard: int) -> None:
        """Begin, stage and end one resync of `shard`, named by the seq it ends at."""
        seq = self.sync.start_resync(shard)
        ok = False
        try:
            held = await self.held()
            known = held if isinstance(held, Mapping) else {}
            hashes = self.sync.group_by_shard(set(held))[shard]
            if await self._report(shard, BeginResync(seq, self.address)) is not ApplyOutcome.ACCEPTED:
                return
            step = self.config.resync_batch
            for i in range(0, len(hashes), step):
                part = hashes[i:i + step]
                versions = tuple(known.get(h, b"") for h in part) if known else ()
                if await self._report(shard, ResyncBatch(seq, part, versions)) is not ApplyOutcome.ACCEPTED:
                    return
            ok = await self._report(shard, EndResync(seq, seq)) is ApplyOutcome.ACCEPTED
            if ok:
                logger.info("resynced %d block hashes to directory shard %d (seq %d)", len(hashes), shard, seq)
        finally:
            self.sync.finish_resync(shard, ok)
            if not ok:
                self._resync_at[shard] = self.clock() + self.config.heartbeat_s
