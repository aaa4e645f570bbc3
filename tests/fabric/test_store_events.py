"""Store events and held addresses: what the cluster layer advertises to the directory by block hash.

Every test uses a real Store on tmp folders (real files, fsync, RocksDB). The property they share:
replaying the events in order (STORED adds, REMOVED removes) yields exactly `held_addresses()`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import blake3
import msgpack
import pytest

from fabric.config import KVConfig
from fabric.events import EventKind, StoreEvents
from fabric.index import BlockMeta, Index
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store

KIB = 1 << 10
GIB = 1 << 30


def kv(tmp_path: Path, **overrides: Any) -> KVConfig:
    base: dict[str, Any] = dict(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"),
                                ram_gib=4096 * KIB / GIB, ssd_gib=8192 * KIB / GIB)
    base.update(overrides)
    return KVConfig(**base)


def addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"ev" + i.to_bytes(8, "little")).digest()), layer)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def replay(batches: list[StoreEvents]) -> set[BlockAddress]:
    held: set[BlockAddress] = set()
    for batch in batches:
        assert not batch.overflowed
        for kind, address in batch.events:
            if kind is EventKind.STORED:
                assert address not in held, f"{address} reported stored twice"
                held.add(address)
            else:
                assert address in held, f"{address} reported removed while not held"
                held.remove(address)
    return held


@pytest.mark.parametrize("write_through", [True, False])
def test_puts_emit_stored_once_in_order_and_delete_emits_removed(tmp_path: Path, write_through: bool) -> None:
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        addresses = [addr(i, layer) for i in range(3) for layer in range(2)]
        for a in addresses:
            assert store.put(a, os.urandom(8 * KIB)) is PutResult.OK
        assert store.put(addresses[0], store.get(addresses[0]) or b"") is PutResult.OK   # same bytes again
        store.flush()
        store.get(addresses[1])                                                       # a hit: no event
        first = store.take_events()
        assert first == StoreEvents(tuple((EventKind.STORED, a) for a in addresses), False)
        assert store.delete(addresses[2])
        assert not store.delete(addresses[2])
        assert store.take_events() == StoreEvents(((EventKind.REMOVED, addresses[2]),), False)
        assert sorted(store.held_addresses(), key=repr) == sorted(set(addresses) - {addresses[2]}, key=repr)
        assert store.take_events() == StoreEvents((), False)


def test_mirror_emits_stored(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        payload = os.urandom(4 * KIB)
        assert store.mirror(addr(1), payload, digest=blake3.blake3(payload).digest()) is PutResult.OK
        assert store.take_events().events == ((EventKind.STORED, addr(1)),)


def test_take_events_honours_max_events(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        for i in range(5):
            store.put(addr(i), os.urandom(KIB))
        assert [a for _, a in store.take_events(2).events] == [addr(0), addr(1)]
        assert [a for _, a in store.take_events().events] == [addr(2), addr(3), addr(4)]


def test_eviction_from_small_ram_and_ssd_reports_removed_and_replay_matches(tmp_path: Path) -> None:
    # RAM holds ~3 blocks, SSD ~8: filling both forces RAM offload and SSD capacity eviction.
    clock = Clock()
    config = kv(tmp_path, write_through=False, ram_gib=400 * KIB / GIB, ram_high_water=3.0,
                ssd_gib=(8 * (100 + 4)) * KIB / GIB)
    batches: list[StoreEvents] = []
    with Store.open(config, background=False, clock=clock) as store:
        for i in range(30):
            clock.now += 1
            assert store.put(addr(i), os.urandom(100 * KIB)) is PutResult.OK   # room is made inline
            batches.append(store.take_events())
        store.run_maintenance()
        batches.append(store.take_events())
        held = store.held_addresses()
        assert replay(batches) == set(held)
        removed = {a for b in batches for kind, a in b.events if kind is EventKind.REMOVED}
        assert len(removed) >= 10
        assert all(store.get(a) is None for a in removed - set(held))
        assert all(store.get(a) is not None for a in held)


def test_ttl_expiry_reports_removed(tmp_path: Path) -> None:
    clock = Clock()
    # RAM too small to keep a copy: the SSD file is the only one, so expiry removes the address.
    with Store.open(kv(tmp_path, write_through=True, ram_gib=1 * KIB / GIB, ssd_ttl_s=60.0),
                    background=False, clock=clock) as store:
        for i in range(3):
            assert store.put(addr(i), os.urandom(8 * KIB)) is PutResult.OK
        assert len(store.take_events().events) == 3
        clock.now += 61
        store.run_maintenance()
        events = store.take_events().events
        assert sorted(events, key=repr) == sorted(((EventKind.REMOVED, addr(i)) for i in range(3)), key=repr)
        assert store.held_addresses() == []


def test_corrupt_block_dropped_reports_removed(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, write_through=True, ram_gib=1 * KIB / GIB), background=False) as store:
        assert store.put(addr(7), os.urandom(8 * KIB)) is PutResult.OK
        store.take_events()
        path = next(p for p in (tmp_path / "ssd").rglob("*.kvb"))
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        assert store.get(addr(7)) is None
        assert store.take_events().events == ((EventKind.REMOVED, addr(7)),)


@pytest.mark.parametrize("write_through", [True, False])
def test_reopen_lists_ssd_blocks_and_emits_nothing(tmp_path: Path, write_through: bool) -> None:
    addresses = [addr(i, layer) for i in range(4) for layer in range(3)]
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        for a in addresses:
            assert store.put(a, os.urandom(4 * KIB)) is PutResult.OK
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        assert sorted(store.held_addresses(), key=repr) == sorted(addresses, key=repr)
        assert store.take_events() == StoreEvents((), False)
        assert store.delete(addresses[0])
        assert store.take_events().events == ((EventKind.REMOVED, addresses[0]),)


def test_rows_without_a_hash_still_load_but_are_not_listed(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, write_through=True), background=False) as store:
        payload = os.urandom(4 * KIB)
        assert store.put(addr(1), payload) is PutResult.OK
        assert store.put(addr(2), os.urandom(4 * KIB)) is PutResult.OK
    key = addr(1).storage_key
    with Index(tmp_path / "index") as index:
        meta = index.get(key)
        assert meta is not None and meta.block_hash == addr(1).hash
        old = {"model": meta.model, "layer": meta.layer, "bytes": meta.num_bytes, "digest": meta.digest,
               "created_unix": meta.created_unix, "last_seen_unix": meta.last_seen_unix, "tier": meta.tier.value}
        assert BlockMeta.decode(msgpack.packb(old, use_bin_type=True)).block_hash == b""
        index.put(key, BlockMeta.decode(msgpack.packb(old, use_bin_type=True)))
    with Store.open(kv(tmp_path, write_through=True), background=False) as store:
        assert bytes(store.get(addr(1)) or b"") == payload
        assert store.held_addresses() == [addr(2)]


def test_overflow_clears_the_queue_reports_once_then_resumes(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, event_queue_max=4), background=False) as store:
        for i in range(6):
            assert store.put(addr(i), os.urandom(KIB)) is PutResult.OK
        assert store.take_events() == StoreEvents((), True)
        assert sorted(store.held_addresses(), key=repr) == sorted((addr(i) for i in range(6)), key=repr)
        assert store.take_events() == StoreEvents((), False)
        store.delete(addr(0))
        assert store.take_events() == StoreEvents(((EventKind.REMOVED, addr(0)),), False)
