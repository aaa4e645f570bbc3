"""The SSD tier's in-memory catalog: key -> `SsdEntry` of every committed block file, ordered least
recently seen first, with the bytes and distinct blocks it holds. It answers `contains` without I/O
and gives eviction its TTL / LRU order: contains / add / discard / touch O(1), expired / lru walks
O(victims). Not thread-safe: the Store serialises it under its lock. `fabric.tiers.ssd.SsdTier`
adds the block files.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from fabric.keys import StorageKey
from fabric.provenance import Provenance
from fabric.tiers.base import TierStats
from fabric.tiers.ssd_format import HEADER_SIZE

__all__ = ["SsdCatalog", "SsdEntry"]


@dataclass(slots=True)
class SsdEntry:
    """What the catalog knows of one committed block (mirrors its index row)."""

    layer: int
    num_bytes: int
    digest: bytes
    model: str
    created_unix: float
    last_seen_unix: float
    block_hash: bytes = b""     # b"" for a block loaded from a row older than the hash field
    provenance: Provenance | None = None   # from the index row; None: unsigned (or a row older than it)
    row_seen_unix: float = field(init=False)   # the last_seen_unix its index row holds

    def __post_init__(self) -> None:
        self.row_seen_unix = self.last_seen_unix

    @property
    def file_bytes(self) -> int:
        return HEADER_SIZE + self.num_bytes


class SsdCatalog:
    """The catalog half of `SsdTier` (caller holds the Store lock)."""

    capacity_bytes: int
    capacity_blocks: int   # distinct block hashes at most (0: bytes only)

    def _init_catalog(self) -> None:
        self._catalog: OrderedDict[StorageKey, SsdEntry] = OrderedDict()
        self._layers: dict[bytes, int] = {}        # block hash -> its (block, layer) files here
        self._used = 0

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def num_blocks(self) -> int:
        """(block, layer) files."""
        return len(self._catalog)

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks with at least one layer here (a row without a hash counts alone)."""
        return len(self._layers)

    def holds_block(self, block: bytes) -> bool:
        return block in self._layers

    def has_block_room(self, block: bytes, num_new: int = 0) -> bool:
        """Whether `block` may add a layer here under capacity_blocks, with `num_new` other new
        blocks already admitted."""
        return (not self.capacity_blocks or block in self._layers
                or len(self._layers) + num_new < self.capacity_blocks)

    def contains(self, key: StorageKey) -> bool:
        return key in self._catalog

    def entry(self, key: StorageKey) -> SsdEntry | None:
        return self._catalog.get(key)

    def add(self, key: StorageKey, entry: SsdEntry) -> None:
        """Record a committed file (replacing an older entry of the same key) as most recently seen."""
        self.discard(key)
        self._catalog[key] = entry
        self._used += entry.file_bytes
        block = entry.block_hash or key
        self._layers[block] = self._layers.get(block, 0) + 1

    def load(self, entries: Iterable[tuple[StorageKey, SsdEntry]]) -> None:
        """Fill the catalog from the index at open, least recently seen first."""
        for key, entry in sorted(entries, key=lambda kv: kv[1].last_seen_unix):
            self.add(key, entry)

    def discard(self, key: StorageKey) -> SsdEntry | None:
        entry = self._catalog.pop(key, None)
        if entry is not None:
            self._used -= entry.file_bytes
            block = entry.block_hash or key
            left = self._layers[block] - 1
            if left:
                self._layers[block] = left
            else:
                del self._layers[block]
        return entry

    def touch(self, key: StorageKey, now_unix: float) -> SsdEntry | None:
        """Mark `key` seen at `now_unix` (most recent in the LRU order); its entry, or None."""
        entry = self._catalog.get(key)
        if entry is not None:
            entry.last_seen_unix = max(entry.last_seen_unix, now_unix)
            self._catalog.move_to_end(key)
        return entry

    def expired(self, cutoff_unix: float) -> list[StorageKey]:
        """Keys last seen before `cutoff_unix` (oldest first)."""
        out: list[StorageKey] = []
        for key, entry in self._catalog.items():
            if entry.last_seen_unix >= cutoff_unix:
                break
            out.append(key)
        return out

    def least_recent(self, num_bytes: int, skip: frozenset[StorageKey] = frozenset(),
                     num_blocks: int = 0) -> list[StorageKey]:
        """Least recently seen keys whose files add up to at least `num_bytes` and take at least
        `num_blocks` blocks out entirely (a block's layers are seen together, so they sit side by side)."""
        out: list[StorageKey] = []
        freed = 0
        left: dict[bytes, int] = {}
        blocks_freed = 0
        for key, entry in self._catalog.items():
            if freed >= num_bytes and blocks_freed >= num_blocks:
                break
            if key in skip:
                continue
            out.append(key)
            freed += entry.file_bytes
            block = entry.block_hash or key
            left[block] = left.get(block, self._layers[block]) - 1
            blocks_freed += not left[block]
        return out

    def items(self) -> list[tuple[StorageKey, SsdEntry]]:
        return list(self._catalog.items())

    def stats(self) -> TierStats:
        return TierStats(len(self._catalog), self._used, self.capacity_bytes)
