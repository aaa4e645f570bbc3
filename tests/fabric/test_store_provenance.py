"""Provenance kept with the block: RAM entry, index row (restart-safe), purge by producer."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import msgpack
import pytest

from fabric.config import KVConfig
from fabric.events import EventKind
from fabric.index import BlockMeta
from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block, sign_run
from fabric.store import Store
from fabric.tiers.base import Tier

NUM_LAYERS = 3


def _kv(root: Path, write_through: bool) -> KVConfig:
    return KVConfig(ram_gib=0.05, ssd_dir=str(root / "ssd"), index_dir=str(root / "index"), ssd_gib=0.1,
                    write_through=write_through, durable=False, o_direct=False)


def _block(producer: str) -> tuple[list[tuple[BlockAddress, bytes]], Provenance]:
    block = BlockHash(os.urandom(32))
    payloads = [os.urandom(4096) for _ in range(NUM_LAYERS)]
    record = sign_block(b"n" * 32, block, [blake3.blake3(p).digest() for p in payloads], producer, b"cert",
                        lambda m: b"s" * 64)
    return [(BlockAddress(block, layer), p) for layer, p in enumerate(payloads)], record


def _put(store: Store, items: list[tuple[BlockAddress, bytes]], record: Provenance | None) -> None:
    results = store.put_many(items, provenance=[record] * len(items))
    assert all(r.ok for r in results)


@pytest.mark.parametrize("write_through", [True, False])
def test_a_blocks_provenance_survives_a_restart(tmp_path: Path, write_through: bool) -> None:
    items, record = _block("node-a")
    with Store.open(_kv(tmp_path, write_through), background=False) as store:
        _put(store, items, record)
        got = store.get_block(items[1][0])
        assert got is not None and got.tier is Tier.RAM and got.provenance == record
        store.flush()
    with Store.open(_kv(tmp_path, write_through), background=False) as store:
        for address, payload in items:
            got = store.get_block(address)
            assert got is not None and got.tier is Tier.SSD and bytes(got.payload) == payload
            assert got.provenance == record and got.provenance.cert_der == b"cert"
        promoted = store.get_block(items[0][0])
        assert promoted is not None and promoted.tier is Tier.RAM and promoted.provenance == record


def test_blocks_stored_without_provenance_are_unsigned(tmp_path: Path) -> None:
    items, _ = _block("node-a")
    with Store.open(_kv(tmp_path, True), background=False) as store:
        _put(store, items, None)
        got = store.get_block(items[0][0])
        assert got is not None and got.provenance is None


def test_an_index_row_written_before_provenance_reads_as_unsigned() -> None:
    old = msgpack.packb({"model": "m", "layer": 0, "bytes": 3, "digest": b"d" * 32, "created_unix": 1.0,
                         "last_seen_unix": 1.0, "tier": "ssd", "hash": b"h" * 32}, use_bin_type=True)
    assert BlockMeta.decode(old).provenance is None
    _, record = _block("node-a")
    meta = BlockMeta("m", 0, 3, b"d" * 32, 1.0, 1.0, Tier.SSD, b"h" * 32, record)
    assert BlockMeta.decode(meta.encode()).provenance == record


def test_a_record_of_a_signed_run_survives_its_index_row() -> None:
    run = sign_run(b"n" * 32, [(bytes([i]) * 32, [b"d" * 32]) for i in range(3)], "node-a", b"cert",
                   lambda m: b"s" * 64)
    meta = BlockMeta("m", 0, 3, b"d" * 32, 1.0, 1.0, Tier.SSD, b"\2" * 32, run[2])
    again = BlockMeta.decode(meta.encode()).provenance
    assert again == run[2] and again is not None and again.message() == run[0].message()


def test_purge_by_producer_removes_that_producers_blocks_and_every_unsigned_one(tmp_path: Path) -> None:
    bad_items, bad = _block("node-bad")
    good_items, good = _block("node-good")
    unsigned_items, _ = _block("node-x")
    with Store.open(_kv(tmp_path, True), background=False) as store:
        _put(store, bad_items, bad)
        _put(store, good_items, good)
        _put(store, unsigned_items, None)
        store.take_events()
        assert store.purge_producer("node-bad") == 2 * NUM_LAYERS   # no record says whose the unsigned are
        assert all(store.get_block(a) is None for a, _ in bad_items + unsigned_items)
        assert all(store.get_block(a) is not None for a, _ in good_items)
        removed = [a for kind, a in store.take_events().events if kind is EventKind.REMOVED]
        assert sorted(removed, key=lambda a: (a.hash, a.layer)) == sorted(
            [a for a, _ in bad_items + unsigned_items], key=lambda a: (a.hash, a.layer))
    with Store.open(_kv(tmp_path, True), background=False) as store:   # gone from the SSD too
        assert all(store.get_block(a) is None for a, _ in bad_items + unsigned_items)
        assert store.purge_producer("node-bad") == 0


@pytest.mark.parametrize("write_through", [True, False])
def test_a_conflicting_store_is_counted_with_both_producers_named(tmp_path: Path, write_through: bool,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    items, record = _block("node-a")
    other = [(address, os.urandom(len(payload))) for address, payload in items]
    other_record = sign_block(b"n" * 32, items[0][0].hash, [blake3.blake3(p).digest() for _, p in other],
                              "node-b", b"cert", lambda m: b"s" * 64)
    with Store.open(_kv(tmp_path, write_through), background=False) as store:
        _put(store, items, record)
        with caplog.at_level("WARNING", logger="fabric.store_puts"):
            results = store.put_many(other, provenance=[other_record] * len(other))
        assert [r.value for r in results] == ["conflict"] * NUM_LAYERS
        assert store.metrics.value("kvfabric_store_conflicts_total", held_producer="node-a",
                                   new_producer="node-b") == NUM_LAYERS
        assert any("node-a" in m and "node-b" in m for m in caplog.messages)
        assert [bytes(store.get(a) or b"") for a, _ in items] == [p for _, p in items]   # the first stands
        store.put_many(other)   # unsigned bytes: named as such
        assert store.metrics.value("kvfabric_store_conflicts_total", held_producer="node-a",
                                   new_producer="unsigned") == NUM_LAYERS
