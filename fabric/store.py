"""The node-local store: device (tracked) -> RAM -> SSD tiers, a persistent index, eviction.

    put ──► hash once (BLAKE3) ──► write-through: SSD file + index row, then RAM copy ──► OK
                               └─► write-behind:  RAM (pinned) ──► background flush ──► SSD + row
    get ──► RAM hit ─────────────────────────────────────────────────────────► view, no copy
        └─► SSD file ─► verify header + digest ─► promote to RAM ─────────────► view over the read
    lookup(addresses) ─► tier per address (device / RAM / SSD catalog, no I/O), leading run length
    mirror(address, payload, digest) ─► a put checked against the peer's digest if [kv].mirror_pulls

Crash consistency. A block is written in this order (a write-through put, or one group commit
of the write-behind flusher or of `put_many`):

    1. temp file written and fdatasync'ed          crash here: a temp file, removed at open
    2. renamed to its final name, folder fsync'ed  crash here: a file without a row, removed at
                                                    open; its put had not returned, so nothing
                                                    acknowledged is lost
    3. index row(s) in one WriteBatch, WAL synced  from here on the block is acknowledged
    4. put returns OK / the RAM copy is unpinned

The row is synced because reconciliation deletes files without rows: an unsynced row lost in a
power cut would take an acknowledged file with it. The sync costs ~0.1 ms and one group commit
shares it. Removal runs the other way (catalog entry, file, then row without sync): a crash
between leaves a row without a file, removed at open. With `durable = false` nothing is synced,
so a power cut (not a process crash: the page cache survives SIGKILL) may lose recent blocks, but
reconciliation and the digest check on every read still guarantee that nothing wrong is served.
(Rewriting a key with a different payload and crashing between steps 2 and 3 leaves the new file
under the old row: the header digest disagrees with the row, so the read drops it as corrupt.)

Concurrency. One lock guards the in-memory maps (RAM tier, SSD catalog, write-behind queue,
device set, frequencies); file I/O runs outside it. Every file mutation of a key (write + commit,
unlink) holds that key's stripe lock (key[0], one per fan-out folder), taken before the map lock,
in ascending order when a batch needs several, so a delete or an eviction never races a write of
the same key. Reads take no stripe: a rename is atomic and an unlinked file stays readable through
an open descriptor; a read that finds its catalog entry replaced meanwhile does not promote.
SSD reads are bounded to `io_threads` at once; `aget_block` / `aput` run on the store's own pool
of `io_threads` threads so an event loop never blocks on a file.

Writes never wait for eviction: a put that would pass RAM's high-water mark (write-behind) or
the SSD capacity (write-through) answers FULL, and the background thread (every
eviction_interval_s) frees room. Costs: lookup O(addresses); a RAM get O(1) plus one BLAKE3 of
36 bytes for the storage key; an SSD get one open + one read + one BLAKE3 of the payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from fabric.config import Config, KVConfig
from fabric.events import EventKind, StoreEventLog, StoreEvents
from fabric.eviction import DecayedFrequency, TierPolicy
from fabric.index import BlockMeta, Index, IndexUnavailableError, reconcile
from fabric.keys import BlockAddress, BlockHash, StorageKey
from fabric.metrics import StoreMetrics
from fabric.tiers.base import CorruptBlockError, Payload, StoredBlock, Tier, as_bytes_view, digest_of
from fabric.tiers.device import DeviceTier
from fabric.tiers.ram import RamTier
from fabric.tiers.ssd import HEADER_SIZE, NO_SPACE_ERRNOS, SsdEntry, SsdTier, WriteItem

logger = logging.getLogger(__name__)

__all__ = ["LookupResult", "PutResult", "Store", "StoredBlock", "Tier", "VerifyReport"]

FLUSH_BATCH_BLOCKS = 32
FLUSH_BATCH_BYTES = 64 << 20
PREFETCH_MAX_BLOCKS = 64
_NUM_STRIPES = 256


class PutResult(enum.Enum):
    """The outcome of a put; every value but OK is a rejection and is counted by reason."""

    OK = "ok"
    FULL = "full"                        # RAM past its high-water mark or SSD at ssd_gib
    NO_SPACE = "no_space"                # the filesystem refused the write (ENOSPC / EDQUOT / EFBIG)
    DIGEST_MISMATCH = "digest_mismatch"  # the caller's digest is not the payload's BLAKE3
    IO_ERROR = "io_error"                # any other file or index error

    @property
    def ok(self) -> bool:
        return self is PutResult.OK


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Where each address is (None: not on this node) and how many leading ones are present."""

    num_leading: int
    tiers: tuple[Tier | None, ...]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    num_checked: int
    corrupt: tuple[tuple[StorageKey, str], ...]


@dataclass(frozen=True, slots=True)
class _Pending:
    """A write-behind block waiting for its SSD copy (its payload is pinned in RAM)."""

    layer: int
    model: str
    digest: bytes
    payload: memoryview
    created_unix: float
    block_hash: BlockHash


class Store:
    """Node-local tiered KV block store. Thread-safe; use `Store.open(config)` and `close()`."""

    def __init__(self, kv: KVConfig, *, registry: CollectorRegistry | None, background: bool,
                 clock: Callable[[], float]) -> None:
        self.config = kv
        self.policy = TierPolicy.from_config(kv)
        self.metrics = StoreMetrics(registry)
        self._clock = clock
        self._lock = threading.Lock()
        self._stripes = tuple(threading.Lock() for _ in range(_NUM_STRIPES))
        self._read_slots = threading.BoundedSemaphore(kv.io_threads)
        self._writers = ThreadPoolExecutor(kv.io_threads, thread_name_prefix="kvfabric-ssd-write")
        self._async_pool = ThreadPoolExecutor(kv.io_threads, thread_name_prefix="kvfabric-io")
        self._ram = RamTier(self.policy.ram_capacity_bytes, self.policy.ram_high_water_bytes)
        self._device = DeviceTier()
        self._dirty: OrderedDict[StorageKey, _Pending] = OrderedDict()
        self._freq: DecayedFrequency[StorageKey] = DecayedFrequency(kv.frequency_half_life_s)
        self._touched_ssd: set[StorageKey] = set()   # seen since the last tick, SSD-only at the time
        self._touched_rows: set[StorageKey] = set()  # last_seen / tier changed since the last tick
        self._ssd_reserved = 0
        self._ssd_wanted = 0       # bytes refused or kept waiting for SSD room since the last pass
        self._flush_blocked = False
        self._closed = False
        self._ssd = SsdTier(kv.ssd_dir, capacity_bytes=self.policy.ssd_capacity_bytes, durable=kv.durable,
                            o_direct=kv.o_direct)
        self._index = Index(kv.index_dir, sync=kv.durable)
        try:
            report = reconcile(self._index, self._ssd)
        except BaseException:
            self._index.close()
            raise
        for action, count in report.counts.items():
            self.metrics.reconciled.labels(action).inc(count)
        self.reconciled = dict(report.counts)
        self._ssd.load((key, SsdEntry(m.layer, m.num_bytes, m.digest, m.model, m.created_unix,
                                      m.last_seen_unix, m.block_hash)) for key, m in report.kept)
        # Every held (block, layer) whose hash is known, for held_addresses() and REMOVED events.
        self._held: dict[StorageKey, BlockAddress] = {
            key: BlockAddress(BlockHash(m.block_hash), m.layer) for key, m in report.kept if m.block_hash}
        self._events = StoreEventLog(kv.event_queue_max)
        self.metrics.bind_tier(Tier.RAM, lambda: self._ram.num_blocks, lambda: self._ram.used_bytes)
        self.metrics.bind_tier(Tier.SSD, lambda: self._ssd.num_blocks, lambda: self._ssd.used_bytes)
        self.metrics.bind_tier(Tier.DEVICE, lambda: len(self._device), lambda: 0)
        self.metrics.pending_writes.set_function(lambda: len(self._dirty))
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._background, name="kvfabric-store", daemon=True)
            self._thread.start()

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

        Write-through: returns OK once the SSD file and its index row are committed (fsynced when
        durable). Write-behind: returns OK once the payload is in RAM; the SSD copy follows.
        """
        return self.put_many([(address, payload)], model=model, digests=None if digest is None else [digest])[0]

    def put_many(self, items: Sequence[tuple[BlockAddress, Payload]], *, model: str = "",
                 digests: Sequence[bytes] | None = None) -> list[PutResult]:
        """Store several payloads; in write-through mode they share one group commit."""
        self._check_open()
        if digests is not None and len(digests) != len(items):
            raise ValueError(f"{len(digests)} digests for {len(items)} payloads")
        now = self._clock()
        results: list[PutResult | None] = [None] * len(items)
        todo: dict[StorageKey, tuple[int, _Pending]] = {}
        last = {address.storage_key: i for i, (address, _) in enumerate(items)}
        for i, (address, payload) in enumerate(items):
            if last[address.storage_key] != i:
                continue    # a key given twice in one call: its last payload wins
            view = as_bytes_view(payload)
            # Own the bytes before hashing them, so what is hashed is what is stored. A view of a
            # whole bytes object is kept as is; a slice is copied, or RAM would keep the (maybe far
            # larger) object alive while counting only the slice.
            whole = isinstance(view.obj, bytes) and len(view.obj) == view.nbytes
            owned = view if whole else memoryview(bytes(view))
            actual = digest_of(owned)
            if digests is not None and digests[i] != actual:
                results[i] = self._reject(PutResult.DIGEST_MISMATCH)
                continue
            todo[address.storage_key] = (i, _Pending(address.layer, model, actual, owned, now, address.hash))
        with self._lock:
            for key in [k for k, (_, p) in todo.items() if self._holds(k, p.digest)]:
                results[todo.pop(key)[0]] = PutResult.OK
        if self.config.write_through:
            self._write_through(todo, results)
        else:
            self._write_behind(todo, results)
        out: list[PutResult] = []
        for address, _ in items:
            result = results[last[address.storage_key]]
            if result is None:
                raise RuntimeError(f"put of {address} ended without a result")
            out.append(result)
        return out

    def mirror(self, address: BlockAddress, payload: Payload, *, digest: bytes,
               model: str = "") -> PutResult | None:
        """Keep a block pulled from a peer, as `put` with the peer's digest, if [kv].mirror_pulls is on.

        None (nothing stored) when mirroring is off: the block stays the owner's and the next
        request for it pulls again.
        """
        self._check_open()
        if not self.config.mirror_pulls:
            return None
        return self.put(address, payload, model=model, digest=digest)

    def delete(self, address: BlockAddress) -> bool:
        """Remove a block from every tier this store holds; True if it was anywhere."""
        self._check_open()
        key = address.storage_key
        with self._stripes[key[0]]:
            with self._lock:
                in_ram = self._ram.remove(key)
                pending = self._dirty.pop(key, None)
                entry = self._ssd.discard(key)
                self._forget(key)
            if entry is not None:
                self._ssd.unlink(key, entry.layer)
                self._index.delete_many([key], sync=False)
        return in_ram or pending is not None or entry is not None

    def flush(self) -> int:
        """Write every pending write-behind block to SSD now; returns how many are still pending
        (blocks that met a full SSD or a failing disk stay in RAM, pinned, for the next try)."""
        self._check_open()
        self._flush_blocked = False
        while self._flush_batch():
            pass
        with self._lock:
            return len(self._dirty)

    # ---- reads -------------------------------------------------------------------------------------

    def get(self, address: BlockAddress) -> memoryview | None:
        """The verified payload (a read-only view, no copy), or None."""
        block = self.get_block(address)
        return None if block is None else block.payload

    def get_block(self, address: BlockAddress, *, promote: bool = True) -> StoredBlock | None:
        """The verified payload with its digest and the tier that served it, or None.

        An SSD hit's buffer is kept in RAM (no copy) when `promote` and RAM is under capacity.
        """
        self._check_open()
        start = time.perf_counter()
        key = address.storage_key
        with self._lock:
            block = self._ram.get(key)
            if block is not None:
                self._touch(key, self._clock())
                entry = None
            else:
                entry = self._ssd.entry(key)
        if block is not None:
            self.metrics.observe_hit(Tier.RAM, time.perf_counter() - start)
            return block
        if entry is None:
            self.metrics.observe_miss(time.perf_counter() - start)
            return None
        return self._read_ssd(key, entry, promote, start)

    def lookup(self, addresses: Sequence[BlockAddress]) -> LookupResult:
        """Which tier holds each address (device first), without reading any payload."""
        self._check_open()
        keys = [a.storage_key for a in addresses]
        now = self._clock()
        tiers: list[Tier | None] = []
        with self._lock:
            for address, key in zip(addresses, keys, strict=True):
                if self._device.contains(address.hash):
                    tiers.append(Tier.DEVICE)
                elif self._ram.contains(key):
                    tiers.append(Tier.RAM)
                    self._touch(key, now)
                elif self._ssd.contains(key):
                    tiers.append(Tier.SSD)
                    self._touch(key, now)
                    self._touched_ssd.add(key)
                else:
                    tiers.append(None)
        num_leading = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return LookupResult(num_leading, tuple(tiers))

    async def aget_block(self, address: BlockAddress, *, promote: bool = True) -> StoredBlock | None:
        """`get_block` for an event loop: a RAM hit answers inline, a file read runs on the store's pool."""
        self._check_open()
        key = address.storage_key
        start = time.perf_counter()
        with self._lock:
            block = self._ram.get(key)
            if block is not None:
                self._touch(key, self._clock())
        if block is not None:
            self.metrics.observe_hit(Tier.RAM, time.perf_counter() - start)
            return block
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._async_pool, lambda: self.get_block(address, promote=promote))

    async def aput(self, address: BlockAddress, payload: Payload, *, model: str = "",
                   digest: bytes | None = None) -> PutResult:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._async_pool,
                                          lambda: self.put(address, payload, model=model, digest=digest))

    # ---- events for the cluster layer ----------------------------------------------------------------

    def held_addresses(self) -> list[BlockAddress]:
        """A snapshot of every (block hash, layer) held in any tier (RAM, pending write-behind, SSD).

        After a reopen, the SSD blocks come back from the index (rows written before block hashes
        were persisted are held but not listed).
        """
        with self._lock:
            return list(self._held.values())

    def take_events(self, max_events: int | None = None) -> StoreEvents:
        """Drain up to `max_events` STORED / REMOVED events in the order they happened.

        `overflowed=True` (reported once) means the queue passed [kv].event_queue_max and was
        cleared: resync from `held_addresses()`. Reconciliation at open emits nothing.
        """
        with self._lock:
            return self._events.take(max_events)

    # ---- device tier and thresholds ----------------------------------------------------------------

    def apply_events(self, events: Iterable[object]) -> int:
        """Feed BlockStored / BlockEvicted events of the engine's block manager; returns how many."""
        with self._lock:
            return self._device.apply_all(events)

    def on_device(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return self._device.contains(block_hash)

    def should_offload_device(self, pool_utilisation: float) -> bool:
        """True once the engine pool is fuller than gpu_offload_threshold: time to put its cold blocks."""
        return self.policy.should_offload_device(pool_utilisation)

    # ---- maintenance -------------------------------------------------------------------------------

    def run_maintenance(self, now: float | None = None) -> dict[str, int]:
        """One evictor pass: SSD TTL + capacity, write-behind flush, RAM offload, prefetch."""
        self._check_open()
        now = self._clock() if now is None else now
        done = {"ssd_evicted": self._evict_ssd(now)}
        self.flush()
        done["ram_evicted"] = self._evict_ram()
        done["prefetched"] = self._prefetch(now)
        done["rows_refreshed"] = self._persist_last_seen()
        return done

    def verify(self, progress: Callable[[int], object] | None = None) -> VerifyReport:
        """Re-read every SSD block; corrupt ones are counted and removed. `progress(n)` per block."""
        self._check_open()
        with self._lock:
            entries = self._ssd.items()
        corrupt: list[tuple[StorageKey, str]] = []
        for key, entry in entries:
            try:
                self._ssd.read_file(key, entry.layer, entry.digest)
            except CorruptBlockError as e:
                corrupt.append((key, e.reason))
                self.metrics.corrupt.labels(Tier.SSD.value).inc()
                self._drop_file(key, entry)
            except FileNotFoundError:
                corrupt.append((key, "file missing"))
                self.metrics.reconciled.labels("row_without_file").inc()
                self._drop_file(key, entry)
            if progress is not None:
                progress(1)
        return VerifyReport(len(entries), tuple(corrupt))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            ram, ssd = self._ram.stats(), self._ssd.stats()
            out: dict[str, Any] = {
                "ram": {"blocks": ram.num_blocks, "bytes": ram.num_bytes, "capacity_bytes": ram.capacity_bytes,
                        "high_water_bytes": self._ram.high_water_bytes, "pinned_blocks": self._ram.num_pinned},
                "ssd": {"blocks": ssd.num_blocks, "bytes": ssd.num_bytes, "capacity_bytes": ssd.capacity_bytes,
                        "o_direct": self._ssd.o_direct},
                "device": {"blocks": len(self._device)},
                "pending_writes": len(self._dirty),
                "write_through": self.config.write_through, "durable": self.config.durable,
            }
        value = self.metrics.value
        out["reconciled"] = {a: int(value("kvfabric_index_reconciled_total", action=a)) for a in self.reconciled}
        out["corrupt_blocks"] = {t.value: int(value("kvfabric_corrupt_blocks_total", tier=t.value))
                                 for t in (Tier.RAM, Tier.SSD)}
        out["evictions"] = {t.value: int(value("kvfabric_evictions_total", tier=t.value))
                            for t in (Tier.RAM, Tier.SSD)}
        out["put_rejected"] = {r.value: int(value("kvfabric_put_rejected_total", reason=r.value))
                               for r in PutResult if r is not PutResult.OK}
        return out

    def close(self) -> None:
        """Stop the background thread, write pending blocks, release the index. Idempotent."""
        if self._closed:
            return
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join()
        still_pending = self.flush()
        if still_pending:
            logger.warning("closing with %d write-behind blocks that could not reach SSD", still_pending)
        self._persist_last_seen()
        self._closed = True
        self._writers.shutdown()
        self._async_pool.shutdown()
        self._index.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals: writes -------------------------------------------------------------------------

    def _write_behind(self, todo: dict[StorageKey, tuple[int, _Pending]],
                      results: list[PutResult | None]) -> None:
        with self._lock:
            for key, (i, p) in todo.items():
                if not self._ram.put(key, p.payload, p.digest, pinned=True):
                    results[i] = self._reject(PutResult.FULL)
                    continue
                self._dirty.pop(key, None)
                self._dirty[key] = p
                self._hold(key, p)
                results[i] = PutResult.OK
        if todo:
            self._wake.set()

    def _write_through(self, todo: dict[StorageKey, tuple[int, _Pending]],
                       results: list[PutResult | None]) -> None:
        if not todo:
            return
        with self._stripes_of(todo):
            with self._lock:
                accepted = {}
                for key, (i, p) in todo.items():
                    size = p.payload.nbytes + HEADER_SIZE
                    if self.policy.ssd_has_room(self._ssd.used_bytes + self._ssd_reserved, size):
                        self._ssd_reserved += size
                        accepted[key] = p
                    else:
                        self._ssd_wanted = max(self._ssd_wanted, size)
                        results[i] = self._reject(PutResult.FULL)
            outcome = self._commit(accepted)
            with self._lock:
                for key, p in accepted.items():
                    results[todo[key][0]] = outcome[key]
                    if outcome[key].ok:
                        self._hold(key, p)
                        self._ram.put(key, p.payload, p.digest, limit_bytes=self._ram.capacity_bytes)
        for result in outcome.values():
            if not result.ok:
                self._reject(result)

    def _commit(self, batch: dict[StorageKey, _Pending]) -> dict[StorageKey, PutResult]:
        """Steps 1-3 of the module docstring for a batch whose stripes the caller holds and whose
        SSD bytes it reserved; adds committed blocks to the catalog and releases the reservation."""
        items = [WriteItem(k, p.layer, p.payload, p.digest, p.created_unix) for k, p in batch.items()]
        errors = self._ssd.write_files(items, self._writers) if items else []
        outcome: dict[StorageKey, PutResult] = {}
        for item, err in zip(items, errors, strict=True):
            outcome[item.key] = PutResult.OK if err is None else _classify(err)
            if err is not None:
                logger.warning("SSD write of %s failed: %s", item.key.hex()[:16], err)
        committed = [k for k, r in outcome.items() if r.ok]
        # Seen now: a write-behind block that waited in RAM for longer than the TTL is not expired
        # the moment it reaches the SSD.
        now = self._clock()
        rows = [(k, _meta(batch[k], Tier.SSD, now)) for k in committed]
        try:
            self._index.put_many(rows, sync=self.config.durable)
        except IndexUnavailableError as e:
            logger.error("index write failed, dropping %d just-written files: %s", len(rows), e)
            for k in committed:
                self._ssd.unlink(k, batch[k].layer)
                outcome[k] = PutResult.IO_ERROR
            committed = []
        with self._lock:
            self._ssd_reserved -= sum(p.payload.nbytes + HEADER_SIZE for p in batch.values())
            for k in committed:
                p = batch[k]
                self._ssd.add(k, SsdEntry(p.layer, p.payload.nbytes, p.digest, p.model, p.created_unix, now,
                                          p.block_hash))
        return outcome

    def _flush_batch(self) -> bool:
        """Commit one batch of write-behind blocks; False when nothing (more) can be done now."""
        with self._lock:
            if self._flush_blocked or not self._dirty:
                return False
            batch: dict[StorageKey, _Pending] = {}
            num_bytes = 0
            for key, p in self._dirty.items():
                size = p.payload.nbytes + HEADER_SIZE
                if len(batch) >= FLUSH_BATCH_BLOCKS or (batch and num_bytes + size > FLUSH_BATCH_BYTES):
                    break
                if not self.policy.ssd_has_room(self._ssd.used_bytes + self._ssd_reserved + num_bytes, size):
                    # Until the next tick evicts enough older SSD blocks for everything still pending.
                    self._flush_blocked = True
                    waiting = sum(q.payload.nbytes + HEADER_SIZE for q in self._dirty.values()) - num_bytes
                    self._ssd_wanted = max(self._ssd_wanted, waiting)
                    break
                batch[key] = p
                num_bytes += size
            if not batch:
                return False
            self._ssd_reserved += num_bytes
        with self._stripes_of(batch):
            with self._lock:   # a delete may have come between the two locks
                gone = [k for k, p in batch.items() if self._dirty.get(k) is not p]
                for k in gone:
                    self._ssd_reserved -= batch.pop(k).payload.nbytes + HEADER_SIZE
            outcome = self._commit(batch)
            with self._lock:
                for k, p in batch.items():
                    if outcome[k].ok and self._dirty.get(k) is p:
                        del self._dirty[k]
                        self._ram.unpin(k)
                    elif not outcome[k].ok:
                        self._flush_blocked = True
        return not self._flush_blocked

    # ---- internals: reads, eviction ----------------------------------------------------------------

    def _read_ssd(self, key: StorageKey, entry: SsdEntry, promote: bool, start: float) -> StoredBlock | None:
        with self._read_slots:
            try:
                block = self._ssd.read_file(key, entry.layer, entry.digest)
            # Either way the read is a miss. It is counted as corrupt / vanished only if the entry
            # was still current: a delete or rewrite that raced the read explains it otherwise.
            except CorruptBlockError as e:
                if self._drop_file(key, entry):
                    logger.warning("corrupt SSD block removed: %s", e)
                    self.metrics.observe_corrupt(Tier.SSD, time.perf_counter() - start)
                else:
                    self.metrics.observe_miss(time.perf_counter() - start)
                return None
            except FileNotFoundError:
                if self._drop_file(key, entry):
                    logger.warning("SSD file of %s vanished; dropped its row", key.hex()[:16])
                    self.metrics.reconciled.labels("row_without_file").inc()
                self.metrics.observe_miss(time.perf_counter() - start)
                return None
            except OSError as e:
                logger.warning("SSD read of %s failed (%s); answering a miss", key.hex()[:16], e)
                self.metrics.observe_miss(time.perf_counter() - start)
                return None
        with self._lock:
            if self._ssd.entry(key) is entry:
                now = self._clock()
                self._touch(key, now)
                # A put that landed while the file was read holds newer bytes in RAM: keep them.
                if promote and not self._ram.contains(key):
                    self._ram.put(key, block.payload, block.digest, footprint=_footprint(block.payload),
                                  limit_bytes=self._ram.capacity_bytes)
        self.metrics.observe_hit(Tier.SSD, time.perf_counter() - start)
        return block

    def _drop_file(self, key: StorageKey, entry: SsdEntry) -> bool:
        """Remove a block's file and row, unless the key was rewritten meanwhile."""
        with self._stripes[key[0]]:
            with self._lock:
                if self._ssd.entry(key) is not entry:
                    return False
                self._ssd.discard(key)
                if not self._ram.contains(key):
                    self._forget(key)
            self._ssd.unlink(key, entry.layer)
            self._index.delete_many([key], sync=False)
        return True

    def _evict_ram(self) -> int:
        with self._lock:
            victims = self._ram.evict(self.policy.ram_bytes_to_free(self._ram.used_bytes))
            for v in victims:
                if not self._ssd.contains(v.key):
                    self._forget(v.key)
        if victims:
            self.metrics.evictions.labels(Tier.RAM.value).inc(len(victims))
        return len(victims)

    def _evict_ssd(self, now: float) -> int:
        with self._lock:
            expired = self._ssd.expired(self.policy.ssd_expiry_cutoff(now))
            expired_bytes = sum(self._ssd_entry(k).file_bytes for k in expired)
            extra = self.policy.ssd_bytes_to_free(self._ssd.used_bytes - expired_bytes, self._ssd_wanted)
            self._ssd_wanted = 0
            lru = self._ssd.least_recent(extra, skip=frozenset(expired)) if extra else []
            victims = [(k, self._ssd_entry(k)) for k in expired + lru]
        evicted = sum(self._drop_file(key, entry) for key, entry in victims)
        if evicted:
            self.metrics.evictions.labels(Tier.SSD.value).inc(evicted)
        return evicted

    def _prefetch(self, now: float) -> int:
        with self._lock:
            candidates = [k for k in self._touched_ssd if self._ssd.contains(k) and not self._ram.contains(k)
                          and self.policy.should_prefetch(self._freq.relative(k))]
            self._touched_ssd.clear()
            budget = self.policy.ram_room_for_promotion(self._ram.used_bytes)
            plan = [(k, self._ssd_entry(k)) for k in self._freq.hottest_first(candidates)[:PREFETCH_MAX_BLOCKS]]
        done = 0
        for key, entry in plan:
            if entry.file_bytes > budget:
                break
            if self._read_ssd(key, entry, True, time.perf_counter()) is not None:
                budget -= entry.file_bytes
                done += 1
        return done

    def _persist_last_seen(self) -> int:
        """Write the last-seen time and tier of blocks touched since the last tick (no sync: advisory)."""
        with self._lock:
            live = {k: e for k in self._touched_rows if (e := self._ssd.entry(k)) is not None}
            self._touched_rows.clear()
        if not live:
            return 0
        # Under the stripes, so a row is never written back after its block was deleted.
        with self._stripes_of(live):
            with self._lock:
                rows = [(k, BlockMeta(e.model, e.layer, e.num_bytes, e.digest, e.created_unix,
                                      e.last_seen_unix, Tier.RAM if self._ram.contains(k) else Tier.SSD,
                                      e.block_hash))
                        for k, e in live.items() if self._ssd.entry(k) is e]
            self._index.put_many(rows, sync=False)
        return len(rows)

    def _background(self) -> None:
        interval = self.config.eviction_interval_s
        next_tick = time.monotonic() + interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while self._flush_batch():
                    pass
                if time.monotonic() >= next_tick:
                    self.run_maintenance()
                    next_tick = time.monotonic() + interval
            except Exception:   # a daemon must outlive one bad pass; the traceback is logged
                logger.exception("store maintenance failed; retrying at the next tick")
                next_tick = time.monotonic() + interval

    # ---- internals: helpers ------------------------------------------------------------------------

    def _holds(self, key: StorageKey, digest: bytes) -> bool:
        """True if this exact payload is already stored as the mode promises (callers hold the lock):
        on SSD for write-through, anywhere (RAM included, flushed later) for write-behind."""
        entry = self._ssd.entry(key)
        if entry is not None and entry.digest == digest:
            return True
        return not self.config.write_through and self._ram.digest(key) == digest

    def _touch(self, key: StorageKey, now: float) -> None:
        self._freq.touch(key, now)
        if self._ssd.contains(key):
            self._ssd.touch(key, now)
            self._touched_rows.add(key)

    def _forget(self, key: StorageKey) -> None:
        """The key left its last tier (callers hold the lock): drop its bookkeeping, queue REMOVED."""
        self._freq.forget(key)
        self._touched_ssd.discard(key)
        self._touched_rows.discard(key)
        address = self._held.pop(key, None)
        if address is not None:
            self._events.append(EventKind.REMOVED, address)

    def _hold(self, key: StorageKey, p: _Pending) -> None:
        """An acknowledged put (callers hold the lock): queue STORED unless the key was held already."""
        if key not in self._held:
            address = BlockAddress(p.block_hash, p.layer)
            self._held[key] = address
            self._events.append(EventKind.STORED, address)

    def _ssd_entry(self, key: StorageKey) -> SsdEntry:
        entry = self._ssd.entry(key)
        if entry is None:
            raise RuntimeError(f"SSD catalog lost {key.hex()[:16]} while the store lock was held")
        return entry

    @contextlib.contextmanager
    def _stripes_of(self, keys: Iterable[StorageKey]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for i in sorted({k[0] for k in keys}):
                stack.enter_context(self._stripes[i])
            yield

    def _reject(self, result: PutResult) -> PutResult:
        self.metrics.put_rejected.labels(result.value).inc()
        return result

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("store is closed")


def _classify(err: OSError) -> PutResult:
    return PutResult.NO_SPACE if err.errno in NO_SPACE_ERRNOS else PutResult.IO_ERROR


def _meta(p: _Pending, tier: Tier, last_seen: float) -> BlockMeta:
    return BlockMeta(p.model, p.layer, p.payload.nbytes, p.digest, p.created_unix, last_seen, tier, p.block_hash)


def _footprint(payload: memoryview) -> int:
    """Bytes of memory a view keeps alive (a page-aligned read buffer is larger than its payload)."""
    owner = payload.obj
    if isinstance(owner, mmap.mmap | bytearray | bytes):
        return len(owner)
    return payload.nbytes
