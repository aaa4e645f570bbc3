"""RAM tier: byte-bounded payload cache with CLOCK (second-chance) eviction, an approximate LRU.

Data structure: one `OrderedDict[StorageKey, _Entry]` whose order is the CLOCK ring; the front is
where the hand points. A hit only sets the entry's `referenced` bit (no reordering, so the hot path
is one dict lookup and one store). `evict(num_bytes)` sweeps from the front: a referenced entry
gets its bit cleared and moves to the back (its second chance), an unreferenced one is evicted,
a pinned one (a write-behind block not yet on SSD) is moved to the back untouched.

Invariants:
  * `used_bytes` == sum of the entries' `footprint` (the memory the held buffer occupies,
    >= the payload length for page-aligned buffers read from SSD).
  * `used_bytes` <= `high_water_bytes` after every `put` that returned True, and with
    `capacity_blocks` set, at most that many distinct block hashes are held. `put` never evicts by
    itself: `make_room` (called by the Store for a write) evicts in CLOCK order just enough for one
    more payload, and going under the offload line is the background evictor's job.
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
    block: bytes                           # the block hash its layers share (the key when unknown)
    provenance: Provenance | None = None   # shared by the block's layers (one object per block)


@dataclass(frozen=True, slots=True)
class Evicted:
    key: StorageKey
    num_bytes: int


class RamTier:
    """Payloads in host memory, bounded by bytes. See the module docstring for the invariants."""

    tier = Tier.RAM

    def __init__(self, capacity_bytes: int, high_water_bytes: int | None = None, capacity_blocks: int = 0) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        high = capacity_bytes if high_water_bytes is None else high_water_bytes
        if high < capacity_bytes:
            raise ValueError(f"high_water_bytes ({high}) must be >= capacity_bytes ({capacity_bytes})")
        self.capacity_bytes = capacity_bytes
        self.high_water_bytes = high
        self.capacity_blocks = capacity_blocks     # distinct block hashes at most (0: bytes only)
        self._entries: OrderedDict[StorageKey, _Entry] = OrderedDict()
        self._layers: dict[bytes, int] = {}        # block hash -> its payloads here
        self._used = 0
        self._num_pinned = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        """(block, layer) payloads."""
        return len(self._entries)

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks with at least one layer here."""
        return len(self._layers)

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
            pinned: bool = False, limit_bytes: int | None = None, provenance: Provenance | None = None,
            block: bytes = b"") -> bool:
        """Store a verified payload (replacing any old one); False if it would pass a limit.

        `payload` must not be mutated afterwards (pass a view over bytes or a buffer nobody
        else writes). `limit_bytes` defaults to the high-water mark. `block`: the block hash this
        payload is a layer of (counted against capacity_blocks; default: a block of its own).
        """
        size = payload.nbytes if footprint is None else footprint
        block = block or key
        if self._bytes_short(key, size, limit_bytes) > 0 or self._blocks_short(block) > 0:
            return False
        old = self._entries.get(key)
        if old is not None:
            self._drop(key, old)
        self._entries[key] = _Entry(payload.toreadonly(), digest, size, referenced=False, pinned=pinned,
                                    block=block, provenance=provenance)
        self._layers[block] = self._layers.get(block, 0) + 1
        self._used += size
        self._num_pinned += pinned
        return True

    def make_room(self, key: StorageKey, num_bytes: int, *, block: bytes = b"",
                  limit_bytes: int | None = None) -> list[Evicted]:
        """Evict unpinned payloads in CLOCK order (never a layer of `block` itself) until a put of
        `num_bytes` under `key` would fit; what was evicted. It may still not fit: everything
        else is pinned."""
        block = block or key
        need_bytes = self._bytes_short(key, num_bytes, limit_bytes)
        need_blocks = self._blocks_short(block)
        if need_bytes <= 0 and need_blocks <= 0:
            return []
        return self.evict(need_bytes, num_blocks=need_blocks, keep=block)

    def _bytes_short(self, key: StorageKey, size: int, limit_bytes: int | None) -> int:
        old = self._entries.get(key)
        freed = old.footprint if old is not None else 0
        limit = self.high_water_bytes if limit_bytes is None else limit_bytes
        return self._used - freed + size - limit

    def _blocks_short(self, block: bytes) -> int:
        if not self.capacity_blocks or block in self._layers:
            return 0
        return len(self._layers) + 1 - self.capacity_blocks

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

    def evict(self, num_bytes: int, *, num_blocks: int = 0, keep: bytes = b"") -> list[Evicted]:
        """Drop unpinned payloads in CLOCK order until `num_bytes` are freed and `num_blocks`
        blocks have lost their last layer here, or one sweep is done. Layers of `keep` stay."""
        out: list[Evicted] = []
        freed = 0
        blocks_freed = 0
        # Each entry is looked at most twice: once to clear its bit, once to evict it.
        budget = 2 * len(self._entries)
        while (freed < num_bytes or blocks_freed < num_blocks) and budget > 0 and self._entries:
            budget -= 1
            key, entry = next(iter(self._entries.items()))
            if entry.pinned or entry.referenced or (keep and entry.block == keep):
                entry.referenced = False
                self._entries.move_to_end(key)
                continue
            self._drop(key, entry)
            freed += entry.footprint
            blocks_freed += entry.block not in self._layers
            out.append(Evicted(key, entry.footprint))
        return out

    def keys(self) -> list[StorageKey]:
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._layers.clear()
        self._used = 0
        self._num_pinned = 0

    def stats(self) -> TierStats:
        return TierStats(len(self._entries), self._used, self.capacity_bytes)

    def _drop(self, key: StorageKey, entry: _Entry) -> None:
        del self._entries[key]
        left = self._layers[entry.block] - 1
        if left:
            self._layers[entry.block] = left
        else:
            del self._layers[entry.block]
        self._used -= entry.footprint
        self._num_pinned -= entry.pinned
