"""Store capacity you can read and set in blocks: held blocks per tier, [kv] ram_blocks / ssd_blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import pytest

from fabric.config import Config, ConfigError, KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store
from fabric.tiers.base import Tier

MIB = 1 << 20
GIB = 1 << 30
LAYERS = 3
SIZE = 16 * 1024


def kv(tmp_path: Path, **overrides: Any) -> KVConfig:
    base: dict[str, Any] = dict(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"),
                                ram_gib=64 * MIB / GIB, ssd_gib=256 * MIB / GIB, o_direct=False)
    base.update(overrides)
    return KVConfig(**base)


def block(i: int) -> BlockHash:
    return BlockHash(blake3.blake3(b"capacity-block-%d" % i).digest())


def put_block(store: Store, i: int) -> list[PutResult]:
    """All LAYERS payloads of block i, as an engine stores a block."""
    return store.put_many([(BlockAddress(block(i), layer), payload(i, layer)) for layer in range(LAYERS)])


def payload(i: int, layer: int) -> bytes:
    return blake3.blake3(b"capacity-payload-%d-%d" % (i, layer)).digest(length=SIZE)


def tiers_of(store: Store, i: int) -> set[Tier | None]:
    return set(store.peek([BlockAddress(block(i), layer) for layer in range(LAYERS)]).tiers)


@pytest.mark.parametrize("write_through", [True, False])
def test_stats_and_metrics_count_payloads_and_distinct_blocks_per_tier(tmp_path: Path, write_through: bool) -> None:
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        for i in range(4):
            assert put_block(store, i) == [PutResult.OK] * LAYERS
        store.flush()
        stats = store.stats()
        for tier in ("ram", "ssd"):
            assert (stats[tier]["blocks"], stats[tier]["held_blocks"]) == (4 * LAYERS, 4)
            assert store.metrics.value("kvfabric_blocks", tier=tier) == 4 * LAYERS
            assert store.metrics.value("kvfabric_held_blocks", tier=tier) == 4
        assert store.delete(BlockAddress(block(0), 0))       # one layer gone: the block is still held
        assert store.stats()["ssd"]["held_blocks"] == 4
        for layer in (1, 2):
            store.delete(BlockAddress(block(0), layer))
        assert store.metrics.value("kvfabric_held_blocks", tier="ssd") == 3
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:   # from the index
        assert (store.stats()["ssd"]["held_blocks"], store.stats()["ram"]["held_blocks"]) == (3, 0)


@pytest.mark.parametrize("write_through", [True, False])
def test_ram_blocks_caps_the_blocks_in_ram_and_evicts_whole_blocks_inline(tmp_path: Path,
                                                                          write_through: bool) -> None:
    """RAM may hold 4 blocks (its byte capacity would take hundreds); 20 are stored with no
    maintenance in between: every put is acknowledged, RAM holds exactly the 4 newest blocks with
    all their layers, and the rest is served from SSD."""
    with Store.open(kv(tmp_path, write_through=write_through, ram_blocks=4), background=False) as store:
        for i in range(20):
            assert put_block(store, i) == [PutResult.OK] * LAYERS
        stats = store.stats()
        assert stats["ram"]["held_blocks"] == 4 and stats["ram"]["blocks"] == 4 * LAYERS
        assert stats["ram"]["capacity_blocks"] == 4
        assert [i for i in range(20) if tiers_of(store, i) == {Tier.RAM}] == [16, 17, 18, 19]
        assert all(store.get(BlockAddress(block(i), layer)) == payload(i, layer)
                   for i in range(20) for layer in range(LAYERS))


def test_the_evictor_trims_ram_blocks_to_the_offload_line(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True, ram_blocks=10, cpu_offload_threshold=0.8)
    with Store.open(cfg, background=False) as store:
        for i in range(10):
            put_block(store, i)
        assert store.stats()["ram"]["held_blocks"] == 10
        store.run_maintenance()
        assert store.stats()["ram"]["held_blocks"] == 8 and store.stats()["ram"]["blocks"] == 8 * LAYERS


def test_ssd_blocks_caps_the_blocks_on_ssd_evicting_the_least_recently_seen_whole(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True, ssd_blocks=5)
    with Store.open(cfg, background=False) as store:
        for i in range(5):
            put_block(store, i)
        store.lookup([BlockAddress(block(0), layer) for layer in range(LAYERS)])   # 0: most recently seen
        for i in range(5, 8):
            assert put_block(store, i) == [PutResult.OK] * LAYERS
        stats = store.stats()
        assert (stats["ssd"]["held_blocks"], stats["ssd"]["blocks"]) == (5, 5 * LAYERS)
        assert stats["put_rejected"]["full"] == 0
    with Store.open(cfg, background=False) as store:            # RAM is empty: only SSD answers
        assert [i for i in range(8) if tiers_of(store, i) == {Tier.SSD}] == [0, 4, 5, 6, 7]
        assert [i for i in range(8) if tiers_of(store, i) == {None}] == [1, 2, 3]


def test_block_capacities_come_from_the_config_file_and_reject_negative_values(tmp_path: Path) -> None:
    path = tmp_path / "kvfabric.toml"
    path.write_text("[kv]\nram_blocks = 1000\nssd_blocks = 20000\n")
    cfg = Config.load(path)
    assert (cfg.kv.ram_blocks, cfg.kv.ssd_blocks) == (1000, 20000)
    assert (KVConfig().ram_blocks, KVConfig().ssd_blocks) == (0, 0)
    path.write_text("[kv]\nram_blocks = -1\n")
    with pytest.raises(ConfigError, match=r"kv\.ram_blocks must be >= 0"):
        Config.load(path)


def test_a_write_behind_put_past_ram_blocks_while_all_is_pinned_commits_then_evicts(tmp_path: Path) -> None:
    # No background thread: every write-behind payload stays pinned until a put needs its room.
    with Store.open(kv(tmp_path, write_through=False, ram_blocks=2), background=False) as store:
        for i in range(6):
            assert put_block(store, i) == [PutResult.OK] * LAYERS
        stats = store.stats()
        assert stats["ram"]["held_blocks"] == 2 and stats["ssd"]["held_blocks"] >= 4
        assert sum(stats["put_rejected"].values()) == 0
        assert all(store.get(BlockAddress(block(i), layer)) == payload(i, layer)
                   for i in range(6) for layer in range(LAYERS))
