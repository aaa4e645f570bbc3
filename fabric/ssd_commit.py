"""The one path by which blocks reach the SSD (a write-through put, `put_many`, the write-behind
flusher), and the room it makes there.

The commit path, for a batch whose stripes the caller holds (module docstring of fabric/store.py
gives the crash argument)::

    reserve SSD bytes (or FULL) -> write temp files, fdatasync -> rename -> folder fsync
        (a batch of GROUP_SYNC_MIN+ files: write temp files -> syncfs -> rename -> syncfs)
        -> index rows in one WriteBatch, WAL synced -> catalog entries -> release the reservation

`SsdCommitter` owns what is on its way to the disk: the bytes reserved by commits in progress,
and the room wanted by writes the SSD refused since the planner last asked (`take_wanted`), so
the next maintenance pass evicts for them.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor

from fabric.index import IndexUnavailableError
from fabric.keys import StorageKey
from fabric.store_parts import StoreParts
from fabric.store_types import Pending, PutResult
from fabric.tiers.base import Tier
from fabric.tiers.ssd import NO_SPACE_ERRNOS, WriteItem
from fabric.tiers.ssd_catalog import SsdEntry
from fabric.tiers.ssd_format import HEADER_SIZE

logger = logging.getLogger(__name__)


def file_bytes(p: Pending) -> int:
    """Bytes a pending block's file takes on the SSD."""
    return p.payload.nbytes + HEADER_SIZE


class SsdCommitter:
    """Commits batches to the SSD and evicts for room; thread-safe (state under `parts.lock`)."""

    def __init__(self, parts: StoreParts, pool: Executor) -> None:
        self._parts = parts
        self._pool = pool
        self._reserved = 0   # bytes of SSD writes in progress
        self._wanted = 0     # bytes refused or kept waiting for SSD room since the last `take_wanted`

    def want_locked(self, num_bytes: int) -> None:
        """Writes of `num_bytes` wait for SSD room (the next pass evicts for them)."""
        self._wanted = max(self._wanted, num_bytes)

    def take_wanted_locked(self) -> int:
        """The SSD room wanted since the last call; starts a new count."""
        wanted, self._wanted = self._wanted, 0
        return wanted

    def commit(self, batch: dict[StorageKey, Pending]) -> dict[StorageKey, PutResult]:
        """The one commit path (module docstring) for a batch whose stripes the caller holds. A block
        the SSD has no room for answers FULL (and is wanted)."""
        parts = self._parts
        outcome: dict[StorageKey, PutResult] = {}
        accepted: dict[StorageKey, Pending] = {}
        with parts.lock:
            used = parts.ssd.used_bytes + self._reserved
            new_blocks: set[bytes] = set()
            for key, p in batch.items():
                size = file_bytes(p)
                fresh = not parts.ssd.holds_block(p.block_hash) and p.block_hash not in new_blocks
                if parts.policy.ssd_has_room(used, size) and (
                        not fresh or parts.ssd.has_block_room(p.block_hash, len(new_blocks))):
                    accepted[key] = p
                    used += size
                    if fresh:
                        new_blocks.add(p.block_hash)
                else:
                    self.want_locked(size)
                    outcome[key] = PutResult.FULL
            reserved = sum(file_bytes(p) for p in accepted.values())
            self._reserved += reserved
        try:
            outcome.update(self._write_and_index(accepted))
        finally:
            with parts.lock:
                self._reserved -= reserved
                now = parts.clock()
                for key, p in accepted.items():
                    if outcome.get(key) is PutResult.OK:
                        parts.ssd.add(key, SsdEntry(p.layer, p.payload.nbytes, p.digest, p.model,
                                                    p.created_unix, now, p.block_hash, p.provenance))
        return outcome

    def _write_and_index(self, batch: dict[StorageKey, Pending]) -> dict[StorageKey, PutResult]:
        parts = self._parts
        if not batch:
            return {}
        items = [WriteItem(k, p.layer, p.payload, p.digest, p.created_unix) for k, p in batch.items()]
        errors = parts.ssd.write_files(items, self._pool)
        outcome: dict[StorageKey, PutResult] = {}
        for item, err in zip(items, errors, strict=True):
            outcome[item.key] = PutResult.OK if err is None else _classify(err)
            if err is not None:
                logger.warning("SSD write of %s failed: %s", item.key.hex()[:16], err)
        committed = [k for k, r in outcome.items() if r.ok]
        # Seen now: a write-behind block that waited in RAM for longer than the TTL is not expired
        # the moment it reaches the SSD.
        now = parts.clock()
        rows = [(k, batch[k].meta(now)) for k in committed]
        try:
            parts.index.put_many(rows, sync=parts.config.durable)
        except IndexUnavailableError as e:
            logger.error("index write failed, removing %d just-written files: %s", len(rows), e)
            failed = PutResult.NO_SPACE if "No space" in str(e) else PutResult.IO_ERROR
            for k in committed:
                parts.ssd.unlink(k, batch[k].layer)
                outcome[k] = failed
        return outcome

    def make_room(self, items: list[tuple[StorageKey, Pending]]) -> int:
        """Evict least recently seen SSD files until the leading `items` that an empty SSD could
        take fit in its bytes and blocks; how many were evicted. The caller holds no stripe (a
        victim's stripe is taken here)."""
        parts = self._parts
        cap_bytes, cap_blocks = parts.policy.ssd_capacity_bytes, parts.ssd.capacity_blocks
        with parts.lock:
            size = 0
            fresh: set[bytes] = set()
            for _, p in items:
                new = set() if parts.ssd.holds_block(p.block_hash) else {p.block_hash}
                if size + file_bytes(p) > cap_bytes or (cap_blocks and len(fresh | new) > cap_blocks):
                    break   # even an empty SSD could not take this one too: evicting for it would only lose blocks
                size += file_bytes(p)
                fresh |= new
            extra = parts.ssd.used_bytes + self._reserved + size - cap_bytes
            need_blocks = parts.ssd.num_held_blocks + len(fresh) - cap_blocks if cap_blocks else 0
            if size == 0 or (extra <= 0 and need_blocks <= 0):
                return 0
            keys = parts.ssd.least_recent(max(0, extra), num_blocks=max(0, need_blocks))
            victims = [(k, parts.ssd_entry_locked(k)) for k in keys]
        evicted = sum(parts.drop_file(key, entry) for key, entry in victims)
        with parts.lock:
            parts.counters.evicted(Tier.SSD, evicted)
        return evicted


def _classify(err: OSError) -> PutResult:
    return PutResult.NO_SPACE if err.errno in NO_SPACE_ERRNOS else PutResult.IO_ERROR
