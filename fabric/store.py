"""The node-local store: device (tracked) -> RAM -> SSD tiers, a persistent index, eviction.

    put ──► hash once (BLAKE3) ──► overwrite rule ──► write-through: commit (SSD file + row), RAM copy ──► OK
                                                  └─► write-behind:  RAM (pinned) ──► flusher: commit ──► unpin
    get ──► RAM hit ─────────────────────────────────────────────────────────► view, no copy
        └─► SSD file ─► verify header + digest ─► promote to RAM ─────────────► view over the read
    lookup(addresses) ─► tier per address (device / RAM / SSD catalog, no I/O), leading run length
    peek(addresses)   ─► the same answer; recency and access frequency stay untouched
    read_run(blocks)  ─► every layer of the leading blocks held in full, verified, in one walk
    mirror(address, payload, digest) ─► a put checked against the peer's digest if [kv].mirror_pulls

Modules, one job each, each the one writer of its state: store_parts (the parts, wired once),
store_holdings (held addresses, events, accesses, counts), store_puts (hashing, the overwrite rule,
write-through), write_behind (the pending queue and its flusher), ssd_commit (the one commit path,
reserved and wanted SSD room), store_reads (lookups, gets, runs), store_maintenance (carrying out
the pure planner's `MaintenancePlan`, the background thread), store_types (results, errors,
lifecycle), eviction (the planner itself).

Overwrite rule: the first acknowledged payload of an address stands; a put of other bytes for a
held address answers CONFLICT and is counted (fabric/store_puts.py). So a committed file is never
renamed over, and `get()` returns only the payload acknowledged for that address.

Crash consistency. A block is committed in this order (a write-through put, a `put_many`, or one
group commit of the write-behind flusher, all through `SsdCommitter.commit`):

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

Lifecycle: OPEN -> CLOSING -> CLOSED (fabric/store_types.py). `close()` admits no new call (they
raise StoreClosedError), waits for the calls in flight (up to `timeout_s`), stops the background thread,
flushes, and always shuts the pools down and releases the index lock, even when a step fails; it
returns a CloseReport naming the acknowledged write-behind blocks it could not flush.

Full disk and full tiers: fabric/write_behind.py and fabric/store_puts.py. Costs: fabric/store_reads.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CollectorRegistry

from fabric.config import Config, KVConfig
from fabric.events import StoreEvents
from fabric.eviction import TierPolicy
from fabric.index import IndexUnavailableError
from fabric.keys import BlockAddress, BlockHash
from fabric.metrics import StoreMetrics
from fabric.provenance import Provenance, block_version
from fabric.ssd_commit import SsdCommitter
from fabric.store_maintenance import Background, Maintenance
from fabric.store_parts import StoreParts
from fabric.store_puts import Puts
from fabric.store_reads import Reads
from fabric.store_types import (
    CallGate,
    CloseReport,
    Hashed,
    LookupResult,
    PutResult,
    StoreClosedError,
    VerifyReport,
    hash_payload,
)
from fabric.tiers.base import Payload, StoredBlock, Tier
from fabric.write_behind import WriteBehind

logger = logging.getLogger(__name__)

__all__ = ["CloseReport", "Hashed", "LookupResult", "PutResult", "Store", "StoreClosedError", "StoredBlock", "Tier",
           "VerifyReport", "hash_payload"]


class Store:
    """Node-local tiered KV block store. Thread-safe; use `Store.open(config)` and `close()`."""

    def __init__(self, kv: KVConfig, *, registry: CollectorRegistry | None, background: bool,
                 clock: Callable[[], float]) -> None:
        self.config = kv
        self.policy = TierPolicy.from_config(kv)
        self.metrics = StoreMetrics(registry)
        self._parts = parts = StoreParts.open(kv, self.policy, self.metrics, clock)
        self.reconciled = parts.counters.reconciled_counts()   # what reconciliation at open repaired
        self._lock = parts.lock
        self._clock = clock
        self._gate = CallGate(parts.lock, kv.index_dir)
        self._writers = ThreadPoolExecutor(kv.io_threads, thread_name_prefix="kvfabric-ssd-write")
        self._committer = SsdCommitter(parts, self._writers)
        self._write_behind = WriteBehind(parts, self._committer)
        self._puts = Puts(parts, self._committer, self._write_behind)
        self._reads = Reads(parts)
        self._maintenance = Maintenance(parts, self._reads, self._committer, self._write_behind)
        ram, ssd_tier = parts.ram, parts.ssd
        self.metrics.bind_tier(Tier.RAM, lambda: ram.num_blocks, lambda: ram.used_bytes, lambda: ram.num_held_blocks)
        self.metrics.bind_tier(Tier.SSD, lambda: ssd_tier.num_blocks, lambda: ssd_tier.used_bytes,
                               lambda: ssd_tier.num_held_blocks)
        self.metrics.bind_tier(Tier.DEVICE, lambda: len(parts.device), lambda: 0)
        self.metrics.pending_writes.set_function(lambda: self._write_behind.num_pending)
        self._background: Background | None = None
        if background:
            self._background = Background(parts, self._maintenance, self._write_behind)
            self._write_behind.on_queued = self._background.wake

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

    def put(self, address: BlockAddress, payload: Payload | Hashed, *, model: str = "",
            digest: bytes | None = None) -> PutResult:
        """Store one (block, layer) payload. With `digest` (e.g. from the network) verify it first.

        Write-through: OK once the SSD file and its index row are committed (fsynced when durable).
        Write-behind: OK once the payload is in RAM; the SSD copy follows. A full tier makes room
        first (module docstring); FULL / PINNED / NO_SPACE only when it cannot. CONFLICT: the
        address already holds other bytes (they stay). Raises StoreClosedError once `close()` has begun.
        """
        return self.put_many([(address, payload)], model=model, digests=None if digest is None else [digest])[0]

    def put_many(self, items: Sequence[tuple[BlockAddress, Payload | Hashed]], *, model: str = "",
                 digests: Sequence[bytes] | None = None,
                 provenance: Sequence[Provenance | None] | None = None) -> list[PutResult]:
        """Store several payloads; in write-through mode they share one group commit. `provenance`
        (one per item) is each block's producer record, kept verbatim with it (fabric/provenance.py);
        a block already held keeps the record it was first stored with. A `Hashed` payload
        (`hash_payload`) is not hashed again: its digest is the one its record signs."""
        if digests is not None and len(digests) != len(items):
            raise ValueError(f"{len(digests)} digests for {len(items)} payloads")
        if provenance is not None and len(provenance) != len(items):
            raise ValueError(f"{len(provenance)} provenance records for {len(items)} payloads")
        self._gate.enter()
        try:
            return self._puts.put_many(list(items), model, None if digests is None else list(digests),
                                       None if provenance is None else list(provenance))
        finally:
            self._gate.leave()

    def mirror(self, address: BlockAddress, payload: Payload, *, digest: bytes,
               model: str = "") -> PutResult | None:
        """Keep a block pulled from a peer, as `put` with the peer's digest, if [kv].mirror_pulls is on.

        None (nothing stored) when mirroring is off: the block stays the owner's and the next
        request for it pulls again.
        """
        if not self.config.mirror_pulls:
            self._gate.enter()
            self._gate.leave()
            return None
        return self.put(address, payload, model=model, digest=digest)

    def delete(self, address: BlockAddress) -> bool:
        """Remove a block from every tier this store holds; True if it was anywhere."""
        parts = self._parts
        key = address.storage_key
        self._gate.enter()
        try:
            with parts.stripes[key[0]]:
                with parts.lock:
                    in_ram = parts.ram.remove(key)
                    pending = self._write_behind.discard_locked(key)
                    entry = parts.ssd.discard(key)
                    parts.holdings.forget(key)
                if entry is not None:
                    parts.ssd.unlink(key, entry.layer)
                    parts.index.delete_many([key], sync=False)
        finally:
            self._gate.leave()
        return in_ram or pending or entry is not None

    def purge_producer(self, producer: str) -> int:
        """Delete every (block, layer) whose provenance names `producer`, and every unsigned one (a
        block stored before provenance, or a mirror no record vouches for: it may be that producer's),
        from every tier; returns how many. Each leaves with a REMOVED event, so the directory forgets it."""
        with self._lock:
            self._gate.check_open_locked()
            # Unsigned ones too: no record says whose they are, so they may be that producer's.
            named = self._parts.addresses_where_locked(lambda prov: prov is None or prov.producer == producer)
        return sum(self.delete(address) for address in named)

    def flush(self) -> int:
        """Write every pending write-behind block to SSD now; returns how many are still pending
        (blocks that met a full SSD or a failing disk stay in RAM, pinned, for the next try)."""
        self._gate.enter()
        try:
            return self._write_behind.flush()
        finally:
            self._gate.leave()

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
        with self._lock:
            self._gate.check_open_locked()
            block, entry = self._reads.find_locked(key)
            if entry is not None:
                self._gate.admit_locked()   # only a file read outlives the lock
        if entry is None:
            return self._reads.finish_get(key, block, None, promote, start)
        try:
            return self._reads.finish_get(key, None, entry, promote, start)
        finally:
            self._gate.leave()

    def read_run(self, blocks: Iterable[Sequence[BlockAddress]], *, promote: bool = True) -> list[list[StoredBlock]]:
        """Every layer of the leading `blocks` (each a block's addresses) held in full, each payload
        verified, in one walk that ends before the first block with a layer missing or failing its
        check (a block past it is not looked at: pass a generator to build none). Each layer served
        is an access, as a get is."""
        self._gate.enter()
        try:
            return self._reads.read_run(blocks, promote)
        finally:
            self._gate.leave()

    def lookup(self, addresses: Sequence[BlockAddress], *, peek: bool = False) -> LookupResult:
        """Which tier holds each address (device first), without reading any payload.

        A lookup is an access: it refreshes the blocks' recency and access frequency, as a get
        does. `peek=True` answers the same without touching either (see `peek`)."""
        keys = [a.storage_key for a in addresses]
        now = self._clock()
        with self._lock:
            self._gate.check_open_locked()
            return self._reads.lookup_locked(addresses, keys, now, peek=peek)

    def lookup_run(self, blocks: Iterable[Sequence[BlockAddress]], *, peek: bool = False) -> list[tuple[Tier, ...]]:
        """The tiers of every layer of the leading `blocks` held in full, in one walk that stops at the
        first block with a layer missing (a prompt mostly held elsewhere costs one block past the
        run). An access of each layer of the run unless `peek`, as `lookup`."""
        self._gate.enter()
        try:
            return self._reads.lookup_run(blocks, self._clock(), peek=peek)
        finally:
            self._gate.leave()

    def peek(self, addresses: Sequence[BlockAddress]) -> LookupResult:
        """`lookup` that leaves recency and access frequency untouched: for a router probing nodes
        that may not serve the request, so probing alone never reorders their eviction."""
        return self.lookup(addresses, peek=True)

    # ---- events for the cluster layer (answered in any state, so a closed store can be drained) ----

    def held_addresses(self) -> list[BlockAddress]:
        """A snapshot of every (block hash, layer) held in any tier (RAM, pending write-behind, SSD).

        After a reopen, the SSD blocks come back from the index (rows written before block hashes
        were persisted are held but not listed).
        """
        with self._lock:
            return self._parts.holdings.addresses()

    def held_versions(self) -> dict[bytes, bytes]:
        """Every held block hash with its `block_version` (the record of its first layer found)."""
        with self._lock:
            parts = self._parts
            out: dict[bytes, bytes] = {}
            for key, address in parts.holdings.items():
                if address.hash not in out:
                    out[address.hash] = block_version(parts.provenance_locked(key))
            return out

    def versions_of(self, addresses: Sequence[BlockAddress]) -> list[bytes]:
        """The `block_version` of each held address (b"": not held, or unsigned)."""
        with self._lock:
            return [block_version(self._parts.provenance_locked(a.storage_key)) for a in addresses]

    def held_addresses_where(self, keep: Callable[[Provenance | None], bool]) -> list[BlockAddress]:
        """`held_addresses` whose provenance record (None: unsigned) `keep` accepts, e.g. those of one
        tenant's namespaces."""
        with self._lock:
            return self._parts.addresses_where_locked(keep)

    def take_events(self, max_events: int | None = None) -> StoreEvents:
        """Drain up to `max_events` STORED / REMOVED events in the order they happened.

        `overflowed=True` (reported once) means the queue passed [kv].event_queue_max and was
        cleared: resync from `held_addresses()`. Reconciliation at open emits nothing.
        """
        with self._lock:
            return self._parts.holdings.take_events(max_events)

    # ---- device tier and thresholds ----------------------------------------------------------------

    def apply_events(self, events: Iterable[object]) -> int:
        """Feed BlockStored / BlockEvicted events of the engine's block manager; returns how many."""
        with self._lock:
            self._gate.check_open_locked()
            return self._parts.device.apply_all(events)

    def on_device(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return self._parts.device.contains(block_hash)

    def should_offload_device(self, pool_utilisation: float) -> bool:
        """True once the engine pool is fuller than gpu_offload_threshold. Advisory: the store never
        acts on it; an engine adapter that wants offloading asks this and puts its cold blocks."""
        return self.policy.should_offload_device(pool_utilisation)

    # ---- maintenance -------------------------------------------------------------------------------

    def run_maintenance(self, now: float | None = None) -> dict[str, int]:
        """One evictor pass: SSD TTL + capacity, write-behind flush, RAM offload, prefetch."""
        self._gate.enter()
        try:
            return self._maintenance.run_pass(self._clock() if now is None else now)
        finally:
            self._gate.leave()

    def verify(self, progress: Callable[[int], object] | None = None) -> VerifyReport:
        """Re-read every SSD block; corrupt ones are counted and removed. `progress(n)` per block."""
        self._gate.enter()
        try:
            return self._maintenance.verify(progress)
        finally:
            self._gate.leave()

    def stats(self) -> dict[str, Any]:
        """Sizes per tier and the store's own counters since open."""
        with self._lock:
            return {**self._parts.stats_locked(), "pending_writes": self._write_behind.num_pending,
                    "disk_full": self._write_behind.disk_full, "state": self._gate.state.value}

    def close(self, timeout_s: float = 30.0) -> CloseReport:
        """Stop admitting calls, wait up to `timeout_s` for those in flight, flush, release everything.

        Idempotent; a concurrent second call waits for the first. Never raises for a failing disk
        or index: what could not be done is in the returned CloseReport.
        """
        begun = self._gate.begin_close(timeout_s)
        if isinstance(begun, CloseReport):
            return begun
        errors: list[str] = []
        unflushed: tuple[BlockAddress, ...] = ()
        try:
            if self._background is not None:
                self._background.stop()
            self._write_behind.flush()
            with self._lock:
                unflushed = self._write_behind.addresses_locked()
            self._maintenance.persist_last_seen()
        except (OSError, IndexUnavailableError) as e:
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            self._writers.shutdown()
            try:
                self._parts.index.close()
            except IndexUnavailableError as e:
                errors.append(str(e))
            report = CloseReport(unflushed, tuple(errors), begun)
            self._gate.finish_close(report)
        if not report.clean:
            logger.warning("store closed with %d unflushed write-behind blocks, errors %s, %d calls abandoned",
                           len(report.unflushed), report.errors, report.num_calls_abandoned)
        return report

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

