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
from fabric.tiers.base import Payload, as_bytes_view, digest_of
from fabric.tiers.ssd import HEADER_SIZE, NO_SPACE_ERRNOS, SsdEntry, WriteItem

logger = logging.getLogger(__name__)

FLUSH_BATCH_BLOCKS = 128
FLUSH_BATCH_BYTES = 64 << 20


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
            return self.core.reject_locked(PutResult.CONFLICT)
        if need_ssd and not self.core.ssd.contains(t.key):
            return None     # held in RAM only (its SSD copy expired): write-through writes it again
        return PutResult.OK

    def _write_behind(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        core = self.core
        added = False
        with core.lock:
            for t in todo:
                admitted = self._admit_locked(t, need_ssd=False)
                if admitted is not None:
                    results[t.index] = admitted
                elif not core.ram.put(t.key, t.pending.payload, t.pending.digest, pinned=True,
                                      provenance=t.pending.provenance):
                    results[t.index] = core.reject_locked(PutResult.NO_SPACE if core.disk_full else PutResult.FULL)
                else:
                    core.dirty[t.key] = t.pending
                    core.hold_locked(t.key, t.pending)
                    results[t.index] = PutResult.OK
                    added = True
        if added:
            self.on_dirty()

    def on_dirty(self) -> None:
        """Hook the Store sets to wake its flusher."""

    def _write_through(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        core = self.core
        if not todo:
            return
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
                    results[t.index] = outcome[t.key]
                    if outcome[t.key].ok:
                        core.hold_locked(t.key, t.pending)
                        if not core.ram.contains(t.key):
                            core.ram.put(t.key, t.pending.payload, t.pending.digest,
                                         limit_bytes=core.ram.capacity_bytes, provenance=t.pending.provenance)
                    else:
                        core.reject_locked(outcome[t.key])

    def commit(self, batch: dict[StorageKey, Pending]) -> dict[StorageKey, PutResult]:
        """The one commit path (module docstring) for a batch whose stripes the caller holds."""
        core = self.core
        outcome: dict[StorageKey, PutResult] = {}
        accepted: dict[StorageKey, Pending] = {}
        with core.lock:
            used = core.ssd.used_bytes + core.ssd_reserved
            for key, p in batch.items():
                size = p.payload.nbytes + HEADER_SIZE
                if core.policy.ssd_has_room(used, size):
                    accepted[key] = p
                    used += size
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
                for k, p in batch.items():
                    result = outcome[k]
                    if result.ok and core.dirty.get(k) is p:
                        del core.dirty[k]
                        core.ram.unpin(k)
                        core.disk_full = False
                    elif not result.ok:
                        # The block stays pinned in RAM until a later tick finds room.
                        core.flush_blocked = True
                        core.counters.flush_failures += 1
                        if result is PutResult.NO_SPACE:
                            core.disk_full = True
                        elif result is PutResult.FULL:
                            core.ssd_wanted = max(core.ssd_wanted, sum(
                                q.payload.nbytes + HEADER_SIZE for q in core.dirty.values()))
                return not core.flush_blocked

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
