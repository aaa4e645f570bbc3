"""Carrying out a `MaintenancePlan` (fabric/eviction.py) on a store's parts: SSD expiry and
capacity eviction, RAM offload, prefetch, last-seen rows, and the full re-read of `verify`; and
the background thread that runs a pass every tick and drains write-behind batches between ticks.

The decisions are the planner's; `Maintenance` only takes the lock, picks the victims the plan
names (TTL first, then least recently seen) and does the file and index work outside the lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from fabric.eviction import MaintenancePlan, TierSnapshot
from fabric.index import BlockMeta
from fabric.keys import StorageKey
from fabric.priority import lower_thread_priority
from fabric.ssd_commit import SsdCommitter
from fabric.store_parts import StoreParts
from fabric.store_reads import Reads
from fabric.store_types import VerifyReport
from fabric.tiers.base import CorruptBlockError, Tier
from fabric.write_behind import WriteBehind

logger = logging.getLogger(__name__)


class Maintenance:
    """One store's maintenance: each pass asks the planner, then evicts, flushes, prefetches and
    rewrites stale rows through the parts' own methods."""

    def __init__(self, parts: StoreParts, reads: Reads, committer: SsdCommitter, write_behind: WriteBehind) -> None:
        self._parts = parts
        self._reads = reads
        self._committer = committer
        self._write_behind = write_behind

    def run_pass(self, now: float) -> dict[str, int]:
        """One evictor pass: plan from a snapshot, then SSD TTL + capacity, write-behind flush, RAM
        offload, prefetch, last-seen rows."""
        plan = self._parts.policy.plan(self.snapshot(), now)
        done = {"ssd_evicted": self.evict_ssd(plan)}
        if plan.flush:
            self._write_behind.flush()
        done["ram_evicted"] = self.evict_ram(plan)
        done["prefetched"] = self.prefetch(plan)
        done["rows_refreshed"] = self.persist_last_seen()
        return done

    def snapshot(self) -> TierSnapshot:
        """The planner's input; starts new counts of the SSD blocks touched and the SSD room wanted."""
        parts = self._parts
        with parts.lock:
            ram, ssd = parts.ram, parts.ssd
            candidates = tuple((k, parts.holdings.relative_frequency(k), parts.ssd_entry_locked(k).file_bytes)
                               for k in parts.holdings.take_touched_ssd()
                               if ssd.contains(k) and not ram.contains(k))
            return TierSnapshot(ram.used_bytes, ssd.used_bytes, self._committer.take_wanted_locked(),
                                self._write_behind.num_pending, ram.num_held_blocks, ssd.num_held_blocks,
                                candidates)

    def evict_ssd(self, plan: MaintenancePlan) -> int:
        parts = self._parts
        with parts.lock:
            expired = parts.ssd.expired(plan.ssd_expiry_cutoff)
            expired_bytes = sum(parts.ssd_entry_locked(k).file_bytes for k in expired)
            extra = max(0, parts.ssd.used_bytes - expired_bytes - plan.ssd_target_bytes)
            lru = parts.ssd.least_recent(extra, skip=frozenset(expired), num_blocks=plan.ssd_evict_blocks) \
                if extra or plan.ssd_evict_blocks else []
            victims = [(k, parts.ssd_entry_locked(k)) for k in expired + lru]
        evicted = sum(parts.drop_file(key, entry) for key, entry in victims)
        with parts.lock:
            parts.counters.evicted(Tier.SSD, evicted)
        return evicted

    def evict_ram(self, plan: MaintenancePlan) -> int:
        parts = self._parts
        with parts.lock:
            victims = parts.ram.evict(max(0, parts.ram.used_bytes - plan.ram_target_bytes),
                                      num_blocks=plan.ram_evict_blocks)
            parts.drop_ram_victims_locked(victims)
        return len(victims)

    def prefetch(self, plan: MaintenancePlan) -> int:
        parts = self._parts
        done = 0
        for key in plan.prefetch:
            with parts.lock:
                entry = parts.ssd.entry(StorageKey(key))
                if entry is None or parts.ram.contains(StorageKey(key)):
                    continue
            if self._reads.read_ssd(StorageKey(key), entry, True, time.perf_counter()) is not None:
                done += 1
        return done

    def persist_last_seen(self) -> int:
        """Write the last-seen time and tier of blocks whose row is LAST_SEEN_RESOLUTION_S behind (no
        sync: advisory)."""
        parts = self._parts
        with parts.lock:
            live = {k: e for k in parts.holdings.take_touched_rows() if (e := parts.ssd.entry(k)) is not None}
        if not live:
            return 0
        # Under the stripes, so a row is never written back after its block was deleted.
        with parts.stripes_of(live):
            with parts.lock:
                rows = [(k, BlockMeta(e.model, e.layer, e.num_bytes, e.digest, e.created_unix, e.last_seen_unix,
                                      Tier.RAM if parts.ram.contains(k) else Tier.SSD, e.block_hash, e.provenance))
                        for k, e in live.items() if parts.ssd.entry(k) is e]
            parts.index.put_many(rows, sync=False)
            with parts.lock:
                for k, meta in rows:
                    if (e := parts.ssd.entry(k)) is not None:
                        e.row_seen_unix = max(e.row_seen_unix, meta.last_seen_unix)
        return len(rows)

    def verify(self, progress: Callable[[int], object] | None) -> VerifyReport:
        """Re-read every SSD block; corrupt ones are counted and removed."""
        parts = self._parts
        with parts.lock:
            entries = parts.ssd.items()
        corrupt: list[tuple[StorageKey, str]] = []
        for key, entry in entries:
            try:
                parts.ssd.read_file(key, entry.layer, entry.digest)
            except CorruptBlockError as e:
                corrupt.append((key, e.reason))
                if parts.drop_file(key, entry, "corrupt"):
                    parts.metrics.corrupt.labels(Tier.SSD.value).inc()
            except FileNotFoundError:
                corrupt.append((key, "file missing"))
                parts.drop_file(key, entry, "row_without_file")
            if progress is not None:
                progress(1)
        return VerifyReport(len(entries), tuple(corrupt))


class Background:
    """The store's one background thread: drains write-behind batches as soon as they are queued
    (`wake`), and runs a maintenance pass every `eviction_interval_s`."""

    def __init__(self, parts: StoreParts, maintenance: Maintenance, write_behind: WriteBehind) -> None:
        self._parts = parts
        self._maintenance = maintenance
        self._write_behind = write_behind
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfabric-store", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self) -> None:
        """Ask the thread to stop and wait for it (it finishes the batch or pass in progress)."""
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        parts, queue = self._parts, self._write_behind
        lower_thread_priority(parts.config.background_nice)
        interval = parts.config.eviction_interval_s
        next_tick = time.monotonic() + interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while queue.flush_batch():
                    pass
                if time.monotonic() >= next_tick:
                    with parts.lock:
                        queue.retry_locked()   # a new tick retries a blocked flush
                    self._maintenance.run_pass(parts.clock())
                    next_tick = time.monotonic() + interval
            except Exception:   # a daemon must outlive one bad pass; the traceback is logged
                logger.exception("store maintenance failed; retrying at the next tick")
                next_tick = time.monotonic() + interval
