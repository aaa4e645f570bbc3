"""The Store's puts: each payload hashed once, the overwrite rule, then write-through (commit, then a
RAM copy) or write-behind (queued in RAM; committed by the flusher).

The overwrite rule. Keys are content addresses, so an address carries one payload: the first
acknowledged one stands. A put of the same bytes for a held address is OK and writes nothing; a
put of other bytes is refused with CONFLICT and counted (it means non-deterministic KV or a key
bug upstream). Hence no file of an acknowledged block is ever renamed over, and `get()` can only
serve the payload acknowledged for that address. After `delete()` the address is free again.

A write is never refused for want of room while room can be made. A put that would pass RAM's
high-water mark or `ram_blocks` evicts unpinned payloads inline (CLOCK order; each is on SSD
already, unless the SSD evictor dropped it). If all of RAM is pinned, the put commits the oldest
pending write-behind blocks itself, through the same commit path in the same order (fabric/store.py,
1-4), and only then evicts them from RAM: an acknowledged block is always in RAM or committed on
SSD. A write that would pass the SSD's bytes or `ssd_blocks` evicts its least recently seen files
first. What is still refused is counted by reason: FULL (larger than the SSD may hold), PINNED,
NO_SPACE. The background thread (every eviction_interval_s) still trims each tier to its offload /
low-water line, so most writes find room without evicting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fabric.keys import BlockAddress, StorageKey
from fabric.provenance import Provenance
from fabric.ssd_commit import SsdCommitter
from fabric.store_parts import StoreParts
from fabric.store_types import Hashed, Pending, PutResult, hash_payload
from fabric.tiers.base import Payload
from fabric.write_behind import WriteBehind

logger = logging.getLogger(__name__)
UNSIGNED_PRODUCER = "unsigned"   # the producer label of a block without a provenance record

# A write-behind put that finds RAM full of pinned payloads commits at most this many flush
# batches for its room before it is refused.
ROOM_FLUSH_ROUNDS = 64


@dataclass(frozen=True, slots=True)
class _Todo:
    index: int          # position of the result in the caller's list
    key: StorageKey
    pending: Pending


class Puts:
    """Puts of one store; thread-safe (state under `parts.lock`, files under stripes)."""

    def __init__(self, parts: StoreParts, committer: SsdCommitter, write_behind: WriteBehind) -> None:
        self._parts = parts
        self._committer = committer
        self._write_behind = write_behind

    def put_many(self, items: list[tuple[BlockAddress, Payload | Hashed]], model: str,
                 digests: list[bytes] | None, provenance: list[Provenance | None] | None = None) -> list[PutResult]:
        parts = self._parts
        now = parts.clock()
        results: list[PutResult | None] = [None] * len(items)
        last = {address.storage_key: i for i, (address, _) in enumerate(items)}
        todo: list[_Todo] = []
        for i, (address, payload) in enumerate(items):
            if last[address.storage_key] != i:
                continue    # a key given twice in one call: its last payload is the one considered
            hashed = hash_payload(payload)
            if digests is not None and digests[i] != hashed.digest:
                with parts.lock:
                    results[i] = parts.counters.rejected(PutResult.DIGEST_MISMATCH)
                continue
            todo.append(_Todo(i, address.storage_key, Pending(address.hash, address.layer, model, hashed.digest,
                                                               hashed.payload, now,
                                                               provenance[i] if provenance else None)))
        if parts.config.write_through:
            self._write_through(todo, results)
        else:
            self._write_behind_puts(todo, results)
        out: list[PutResult] = []
        for address, _ in items:
            result = results[last[address.storage_key]]
            if result is None:
                raise RuntimeError(f"put of {address} ended without a result")
            out.append(result)
        return out

    def _admit_locked(self, t: _Todo, need_ssd: bool) -> PutResult | None:
        """The overwrite rule: OK (already held, nothing to write), CONFLICT, or None (write it)."""
        parts = self._parts
        held = parts.digest_held_locked(t.key)
        if held is None:
            return None
        if held != t.pending.digest:
            self._note_conflict_locked(t)
            return parts.counters.rejected(PutResult.CONFLICT)
        if need_ssd and not parts.ssd.contains(t.key):
            return None     # held in RAM only (its SSD copy expired): write-through writes it again
        return PutResult.OK

    def _note_conflict_locked(self, t: _Todo) -> None:
        """Name both producers of a conflict: the held bytes' and the refused ones' (or "unsigned")."""
        held_by = _producer(self._parts.provenance_locked(t.key))
        new_by = _producer(t.pending.provenance)
        self._parts.metrics.conflicts.labels(held_by, new_by).inc()
        logger.warning("conflicting store at %s: held bytes produced by %s, refused bytes from %s (the held ones "
                       "stand)", t.pending.address, held_by, new_by)

    # ---- write-behind ------------------------------------------------------------------------------

    def _write_behind_puts(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        parts, queue = self._parts, self._write_behind
        added = False
        waiting: list[_Todo] = []
        with parts.lock:
            for t in todo:
                admitted = self._admit_locked(t, need_ssd=False)
                if admitted is not None:
                    results[t.index] = admitted
                elif queue.hold_locked(t.key, t.pending):
                    results[t.index] = PutResult.OK
                    added = True
                else:
                    waiting.append(t)
        for t in waiting:
            results[t.index] = self._admit_after_flush(t)
            added |= results[t.index] is PutResult.OK
        if added:
            queue.on_queued()

    def _admit_after_flush(self, t: _Todo) -> PutResult:
        """RAM is full of pinned payloads: commit the oldest pending ones to SSD now, then evict them,
        until this payload fits. Refused only when the flush cannot proceed."""
        parts, queue = self._parts, self._write_behind
        for _ in range(ROOM_FLUSH_ROUNDS):
            progressed = queue.flush_batch()
            with parts.lock:
                admitted = self._admit_locked(t, need_ssd=False)
                if admitted is not None:
                    return admitted
                if queue.hold_locked(t.key, t.pending):
                    return PutResult.OK
            if not progressed:
                break
        with parts.lock:
            return parts.counters.rejected(queue.refusal_locked())

    # ---- write-through -----------------------------------------------------------------------------

    def _write_through(self, todo: list[_Todo], results: list[PutResult | None]) -> None:
        """Commit, then keep a RAM copy. A batch the SSD has no room for evicts its least recently
        seen files inline and is tried once more."""
        full = self._write_through_once(todo, results)
        if full:
            self._committer.make_room([(t.key, t.pending) for t in full])
            full = self._write_through_once(full, results)
        with self._parts.lock:
            for t in full:
                results[t.index] = self._parts.counters.rejected(PutResult.FULL)

    def _write_through_once(self, todo: list[_Todo], results: list[PutResult | None]) -> list[_Todo]:
        """One try; the puts that met a full SSD are returned without a result."""
        parts = self._parts
        full: list[_Todo] = []
        if not todo:
            return full
        with parts.stripes_of(t.key for t in todo):
            batch: dict[StorageKey, Pending] = {}
            with parts.lock:
                for t in todo:
                    admitted = self._admit_locked(t, need_ssd=True)
                    if admitted is None:
                        batch[t.key] = t.pending
                    else:
                        results[t.index] = admitted
            outcome = self._committer.commit(batch)
            with parts.lock:
                for t in todo:
                    if t.key not in outcome:
                        continue
                    if outcome[t.key] is PutResult.FULL:
                        full.append(t)
                        continue
                    results[t.index] = outcome[t.key]
                    if outcome[t.key].ok:
                        parts.holdings.hold(t.key, t.pending.address)
                        self._copy_to_ram_locked(t)
                    else:
                        parts.counters.rejected(outcome[t.key])
        return full

    def _copy_to_ram_locked(self, t: _Todo) -> None:
        """The RAM copy of a committed block, evicting colder copies (all on SSD) for it."""
        parts, p = self._parts, t.pending
        if parts.ram.contains(t.key):
            return
        limit = parts.ram.capacity_bytes
        parts.drop_ram_victims_locked(parts.ram.make_room(t.key, p.payload.nbytes, block=p.block_hash,
                                                         limit_bytes=limit))
        parts.ram.put(t.key, p.payload, p.digest, limit_bytes=limit, provenance=p.provenance, block=p.block_hash)


def _producer(record: Provenance | None) -> str:
    return UNSIGNED_PRODUCER if record is None else record.producer
