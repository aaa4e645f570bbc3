"""Sub-allocation of large registered memory slabs (RDMA: one memory region per slab).

    slab 0  [ extent ][  free  ][ extent ][ extent ][       free        ]
    slab 1  [                    free                                   ]
             ^ offsets and lengths are multiples of `alignment`

Invariants: per slab, a list of free ranges sorted by offset, pairwise disjoint and never
adjacent (freeing coalesces with both neighbours); a live extent lies inside one slab, starts
and ends on the alignment, and overlaps no free range or other extent; free + used bytes =
slabs × slab size. Slabs are only added (by the owner, who then registers the memory), never
removed. `allocate` is first fit, O(free ranges); `free` finds its place in O(log F) and
inserts into the list. Pure bookkeeping: no memory is touched here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Extent:
    slab: int
    offset: int
    length: int   # a multiple of the allocator's alignment


class SlabAllocator:
    """First-fit sub-allocation of extents from up to `max_slabs` slabs of `slab_size` bytes."""

    def __init__(self, slab_size: int, max_slabs: int, alignment: int = 4096) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if slab_size <= 0 or slab_size % alignment:
            raise ValueError(f"slab size {slab_size} must be a positive multiple of {alignment}")
        if max_slabs <= 0:
            raise ValueError(f"max_slabs must be positive, got {max_slabs}")
        self.slab_size = slab_size
        self.max_slabs = max_slabs
        self.alignment = alignment
        self._free: list[list[tuple[int, int]]] = []   # per slab: sorted (offset, length)
        self._live: dict[tuple[int, int], int] = {}     # (slab, offset) -> length
        self.used_bytes = 0

    @property
    def num_slabs(self) -> int:
        return len(self._free)

    @property
    def can_add_slab(self) -> bool:
        return self.num_slabs < self.max_slabs

    @property
    def free_bytes(self) -> int:
        return self.num_slabs * self.slab_size - self.used_bytes

    def free_ranges(self, slab: int) -> list[tuple[int, int]]:
        return list(self._free[slab])

    def add_slab(self) -> int:
        """Add an empty slab (the owner registers its memory); returns its id."""
        if not self.can_add_slab:
            raise RuntimeError(f"all {self.max_slabs} slabs are in use")
        self._free.append([(0, self.slab_size)])
        return self.num_slabs - 1

    def _rounded(self, nbytes: int) -> int:
        if not 0 < nbytes <= self.slab_size:
            raise ValueError(f"cannot allocate {nbytes} bytes from slabs of {self.slab_size} bytes")
        return -(-nbytes // self.alignment) * self.alignment

    def can_allocate(self, nbytes: int) -> bool:
        size = self._rounded(nbytes)
        return any(length >= size for ranges in self._free for _, length in ranges)

    def allocate(self, nbytes: int) -> Extent | None:
        """An extent of at least `nbytes` from the existing slabs, or None when none has room."""
        size = self._rounded(nbytes)
        for slab, ranges in enumerate(self._free):
            for i, (offset, length) in enumerate(ranges):
                if length < size:
                    continue
                if length == size:
                    del ranges[i]
                else:
                    ranges[i] = (offset + size, length - size)
                self._live[(slab, offset)] = size
                self.used_bytes += size
                return Extent(slab, offset, size)
        return None

    def free(self, extent: Extent) -> None:
        key = (extent.slab, extent.offset)
        if self._live.get(key) != extent.length:
            raise RuntimeError(f"{extent} is not a live extent of this allocator (double free?)")
        del self._live[key]
        self.used_bytes -= extent.length
        ranges = self._free[extent.slab]
        i = bisect.bisect_left(ranges, (extent.offset, 0))
        start, end = extent.offset, extent.offset + extent.length
        if i < len(ranges) and ranges[i][0] == end:            # merge with the range after
            end += ranges[i][1]
            del ranges[i]
        if i > 0 and ranges[i - 1][0] + ranges[i - 1][1] == start:  # merge with the range before
            start = ranges[i - 1][0]
            del ranges[i - 1]
            i -= 1
        ranges.insert(i, (start, end - start))
