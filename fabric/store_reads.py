"""The Store's reads: where addresses are (no I/O), one payload, and a leading run of blocks in one pass.

    get       RAM hit ──► view, no copy
              └─► SSD entry ──► read + verify header and digest (outside the lock) ──► promote to RAM
    read_run  one pass under the lock finds every layer of the leading blocks (RAM copy or SSD entry)
              and stops at the first block with a layer missing; then the SSD files are read and
              verified outside the lock, and the run ends before the first block one fails in

A read that meets a corrupt file or a row without a file drops both (counted), and answers a miss.
`read_slots` bounds the file reads in flight to [kv].io_threads. Costs: lookup O(addresses); a RAM
get O(1) plus one BLAKE3 of 36 bytes for the storage key; an SSD get one open + one read + one
BLAKE3 of the payload.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
import time
from collections.abc import Sequence

from fabric.keys import BlockAddress, StorageKey
from fabric.store_parts import StoreParts
from fabric.store_types import LookupResult
from fabric.tiers.base import CorruptBlockError, StoredBlock, Tier
from fabric.tiers.ssd_catalog import SsdEntry

logger = logging.getLogger(__name__)

# What one pass of `read_run` found for a (block, layer): its RAM copy, else its SSD entry.
_Found = tuple[StorageKey, StoredBlock | SsdEntry]


class Reads:
    """Reads of one store; thread-safe (state under `parts.lock`, file reads outside it)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._read_slots = threading.BoundedSemaphore(parts.config.io_threads)

    # ---- where addresses are -----------------------------------------------------------------------

    def tier_locked(self, address: BlockAddress, key: StorageKey, now: float, peek: bool) -> Tier | None:
        """Which tier holds `address` (device first), no I/O; a RAM or SSD hit is an access (access
        frequency, SSD recency) unless `peek`: a peek leaves every eviction order as it was."""
        parts = self._parts
        if parts.device.contains(address.hash):
            return Tier.DEVICE
        if parts.ram.contains(key):
            if not peek:
                parts.touch_locked(key, now)
            return Tier.RAM
        if parts.ssd.contains(key):
            if not peek:
                parts.touch_locked(key, now, ssd_only=True)
            return Tier.SSD
        return None

    def lookup_locked(self, addresses: Sequence[BlockAddress], now: float, *, peek: bool = False) -> LookupResult:
        tiers = tuple(self.tier_locked(a, a.storage_key, now, peek) for a in addresses)
        num_leading = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return LookupResult(num_leading, tiers)

    def lookup_run_locked(self, blocks: Sequence[Sequence[BlockAddress]], now: float, *,
                          peek: bool = False) -> list[tuple[Tier, ...]]:
        """The tiers of each leading block held in full, up to the first block with a layer missing;
        the layers of a block past the run are not accessed."""
        out: list[tuple[Tier, ...]] = []
        for addresses in blocks:
            tiers = [self.tier_locked(a, a.storage_key, now, peek=True) for a in addresses]
            if any(t is None for t in tiers):
                break
            if not peek:
                for a in addresses:
                    self.tier_locked(a, a.storage_key, now, peek=False)
            out.append(tuple(t for t in tiers if t is not None))
        return out

    # ---- payloads ----------------------------------------------------------------------------------

    def find_locked(self, key: StorageKey) -> tuple[StoredBlock | None, SsdEntry | None]:
        """(the RAM copy, touched, or None; else the SSD catalog entry or None)."""
        block = self._parts.ram.get(key)
        if block is not None:
            self._parts.touch_locked(key, self._parts.clock())
            return block, None
        return None, self._parts.ssd.entry(key)

    def finish_get(self, key: StorageKey, block: StoredBlock | None, entry: SsdEntry | None, promote: bool,
                   start: float) -> StoredBlock | None:
        """What `find_locked` found, counted; an SSD entry is read (outside the lock) and verified."""
        metrics = self._parts.metrics
        if block is not None:
            metrics.observe_hit(Tier.RAM, time.perf_counter() - start)
            return block
        if entry is None:
            metrics.observe_miss(time.perf_counter() - start)
            return None
        return self.read_ssd(key, entry, promote, start)

    def find_run_locked(self, blocks: Sequence[Sequence[BlockAddress]]) -> list[list[_Found]]:
        """One pass: each leading block's layers as found (RAM copy, else SSD entry), up to the first
        block with a layer missing. Every layer of the run is an access; none past it is."""
        parts = self._parts
        run_keys: list[list[StorageKey]] = []
        for addresses in blocks:
            keys = [a.storage_key for a in addresses]
            if not all(parts.ram.contains(k) or parts.ssd.contains(k) for k in keys):
                break
            run_keys.append(keys)
        now = parts.clock()
        run: list[list[_Found]] = []
        for keys in run_keys:
            found: list[_Found] = []
            for key in keys:
                block = parts.ram.get(key)
                parts.touch_locked(key, now, ssd_only=block is None)
                found.append((key, block if block is not None else parts.ssd_entry_locked(key)))
            run.append(found)
        return run

    def read_run(self, run: list[list[_Found]], promote: bool, start: float) -> list[list[StoredBlock]]:
        """`find_run_locked`'s run with its SSD files read and verified (outside the lock), up to the
        first block with a layer that fails."""
        pass_s = time.perf_counter() - start
        out: list[list[StoredBlock]] = []
        num_ram_hits = 0
        for found in run:
            layers: list[StoredBlock] = []
            for key, where in found:
                if isinstance(where, StoredBlock):
                    num_ram_hits += 1
                    layers.append(where)
                    continue
                block = self.read_ssd(key, where, promote, time.perf_counter())
                if block is None:
                    break
                layers.append(block)
            if len(layers) < len(found):
                break
            out.append(layers)
        # The run was found under one lock: each RAM hit is counted with its share of that pass.
        share = pass_s / max(1, num_ram_hits)
        for _ in range(num_ram_hits):
            self._parts.metrics.observe_hit(Tier.RAM, share)
        return out

    def read_ssd(self, key: StorageKey, entry: SsdEntry, promote: bool, start: float) -> StoredBlock | None:
        """Read and verify a catalogued file; promote it to RAM if asked and there is room."""
        parts = self._parts
        with self._read_slots:
            try:
                block = parts.ssd.read_file(key, entry.layer, entry.digest)
            # Either way the read is a miss. It is counted as corrupt / vanished only if the entry
            # was still current: a delete that raced the read explains it otherwise.
            except CorruptBlockError as e:
                if parts.drop_file(key, entry, "corrupt"):
                    logger.warning("corrupt SSD block removed: %s", e)
                    parts.metrics.observe_corrupt(Tier.SSD, time.perf_counter() - start)
                else:
                    parts.metrics.observe_miss(time.perf_counter() - start)
                return None
            except FileNotFoundError:
                if parts.drop_file(key, entry, "row_without_file"):
                    logger.warning("SSD file of %s vanished; dropped its row", key.hex()[:16])
                parts.metrics.observe_miss(time.perf_counter() - start)
                return None
            except OSError as e:
                logger.warning("SSD read of %s failed (%s); answering a miss", key.hex()[:16], e)
                parts.metrics.observe_miss(time.perf_counter() - start)
                return None
        with parts.lock:
            if parts.ssd.entry(key) is entry:
                parts.touch_locked(key, parts.clock())
                if promote and not parts.ram.contains(key):
                    parts.ram.put(key, block.payload, block.digest, footprint=_footprint(block.payload),
                                  provenance=entry.provenance, limit_bytes=parts.ram.capacity_bytes,
                                  block=entry.block_hash)
        parts.metrics.observe_hit(Tier.SSD, time.perf_counter() - start)
        return block if entry.provenance is None else dataclasses.replace(block, provenance=entry.provenance)


def _footprint(payload: memoryview) -> int:
    """Bytes of memory a view keeps alive (a page-aligned read buffer is larger than its payload)."""
    owner = payload.obj
    if isinstance(owner, mmap.mmap | bytearray | bytes):
        return len(owner)
    return payload.nbytes
