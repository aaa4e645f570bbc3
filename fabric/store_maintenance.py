"""Carrying out a `MaintenancePlan` (fabric/eviction.py) on a store's state: SSD expiry and
capacity eviction, RAM offload, prefetch, last-seen rows, and the full re-read of `verify`; and
the background thread that runs a pass every tick and drains write-behind batches between ticks.

The decisions are the planner's; these functions only take the lock, pick the victims the plan
names (TTL first, then least recently seen) and do the file and index work outside the lock.
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
from fabric.store_core import StoreCore
from fabric.store_types import VerifyReport
from fabric.store_writes import Writer
from fabric.tiers.base import CorruptBlockError, Tier

logger = logging.getLogger(__name__)


def run_pass(core: StoreCore, writer: Writer, now: float) -> dict[str, int]:
    """One evictor pass: plan from a snapshot, then SSD TTL + capacity, write-behind flush, RAM
    offload, prefetch, last-seen rows."""
    plan = core.policy.plan(snapshot(core), now)
    done = {"ssd_evicted": evict_ssd(core, plan)}
    if plan.flush:
        writer.flush()
    done["ram_evicted"] = evict_ram(core, plan)
    done["prefetched"] = prefetch(core, plan)
    done["rows_refreshed"] = persist_last_seen(core)
    return done


class Background:
    """The store's one background thread: drains write-behind batches as soon as they are queued
    (`wake`), and runs `run_pass` every `eviction_interval_s`."""

    def __init__(self, core: StoreCore, writer: Writer) -> None:
        self._core = core
        self._writer = writer
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
        core, writer = self._core, self._writer
        lower_thread_priority(core.config.background_nice)
        interval = core.config.eviction_interval_s
        next_tick = time.monotonic() + interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_tick - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                while writer.flush_batch():
                    pass
                if time.monotonic() >= next_tick:
                    with core.lock:
                        core.flush_blocked = False   # a new tick retries a blocked flush
                    run_pass(core, writer, core.clock())
                    next_tick = time.monotonic() + interval
            except Exception:   # a daemon must outlive one bad pass; the traceback is logged
                logger.exception("store maintenance failed; retrying at the next tick")
                next_tick = time.monotonic() + interval


def snapshot(core: StoreCore) -> TierSnapshot:
    """The planner's input; clears the set of SSD blocks touched since the last pass."""
    with core.lock:
        candidates = tuple((k, core.freq.relative(k), core.ssd_entry_locked(k).file_bytes)
                           for k in core.touched_ssd if core.ssd.contains(k) and not core.ram.contains(k))
        core.touched_ssd.clear()
        return TierSnapshot(core.ram.used_bytes, core.ssd.used_bytes, core.ssd_wanted, len(core.dirty),
                            core.ram.num_held_blocks, core.ssd.num_held_blocks, candidates)


def evict_ssd(core: StoreCore, plan: MaintenancePlan) -> int:
    with core.lock:
        expired = core.ssd.expired(plan.ssd_expiry_cutoff)
        expired_bytes = sum(core.ssd_entry_locked(k).file_bytes for k in expired)
        extra = max(0, core.ssd.used_bytes - expired_bytes - plan.ssd_target_bytes)
        core.ssd_wanted = 0
        lru = core.ssd.least_recent(extra, skip=frozenset(expired), num_blocks=plan.ssd_evict_blocks) \
            if extra or plan.ssd_evict_blocks else []
        victims = [(k, core.ssd_entry_locked(k)) for k in expired + lru]
    evicted = sum(core.drop_file(key, entry) for key, entry in victims)
    with core.lock:
        core.count_evictions_locked(Tier.SSD, evicted)
    return evicted


def evict_ram(core: StoreCore, plan: MaintenancePlan) -> int:
    with core.lock:
        victims = core.ram.evict(max(0, core.ram.used_bytes - plan.ram_target_bytes),
                                 num_blocks=plan.ram_evict_blocks)
        core.drop_ram_victims_locked(victims)
    return len(victims)


def prefetch(core: StoreCore, plan: MaintenancePlan) -> int:
    done = 0
    for key in plan.prefetch:
        with core.lock:
            entry = core.ssd.entry(StorageKey(key))
            if entry is None or core.ram.contains(StorageKey(key)):
                continue
        if core.read_ssd(StorageKey(key), entry, True, time.perf_counter()) is not None:
            done += 1
    return done


def persist_last_seen(core: StoreCore) -> int:
    """Write the last-seen time and tier of blocks whose row is LAST_SEEN_RESOLUTION_S behind (no
    sync: advisory)."""
    with core.lock:
        live = {k: e for k in core.touched_rows if (e := core.ssd.entry(k)) is not None}
        core.touched_rows.clear()
    if not live:
        return 0
    # Under the stripes, so a row is never written back after its block was deleted.
    with core.stripes_of(live):
        with core.lock:
            rows = [(k, BlockMeta(e.model, e.layer, e.num_bytes, e.digest, e.created_unix, e.last_seen_unix,
                                  Tier.RAM if core.ram.contains(k) else Tier.SSD, e.block_hash, e.provenance))
                    for k, e in live.items() if core.ssd.entry(k) is e]
        core.index.put_many(rows, sync=False)
        with core.lock:
            for k, meta in rows:
                if (e := core.ssd.entry(k)) is not None:
                    e.row_seen_unix = max(e.row_seen_unix, meta.last_seen_unix)
    return len(rows)


def verify(core: StoreCore, progress: Callable[[int], object] | None) -> VerifyReport:
    """Re-read every SSD block; corrupt ones are counted and removed."""
    with core.lock:
        entries = core.ssd.items()
    corrupt: list[tuple[StorageKey, str]] = []
    for key, entry in entries:
        try:
            core.ssd.read_file(key, entry.layer, entry.digest)
        except CorruptBlockError as e:
            corrupt.append((key, e.reason))
            if core.drop_file(key, entry, "corrupt"):
                core.metrics.corrupt.labels(Tier.SSD.value).inc()
        except FileNotFoundError:
            corrupt.append((key, "file missing"))
            core.drop_file(key, entry, "row_without_file")
        if progress is not None:
            progress(1)
    return VerifyReport(len(entries), tuple(corrupt))
