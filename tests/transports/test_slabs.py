"""Slab sub-allocation: extents stay aligned, disjoint and inside their slab; frees coalesce."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transports.core.slabs import Extent, SlabAllocator

KIB = 1024


def test_first_fit_reuses_freed_space_and_coalesces() -> None:
    alloc = SlabAllocator(64 * KIB, max_slabs=1, alignment=4 * KIB)
    alloc.add_slab()
    a, b, c = (alloc.allocate(16 * KIB) for _ in range(3))
    assert (a, b, c) == (Extent(0, 0, 16 * KIB), Extent(0, 16 * KIB, 16 * KIB), Extent(0, 32 * KIB, 16 * KIB))
    assert a is not None and b is not None and c is not None
    alloc.free(b)
    assert alloc.allocate(20 * KIB) is None  # the 16 KiB hole and the 16 KiB tail are both too small
    d = alloc.allocate(8 * KIB)
    assert d == Extent(0, 16 * KIB, 8 * KIB)  # first fit: the hole left by b
    assert d is not None
    for extent in (a, c, d):
        alloc.free(extent)
    assert alloc.free_ranges(0) == [(0, 64 * KIB)]  # every neighbour merged back


def test_sizes_round_up_to_the_alignment() -> None:
    alloc = SlabAllocator(64 * KIB, max_slabs=1, alignment=4 * KIB)
    alloc.add_slab()
    extent = alloc.allocate(1)
    assert extent == Extent(0, 0, 4 * KIB)
    assert alloc.used_bytes == 4 * KIB and alloc.free_bytes == 60 * KIB


def test_full_slabs_answer_none_until_the_owner_adds_one() -> None:
    alloc = SlabAllocator(32 * KIB, max_slabs=2)
    assert alloc.allocate(4 * KIB) is None  # no slab yet
    alloc.add_slab()
    assert alloc.allocate(32 * KIB) == Extent(0, 0, 32 * KIB)
    assert not alloc.can_allocate(4 * KIB) and alloc.allocate(4 * KIB) is None
    assert alloc.add_slab() == 1
    assert alloc.allocate(4 * KIB) == Extent(1, 0, 4 * KIB)
    assert not alloc.can_add_slab
    with pytest.raises(RuntimeError):
        alloc.add_slab()


def test_misuse_is_refused() -> None:
    alloc = SlabAllocator(32 * KIB, max_slabs=1)
    alloc.add_slab()
    with pytest.raises(ValueError):
        alloc.allocate(33 * KIB)  # larger than a slab: the caller must split
    with pytest.raises(ValueError):
        alloc.allocate(0)
    extent = alloc.allocate(4 * KIB)
    assert extent is not None
    alloc.free(extent)
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free(extent)
    with pytest.raises(ValueError):
        SlabAllocator(10_000, max_slabs=1, alignment=4096)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40 * KIB), st.integers(0, 10**6)), max_size=80))
def test_random_allocations_match_a_byte_map(ops: list[tuple[bool, int, int]]) -> None:
    """Against a reference model: one owner per 1 KiB unit of every slab."""
    unit = KIB
    alloc = SlabAllocator(64 * KIB, max_slabs=3, alignment=unit)
    owners: list[list[Extent | None]] = []
    live: list[Extent] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            extent = alloc.allocate(size)
            if extent is None and alloc.can_add_slab:
                owners.append([None] * (alloc.slab_size // unit))
                alloc.add_slab()
                extent = alloc.allocate(size)
            if extent is None:
                # no room anywhere: indeed no run of free units is long enough in any slab
                need = -(-size // unit)
                for slab in owners:
                    run = best = 0
                    for o in slab:
                        run = run + 1 if o is None else 0
                        best = max(best, run)
                    assert best < need
                continue
            assert extent.length >= size and extent.offset % unit == 0 and extent.length % unit == 0
            assert extent.offset + extent.length <= alloc.slab_size
            cells = owners[extent.slab][extent.offset // unit:(extent.offset + extent.length) // unit]
            assert all(o is None for o in cells), "extent overlaps a live one"
            for i in range(extent.offset // unit, (extent.offset + extent.length) // unit):
                owners[extent.slab][i] = extent
            live.append(extent)
        else:
            extent = live.pop(pick % len(live))
            alloc.free(extent)
            for i in range(extent.offset // unit, (extent.offset + extent.length) // unit):
                owners[extent.slab][i] = None
        assert alloc.used_bytes == sum(e.length for e in live)
        assert alloc.used_bytes + alloc.free_bytes == alloc.num_slabs * alloc.slab_size
    for slab in range(alloc.num_slabs):  # free ranges are sorted, disjoint, non-adjacent
        ranges = alloc.free_ranges(slab)
        for (o1, l1), (o2, _) in itertools.pairwise(ranges):
            assert o1 + l1 < o2
    for extent in live:
        alloc.free(extent)
    assert all(alloc.free_ranges(s) == [(0, alloc.slab_size)] for s in range(alloc.num_slabs))
