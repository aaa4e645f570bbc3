"""Store: put / get / lookup / delete across tiers, promotion, write-behind, eviction, thresholds."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import pytest
from testkit import wait_until

from fabric.config import Config, KVConfig
from fabric.events import BlockEvicted, BlockStored
from fabric.index import IndexUnavailableError
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store
from fabric.store_holdings import LAST_SEEN_RESOLUTION_S
from fabric.tiers.base import Tier
from fabric.tiers.device import UnknownEventError
from fabric.tiers.ssd_format import HEADER_SIZE

MIB = 1 << 20
GIB = 1 << 30


def kv(tmp_path: Path, **overrides: Any) -> KVConfig:
    base: dict[str, Any] = dict(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"),
                                ram_gib=64 * MIB / GIB, ssd_gib=256 * MIB / GIB)
    base.update(overrides)
    return KVConfig(**base)


def addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"block" + i.to_bytes(8, "little")).digest()), layer)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def payloads() -> dict[int, bytes]:
    return {i: os.urandom(64 * 1024) for i in range(16)}


@pytest.mark.parametrize("write_through", [True, False])
def test_put_then_get_returns_the_same_verified_bytes(tmp_path: Path, payloads: dict[int, bytes],
                                                      write_through: bool) -> None:
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        for i, p in payloads.items():
            assert store.put(addr(i), p, model="llama") is PutResult.OK
        for i, p in payloads.items():
            block = store.get_block(addr(i))
            assert block is not None and bytes(block.payload) == p
            assert block.digest == blake3.blake3(p).digest() and block.tier is Tier.RAM
        view = store.get(addr(0))
        assert isinstance(view, memoryview) and view.readonly
        assert store.get(addr(99)) is None


def test_put_accepts_config_object_and_mutable_buffers_are_copied(tmp_path: Path) -> None:
    cfg = Config()
    cfg.kv = kv(tmp_path)
    buf = bytearray(os.urandom(1000))
    expected = bytes(buf)
    with Store.open(cfg, background=False) as store:
        assert store.put(addr(1), buf).ok
        buf[:10] = b"\0" * 10                      # the caller reuses its buffer
        assert store.get(addr(1)) == expected


def test_a_wrong_digest_from_the_network_is_rejected_and_nothing_is_stored(tmp_path: Path) -> None:
    p = os.urandom(5000)
    with Store.open(kv(tmp_path, write_through=True), background=False) as store:
        assert store.put(addr(1), p, digest=b"\0" * 32) is PutResult.DIGEST_MISMATCH
        assert store.get(addr(1)) is None and store.lookup([addr(1)]).num_leading == 0
        assert store.put(addr(1), p, digest=blake3.blake3(p).digest()) is PutResult.OK
        assert store.stats()["put_rejected"]["digest_mismatch"] == 1


def test_lookup_reports_leading_run_and_tier_per_address(tmp_path: Path, payloads: dict[int, bytes]) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        for i in range(4):
            store.put(addr(i), payloads[i])
    with Store.open(cfg, background=False) as store:   # RAM starts empty after a restart
        store.get(addr(1))                             # promoted to RAM
        store.apply_events([BlockStored((addr(0).hash,), addr(0).hash, (7,))])
        result = store.lookup([addr(0), addr(1), addr(2), addr(9), addr(3)])
        assert result.num_leading == 3
        assert result.tiers == (Tier.DEVICE, Tier.RAM, Tier.SSD, None, Tier.SSD)
        store.apply_events([BlockEvicted((addr(0).hash,))])
        assert store.lookup([addr(0)]).tiers == (Tier.SSD,)


def test_device_events_of_another_class_with_the_same_name_are_accepted(tmp_path: Path) -> None:
    @dataclass(frozen=True)
    class BlockStored:                                  # an engine adapter's own event type
        block_hashes: tuple[bytes, ...]

    with Store.open(kv(tmp_path), background=False) as store:
        store.apply_events([BlockStored((addr(5).hash,))])
        assert store.on_device(addr(5).hash)
        assert store.lookup([addr(5, layer=3)]).tiers == (Tier.DEVICE,)
        with pytest.raises(UnknownEventError):
            store.apply_events([object()])


def test_ssd_hit_is_promoted_to_ram_unless_asked_not_to(tmp_path: Path, payloads: dict[int, bytes]) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        store.put(addr(1), payloads[1])
        store.put(addr(2), payloads[2])
    with Store.open(cfg, background=False) as store:
        block = store.get_block(addr(1), promote=False)
        assert block is not None and block.tier is Tier.SSD and bytes(block.payload) == payloads[1]
        assert store.lookup([addr(1)]).tiers == (Tier.SSD,)
        assert store.get_block(addr(2)).tier is Tier.SSD  # type: ignore[union-attr]
        assert store.get_block(addr(2)).tier is Tier.RAM  # type: ignore[union-attr]


def test_write_behind_reaches_ssd_on_flush_and_survives_restart(tmp_path: Path,
                                                                payloads: dict[int, bytes]) -> None:
    cfg = kv(tmp_path, write_through=False)
    with Store.open(cfg, background=False) as store:
        for i, p in payloads.items():
            store.put(addr(i), p)
        assert store.stats()["pending_writes"] == len(payloads)
        assert store.stats()["ssd"]["blocks"] == 0
        assert store.flush() == 0
        assert store.stats()["ssd"]["blocks"] == len(payloads)
        store.put(addr(100), b"written at close")     # close() flushes what is pending
    with Store.open(cfg, background=False) as store:
        for i, p in payloads.items():
            assert store.get(addr(i)) == p
        assert store.get(addr(100)) == b"written at close"


def test_background_thread_flushes_write_behind_and_stops_on_close(tmp_path: Path) -> None:
    store = Store.open(kv(tmp_path, write_through=False, eviction_interval_s=0.05))
    store.put(addr(1), b"x" * 10_000)
    wait_until(lambda: store.stats()["ssd"]["blocks"] > 0, "the background flush", 10, poll_s=0.01)
    assert store.stats()["ssd"]["blocks"] == 1
    store.close()
    assert not any(t.name == "kvfabric-store" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        store.get(addr(1))


def test_a_full_ram_tier_accepts_a_put_by_demoting_to_ssd(tmp_path: Path) -> None:
    # RAM holds 1 MiB, high-water mark 2 MiB; sixteen 128 KiB write-behind blocks fill it, every
    # one pinned (none flushed: no background thread). The next put commits the oldest to SSD
    # inline and evicts them from RAM instead of being refused.
    cfg = kv(tmp_path, write_through=False, ram_gib=MIB / GIB, ram_high_water=2.0)
    blocks = {i: os.urandom(128 * 1024) for i in range(16)}
    extra = os.urandom(128 * 1024)
    with Store.open(cfg, background=False) as store:
        for i, p in blocks.items():
            assert store.put(addr(i), p) is PutResult.OK
        assert store.stats()["ram"]["pinned_blocks"] == 16 and store.stats()["ssd"]["blocks"] == 0
        assert store.put(addr(99), extra) is PutResult.OK
        stats = store.stats()
        assert sum(stats["put_rejected"].values()) == 0
        assert stats["evictions"]["ram"] >= 1 and stats["ram"]["bytes"] <= 2 * MIB
        demoted = [i for i in blocks if store.peek([addr(i)]).tiers[0] is Tier.SSD]
        assert demoted
        for i in demoted:                              # still served, from SSD
            block = store.get_block(addr(i), promote=False)
            assert block is not None and block.tier is Tier.SSD and block.payload == blocks[i]
        for i, p in blocks.items():
            assert store.get(addr(i)) == p
        assert store.get(addr(99)) == extra
        done = store.run_maintenance()                 # the evictor still trims to its offload line
        stats = store.stats()
        assert done["ram_evicted"] > 0 and stats["ram"]["bytes"] <= 0.9 * MIB
        assert stats["pending_writes"] == 0 and stats["ssd"]["blocks"] == len(blocks) + 1


@pytest.mark.parametrize("write_through", [True, False])
def test_300_puts_into_a_small_ram_tier_between_two_ticks_lose_none(tmp_path: Path, write_through: bool) -> None:
    """RAM holds eight 64 KiB blocks; no maintenance runs while 300 are put. Every put is
    acknowledged, lands in RAM, and every acknowledged block is served."""
    cfg = kv(tmp_path, write_through=write_through, ram_gib=8 * 64 * 1024 / GIB)
    blocks = {i: os.urandom(64 * 1024) for i in range(300)}
    with Store.open(cfg, background=False) as store:
        assert [store.put(addr(i), p) for i, p in blocks.items()] == [PutResult.OK] * 300
        assert sum(store.stats()["put_rejected"].values()) == 0
        assert store.peek([addr(299)]).tiers == (Tier.RAM,)      # the newest is in RAM: older copies gave way
        assert all(store.get(addr(i)) == p for i, p in blocks.items())
        assert store.stats()["ram"]["bytes"] <= store.stats()["ram"]["high_water_bytes"]


def test_ssd_blocks_expire_after_ttl_since_last_seen(tmp_path: Path) -> None:
    clock = Clock()
    cfg = kv(tmp_path, write_through=True, ssd_ttl_s=100.0)
    with Store.open(cfg, background=False, clock=clock) as store:
        store.put(addr(1), b"old")
        store.put(addr(2), b"kept alive")
        clock.now += 60
        store.get(addr(2))                              # seen again at +60
        clock.now += 60
        done = store.run_maintenance()
        assert done["ssd_evicted"] == 1
        assert store.lookup([addr(1), addr(2)]).tiers[1] is not None
        assert store.stats()["ssd"]["blocks"] == 1
    with Store.open(cfg, background=False, clock=clock) as store:
        assert store.get(addr(1)) is None              # file and row gone for good
        assert store.get(addr(2)) == b"kept alive"
        assert store.reconciled["row_without_file"] == 0


def test_reads_rewrite_last_seen_rows_only_once_they_are_a_minute_old(tmp_path: Path) -> None:
    """A peer pulling a 4k-token prefix reads 7,680 (block, layer) rows; every maintenance tick
    after each pull would rewrite all of them in the index, a large share of the owner's CPU while
    serving. A row is refreshed once the time it holds is LAST_SEEN_RESOLUTION_S old, and a restart still
    knows when each block was last seen to that resolution."""
    clock = Clock()
    cfg = kv(tmp_path, write_through=True, ssd_ttl_s=150.0)
    with Store.open(cfg, background=False, clock=clock) as store:
        for i in range(20):
            store.put(addr(i), b"x" * 100)
        for _ in range(3):                                 # read again and again within the minute
            clock.now += 10
            assert all(store.get(addr(i)) == b"x" * 100 for i in range(20))
            assert store.run_maintenance()["rows_refreshed"] == 0
        clock.now += LAST_SEEN_RESOLUTION_S
        assert all(store.get(addr(i)) == b"x" * 100 for i in range(10))
        assert store.run_maintenance()["rows_refreshed"] == 10
        assert store.run_maintenance()["rows_refreshed"] == 0
    clock.now += 100          # rows 0-9 were last seen 100 s ago, rows 10-19 160 s ago: past the TTL
    with Store.open(cfg, background=False, clock=clock) as store:
        store.run_maintenance()
        assert [store.get(addr(i)) is not None for i in (0, 9, 10, 19)] == [True, True, False, False]


def filled_ssd(tmp_path: Path, clock: Clock, num_blocks: int, size: int,
               capacity_files: float) -> tuple[Store, KVConfig]:
    """A write-through store whose SSD takes `capacity_files` files of `size` payload bytes, with
    blocks 0 .. num_blocks-1 put one second apart; and its config, for reopening."""
    cfg = kv(tmp_path, write_through=True, ssd_gib=capacity_files * (HEADER_SIZE + size) / GIB)
    store = Store.open(cfg, background=False, clock=clock)
    for i in range(num_blocks):
        clock.now += 1
        assert store.put(addr(i), os.urandom(size)) is PutResult.OK
    clock.now += 1
    return store, cfg


def test_a_full_ssd_evicts_its_least_recently_seen_file_inline_for_a_put(tmp_path: Path) -> None:
    clock = Clock()
    store, cfg = filled_ssd(tmp_path, clock, 4, 256 * 1024, 4.5)
    with store:
        store.lookup([addr(0)])                         # 0 is now the most recently seen
        assert store.put(addr(4), os.urandom(256 * 1024)) is PutResult.OK
        stats = store.stats()
        assert stats["put_rejected"]["full"] == 0 and stats["evictions"]["ssd"] == 1
        assert stats["ssd"]["blocks"] == 4
    with Store.open(cfg, background=False, clock=clock) as store:    # RAM is empty: only SSD answers
        tiers = store.lookup([addr(i) for i in range(5)]).tiers
        assert tiers == (Tier.SSD, None, Tier.SSD, Tier.SSD, Tier.SSD)


def test_ssd_evictor_keeps_usage_under_the_low_water_line(tmp_path: Path) -> None:
    clock = Clock()
    per_file = HEADER_SIZE + 64 * 1024
    cfg = kv(tmp_path, write_through=True, ssd_gib=10 * per_file / GIB, ssd_low_water=0.8)
    with Store.open(cfg, background=False, clock=clock) as store:
        for i in range(10):
            clock.now += 1
            assert store.put(addr(i), os.urandom(64 * 1024)) is PutResult.OK
        assert store.run_maintenance()["ssd_evicted"] == 2           # 10 files -> 8 (80 %)
        assert store.stats()["ssd"]["bytes"] == 8 * per_file
        assert store.stats()["evictions"]["ssd"] == 2


def test_write_behind_under_a_full_ssd_replaces_the_oldest_blocks(tmp_path: Path) -> None:
    clock = Clock()
    per_file = HEADER_SIZE + 64 * 1024
    cfg = kv(tmp_path, write_through=False, ssd_gib=4 * per_file / GIB)
    blocks = {i: os.urandom(64 * 1024) for i in range(6)}
    with Store.open(cfg, background=False, clock=clock) as store:
        for i, p in blocks.items():
            clock.now += 1
            store.put(addr(i), p)
        assert store.flush() == 0                          # four fit, the two oldest files make room
        assert store.stats()["pending_writes"] == 0 and store.stats()["evictions"]["ssd"] == 2
        assert store.stats()["ssd"]["bytes"] <= 4 * per_file
        for i, p in blocks.items():                        # every block still served (RAM or SSD)
            assert store.get(addr(i)) == p
    with Store.open(cfg, background=False) as store:       # and the newest ones are on SSD
        assert store.lookup([addr(4), addr(5)]).num_leading == 2


def test_hot_ssd_blocks_are_prefetched_into_ram(tmp_path: Path, payloads: dict[int, bytes]) -> None:
    clock = Clock()
    cfg = kv(tmp_path, write_through=True, prefetch_threshold=0.7)
    with Store.open(cfg, background=False, clock=clock) as store:
        for i in range(3):
            store.put(addr(i), payloads[i])
    with Store.open(cfg, background=False, clock=clock) as store:
        for _ in range(10):
            clock.now += 1
            store.lookup([addr(0), addr(1)])
        store.lookup([addr(2)])                         # touched once: far below 0.7 of the hottest
        assert store.run_maintenance(clock.now)["prefetched"] == 2
        assert store.lookup([addr(0), addr(1), addr(2)]).tiers == (Tier.RAM, Tier.RAM, Tier.SSD)


def test_offload_thresholds_come_from_config(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, gpu_offload_threshold=0.85), background=False) as store:
        assert not store.should_offload_device(0.80)
        assert store.should_offload_device(0.86)
        assert store.policy.ram_offload_line == int(64 * MIB * 0.90)


def test_delete_removes_every_copy(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        store.put(addr(1), b"to be deleted")
        path = Path(cfg.ssd_dir) / f"{addr(1).storage_key[0]:02x}" / f"{addr(1).storage_key.hex()[:16]}-0.kvb"
        assert path.exists()
        assert store.delete(addr(1)) is True
        assert store.get(addr(1)) is None and not path.exists()
        assert store.delete(addr(1)) is False
    with Store.open(cfg, background=False) as store:
        assert store.get(addr(1)) is None


def test_put_many_is_one_group_commit_and_handles_repeated_keys(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path, write_through=True), background=False) as store:
        results = store.put_many([(addr(1), b"first"), (addr(2), b"two"), (addr(1), b"second")])
        assert results == [PutResult.OK] * 3
        assert store.get(addr(1)) == b"second"
        assert store.put(addr(2), b"two") is PutResult.OK    # already stored: no rewrite
        assert store.stats()["ssd"]["blocks"] == 2


def test_concurrent_puts_gets_and_deletes_stay_consistent(tmp_path: Path) -> None:
    blocks = {i: os.urandom(8192 + i) for i in range(64)}
    errors: list[str] = []
    with Store.open(kv(tmp_path, write_through=False, eviction_interval_s=0.02)) as store:
        def worker(seed: int) -> None:
            for n in range(1500):
                i = (seed * 31 + n * 7) % 64
                op = (seed + n) % 5
                if op < 2:
                    store.put(addr(i), blocks[i])
                elif op < 4:
                    got = store.get(addr(i))
                    if got is not None and bytes(got) != blocks[i]:
                        errors.append(f"block {i} served wrong bytes")
                else:
                    store.delete(addr(i))
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.flush()
        stats = store.stats()
        assert stats["pending_writes"] == 0
        present = [i for i in blocks if store.lookup([addr(i)]).num_leading]
        for i in present:
            assert store.get(addr(i)) == blocks[i]
    assert errors == []


def test_a_second_store_on_the_same_index_is_refused(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False), pytest.raises(IndexUnavailableError):
        Store.open(kv(tmp_path), background=False)


def test_an_overwrite_racing_an_ssd_read_is_refused_and_the_first_payload_stays(tmp_path: Path) -> None:
    # The first acknowledged payload of an address stands: a put of other bytes that lands while
    # a get reads the SSD copy answers CONFLICT, and every later get (and a reopen) serves the first.
    old, new = os.urandom(4096), os.urandom(4096)
    cfg = kv(tmp_path, write_through=False)
    with Store.open(cfg, background=False) as store:
        store.put(addr(1), old)
        store.flush()
    with Store.open(cfg, background=False) as store:     # RAM empty: the next get reads the file
        real_read = store._parts.ssd.read_file

        def read_then_race(*args: Any, **kwargs: Any) -> Any:
            block = real_read(*args, **kwargs)
            assert store.put(addr(1), new) is PutResult.CONFLICT   # lands while the read is in flight
            return block

        store._parts.ssd.read_file = read_then_race  # type: ignore[method-assign]
        assert store.get(addr(1)) == old
        store._parts.ssd.read_file = real_read  # type: ignore[method-assign]
        assert store.get(addr(1)) == old
        assert store.stats()["put_rejected"]["conflict"] == 1
        assert store.flush() == 0
    with Store.open(cfg, background=False) as store:
        assert store.get(addr(1)) == old


def test_ram_accounts_for_the_whole_buffer_a_payload_view_keeps_alive(tmp_path: Path) -> None:
    big = os.urandom(8 * MIB)
    with Store.open(kv(tmp_path, write_through=False), background=False) as store:
        for i in range(4):
            assert store.put(addr(i), memoryview(big)[i * 4096:(i + 1) * 4096]) is PutResult.OK
        owners = {id(view.obj): len(view.obj) for i in range(4)  # type: ignore[arg-type]
                  if (view := store.get(addr(i))) is not None}
        assert sum(owners.values()) <= store.stats()["ram"]["bytes"] == 4 * 4096
        for i in range(4):
            assert store.get(addr(i)) == big[i * 4096:(i + 1) * 4096]


@pytest.mark.parametrize("mirror_pulls", [True, False])
def test_pulled_blocks_are_mirrored_only_when_configured(tmp_path: Path, mirror_pulls: bool) -> None:
    p = os.urandom(4096)
    with Store.open(kv(tmp_path, mirror_pulls=mirror_pulls), background=False) as store:
        assert store.mirror(addr(1), p, digest=b"\0" * 32) is (PutResult.DIGEST_MISMATCH if mirror_pulls
                                                                 else None)
        result = store.mirror(addr(1), p, digest=blake3.blake3(p).digest(), model="m")
        assert result is (PutResult.OK if mirror_pulls else None)
        assert (store.get(addr(1)) == p) is mirror_pulls
        assert store.lookup([addr(1)]).num_leading == int(mirror_pulls)


def test_a_block_flushed_late_is_not_expired_at_once(tmp_path: Path) -> None:
    # A write-behind block that waited in RAM (e.g. for SSD room) longer than the TTL starts its
    # SSD life when it reaches the SSD, not when it was put.
    clock = Clock()
    cfg = kv(tmp_path, write_through=False, ssd_ttl_s=100.0)
    with Store.open(cfg, background=False, clock=clock) as store:
        store.put(addr(1), b"waited in RAM")
        clock.now += 150
        assert store.flush() == 0
        assert store.run_maintenance()["ssd_evicted"] == 0
    with Store.open(cfg, background=False, clock=clock) as store:
        assert store.get(addr(1)) == b"waited in RAM"


def test_a_delete_racing_a_read_is_a_miss_not_a_lost_file(tmp_path: Path) -> None:
    cfg = kv(tmp_path, write_through=True)
    with Store.open(cfg, background=False) as store:
        store.put(addr(1), b"short-lived")
    with Store.open(cfg, background=False) as store:     # RAM empty: the get reads the file
        real_read = store._parts.ssd.read_file

        def delete_then_read(*args: Any, **kwargs: Any) -> Any:
            assert store.delete(addr(1))                   # lands after the get found the entry
            return real_read(*args, **kwargs)

        store._parts.ssd.read_file = delete_then_read  # type: ignore[method-assign]
        assert store.get(addr(1)) is None
        assert store.metrics.value("kvfabric_index_reconciled_total", action="row_without_file") == 0
        assert store.metrics.value("kvfabric_lookup_seconds_count", tier="none", outcome="miss") == 1


@pytest.mark.parametrize(("access", "evicted"), [("none", 0), ("peek", 0), ("lookup", 1), ("get", 1)])
def test_a_peek_leaves_recency_as_if_the_block_was_never_looked_at(tmp_path: Path, access: str,
                                                                   evicted: int) -> None:
    """Five files past the SSD's low-water line: maintenance drops the least recently seen one.
    Block 0 is the oldest; a peek at it leaves it the oldest, a lookup or a get saves it."""
    clock = Clock()
    store, cfg = filled_ssd(tmp_path, clock, 5, 64 * 1024, 5.5)
    with store:
        if access == "peek":
            assert store.peek([addr(0)]).tiers == (Tier.RAM,)
            assert store.lookup([addr(0)], peek=True).num_leading == 1
        elif access == "lookup":
            store.lookup([addr(0)])
        elif access == "get":
            assert store.get(addr(0)) is not None
        assert store.run_maintenance()["ssd_evicted"] == 1
    with Store.open(cfg, background=False, clock=clock) as store:    # RAM is empty: only SSD answers
        tiers = store.peek([addr(i) for i in range(5)]).tiers
        assert [i for i, t in enumerate(tiers) if t is None] == [evicted]
