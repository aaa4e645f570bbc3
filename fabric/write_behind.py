"""The write-behind queue: acknowledged payloads held in RAM, pinned, until the SSD committer has
committed them; and the flusher that drains it, oldest first, one batch at a time.

    put ──► hold: pin in RAM (evicting unpinned copies) ──► queued ──► flush_batch: commit ──► unpin
                                                                  └─► full SSD: evict LRU files, go on
                                                                  └─► failed: blocked until `retry`

`WriteBehind` owns the queue (`_pending`, oldest first), whether the flusher is blocked (no room
could be made, a failing disk or index: it waits for the next tick's `retry`), and whether the
last flush met a full filesystem (cleared by the next success). A queued block is always pinned
in RAM with its digest and record, so nothing acknowledged leaves RAM before it is committed, and
what a key holds is answered by RAM and the SSD alone (fabric/store_parts.py).

Full disk: a flush that meets ENOSPC / EDQUOT / EFBIG (or an index that cannot write) leaves its
blocks pinned in RAM and marks the disk full; write-behind puts keep landing in RAM while unpinned
payloads can make room, and answer NO_SPACE (PINNED for a failing disk) once all of RAM is pinned;
every tick retries, and the first success clears the state. The index keeps a reserve file so it
can reopen on a full disk (fabric/index.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from fabric.keys import BlockAddress, StorageKey
from fabric.ssd_commit import SsdCommitter, file_bytes
from fabric.store_parts import StoreParts
from fabric.store_types import Pending, PutResult

FLUSH_BATCH_BLOCKS = 128
FLUSH_BATCH_BYTES = 64 << 20


class WriteBehind:
    """Pending write-behind blocks and their flusher; thread-safe (state under `parts.lock`, files
    under the stripes)."""

    def __init__(self, parts: StoreParts, committer: SsdCommitter) -> None:
        self._parts = parts
        self._committer = committer
        self._pending: OrderedDict[StorageKey, Pending] = OrderedDict()
        self._blocked = False     # the flusher stops until the next `retry` (no room, failing disk)
        self._disk_full = False   # the last flush met a full filesystem; cleared by the next success
        self.on_queued: Callable[[], None] = lambda: None   # the store sets it to wake its flusher

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def disk_full(self) -> bool:
        return self._disk_full

    def addresses_locked(self) -> tuple[BlockAddress, ...]:
        """The addresses still pending, oldest first."""
        return tuple(p.address for p in self._pending.values())

    def refusal_locked(self) -> PutResult:
        """Why a put that found RAM full of pending blocks is refused: the disk is full, or the
        flush cannot proceed."""
        return PutResult.NO_SPACE if self._disk_full else PutResult.PINNED

    def hold_locked(self, key: StorageKey, p: Pending) -> bool:
        """Queue an acknowledged payload: pin it in RAM, evicting unpinned payloads (each already on
        SSD, or one the SSD evictor chose to drop) to make room; False if all that is left is pinned."""
        parts = self._parts
        parts.drop_ram_victims_locked(parts.ram.make_room(key, p.payload.nbytes, block=p.block_hash))
        if not parts.ram.put(key, p.payload, p.digest, pinned=True, provenance=p.provenance, block=p.block_hash):
            return False
        self._pending[key] = p
        parts.holdings.hold(key, p.address)
        return True

    def discard_locked(self, key: StorageKey) -> bool:
        """A delete: the key is no longer pending (its RAM copy is the caller's to remove)."""
        return self._pending.pop(key, None) is not None

    def retry_locked(self) -> None:
        """A new tick (or an explicit flush): a blocked flusher tries again."""
        self._blocked = False

    def flush(self) -> int:
        """Write every pending block now; returns how many are still pending."""
        with self._parts.lock:
            self.retry_locked()
        while self.flush_batch():
            pass
        with self._parts.lock:
            return len(self._pending)

    def flush_batch(self) -> bool:
        """Commit one batch of pending blocks; False when nothing (more) can be done now."""
        parts = self._parts
        with parts.lock:
            if self._blocked or not self._pending:
                return False
            batch: dict[StorageKey, Pending] = {}
            num_bytes = 0
            for key, p in self._pending.items():
                size = file_bytes(p)
                if len(batch) >= FLUSH_BATCH_BLOCKS or (batch and num_bytes + size > FLUSH_BATCH_BYTES):
                    break
                batch[key] = p
                num_bytes += size
        with parts.stripes_of(batch):
            with parts.lock:   # a delete may have come between the two locks
                batch = {k: p for k, p in batch.items() if self._pending.get(k) is p}
            outcome = self._committer.commit(batch)
            with parts.lock:
                full = [(k, p) for k, p in batch.items() if outcome[k] is PutResult.FULL]
                for k, p in batch.items():
                    result = outcome[k]
                    if result.ok and self._pending.get(k) is p:
                        del self._pending[k]
                        parts.ram.unpin(k)
                        self._disk_full = False
                    elif not result.ok and result is not PutResult.FULL:
                        self._block_locked(result)
        # No room on the SSD: evict its least recently seen files (outside the stripes) and go
        # on; only when nothing could be evicted does the flush wait for the next tick.
        if full and not self._committer.make_room(full):
            with parts.lock:
                self._block_locked(PutResult.FULL)
                self._committer.want_locked(sum(file_bytes(q) for q in self._pending.values()))
        with parts.lock:
            return not self._blocked

    def _block_locked(self, result: PutResult) -> None:
        """A flush failed: its blocks stay pinned in RAM until a later tick."""
        self._blocked = True
        self._parts.counters.flush_failed()
        if result is PutResult.NO_SPACE:
            self._disk_full = True
