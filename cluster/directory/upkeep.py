"""Keeping the directory told: heartbeats, ordered batches, epochs and resyncs of one node incarnation.

    store events ──record()──► DirectorySync (pure queue) ──tick()──► DirectoryApi (typed calls)
                                                                 ├─ heartbeat every heartbeat_s (GAP: resync)
                                                                 ├─ apply: one batch in flight per shard
                                                                 └─ resync: begin → batches → end

`DirectoryUpkeep` carries out what `DirectorySync` decides and reacts to the answers: a GAP,
a CONFLICT or a failed call marks a resync; a shard whose epoch changed (it restarted empty) is
resynced after a random delay of up to `resync_jitter_s`, so a cluster does not resync all at once;
a resync that fails is retried a heartbeat later. It owns no Ray handle and no clock: the directory
comes in as a `DirectoryApi` (the `DirectoryClient` of directory/actor.py in a node; a real
`DirectoryShard` behind an in-memory adapter in tests), time as `clock`, the node's held hashes
as `held` (a mapping to their block versions, where known). Every report is signed by `reports`
(directory/auth.py). A call to a shard that does not answer raises `ShardUnavailable`; the other
shards carry on.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Protocol

from cluster.directory.auth import Proof, ReportSigner
from cluster.directory.sync import Batch, DirectorySync
from cluster.directory.types import ApplyOutcome, NodeAddress
from cluster.errors import ClusterError
from cluster.node.metrics import ClusterMetrics
from fabric.config import ClusterConfig

logger = logging.getLogger(__name__)


class ShardUnavailable(ClusterError):
    """A directory shard did not answer (dead, restarting, stalled past the call timeout)."""


class DirectoryApi(Protocol):
    """The directory calls a node makes, one typed method each; `epoch(shard)` is the epoch the
    shard's last answer carried (None before any)."""

    def epoch(self, shard: int) -> str | None: ...

    async def heartbeat(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                        acked_seq: int | None, proof: Proof) -> ApplyOutcome: ...

    async def apply(self, shard: int, node_id: str, incarnation: int, seq: int, stored: Sequence[bytes],
                    removed: Sequence[bytes], address: NodeAddress, proof: Proof,
                    versions: Sequence[bytes] = ()) -> ApplyOutcome: ...

    async def begin_resync(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                           proof: Proof) -> int: ...

    async def resync_batch(self, shard: int, node_id: str, incarnation: int, resync_id: int,
                           hashes: Sequence[bytes], proof: Proof, versions: Sequence[bytes] = ()) -> bool: ...

    async def end_resync(self, shard: int, node_id: str, incarnation: int, resync_id: int, seq: int,
                         proof: Proof) -> bool: ...


class DirectoryUpkeep:
    def __init__(self, directory: DirectoryApi, config: ClusterConfig, *, node_id: str, incarnation: int,
                 address: NodeAddress, reports: ReportSigner, held: Callable[[], Awaitable[Collection[bytes]]],
                 metrics: ClusterMetrics, clock: Callable[[], float], rng: random.Random | None = None) -> None:
        self.directory = directory
        self.config = config
        self.node_id, self.incarnation, self.address = node_id, incarnation, address
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

    # ---- one pass ----------------------------------------------------------------------------------

    async def tick(self) -> bool:
        """Heartbeat when due, then flush or resync each shard as due; True when it heartbeated."""
        now = self.clock()
        beat = now >= self._next_heartbeat
        shards = range(self.config.directory_shards)
        if beat:   # shards are independent: one that stalls does not hold up the others
            self._next_heartbeat = now + self.config.heartbeat_s
            await asyncio.gather(*(self._heartbeat(k) for k in shards))
        await asyncio.gather(*(self._flush(k, now) for k in shards))
        return beat

    async def _heartbeat(self, shard: int) -> None:
        acked = self.sync.acked_seq(shard)
        try:
            outcome = await self.directory.heartbeat(shard, self.node_id, self.incarnation, self.address, acked,
                                                     self.reports.heartbeat(shard, self.address, acked))
        except ShardUnavailable:
            return
        self._check_epoch(shard)
        if outcome is ApplyOutcome.GAP and not self.sync.resync_wanted(shard) and \
                not self.sync.resyncing(shard):
            logger.info("directory shard %d lost this node's entries (lease lapsed?); resyncing", shard)
            self.metrics.resyncs.labels("lease_lapsed").inc()
            self.sync.mark_resync(shard)
        elif outcome is ApplyOutcome.REFUSED:
            logger.error("directory shard %d refused this node's heartbeat (see the shard's log)", shard)
        elif outcome is ApplyOutcome.STALE:
            logger.error("directory shard %d knows a newer incarnation of node %s than %d", shard,
                         self.node_id, self.incarnation)

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
            if now >= self._resync_at[shard]:
                await self._resync(shard)
            return
        if not self.sync.due(shard, now):
            return
        batch = self.sync.take_batch(shard)
        outcome = await self._send(batch)
        self.sync.answered(batch, outcome)
        self.metrics.batches.labels(outcome.value if outcome else "failed").inc()
        if outcome is ApplyOutcome.GAP:
            self.metrics.resyncs.labels("gap").inc()

    async def _send(self, batch: Batch) -> ApplyOutcome | None:
        try:
            outcome = await self.directory.apply(
                batch.shard, self.node_id, self.incarnation, batch.seq, batch.stored, batch.removed, self.address,
                self.reports.apply(batch.shard, batch.seq, batch.stored, batch.removed, self.address, batch.versions),
                batch.versions)
        except ShardUnavailable:
            return None
        self._check_epoch(batch.shard)
        return outcome

    async def _resync(self, shard: int) -> None:
        seq = self.sync.start_resync(shard)
        ok = False
        try:
            held = await self.held()
            known = held if isinstance(held, Mapping) else {}
            hashes = self.sync.group_by_shard(set(held))[shard]
            rid = await self.directory.begin_resync(shard, self.node_id, self.incarnation, self.address,
                                                    self.reports.begin_resync(shard, self.address))
            step = self.config.resync_batch
            for i in range(0, len(hashes), step):
                part = hashes[i:i + step]
                versions = tuple(known.get(h, b"") for h in part) if known else ()
                if not await self.directory.resync_batch(shard, self.node_id, self.incarnation, rid, part,
                                                         self.reports.resync_batch(shard, rid, part, versions),
                                                         versions):
                    return
            ok = await self.directory.end_resync(shard, self.node_id, self.incarnation, rid, seq,
                                                 self.reports.end_resync(shard, rid, seq))
            self._check_epoch(shard)
            logger.info("resynced %d block hashes to directory shard %d (seq %d)", len(hashes), shard, seq)
        except ShardUnavailable:
            pass
        finally:
            self.sync.finish_resync(shard, ok)
            if not ok:
                self._resync_at[shard] = self.clock() + self.config.heartbeat_s
