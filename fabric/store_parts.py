"""The parts of one Store, wired once, and the few operations that span them.

    lock       guards every part's state below; file I/O runs outside it
    stripes    per-key file locks (key[0]): every file mutation of a key (write + commit, unlink)
               holds that key's stripe, taken before `lock`, in ascending order when a batch needs
               several, so a delete or an eviction never races a write of the same key. Reads take
               no stripe: a rename is atomic and an unlinked file stays readable through an open
               descriptor; a read that finds its catalog entry replaced meanwhile does not promote.
    ram        RamTier: payloads (write-behind ones pinned until committed), CLOCK order
    ssd        SsdTier: committed files and their catalog (the index rows mirror it)
    device     DeviceTier: what the engine's block manager reports
    index      Index: one row per committed file
    holdings   Holdings: held addresses, events, accesses
    counters   StoreCounters: what stats() reports

Each part owns its fields and is changed only through its methods. `StoreParts` itself holds no
state of its own: it is a frozen record of the parts, plus what takes several of them at once
(an access, a block leaving RAM, a file leaving the SSD, what is held for a key).

A write-behind block is pinned in RAM with its digest and record until its file is committed
(fabric/write_behind.py), so what a key holds is answered by RAM and the SSD catalog alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fabric.config import KVConfig
from fabric.eviction import TierPolicy
from fabric.index import Index, reconcile
from fabric.keys import BlockAddress, BlockHash, StorageKey
from fabric.metrics import StoreMetrics
from fabric.provenance import Provenance
from fabric.store_holdings import LAST_SEEN_RESOLUTION_S, Holdings, StoreCounters
from fabric.tiers.base import Tier
from fabric.tiers.device import DeviceTier
from fabric.tiers.ram import Evicted, RamTier
from fabric.tiers.ssd import SsdTier
from fabric.tiers.ssd_catalog import SsdEntry

NUM_STRIPES = 256


@dataclass(frozen=True, slots=True)
class StoreParts:
    """One store's parts (module docstring). Methods named `*_locked` expect `lock` held."""

    config: KVConfig
    policy: TierPolicy
    metrics: StoreMetrics
    clock: Callable[[], float]
    lock: threading.Lock
    stripes: tuple[threading.Lock, ...]
    ram: RamTier
    device: DeviceTier
    ssd: SsdTier
    index: Index
    holdings: Holdings
    counters: StoreCounters

    @classmethod
    def open(cls, kv: KVConfig, policy: TierPolicy, metrics: StoreMetrics, clock: Callable[[], float]) -> StoreParts:
        """Open the SSD tier and the index, reconcile the two (counted), and wire the parts over them.
        Raises IndexUnavailableError if the index is locked by another store or unreadable."""
        ssd = SsdTier(kv.ssd_dir, capacity_bytes=policy.ssd_capacity_bytes, durable=kv.durable,
                      o_direct=kv.o_direct, capacity_blocks=kv.ssd_blocks)
        index = Index(kv.index_dir, sync=kv.durable)
        try:
            report = reconcile(index, ssd)
        except BaseException:
            index.close()
            raise
        kept = [(key, SsdEntry(m.layer, m.num_bytes, m.digest, m.model, m.created_unix, m.last_seen_unix,
                               m.block_hash, m.provenance)) for key, m in report.kept]
        ssd.load(kept)
        held = ((key, BlockAddress(BlockHash(e.block_hash), e.layer)) for key, e in kept if e.block_hash)
        counters = StoreCounters(metrics)
        for action, count in report.counts.items():
            counters.reconciled(action, count)
        return cls(kv, policy, metrics, clock, threading.Lock(), tuple(threading.Lock() for _ in range(NUM_STRIPES)),
                   RamTier(policy.ram_capacity_bytes, policy.ram_high_water_bytes, policy.ram_capacity_blocks),
                   DeviceTier(), ssd, index, Holdings(kv.event_queue_max, kv.frequency_half_life_s, held), counters)

    @contextlib.contextmanager
    def stripes_of(self, keys: Iterable[StorageKey]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for i in sorted({k[0] for k in keys}):
                stack.enter_context(self.stripes[i])
            yield

    def stats_locked(self) -> dict[str, Any]:
        """Sizes per tier and the store's own counters since open. Per tier, `blocks` counts
        (block, layer) payloads and `held_blocks` distinct block hashes with a layer there."""
        ram, ssd = self.ram.stats(), self.ssd.stats()
        return {
            "ram": {"blocks": ram.num_blocks, "held_blocks": self.ram.num_held_blocks, "bytes": ram.num_bytes,
                    "capacity_bytes": ram.capacity_bytes, "capacity_blocks": self.ram.capacity_blocks,
                    "high_water_bytes": self.ram.high_water_bytes, "pinned_blocks": self.ram.num_pinned},
            "ssd": {"blocks": ssd.num_blocks, "held_blocks": self.ssd.num_held_blocks, "bytes": ssd.num_bytes,
                    "capacity_bytes": ssd.capacity_bytes, "capacity_blocks": self.ssd.capacity_blocks,
                    "o_direct": self.ssd.o_direct},
            "device": {"blocks": len(self.device)},
            "write_through": self.config.write_through, "durable": self.config.durable,
            "events_queued": self.holdings.num_events, **self.counters.snapshot(),
        }

    # ---- what a key holds --------------------------------------------------------------------------

    def digest_held_locked(self, key: StorageKey) -> bytes | None:
        """The digest this store holds for `key` in any tier (RAM, pending included, or SSD), else None."""
        digest = self.ram.digest(key)
        if digest is not None:
            return digest
        entry = self.ssd.entry(key)
        return None if entry is None else entry.digest

    def provenance_locked(self, key: StorageKey) -> Provenance | None:
        """The provenance record held for `key` (RAM, pending included, or SSD), else None."""
        prov = self.ram.provenance(key)
        if prov is not None:
            return prov
        entry = self.ssd.entry(key)
        return None if entry is None else entry.provenance

    def addresses_where_locked(self, keep: Callable[[Provenance | None], bool]) -> list[BlockAddress]:
        """Every held address whose provenance record (None: unsigned) `keep` accepts: O(held addresses)."""
        return [address for key, address in self.holdings.items() if keep(self.provenance_locked(key))]

    def ssd_entry_locked(self, key: StorageKey) -> SsdEntry:
        entry = self.ssd.entry(key)
        if entry is None:
            raise RuntimeError(f"SSD catalog lost {key.hex()[:16]} while the store lock was held")
        return entry

    # ---- changes that span parts -------------------------------------------------------------------

    def touch_locked(self, key: StorageKey, now: float, *, ssd_only: bool = False) -> None:
        """An access: access frequency, the SSD's recency, and its row's last-seen time once stale.
        The in-memory LRU order stays exact; the row is rewritten at the next pass."""
        entry = self.ssd.touch(key, now)
        self.holdings.accessed(key, now, entry is not None and
                               entry.last_seen_unix - entry.row_seen_unix >= LAST_SEEN_RESOLUTION_S, ssd_only)

    def drop_ram_victims_locked(self, victims: Sequence[Evicted]) -> None:
        """RAM evicted these: one that is not on SSD either has left the store."""
        for v in victims:
            if not self.ssd.contains(v.key):
                self.holdings.forget(v.key)
        self.counters.evicted(Tier.RAM, len(victims))

    def drop_file(self, key: StorageKey, entry: SsdEntry, reason: str = "") -> bool:
        """Remove a block's file and row unless its entry changed meanwhile; `reason` is counted
        ("corrupt" per tier, or a reconcile action) when given."""
        with self.stripes[key[0]]:
            with self.lock:
                if self.ssd.entry(key) is not entry:
                    return False
                self.ssd.discard(key)
                if not self.ram.contains(key):
                    self.holdings.forget(key)
                if reason == "corrupt":
                    self.counters.corrupt(Tier.SSD)
                elif reason:
                    self.counters.reconciled(reason)
            self.ssd.unlink(key, entry.layer)
            self.index.delete_many([key], sync=False)
        return True
