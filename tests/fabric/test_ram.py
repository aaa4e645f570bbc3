"""RAM tier: byte bound, CLOCK (second chance) eviction, pinning, zero-copy views."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.keys import StorageKey
from fabric.tiers.base import Tier, digest_of
from fabric.tiers.ram import RamTier


def key(i: int) -> StorageKey:
    return StorageKey(i.to_bytes(32, "little"))


def put(ram: RamTier, i: int, payload: bytes, *, pinned: bool = False) -> bool:
    return ram.put(key(i), memoryview(payload), digest_of(payload), pinned=pinned)


def test_get_returns_a_read_only_view_of_the_stored_buffer_without_copying() -> None:
    ram = RamTier(1 << 20)
    payload = os.urandom(4096)
    assert put(ram, 1, payload)
    block = ram.get(key(1))
    assert block is not None
    assert block.tier is Tier.RAM
    assert block.payload.obj is payload          # the very object that was put: no copy
    assert block.digest == digest_of(payload)
    with pytest.raises(TypeError):
        block.payload[0] = 0                      # callers cannot scribble on the cache


def test_put_refuses_past_the_high_water_mark_and_keeps_what_it_has() -> None:
    ram = RamTier(capacity_bytes=10_000, high_water_bytes=12_000)
    assert put(ram, 1, os.urandom(6000))
    assert put(ram, 2, os.urandom(6000))          # 12 000: exactly at the mark
    assert not put(ram, 3, os.urandom(1))
    assert ram.used_bytes == 12_000 and len(ram) == 2
    assert not ram.contains(key(3))


def test_replacing_a_key_accounts_only_the_new_size() -> None:
    ram = RamTier(10_000)
    put(ram, 1, os.urandom(6000))
    assert put(ram, 1, os.urandom(9000))          # 9000 fits once the old 6000 are gone
    assert ram.used_bytes == 9000 and len(ram) == 1


def test_clock_gives_a_recently_used_block_a_second_chance() -> None:
    ram = RamTier(1 << 20)
    for i in range(3):
        put(ram, i, os.urandom(100))
    ram.get(key(0))                               # 0 is oldest but was just used
    evicted = ram.evict(100)
    assert [e.key for e in evicted] == [key(1)]
    assert ram.contains(key(0)) and ram.contains(key(2))
    assert [e.key for e in ram.evict(200)] == [key(2), key(0)]


def test_pinned_blocks_are_never_evicted_until_unpinned() -> None:
    ram = RamTier(1 << 20)
    put(ram, 1, os.urandom(100), pinned=True)
    put(ram, 2, os.urandom(100))
    assert [e.key for e in ram.evict(1000)] == [key(2)]
    assert ram.contains(key(1)) and ram.num_pinned == 1
    ram.unpin(key(1))
    assert [e.key for e in ram.evict(1000)] == [key(1)]
    assert ram.used_bytes == 0 and ram.num_pinned == 0


def test_footprint_counts_the_memory_held_not_just_the_payload() -> None:
    ram = RamTier(1 << 20)
    payload = os.urandom(100)
    assert ram.put(key(1), memoryview(payload), digest_of(payload), footprint=4096)
    assert ram.stats().num_bytes == 4096


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "evict", "pin", "unpin"]),
                          st.integers(0, 7), st.integers(0, 300)), max_size=80))
def test_matches_a_reference_model(ops: list[tuple[str, int, int]]) -> None:
    ram = RamTier(capacity_bytes=800, high_water_bytes=1000)
    model: dict[int, int] = {}
    pinned: set[int] = set()
    for op, i, size in ops:
        if op == "put":
            fits = sum(model.values()) - model.get(i, 0) + size <= 1000
            assert put(ram, i, os.urandom(size)) == fits
            if fits:
                model[i] = size
                pinned.discard(i)
        elif op == "get":
            assert (ram.get(key(i)) is not None) == (i in model)
        elif op == "remove":
            assert ram.remove(key(i)) == (i in model)
            model.pop(i, None)
            pinned.discard(i)
        elif op == "evict":
            evictable = sum(v for k, v in model.items() if k not in pinned)
            freed = 0
            for e in ram.evict(size):
                n = int.from_bytes(e.key, "little")
                assert n not in pinned
                assert model.pop(n) == e.num_bytes
                freed += e.num_bytes
            assert freed >= min(size, evictable)
        elif op == "pin" and i in model:
            ram.pin(key(i))
            pinned.add(i)
        elif op == "unpin":
            ram.unpin(key(i))
            pinned.discard(i)
        assert ram.used_bytes == sum(model.values()) <= 1000
        assert set(ram.keys()) == {key(k) for k in model}
        assert ram.num_pinned == len(pinned)


def layer_put(ram: RamTier, block: int, layer: int, *, pinned: bool = False) -> bool:
    payload = bytes([block, layer]) * 50
    return ram.put(key(block * 16 + layer), memoryview(payload), digest_of(payload), pinned=pinned,
                   block=bytes([block]) * 32)


def test_capacity_blocks_counts_a_block_once_for_all_its_layers() -> None:
    ram = RamTier(1 << 20, capacity_blocks=2)
    assert all(layer_put(ram, b, layer) for b in (1, 2) for layer in range(3))
    assert (ram.num_blocks, ram.num_held_blocks) == (6, 2)
    assert not layer_put(ram, 3, 0)                   # a third block does not fit ...
    assert layer_put(ram, 2, 3)                       # ... another layer of a held one does
    ram.remove(key(1 * 16 + 0))
    assert ram.num_held_blocks == 2                   # block 1 keeps two layers
    with pytest.raises(ValueError, match="capacity_blocks"):
        RamTier(1 << 20, capacity_blocks=-1)


def test_make_room_evicts_whole_blocks_in_clock_order_and_never_pinned_ones_or_its_own() -> None:
    ram = RamTier(1 << 20, capacity_blocks=3)
    assert all(layer_put(ram, 1, layer, pinned=True) for layer in range(2))
    assert all(layer_put(ram, b, layer) for b in (2, 3) for layer in range(2))
    evicted = ram.make_room(key(4 * 16), 100, block=bytes([4]) * 32)
    assert {e.key for e in evicted} == {key(2 * 16), key(2 * 16 + 1)}     # block 2, whole; 1 is pinned
    assert layer_put(ram, 4, 0) and ram.num_held_blocks == 3
    assert ram.make_room(key(4 * 16 + 1), 100, block=bytes([4]) * 32) == []   # a layer of a held block


def test_make_room_frees_bytes_up_to_the_high_water_mark() -> None:
    ram = RamTier(capacity_bytes=1000, high_water_bytes=1000)
    assert all(put(ram, i, bytes(300)) for i in range(3))
    assert [e.key for e in ram.make_room(key(9), 300)] == [key(0)]
    assert put(ram, 9, bytes(300)) and ram.used_bytes == 900
