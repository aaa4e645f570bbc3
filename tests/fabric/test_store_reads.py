"""Store.read_run / lookup_run: a leading run of blocks read or located in one pass (real files),
and a payload hashed once (`hash_payload`) kept as hashed."""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest

from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store, hash_payload
from fabric.tiers.base import Tier

MIB = 1 << 20
NUM_LAYERS = 3


def kv(tmp_path: Path, **overrides: object) -> KVConfig:
    settings: dict[str, object] = dict(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"),
                                       ram_gib=64 * MIB / (1 << 30), ssd_gib=256 * MIB / (1 << 30), o_direct=False)
    return KVConfig(**{**settings, **overrides})  # type: ignore[arg-type]


def block(i: int) -> list[BlockAddress]:
    h = BlockHash(blake3.blake3(b"block" + i.to_bytes(8, "little")).digest())
    return [BlockAddress(h, layer) for layer in range(NUM_LAYERS)]


def payload(i: int, layer: int) -> bytes:
    return blake3.blake3(f"{i}/{layer}".encode()).digest(length=4096)


def put_blocks(store: Store, ids: range) -> None:
    assert all(r.ok for r in store.put_many([(a, payload(i, a.layer)) for i in ids for a in block(i)]))


def test_a_run_read_across_ram_and_ssd_ends_at_the_first_block_missing_a_layer(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        put_blocks(store, range(2))
    with Store.open(cfg, background=False) as store:      # blocks 0-1 on SSD only, 2-3 in RAM too
        put_blocks(store, range(2, 4))
        store.put(block(4)[0], payload(4, 0))               # block 4 lacks layers 1 and 2
        put_blocks(store, range(5, 6))
        run = store.read_run([block(i) for i in range(6)])
        assert [[bytes(b.payload) for b in layers] for layers in run] == \
            [[payload(i, layer) for layer in range(NUM_LAYERS)] for i in range(4)]
        assert [{b.tier for b in layers} for layers in run] == [{Tier.SSD}] * 2 + [{Tier.RAM}] * 2
        assert [[b.digest for b in layers] for layers in run] == \
            [[blake3.blake3(payload(i, layer)).digest() for layer in range(NUM_LAYERS)] for i in range(4)]
        assert store.lookup(block(0)).tiers == (Tier.RAM,) * NUM_LAYERS    # the SSD reads were promoted
        assert store.read_run([block(4), block(5)]) == []
        assert store.read_run([]) == []


def test_a_corrupt_file_ends_the_run_before_its_block_and_is_removed(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        put_blocks(store, range(3))
    key = block(1)[2].storage_key
    path = Path(cfg.ssd_dir) / f"{key[0]:02x}" / f"{key.hex()[:16]}-2.kvb"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with Store.open(cfg, background=False) as store:
        run = store.read_run([block(i) for i in range(3)])
        assert [[bytes(b.payload) for b in layers] for layers in run] == [[payload(0, layer) for layer in range(3)]]
        assert store.stats()["corrupt_blocks"]["ssd"] == 1 and not path.exists()
        assert len(store.read_run([block(i) for i in range(3)])) == 1     # never served afterwards


@pytest.mark.parametrize("peek", [True, False])
def test_lookup_run_names_each_layers_tier_up_to_the_first_gap(tmp_path: Path, peek: bool) -> None:
    with Store.open(kv(tmp_path, write_through=False), background=False) as store:
        put_blocks(store, range(3))
        store.delete(block(1)[1])
        assert store.lookup_run([block(i) for i in range(3)], peek=peek) == [(Tier.RAM,) * NUM_LAYERS]
        assert store.lookup_run([block(2), block(0)], peek=peek) == [(Tier.RAM,) * NUM_LAYERS] * 2
        assert store.lookup_run([block(1)], peek=peek) == []


def test_a_payload_hashed_once_is_kept_as_hashed_and_its_source_may_change_afterwards(tmp_path: Path) -> None:
    source = bytearray(os.urandom(8192))
    hashed = hash_payload(memoryview(source)[:4096])
    expected = bytes(source[:4096])
    source[:4096] = bytes(4096)      # the producer reuses its buffer once the put has its bytes
    cfg = kv(tmp_path, write_through=False)
    a = block(0)[0]
    with Store.open(cfg, background=False) as store:
        assert hashed.digest == blake3.blake3(expected).digest()
        assert store.put_many([(a, hashed)], digests=[b"\0" * 32]) == [PutResult.DIGEST_MISMATCH]
        assert store.put_many([(a, hashed)], digests=[hashed.digest]) == [PutResult.OK]
        assert store.get(a) == expected
        assert store.flush() == 0
    with Store.open(cfg, background=False) as store:     # read back from its file, digest verified
        got = store.get_block(a)
        assert got is not None and bytes(got.payload) == expected and got.digest == hashed.digest
