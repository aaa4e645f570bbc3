"""The node-local store: device (tracked) -> RAM -> SSD tiers, a persistent index, eviction.

    put ──► hash once (BLAKE3) ──► overwrite rule ──► write-through: commit (SSD file + row), RAM copy ──► OK
                                                  └─► write-behind:  RAM (pinned) ──► flusher: commit ──► unpin
    get ──► RAM hit ─────────────────────────────────────────────────────────► view, no copy
        └─► SSD file ─► verify header + digest ─► promote to RAM ─────────────► view over the read
    lookup(addresses) ─► tier per address (device / RAM / SSD catalog, no I/O), leading run length
    peek(addresses)   ─► the same answer; recency and access frequency stay untouched
    mirror(address, payload, digest) ─► a put checked against the peer's digest if [kv].mirror_pulls

Modules: store_types (results, errors, counters), store_core (shared state, holdings, SSD reads),
store_writes (overwrite rule, the one commit path, flusher), store_maintenance (carrying out the
pure planner's `MaintenancePlan`), eviction (the planner itself).

Overwrite rule: the first acknowledged payload of an address stands; a put of other bytes for a
held address answers CONFLICT and is counted (fabric/store_writes.py). So a committed file is never
renamed over, and `get()` returns only the payload acknowledged for that address.

Crash consistency. A block is committed in this order (a write-through put, a `put_many`, or one
group commit of the write-behind flusher, all through `Writer.commit`):

    1. temp file written and fdatasync'ed          crash here: a temp file, removed at open
       (a batch: all written, then one syncfs)
    2. renamed to its final name, folder fsync'ed  crash here: a file without a row, removed at
                                                    open; its put had not returned, so nothing
                                                    acknowledged is lost (a batch: all renamed,
                                                    then one syncfs)
    3. index row(s) in one WriteBatch, WAL synced  from here on the block is acknowledged
    4. put returns OK / the RAM copy is unpinned

The row is synced because reconciliation deletes files without rows: an unsynced row lost in a
power cut would take an acknowledged file with it. The order is asserted by a test that records
these calls (a power cut cannot be caused here). With `durable = false` nothing is synced, so a
power cut (not a process crash: the page cache survives SIGKILL) may lose recent blocks; the
digest check on every read still guarantees that nothing wrong is served. Write-behind
acknowledges once the payload is in RAM, before any of this: a crash loses blocks still pending.

Lifecycle: OPEN -> CLOSING -> CLOSED, under the lock. `close()` admits no new call (they raise
StoreClosedError), waits for the calls in flight (up to `timeout_s`), stops the background thread,
flushes, and always shuts the pools down and releases the index lock, even when a step fails; it
returns a CloseReport naming the acknowledged write-behind blocks it could not flush.

Full disk: a flush that meets ENOSPC / EDQUOT / EFBIG (or an index that cannot write) leaves its
blocks pinned in RAM and marks the disk full; write-behind puts keep landing in RAM while unpinned
payloads can make room, and answer NO_SPACE (PINNED for a failing disk) once all of RAM is pinned;
every tick retries, and the first success clears the state. The index keeps a reserve file so it
can reopen on a full disk (fabric/index.py).

A write is never refused for want of room while room can be made (fabric/store_writes.py). A put
that would pass RAM's high-water mark or `ram_blocks` evicts unpinned payloads inline (CLOCK order;
each is on SSD already, unless the SSD evictor dropped it). If all of RAM is pinned, the put
commits the oldest pending write-behind blocks itself, through the same commit path in the same
order (1-4 above), and only then evicts them from RAM: an acknowledged block is always in RAM or
committed on SSD. A write that would pass the SSD's bytes or `ssd_blocks` evicts its least
recently seen files first. What is still refused is counted by reason: FULL (larger than the SSD
may hold), PINNED, NO_SPACE. The background thread (every eviction_interval_s) still trims each
tier to its offload / low-water line, so most writes find room without evicting.
Costs: lookup O(addresses); a RAM get O(1) plus one BLAKE3 of 36 bytes for the
storage key; an SSD get one open + one read + one BLAKE3 of the payload.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry

from fabric import store_maintenance as maintenance
from fabric.config import Config, KVConfig
from fabric.events import StoreEvents
from fabric.eviction import TierPolicy
from fabric.index import Index, IndexUnavailableError, reconcile
from fabric.keys import BlockAddress, BlockHash
from fabric.metrics import StoreMetrics
from fabric.provenance import Provenance, block_version
from fabric.store_core import StoreCore
from fabric.store_types import CloseReport, Lifecycle, LookupResult, PutResult, StoreClosedError, VerifyReport
from fabric.store_writes import Writer
from fabric.tiers.base import Payload, StoredBlock, Tier
from fabric.tiers.ssd import SsdTier
from fabric.tiers.ssd_catalog import SsdEntry

logger = logging.getLogger(__name__)

__all__ = ["CloseReport", "LookupResult", "PutResult", "Store", "StoreClosedError", "StoredBlock", "Tier",
           "VerifyReport"]


class Store:
    """Node-local tiered KV block store. Thread-safe; use `Store.open(config)` and `close()`."""

    def __init__(self, kv: KVConfig, *, registry: CollectorRegistry | None, background: bool,
                 clock: Callable[[], float]) -> None:
        self.config = kv
        self.policy = TierPolicy.from_config(kv)
        self.metrics = StoreMetrics(registry)
        ssd = SsdTier(kv.ssd_dir, capacity_bytes=self.policy.ssd_capacity_bytes, durable=kv.durable,
                      o_direct=kv.o_direct, capacity_blocks=kv.ssd_blocks)
        index = Index(kv.index_dir, sync=kv.durable)
        try:
            report = reconcile(index, ssd)
        except BaseException:
            index.close()
            raise
        for action, count in report.counts.items():
            self.metrics.reconciled.labels(action).inc(count)
        self.reconciled = dict(report.counts)
        kept = ((key, SsdEntry(m.layer, m.num_bytes, m.digest, m.model, m.created_unix, m.last_seen_unix,
                               m.block_hash, m.provenance)) for key, m in report.kept)
        self._core = core = StoreCore(kv, self.policy, self.metrics, clock, ssd, index, kept)
        core.counters.reconciled.update(report.counts)
        self._lock = core.lock
        self._clock = clock
        self._state = Lifecycle.OPEN
        self._num_inflight = 0
        self._idle = threading.Condition(core.lock)
        self._close_report: CloseReport | None = None
        self._writers = ThreadPoolExecutor(kv.io_threads, thread_name_prefix="kvfabric-ssd-write")
        self._async_pool = ThreadPoolExecutor(kv.io_threads, thread_name_prefix="kvfabric-io")
        self._writer = Writer(core, self._writers)
        self.metrics.bind_tier(Tier.RAM, lambda: core.ram.num_blocks, lambda: core.ram.used_bytes,
                               lambda: core.ram.num_held_blocks)
        self.metrics.bind_tier(Tier.SSD, lambda: core.ssd.num_blocks, lambda: core.ssd.used_bytes,
                               lambda: core.ssd.num_held_blocks)
        self.metrics.bind_tier(Tier.DEVICE, lambda: len(core.device), lambda: 0)
        self.metrics.pending_writes.set_function(lambda: len(core.dirty))
        self._background: maintenance.Background | None = None
        if background:
            self._background = maintenance.Background(core, self._writer)
            self._writer.on_dirty = self._background.wake   # type: ignore[method-assign]

    @classmethod
    def open(cls, config: Config | KVConfig, *, registry: CollectorRegistry | None = None,
             background: bool = True, clock: Callable[[], float] = time.time) -> Store:
        """Open (or create) the store under config's ssd_dir and index_dir, reconciling the two.

        `background=False` runs no thread: call `flush()` / `run_maintenance(now)` yourself.
        `clock` gives unix seconds (created / last seen / TTL / access frequency).
        Raises IndexUnavailableError if the index is locked by another store or unreadable.
        """
        kv = config.kv if isinstance(config, Config) else config
        return cls(kv, registry=registry, background=background, clock=clock)

    # ---- writes ------------------------------------------------------------------------------------

    def put(self, address: BlockAddress, payload: Payload, *, model: str = "",
            digest: bytes | None = None) -> PutResult:
        """Store one (block, layer) payload. With `digest` (e.g. from the network) verify it first.

        Write-through: OK once the SSD file and its index row are committed (fsynced when durable).
        Write-behind: OK once the payload is in RAM; the SSD copy follows. A full tier makes room
        first (module docstring); FULL / PINNED / NO_SPACE only when it cannot. CONFLICT: the
        address already holds other bytes (they stay). Raises StoreClosedError once `close()` has begun.
        """
        return self.put_many([(address, payload)], model=model, digests=None if digest is None else [digest])[0]

    def put_many(self, items: Sequence[tuple[BlockAddress, Payload]], *, model: str = "",
                 digests: Sequence[bytes] | None = None,
                 provenance: Sequence[Provenance | None] | None = None) -> list[PutResult]:
        """Store several payloads; in write-through mode they share one group commit. `provenance`
        (one per item) is each block's producer record, kept verbatim with it (fabric/provenance.py);
        a block already held keeps the record it was first stored with."""
        if digests is not None and len(digests) != len(items):
            raise ValueError(f"{len(digests)} digests for {len(items)} payloads")
        if provenance is not None and len(provenance) != len(items):
            raise ValueError(f"{len(provenance)} provenance records for {len(items)} payloads")
        self._enter()
        try:
            return self._writer.put_many(list(items), model, None if digests is None else list(digests),
                                         None if provenance is None else list(provenance))
        finally:
            self._leave()

    def mirror(self, address: BlockAddress, payload: Payload, *, digest: bytes,
               model: str = "") -> PutResult | None:
        """Keep a block pulled from a peer, as `put` with the peer's digest, if [kv].mirror_pulls is on.

        None (nothing stored) when mirroring is off: the block stays the owner's and the next
        request for it pulls again.
        """
        if not self.config.mirror_pulls:
            self._enter()
            self._leave()
            return None
        return self.put(address, payload, model=model, digest=digest)

    def delete(self, address: BlockAddress) -> bool:
        """Remove a block from every tier this store holds; True if it was anywhere."""
        core = self._core
        key = address.storage_key
        self._enter()
        try:
            with core.stripes[key[0]]:
                with core.lock:
                    in_ram = core.ram.remove(key)
                    pending = core.dirty.pop(key, None)
                    entry = core.ssd.discard(key)
                    core.forget_locked(key)
                if entry is not None:
                    core.ssd.unlink(key, entry.layer)
                    core.index.delete_many([key], sync=False)
        finally:
            self._leave()
        return in_ram or pending is not None or entry is not None

    def purge_producer(self, producer: str) -> int:
        """Delete every (block, layer) whose provenance names `producer`, and every unsigned one (a
        block stored before provenance, or a mirror no record vouches for: it may be that producer's),
        from every tier; returns how many. Each leaves with a REMOVED event, so the directory forgets it."""
        with self._lock:
            self._check_open_locked()
            named = self._core.addresses_of_producer_locked(producer)
        return sum(self.delete(address) for address in named)

    def flush(self) -> int:
        """Write every pending write-behind block to SSD now; returns how many are still pending
        (blocks that met a full SSD or a failing disk stay in RAM, pinned, for the next try)."""
        self._enter()
        try:
            return self._writer.flush()
        finally:
            self._leave()

    # ---- reads -------------------------------------------------------------------------------------

    def get(self, address: BlockAddress) -> memoryview | None:
        """The verified payload (a read-only view, no copy), or None."""
        block = self.get_block(address)
        return None if block is None else block.payload

    def get_block(self, address: BlockAddress, *, promote: bool = True) -> StoredBlock | None:
        """The verified payload with its digest and the tier that served it, or None.

        An SSD hit's buffer is kept in RAM (no copy) when `promote` and RAM is under capacity.
        """
        start = time.perf_counter()
        key = address.storage_key
        core = self._core
        with core.lock:
            self._check_open_locked()
            block, entry = core.find_locked(key)
            self._num_inflight += entry is not None   # only a file read outlives the lock
        if entry is None:
            return core.finish_get(key, block, None, promote, start)
        try:
            return core.finish_get(key, None, entry, promote, start)
        finally:
            self._leave()

    def lookup(self, addresses: Sequence[BlockAddress], *, peek: bool = False) -> LookupResult:
        """Which tier holds each address (device first), without reading any payload.

        A lookup is an access: it refreshes the blocks' recency and access frequency, as a get
        does. `peek=True` answers the same without touching either (see `peek`)."""
        keys = [a.storage_key for a in addresses]
        now = self._clock()
        with self._lock:
            self._check_open_locked()
            return self._core.lookup_locked(addresses, keys, now, peek=peek)

    def peek(self, addresses: Sequence[BlockAddress]) -> LookupResult:
        """`lookup` that leaves recency and access frequency untouched: for a router probing nodes
        that may not serve the request, so probing alone never reorders their eviction."""
        return self.lookup(addresses, peek=True)

    async def aget_block(self, address: BlockAddress, *, promote: bool = True) -> StoredBlock | None:
        """`get_block` for an event loop: a RAM hit answers inline, a file read runs on the store's pool."""
        core = self._core
        key = address.storage_key
        with core.lock:
            self._check_open_locked()
            block = core.ram.get(key)
            if block is not None:
                core.touch_locked(key, self._clock())
                self.metrics.observe_hit(Tier.RAM, 0.0)
                return block
            self._num_inflight += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._async_pool, core.get_admitted, address, promote)
        finally:
            self._leave()

    async def aput(self, address: BlockAddress, payload: Payload, *, model: str = "",
                   digest: bytes | None = None) -> PutResult:
        """`put` for an event loop, run on the store's pool."""
        self._enter()
        try:
            loop = asyncio.get_running_loop()
            results = await loop.run_in_executor(self._async_pool, self._writer.put_many, [(address, payload)],
                                                 model, None if digest is None else [digest])
            return results[0]
        finally:
            self._leave()

    # ---- events for the cluster layer (answered in any state, so a closed store can be drained) ----

    def held_addresses(self) -> list[BlockAddress]:
        """A snapshot of every (block hash, layer) held in any tier (RAM, pending write-behind, SSD).

        After a reopen, the SSD blocks come back from the index (rows written before block hashes
        were persisted are held but not listed).
        """
        with self._lock:
            return list(self._core.held.values())

    def held_versions(self) -> dict[bytes, bytes]:
        """Every held block hash with its `block_version` (the record of its first layer found)."""
        with self._lock:
            core = self._core
            out: dict[bytes, bytes] = {}
            for key, address in core.held.items():
                if address.hash not in out:
                    out[address.hash] = block_version(core.provenance_locked(key))
            return out

    def versions_of(self, addresses: Sequence[BlockAddress]) -> list[bytes]:
        """The `block_version` of each held address (b"": not held, or unsigned)."""
        with self._lock:
            return [block_version(self._core.provenance_locked(a.storage_key)) for a in addresses]

    def held_addresses_where(self, keep: Callable[[Provenance | None], bool]) -> list[BlockAddress]:
        """`held_addresses` whose provenance record (None: unsigned) `keep` accepts, e.g. those of one
        tenant's namespaces."""
        with self._lock:
            return self._core.addresses_where_locked(keep)

    def take_events(self, max_events: int | None = None) -> StoreEvents:
        """Drain up to `max_events` STORED / REMOVED events in the order they happened.

        `overflowed=True` (reported once) means the queue passed [kv].event_queue_max and was
        cleared: resync from `held_addresses()`. Reconciliation at open emits nothing.
        """
        with self._lock:
            return self._core.events.take(max_events)

    # ---- device tier and thresholds ----------------------------------------------------------------

    def apply_events(self, events: Iterable[object]) -> int:
        """Feed BlockStored / BlockEvicted events of the engine's block manager; returns how many."""
        with self._lock:
            self._check_open_locked()
            return self._core.device.apply_all(events)

    def on_device(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return self._core.device.contains(block_hash)

    def should_offload_device(self, pool_utilisation: float) -> bool:
        """True once the engine pool is fuller than gpu_offload_threshold. Advisory: the store never
        acts on it; an engine adapter that wants offloading asks this and puts its cold blocks."""
        return self.policy.should_offload_device(pool_utilisation)

    # ---- maintenance -------------------------------------------------------------------------------

    def run_maintenance(self, now: float | None = None) -> dict[str, int]:
        """One evictor pass: SSD TTL + capacity, write-behind flush, RAM offload, prefetch."""
        self._enter()
        try:
            return maintenance.run_pass(self._core, self._writer, self._clock() if now is None else now)
        finally:
            self._leave()

    def verify(self, progress: Callable[[int], object] | None = None) -> VerifyReport:
        """Re-read every SSD block; corrupt ones are counted and removed. `progress(n)` per block."""
        self._enter()
        try:
            return maintenance.verify(self._core, progress)
        finally:
            self._leave()

    def stats(self) -> dict[str, Any]:
        """Sizes per tier and the store's own counters since open."""
        with self._lock:
            return {**self._core.stats_locked(), "state": self._state.value}

    def close(self, timeout_s: float = 30.0) -> CloseReport:
        """Stop admitting calls, wait up to `timeout_s` for those in flight, flush, release everything.

        Idempotent; a concurrent second call waits for the first. Never raises for a failing disk
        or index: what could not be done is in the returned CloseReport.
        """
        with self._lock:
            if self._state is not Lifecycle.OPEN:
                self._idle.wait_for(lambda: self._state is Lifecycle.CLOSED)
                assert self._close_report is not None
                return self._close_report
            self._state = Lifecycle.CLOSING
            self._idle.wait_for(lambda: not self._num_inflight, timeout_s)
            abandoned = self._num_inflight
        errors: list[str] = []
        unflushed: tuple[BlockAddress, ...] = ()
        try:
            if self._background is not None:
                self._background.stop()
            self._writer.flush()
            with self._lock:
                unflushed = tuple(p.address for p in self._core.dirty.values())
            maintenance.persist_last_seen(self._core)
        except (OSError, IndexUnavailableError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._writers.shutdown()
            self._async_pool.shutdown()
            try:
                self._core.index.close()
            except IndexUnavailableError as e:
                errors.append(str(e))
            report = CloseReport(unflushed, tuple(errors), abandoned)
            with self._lock:
                self._close_report = report
                self._state = Lifecycle.CLOSED
                self._idle.notify_all()
        if not report.clean:
            logger.warning("store closed with %d unflushed write-behind blocks, errors %s, %d calls abandoned",
                           len(report.unflushed), report.errors, report.num_calls_abandoned)
        return report

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------

    def _check_open_locked(self) -> None:
        if self._state is not Lifecycle.OPEN:
            raise StoreClosedError(f"store over {self.config.index_dir} is {self._state.value}")

    def _enter(self) -> None:
        with self._lock:
            self._check_open_locked()
            self._num_inflight += 1

    def _leave(self) -> None:
        with self._lock:
            self._num_inflight -= 1
            if not self._num_inflight:
                self._idle.notify_all()
