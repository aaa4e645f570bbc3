"""RAM tier: byte-bounded payload cache with CLOCK (second-chance) eviction, an approximate LRU.

Data structure: one `OrderedDict[StorageKey, _Entry]` whose order is the CLOCK ring; the front is
where the hand points. A hit only sets the entry's `referenced` bit (no reordering, so the hot path
is one dict lookup and one store). `evict(num_bytes)` sweeps from the front: a referenced entry
gets its bit cleared and moves to the back (its second chance), an unreferenced one is evicted,
a pinned one (a write-behind block not yet on SSD) is moved to the back untouched.

Invariants:
  * `used_bytes` == sum of the entries' `footprint` (the memory the held buffer occupies,
    >= the payload length for page-aligned buffers read from SSD).
  * `used_bytes` <= `high_water_bytes` after every `put` that returned True; `put` never evicts:
    going under capacity is the background evictor's job, so a writer never waits for it.
  * payloads are never copied here: `get` returns a read-only view of the buffer `put` was given.

Complexity: contains / get / put / remove / pin / unpin O(1); evict amortised O(1) per evicted
entry, at most one pass over the ring per call.

Not thread-safe by itself: the Store serialises calls under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from fabric.keys import StorageKey
from fabric.provenance import Provenance
from fabric.tiers.base import StoredBlock, Tier, TierStats


@dataclass(slots=True)
class _Entry:
    payload: memoryview
    digest: bytes
    footprint: int
    referenced: bool
    pinned: bool
    provenance: Provenance | None = None   # shared by the block's layers (one object per block)


@dataclass(frozen=True, slots=True)
class Evicted:
    key: StorageKey
    num_bytes: int


class RamTier:
    """Payloads in host memory, bounded by bytes. See the module docstring for the invariants."""

    tier = Tier.RAM

    def __init__(self, capacity_bytes: int, high_water_bytes: int | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        high = capacity_bytes if high_water_bytes is None else high_water_bytes
        if high < capacity_bytes:
            raise ValueError(f"high_water_bytes ({high}) must be >= capacity_bytes ({capacity_bytes})")
        self.capacity_bytes = capacity_bytes
        self.high_water_bytes = high
        self._entries: OrderedDict[StorageKey, _Entry] = OrderedDict()
        self._used = 0
        self._num_pinned = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, key: StorageKey) -> bool:
        return key in self._entries

    def get(self, key: StorageKey) -> StoredBlock | None:
        """The stored block (a view, no copy), marking it recently used; None on a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.referenced = True
        return StoredBlock(entry.payload, entry.digest, Tier.RAM, entry.provenance)

    def digest(self, key: StorageKey) -> bytes | None:
        """The digest of a resident block without marking it used."""
        entry = self._entries.get(key)
        return None if entry is None else entry.digest

    def provenance(self, key: StorageKey) -> Provenance | None:
        """The provenance record of a resident block without marking it used."""
        entry = self._entries.get(key)
        return None if entry is None else entry.provenance

    def put(self, key: StorageKey, payload: memoryview, digest: bytes, *, footprint: int | None = None,
            pinned: bool = False, limit_bytes: int | None = None, provenance: Provenance | None = None) -> bool:
        """Store a verified payload (replacing any old one); False if it would pass the limit.

        `payload` must not be mutated afterwards (pass a view over bytes or a buffer nobody
        else writes). `limit_bytes` defaults to the high-water mark.
        """
        size = payload.nbytes if footprint is None else footprint
        old = self._entries.get(key)
        freed = old.footprint if old is not None else 0
        limit = self.high_water_bytes if limit_bytes is None else limit_bytes
        if self._used - freed + size > limit:
            return False
        if old is not None:
            self._drop(key, old)
        self._entries[key] = _Entry(payload.toreadonly(), digest, size, referenced=False, pinned=pinned,
                                    provenance=provenance)
        self._used += size
        self._num_pinned += pinned
        return True

    def remove(self, key: StorageKey) -> bool:
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._drop(key, entry)
        return True

    def pin(self, key: StorageKey) -> None:
        """Exempt a block from eviction (it is not yet anywhere else)."""
        entry = self._entries[key]
        if not entry.pinned:
            entry.pinned = True
            self._num_pinned += 1

    def unpin(self, key: StorageKey) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pinned:
            entry.pinned = False
            self._num_pinned -= 1

    def is_pinned(self, key: StorageKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.pinned

    def evict(self, num_bytes: int) -> list[Evicted]:
        """Drop unpinned blocks in CLOCK order until `num_bytes` are freed or one sweep is done."""
        out: list[Evicted] = []
        freed = 0
        # Each entry is looked at most twice: once to clear its bit, once to evict it.
        budget = 2 * len(self._entries)
        while freed < num_bytes and budget > 0 and self._entries:
            budget -= 1
            key, entry = next(iter(self._entries.items()))
            if entry.pinned or entry.referenced:
                entry.referenced = False
                self._entries.move_to_end(key)
                continue
            self._drop(key, entry)
            freed += entry.footprint
            out.append(Evicted(key, entry.footprint))
        return out

    def keys(self) -> list[StorageKey]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._used = 0
        self._num_pinned = 0

    def stats(self) -> TierStats:
        return TierStats(len(self._entries), self._used, self.capacity_bytes)

    def _drop(self, key: StorageKey, entry: _Entry) -> None:
        del self._entries[key]
        self._used -= entry.footprint
        self._num_pinned -= entry.pinned
