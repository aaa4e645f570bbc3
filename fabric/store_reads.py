"""The Store's reads: where addresses are (no I/O), one payload, and a leading run of blocks in one pass.

    get       RAM hit ──► view, no copy
              └─► SSD entry ──► read + verify header and digest (outside the lock) ──► promote to RAM
    read_run  one walk over the leading blocks: per block, every layer found under the lock (RAM
              copy or SSD entry), then its SSD files read and verified outside it; the run ends
              before the first block with a layer missing or failing

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
from collections.abc import Iterable, Sequence

from fabric.keys import BlockAddress, StorageKey
from fabric.store_parts import StoreParts
from fabric.store_types import LookupResult
from fabric.tiers.base import CorruptBlockError, StoredBlock, Tier
from fabric.tiers.ssd_catalog import SsdEntry

logger = logging.getLogger(__name__)

# What `read_run` found for a (block, layer) under the lock: its RAM copy, else its SSD entry.
_Found = tuple[StorageKey, StoredBlock | SsdEntry]


class Reads:
    """Reads of one store; thread-safe (state under `parts.lock`, file reads outside it)."""

    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        self._ram, self._touch, self._clock, self._metrics = parts.ram, parts.touch_locked, parts.clock, parts.metrics
        self._read_slots = threading.BoundedSemaphore(parts.config.io_threads)

    # ---- where addresses are -----------------------------------------------------------------------

    def lookup_locked(self, addresses: Sequence[BlockAddress], keys: Sequence[StorageKey], now: float, *,
                      peek: bool = False) -> LookupResult:
        """Which tier holds each address (device first), no I/O; a RAM or SSD hit is an access (access
        frequency, SSD recency) unless `peek`: a peek leaves every eviction order as it was."""
        parts = self._parts
        device, ram, ssd = parts.device, parts.ram, parts.ssd
        tiers: list[Tier | None] = []
        for address, key in zip(addresses, keys, strict=True):
            if device.contains(address.hash):
                tiers.append(Tier.DEVICE)
            elif ram.contains(key):
                tiers.append(Tier.RAM)
                if not peek:
                    parts.touch_locked(key, now)
            elif ssd.contains(key):
                tiers.append(Tier.SSD)
                if not peek:
                    parts.touch_locked(key, now, ssd_only=True)
            else:
                tiers.append(None)
        num_leading = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
        return LookupResult(num_leading, tuple(tiers))

    def lookup_run(self, blocks: Iterable[Sequence[BlockAddress]], now: float, *,
                   peek: bool = False) -> list[tuple[Tier, ...]]:
        """The tiers of each leading block held in full, up to the first block with a layer missing;
        the layers of a block past the run are not accessed. Each block's keys are hashed outside
        the lock, and a block past the first gap is never hashed."""
        out: list[tuple[Tier, ...]] = []
        for addresses in blocks:
            keys = [a.storage_key for a in addresses]
            with self._parts.lock:
                found = self.lookup_locked(addresses, keys, now, peek=True)
                if found.num_leading < len(keys):
                    break
                if not peek:   # the whole block is held: now its layers count as accessed
                    for key, tier in zip(keys, found.tiers, strict=True):
                        if tier is not Tier.DEVICE:
                            self._parts.touch_locked(key, now, ssd_only=tier is Tier.SSD)
            out.append(tuple(t for t in found.tiers if t is not None))
        return out

    # ---- payloads ----------------------------------------------------------------------------------

    def find_locked(self, key: StorageKey) -> tuple[StoredBlock | None, SsdEntry | None]:
        """(the RAM copy, touched, or None; else the SSD catalog entry or None)."""
        block = self._ram.get(key)
        if block is not None:
            self._touch(key, self._clock())
            return block, None
        return None, self._parts.ssd.entry(key)

    def finish_get(self, key: StorageKey, block: StoredBlock | None, entry: SsdEntry | None, promote: bool,
                   start: float) -> StoredBlock | None:
        """What `find_locked` found, counted; an SSD entry is read (outside the lock) and verified."""
        metrics = self._metrics
        if block is not None:
            metrics.observe_hit(Tier.RAM, time.perf_counter() - start)
            return block
        if entry is None:
            metrics.observe_miss(time.perf_counter() - start)
            return None
        return self.read_ssd(key, entry, promote, start)

    def read_run(self, blocks: Iterable[Sequence[BlockAddress]], promote: bool) -> list[list[StoredBlock]]:
        """Each leading block's verified layers, up to the first block with a layer missing or failing.
        Per block: its keys hashed outside the lock, its layers found under it (RAM copy, else SSD
        entry; each an access), its SSD files read and verified outside it."""
        out: list[list[StoredBlock]] = []
        for addresses in blocks:
            start = time.perf_counter()
            keys = [a.storage_key for a in addresses]
            with self._parts.lock:
                found = self._find_block_locked(keys)
            if found is None:
                break
            layers = self._read_block(found, promote, start)
            if layers is None:
                break
            out.append(layers)
        return out

    def _find_block_locked(self, keys: Sequence[StorageKey]) -> list[_Found] | None:
        """Every layer of one block as found (RAM copy, else SSD entry), each touched; None if one is missing."""
        parts = self._parts
        ram, ssd = parts.ram, parts.ssd
        if not all(ram.contains(k) or ssd.contains(k) for k in keys):
            return None
        now = parts.clock()
        found: list[_Found] = []
        for key in keys:
            block = ram.get(key)
            parts.touch_locked(key, now, ssd_only=block is None)
            found.append((key, block if block is not None else parts.ssd_entry_locked(key)))
        return found

    def _read_block(self, found: list[_Found], promote: bool, start: float) -> list[StoredBlock] | None:
        """`found`'s SSD files read and verified (outside the lock); None if one fails."""
        pass_s = time.perf_counter() - start
        layers: list[StoredBlock] = []
        num_ram_hits = 0
        for key, where in found:
            if isinstance(where, StoredBlock):
                num_ram_hits += 1
                layers.append(where)
                continue
            block = self.read_ssd(key, where, promote, time.perf_counter())
            if block is None:
                return None
            layers.append(block)
        # A block's layers are found under one lock: each RAM hit is counted with its share of that pass.
        for _ in range(num_ram_hits):
            self._parts.metrics.observe_hit(Tier.RAM, pass_s / num_ram_hits)
        return layers

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
