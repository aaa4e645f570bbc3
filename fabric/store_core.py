"""The Store's shared state and the operations every part of it uses: holdings, events, SSD reads.

State (guarded by `lock`; file I/O runs outside it):

    ram      RamTier: payloads, write-behind ones pinned until their SSD copy is committed
    ssd      SsdTier catalog: committed files (the index rows mirror it)
    dirty    write-behind blocks waiting for the SSD, oldest first
    held     storage key -> BlockAddress of every (block, layer) in any tier whose hash is known;
             a key enters it with a STORED event and leaves it with a REMOVED event
    counters what stats() reports

Stripe locks: every file mutation of a key (write + commit, unlink) holds that key's stripe lock
(key[0]), taken before `lock`, in ascending order when a batch needs several, so a delete or an
eviction never races a write of the same key. Reads take no stripe: a rename is atomic and an
unlinked file stays readable through an open descriptor; a read that finds its catalog entry
replaced meanwhile does not promote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fabric.config import KVConfig
from fabric.events import EventKind, StoreEventLog
from fabric.eviction import DecayedFrequency, TierPolicy
from fabric.index import Index
from fabric.keys import BlockAddress, BlockHash, StorageKey
from fabric.metrics import StoreMetrics
from fabric.provenance import Provenance
from fabric.store_types import LookupResult, Pending, PutResult, StoreCounters
from fabric.tiers.base import CorruptBlockError, StoredBlock, Tier
from fabric.tiers.device import DeviceTier
from fabric.tiers.ram import Evicted, RamTier
from fabric.tiers.ssd import SsdTier
from fabric.tiers.ssd_catalog import SsdEntry

logger = logging.getLogger(__name__)

_NUM_STRIPES = 256
# An index row's last-seen time is refreshed once it is this much older than the block's: TTL
# expiry (days) and the LRU order after a restart do not need it finer.
LAST_SEEN_RESOLUTION_S = 60.0


class StoreCore:
    """Shared state of one Store (see the module docstring). Methods named `*_locked` expect `lock` held."""

    def __init__(self, kv: KVConfig, policy: TierPolicy, metrics: StoreMetrics, clock: Callable[[], float],
                 ssd: SsdTier, index: Index, kept: Iterable[tuple[StorageKey, SsdEntry]]) -> None:
        self.config = kv
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.lock = threading.Lock()
        self.stripes = tuple(threading.Lock() for _ in range(_NUM_STRIPES))
        self.read_slots = threading.BoundedSemaphore(kv.io_threads)
        self.ram = RamTier(policy.ram_capacity_bytes, policy.ram_high_water_bytes, policy.ram_capacity_blocks)
        self.device = DeviceTier()
        self.ssd = ssd
        self.index = index
        self.dirty: OrderedDict[StorageKey, Pending] = OrderedDict()
        self.freq: DecayedFrequency[StorageKey] = DecayedFrequency(kv.frequency_half_life_s)
        self.touched_ssd: set[StorageKey] = set()    # seen since the last tick, SSD-only at the time
        self.touched_rows: set[StorageKey] = set()   # last_seen / tier changed since the last tick
        self.ssd_reserved = 0       # bytes of SSD writes in progress
        self.ssd_wanted = 0         # bytes refused or kept waiting for SSD room since the last pass
        self.flush_blocked = False  # the flusher stops until the next tick (no room, failing disk)
        self.disk_full = False      # the last flush met a full filesystem; cleared by the next success
        self.counters = StoreCounters()
        self.events = StoreEventLog(kv.event_queue_max)
        kept = list(kept)
        ssd.load(kept)
        self.held: dict[StorageKey, BlockAddress] = {
            key: BlockAddress(BlockHash(e.block_hash), e.layer) for key, e in kept if e.block_hash}

    # ---- holdings ----------------------------------------------------------------------------------

    def digest_held_locked(self, key: StorageKey) -> bytes | None:
        """The digest this store holds for `key` in any tier (pending, RAM or SSD), else None."""
        pending = self.dirty.get(key)
        if pending is not None:
            return pending.digest
        digest = self.ram.digest(key)
        if digest is not None:
            return digest
        entry = self.ssd.entry(key)
        return None if entry is None else entry.digest

    def provenance_locked(self, key: StorageKey) -> Provenance | None:
        """The provenance record held for `key` (pending, RAM or SSD), else None."""
        pending = self.dirty.get(key)
        if pending is not None:
            return pending.provenance
        prov = self.ram.provenance(key)
        if prov is not None:
            return prov
        entry = self.ssd.entry(key)
        return None if entry is None else entry.provenance

    def addresses_of_producer_locked(self, producer: str) -> list[BlockAddress]:
        """Every held address whose provenance names `producer`, and every unsigned one (no record
        says whose it is, so it may be that producer's): O(held addresses)."""
        return self.addresses_where_locked(lambda prov: prov is None or prov.producer == producer)

    def addresses_where_locked(self, keep: Callable[[Provenance | None], bool]) -> list[BlockAddress]:
        """Every held address whose provenance record (None: unsigned) `keep` accepts: O(held addresses)."""
        return [address for key, address in self.held.items() if keep(self.provenance_locked(key))]

    def hold_locked(self, key: StorageKey, p: Pending) -> None:
        """An acknowledged put: queue STORED unless the key was held already."""
        if key not in self.held:
            address = p.address
            self.held[key] = address
            self.events.append(EventKind.STORED, address)

    def forget_locked(self, key: StorageKey) -> None:
        """The key left its last tier: drop its bookkeeping, queue REMOVED."""
        self.freq.forget(key)
        self.touched_ssd.discard(key)
        self.touched_rows.discard(key)
        address = self.held.pop(key, None)
        if address is not None:
            self.events.append(EventKind.REMOVED, address)

    def touch_locked(self, key: StorageKey, now: float) -> None:
        self.freq.touch(key, now)
        entry = self.ssd.touch(key, now)
        # Its index row is rewritten at the next tick only once the time it holds is
        # LAST_SEEN_RESOLUTION_S old: a pull that reads 7,680 (block, layer) rows again and again
        # rewrote all of them every second. The in-memory LRU order stays exact.
        if entry is not None and entry.last_seen_unix - entry.row_seen_unix >= LAST_SEEN_RESOLUTION_S:
            self.touched_rows.add(key)

    def ssd_entry_locked(self, key: StorageKey) -> SsdEntry:
        entry = self.ssd.entry(key)
        if entry is None:
            raise RuntimeError(f"SSD catalog lost {key.hex()[:16]} while the store lock was held")
        return entry

    def reject_locked(self, result: PutResult) -> PutResult:
        self.counters.put_rejected[result.value] += 1
        self.metrics.put_rejected.labels(result.value).inc()
        return result

    def drop_ram_victims_locked(self, victims: Sequence[Evicted]) -> None:
        """RAM evicted these: one that is not on SSD either has left the store."""
        for v in victims:
            if not self.ssd.contains(v.key):
                self.forget_locked(v.key)
        self.count_evictions_locked(Tier.RAM, len(victims))

    def count_evictions_locked(self, tier: Tier, n: int) -> None:
        if n:
            self.counters.evictions[tier.value] += n
            self.metrics.evictions.labels(tier.value).inc(n)

    def lookup_locked(self, addresses: Sequence[BlockAddress], keys: Sequence[StorageKey],
                      now: float, *, peek: bool = False) -> LookupResult:
        """Which tier holds each address (device first), no I/O. RAM and SSD hits count as accesses
        (access frequency, SSD recency) unless `peek`: a peek leaves every eviction order as it was."""
        tiers: list[Tier | None] = []
        for address, key in zip(addresses, keys, strict=True):
            if self.device.contains(address.hash):
                tiers.append(Tier.DEVICE)
            elif self.ram.contains(key):
                tiers.append(Tier.RAM)
                if not peek:
                    self.touch_locked(key, now)
            elif self.ssd.contains(key):
                tiers.append(Tier.SSD)
                if not peek:
                    self.touch_locked(key, now)
                    self.touched_ssd.add(key)
            else:
                tiers.append(None)
        num_leading = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return LookupResult(num_leading, tuple(tiers))

    def stats_locked(self) -> dict[str, Any]:
        """Sizes per tier and the store's own counters since open. Per tier, `blocks` counts
        (block, layer) payloads and `held_blocks` distinct block hashes with a layer there."""
        ram, ssd, c = self.ram.stats(), self.ssd.stats(), self.counters
        return {
            "ram": {"blocks": ram.num_blocks, "held_blocks": self.ram.num_held_blocks, "bytes": ram.num_bytes,
                    "capacity_bytes": ram.capacity_bytes, "capacity_blocks": self.ram.capacity_blocks,
                    "high_water_bytes": self.ram.high_water_bytes, "pinned_blocks": self.ram.num_pinned},
            "ssd": {"blocks": ssd.num_blocks, "held_blocks": self.ssd.num_held_blocks, "bytes": ssd.num_bytes,
                    "capacity_bytes": ssd.capacity_bytes, "capacity_blocks": self.ssd.capacity_blocks,
                    "o_direct": self.ssd.o_direct},
            "device": {"blocks": len(self.device)},
            "pending_writes": len(self.dirty), "disk_full": self.disk_full,
            "write_through": self.config.write_through, "durable": self.config.durable,
            "events_queued": len(self.events),
            "reconciled": dict(c.reconciled), "corrupt_blocks": dict(c.corrupt_blocks),
            "evictions": dict(c.evictions), "put_rejected": dict(c.put_rejected),
            "flush_failures": c.flush_failures,
        }

    @contextlib.contextmanager
    def stripes_of(self, keys: Iterable[StorageKey]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for i in sorted({k[0] for k in keys}):
                stack.enter_context(self.stripes[i])
            yield

    # ---- reads -------------------------------------------------------------------------------------

    def find_locked(self, key: StorageKey) -> tuple[StoredBlock | None, SsdEntry | None]:
        """(the RAM copy, touched, or None; else the SSD catalog entry or None). Caller holds the lock."""
        block = self.ram.get(key)
        if block is not None:
            self.touch_locked(key, self.clock())
            return block, None
        return None, self.ssd.entry(key)

    def finish_get(self, key: StorageKey, block: StoredBlock | None, entry: SsdEntry | None, promote: bool,
                   start: float) -> StoredBlock | None:
        """What `find_locked` found, counted; an SSD entry is read (outside the lock) and verified."""
        if block is not None:
            self.metrics.observe_hit(Tier.RAM, time.perf_counter() - start)
            return block
        if entry is None:
            self.metrics.observe_miss(time.perf_counter() - start)
            return None
        return self.read_ssd(key, entry, promote, start)

    def get_admitted(self, address: BlockAddress, promote: bool) -> StoredBlock | None:
        """A get for a call the store has admitted (it counts as in flight): RAM, else the SSD file."""
        start = time.perf_counter()
        key = address.storage_key
        with self.lock:
            block, entry = self.find_locked(key)
        return self.finish_get(key, block, entry, promote, start)

    def read_ssd(self, key: StorageKey, entry: SsdEntry, promote: bool, start: float) -> StoredBlock | None:
        """Read and verify a catalogued file; promote it to RAM if asked and there is room."""
        with self.read_slots:
            try:
                block = self.ssd.read_file(key, entry.layer, entry.digest)
            # Either way the read is a miss. It is counted as corrupt / vanished only if the entry
            # was still current: a delete that raced the read explains it otherwise.
            except CorruptBlockError as e:
                if self.drop_file(key, entry, "corrupt"):
                    logger.warning("corrupt SSD block removed: %s", e)
                    self.metrics.observe_corrupt(Tier.SSD, time.perf_counter() - start)
                else:
                    self.metrics.observe_miss(time.perf_counter() - start)
                return None
            except FileNotFoundError:
                if self.drop_file(key, entry, "row_without_file"):
                    logger.warning("SSD file of %s vanished; dropped its row", key.hex()[:16])
                self.metrics.observe_miss(time.perf_counter() - start)
                return None
            except OSError as e:
                logger.warning("SSD read of %s failed (%s); answering a miss", key.hex()[:16], e)
                self.metrics.observe_miss(time.perf_counter() - start)
                return None
        with self.lock:
            if self.ssd.entry(key) is entry:
                self.touch_locked(key, self.clock())
                if promote and not self.ram.contains(key):
                    self.ram.put(key, block.payload, block.digest, footprint=_footprint(block.payload),
                                 provenance=entry.provenance, limit_bytes=self.ram.capacity_bytes,
                                 block=entry.block_hash)
        self.metrics.observe_hit(Tier.SSD, time.perf_counter() - start)
        return block if entry.provenance is None else dataclasses.replace(block, provenance=entry.provenance)

    def drop_file(self, key: StorageKey, entry: SsdEntry, reason: str = "") -> bool:
        """Remove a block's file and row unless its entry changed meanwhile; `reason` is counted
        ("corrupt" per tier, or a reconcile action) when given."""
        with self.stripes[key[0]]:
            with self.lock:
                if self.ssd.entry(key) is not entry:
                    return False
                self.ssd.discard(key)
                if not self.ram.contains(key):
                    self.forget_locked(key)
                if reason == "corrupt":
                    self.counters.corrupt_blocks[Tier.SSD.value] += 1
                elif reason:
                    self.counters.reconciled[reason] = self.counters.reconciled.get(reason, 0) + 1
                    self.metrics.reconciled.labels(reason).inc()
            self.ssd.unlink(key, entry.layer)
            self.index.delete_many([key], sync=False)
        return True


def _footprint(payload: memoryview) -> int:
    """Bytes of memory a view keeps alive (a page-aligned read buffer is larger than its payload)."""
    owner = payload.obj
    if isinstance(owner, mmap.mmap | bytearray | bytes):
        return len(owner)
    return payload.nbytes
