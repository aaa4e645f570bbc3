"""The Store's write side: admission (the overwrite rule), write-through, write-behind, and the one
commit path that every SSD write goes through (a write-through put, `put_many`, the flusher).

The overwrite rule. Keys are content addresses, so an address carries one payload: the first
acknowledged one stands. A put of the same bytes for a held address is OK and writes nothing; a
put of other bytes is refused with CONFLICT and counted (it means non-deterministic KV or a key
bug upstream). Hence no file of an acknowledged block is ever renamed over, and `get()` can only
serve the payload acknowledged for that address. After `delete()` the address is free again.

The commit path, for a batch whose stripes the caller holds (module docstring of fabric/store.py
gives the crash argument)::

    reserve SSD bytes (or FULL) -> write temp files, fdatasync -> rename -> folder fsync
        (a batch of GROUP_SYNC_MIN+ files: write temp files -> syncfs -> rename -> syncfs)
        -> index rows in one WriteBatch, WAL synced -> catalog entries -> release the reservation
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass

from fabric.index import IndexUnavailableError
from fabric.keys import BlockAddress, StorageKey
from fabric.provenance import Provenance
from fabric.store_core import StoreCore
from fabric.store_types import Pending, PutResult
from fabric.tiers.base import Payload, Tier, as_bytes_view, digest_of
from fabric.tiers.ssd import NO_SPACE_ERRNOS, WriteItem
from fabric.tiers.ssd_catalog import SsdEntry
from fabric.tiers.ssd_format import HEADER_SIZE

logger = logging.getLogger(__name__)
UNSIGNED_PRODUCER = "unsigned"   # the producer label of a block without a provenance record

FLUSH_BATCH_BLOCKS = 128
FLUSH_BATCH_BYTES = 64 << 20
# A write-behind put that finds RAM full of pinned payloads commits at most this many flush
# batches for its room before it is refused.
ROOM_FLUSH_ROUNDS = 64


@dataclass(frozen=True, slots=True)
class _Todo:
    index: int          # position of the result in the caller's list
    key: StorageKey
    pending: Pending


class Writer:
    """Puts and flushes of one store; thread-safe (state under `core.lock`, files under stripes)."""

    def __init__(self, core: StoreCore, pool: Executor) -> None:
        self.core = core
        self.pool = pool

    def put_many(self, items: list[tuple[BlockAddress, Payload]], model: str,
                 digests: list[bytes] | None, provenance: list[Provenance | None] | None = None) -> list[PutResult]:
        core = self.core
        now = core.clock()
        results: list[PutResult | None] = [None] * len(items)
        last = {address.storage_key: i for i, (address, _) in enumerate(items)}
        todo: list[_Todo] = []
        for i, (address, payload) in enumerate(items):
            if last[address.storage_key] != i:
                continue    # a key given twice in one call: its last payload is the one considered
            view = as_bytes_view(payload)
            # Own the bytes before hashing them, so what is hashed is what is stored. A view of a
            # whole bytes object is kept as is; a slice is copied, or RAM would keep the (maybe far
            # larger) object alive while counting only the slice.
            whole = isinstance(view.obj, bytes) and len(view.obj) == view.nbytes
            owned = view if whole else memoryview(bytes(view))
            actual = digest_of(owned)
            if digests is not None and digests[i] != actual:
                with core.lock:
                    results[i] = core.reject_locked(PutResult.DIGEST_MISMATCH)
                continue
            todo.append(_Todo(i, address.storage_key, Pending(address.hash, address.layer, model, actual,
                                                               owned, now, provenance[i] if provenance else None)))
        if core.config.write_through:
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

    def _admit_locked(self, t: _Todo, need_ssd: bool) -> PutResult | None:
        """The overwrite rule: OK (already held, nothing to write), CONFLICT, or None (write it)."""
        held = self.core.digest_held_locked(t.key)
        if held is None:
            return None
        if held != t.pending.digest:
            self._note_conflict_locked(t)
            return self.core.reject_locked(PutResult.CONFLICT)
        if need_ssd and not self.core.ssd.contains(t.key):
            return None     # held in RAM only (its SSD copy expired): write-through writes it again
        return PutResult.OK

    def _note_conflict_locked(self, t: _Todo) -> None:
        """Name both producers of a conflict: the held bytes' and the refused ones' (or "unsigned")."""
        held_by = _producer(self.core.provenance_locked(t.key))
        new_by = _producer(t.pending.provenance)
        self.core.metrics.conflicts.labels(held_by, new_by).inc()
        logger.warning("conflicting store at %s: held bytes produced by %s, refused bytes from %s (the held ones "
                       "stand)", t.pending.address, held_by, new_by)

    def _write_behind(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        core = self.core
        added = False
        waiting: list[_Todo] = []
        with core.lock:
            for t in todo:
                admitted = self._admit_locked(t, need_ssd=False)
                if admitted is not None:
                    results[t.index] = admitted
                elif self._hold_in_ram_locked(t):
                    results[t.index] = PutResult.OK
                    added = True
                else:
                    waiting.append(t)
        for t in waiting:
            results[t.index] = self._admit_after_flush(t)
            added |= results[t.index] is PutResult.OK
        if added:
            self.on_dirty()

    def _hold_in_ram_locked(self, t: _Todo) -> bool:
        """Pin a write-behind payload in RAM, evicting unpinned payloads (each already on SSD, or
        one the SSD evictor chose to drop) to make room; False if all that is left is pinned."""
        core, p = self.core, t.pending
        core.drop_ram_victims_locked(core.ram.make_room(t.key, p.payload.nbytes, block=p.block_hash))
        if not core.ram.put(t.key, p.payload, p.digest, pinned=True, provenance=p.provenance, block=p.block_hash):
            return False
        core.dirty[t.key] = p
        core.hold_locked(t.key, p)
        return True

    def _admit_after_flush(self, t: _Todo) -> PutResult:
        """RAM is full of pinned payloads: commit the oldest pending ones to SSD now (the same
        commit path as the flusher's, so they are acknowledged on disk before they leave RAM),
        then evict them, until this payload fits. Refused only when the flush cannot proceed."""
        core = self.core
        for _ in range(ROOM_FLUSH_ROUNDS):
            progressed = self.flush_batch()
            with core.lock:
                admitted = self._admit_locked(t, need_ssd=False)
                if admitted is not None:
                    return admitted
                if self._hold_in_ram_locked(t):
                    return PutResult.OK
            if not progressed:
                break
        with core.lock:
            return core.reject_locked(PutResult.NO_SPACE if core.disk_full else PutResult.PINNED)

    def on_dirty(self) -> None:
        """Hook the Store sets to wake its flusher."""

    def _write_through(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        """Commit, then keep a RAM copy. A batch the SSD has no room for evicts its least recently
        seen files inline and is tried once more."""
        full = self._write_through_once(todo, results)
        if full:
            self.make_ssd_room([(t.key, t.pending) for t in full])
            full = self._write_through_once(full, results)
        with self.core.lock:
            for t in full:
                results[t.index] = self.core.reject_locked(PutResult.FULL)

    def _write_through_once(self, todo: list[_Todo], results: list[PutResult | None]) -> list[_Todo]:
        """One try; the puts that met a full SSD are returned without a result."""
        core = self.core
        full: list[_Todo] = []
        if not todo:
            return full
        with core.stripes_of(t.key for t in todo):
            batch: dict[StorageKey, Pending] = {}
            with core.lock:
                for t in todo:
                    admitted = self._admit_locked(t, need_ssd=True)
                    if admitted is None:
                        batch[t.key] = t.pending
                    else:
                        results[t.index] = admitted
            outcome = self.commit(batch)
            with core.lock:
                for t in todo:
                    if t.key not in outcome:
                        continue
                    if outcome[t.key] is PutResult.FULL:
                        full.append(t)
                        continue
                    results[t.index] = outcome[t.key]
                    if outcome[t.key].ok:
                        core.hold_locked(t.key, t.pending)
                        self._copy_to_ram_locked(t)
                    else:
                        core.reject_locked(outcome[t.key])
        return full

    def _copy_to_ram_locked(self, t: _Todo) -> None:
        """The RAM copy of a committed block, evicting colder copies (all on SSD) for it."""
        core, p = self.core, t.pending
        if core.ram.contains(t.key):
            return
        limit = core.ram.capacity_bytes
        core.drop_ram_victims_locked(core.ram.make_room(t.key, p.payload.nbytes, block=p.block_hash,
                                                        limit_bytes=limit))
        core.ram.put(t.key, p.payload, p.digest, limit_bytes=limit, provenance=p.provenance, block=p.block_hash)

    def make_ssd_room(self, items: list[tuple[StorageKey, Pending]]) -> int:
        """Evict least recently seen SSD files until the leading `items` that an empty SSD could
        take fit in its bytes and blocks; how many were evicted. The caller holds no stripe (a
        victim's stripe is taken here)."""
        core = self.core
        cap_bytes, cap_blocks = core.policy.ssd_capacity_bytes, core.ssd.capacity_blocks
        with core.lock:
            size = 0
            fresh: set[bytes] = set()
            for _, p in items:
                new = set() if core.ssd.holds_block(p.block_hash) else {p.block_hash}
                if size + p.payload.nbytes + HEADER_SIZE > cap_bytes or (cap_blocks and len(fresh | new) > cap_blocks):
                    break   # even an empty SSD could not take this one too: evicting for it would only lose blocks
                size += p.payload.nbytes + HEADER_SIZE
                fresh |= new
            extra = core.ssd.used_bytes + core.ssd_reserved + size - cap_bytes
            need_blocks = core.ssd.num_held_blocks + len(fresh) - cap_blocks if cap_blocks else 0
            if size == 0 or (extra <= 0 and need_blocks <= 0):
                return 0
            keys = core.ssd.least_recent(max(0, extra), num_blocks=max(0, need_blocks))
            victims = [(k, core.ssd_entry_locked(k)) for k in keys]
        evicted = sum(core.drop_file(key, entry) for key, entry in victims)
        with core.lock:
            core.count_evictions_locked(Tier.SSD, evicted)
        return evicted

    def commit(self, batch: dict[StorageKey, Pending]) -> dict[StorageKey, PutResult]:
        """The one commit path (module docstring) for a batch whose stripes the caller holds."""
        core = self.core
        outcome: dict[StorageKey, PutResult] = {}
        accepted: dict[StorageKey, Pending] = {}
        with core.lock:
            used = core.ssd.used_bytes + core.ssd_reserved
            new_blocks: set[bytes] = set()
            for key, p in batch.items():
                size = p.payload.nbytes + HEADER_SIZE
                fresh = not core.ssd.holds_block(p.block_hash) and p.block_hash not in new_blocks
                if core.policy.ssd_has_room(used, size) and (
                        not fresh or core.ssd.has_block_room(p.block_hash, len(new_blocks))):
                    accepted[key] = p
                    used += size
                    if fresh:
                        new_blocks.add(p.block_hash)
                else:
                    core.ssd_wanted = max(core.ssd_wanted, size)
                    outcome[key] = PutResult.FULL
            reserved = sum(p.payload.nbytes + HEADER_SIZE for p in accepted.values())
            core.ssd_reserved += reserved
        try:
            outcome.update(self._write_and_index(accepted))
        finally:
            with core.lock:
                core.ssd_reserved -= reserved
                now = core.clock()
                for key, p in accepted.items():
                    if outcome.get(key) is PutResult.OK:
                        core.ssd.add(key, SsdEntry(p.layer, p.payload.nbytes, p.digest, p.model,
                                                   p.created_unix, now, p.block_hash, p.provenance))
        return outcome

    def _write_and_index(self, batch: dict[StorageKey, Pending]) -> dict[StorageKey, PutResult]:
        core = self.core
        if not batch:
            return {}
        items = [WriteItem(k, p.layer, p.payload, p.digest, p.created_unix) for k, p in batch.items()]
        errors = core.ssd.write_files(items, self.pool)
        outcome: dict[StorageKey, PutResult] = {}
        for item, err in zip(items, errors, strict=True):
            outcome[item.key] = PutResult.OK if err is None else _classify(err)
            if err is not None:
                logger.warning("SSD write of %s failed: %s", item.key.hex()[:16], err)
        committed = [k for k, r in outcome.items() if r.ok]
        # Seen now: a write-behind block that waited in RAM for longer than the TTL is not expired
        # the moment it reaches the SSD.
        now = core.clock()
        rows = [(k, batch[k].meta(now)) for k in committed]
        try:
            core.index.put_many(rows, sync=core.config.durable)
        except IndexUnavailableError as e:
            logger.error("index write failed, removing %d just-written files: %s", len(rows), e)
            failed = PutResult.NO_SPACE if "No space" in str(e) else PutResult.IO_ERROR
            for k in committed:
                core.ssd.unlink(k, batch[k].layer)
                outcome[k] = failed
        return outcome

    # ---- write-behind flush ------------------------------------------------------------------------

    def flush_batch(self) -> bool:
        """Commit one batch of write-behind blocks; False when nothing (more) can be done now."""
        core = self.core
        with core.lock:
            if core.flush_blocked or not core.dirty:
                return False
            batch: dict[StorageKey, Pending] = {}
            num_bytes = 0
            for key, p in core.dirty.items():
                size = p.payload.nbytes + HEADER_SIZE
                if len(batch) >= FLUSH_BATCH_BLOCKS or (batch and num_bytes + size > FLUSH_BATCH_BYTES):
                    break
                batch[key] = p
                num_bytes += size
        with core.stripes_of(batch):
            with core.lock:   # a delete may have come between the two locks
                batch = {k: p for k, p in batch.items() if core.dirty.get(k) is p}
            outcome = self.commit(batch)
            with core.lock:
                full = [(k, p) for k, p in batch.items() if outcome[k] is PutResult.FULL]
                for k, p in batch.items():
                    result = outcome[k]
                    if result.ok and core.dirty.get(k) is p:
                        del core.dirty[k]
                        core.ram.unpin(k)
                        core.disk_full = False
                    elif not result.ok and result is not PutResult.FULL:
                        self._block_flush_locked(result)
        # No room on the SSD: evict its least recently seen files (outside the stripes) and go
        # on; only when nothing could be evicted does the flush wait for the next tick.
        if full and not self.make_ssd_room(full):
            with core.lock:
                self._block_flush_locked(PutResult.FULL)
                core.ssd_wanted = max(core.ssd_wanted, sum(
                    q.payload.nbytes + HEADER_SIZE for q in core.dirty.values()))
        with core.lock:
            return not core.flush_blocked

    def _block_flush_locked(self, result: PutResult) -> None:
        """A flush failed: its blocks stay pinned in RAM until a later tick."""
        core = self.core
        core.flush_blocked = True
        core.counters.flush_failures += 1
        if result is PutResult.NO_SPACE:
            core.disk_full = True

    def flush(self) -> int:
        """Write every pending block now; returns how many are still pending."""
        with self.core.lock:
            self.core.flush_blocked = False
        while self.flush_batch():
            pass
        with self.core.lock:
            return len(self.core.dirty)


def _classify(err: OSError) -> PutResult:
    return PutResult.NO_SPACE if err.errno in NO_SPACE_ERRNOS else PutResult.IO_ERROR


def _producer(record: Provenance | None) -> str:
    return UNSIGNED_PRODUCER if record is None else record.producer
