"""Failure behaviour with real files and processes: SIGKILL mid-write, bit flips, truncation,
a full SSD budget, a real EFBIG from the kernel, restarts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import blake3

from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store
from fabric.tiers.base import Tier

MIB = 1 << 20
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def address(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"fail-block-%d" % i).digest()), i % 4)


def payload(i: int) -> bytes:
    """Deterministic, incompressible, 16 KiB .. 528 KiB: the parent recomputes what the child wrote."""
    return blake3.blake3(b"fail-payload-%d" % i).digest(length=16 * 1024 + (i * 37 % 32) * 16 * 1024)


def kv(root: Path, **overrides: Any) -> KVConfig:
    base: dict[str, Any] = dict(ssd_dir=str(root / "ssd"), index_dir=str(root / "index"), ram_gib=0.25,
                                ssd_gib=1.0, write_through=True, durable=True)
    base.update(overrides)
    return KVConfig(**base)


def files_under(root: Path) -> list[Path]:
    return [p for p in (root / "ssd").rglob("*") if p.is_file()]


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_store_failures import address, kv, payload
    from fabric.store import PutResult, Store
    store = Store.open(kv(Path(sys.argv[1])), background=False)
    i = int(sys.argv[3])
    while True:
        if store.put(address(i), payload(i), model="m") is PutResult.OK:
            print(i, flush=True)          # acknowledged: the file and its row are fsynced
        i += 1
""")


def run_writer_and_kill(root: Path, start: int, num_acks: int, delay_s: float) -> list[int]:
    """Start a writer, SIGKILL it `delay_s` after its num_acks-th acknowledgement; return every ack."""
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(Path(__file__).parent), str(start)],
                             stdout=subprocess.PIPE, cwd=REPO)
    assert child.stdout is not None
    acked: list[int] = []
    try:
        for line in child.stdout:
            acked.append(int(line))
            if len(acked) >= num_acks:
                time.sleep(delay_s)        # land somewhere inside a later put
                break
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    rest = child.stdout.read()
    acked += [int(x) for x in rest.split(b"\n")[:-1]]   # complete lines only: printed after put returned
    assert child.returncode == -signal.SIGKILL
    assert len(acked) >= num_acks, "the writer died before it acknowledged enough blocks"
    return acked


def test_sigkill_mid_stream_loses_nothing_acknowledged_and_serves_nothing_torn(tmp_path: Path) -> None:
    acked: list[int] = []
    start = 0
    for delay_s in (0.0, 0.0017, 0.0041):   # three kills at different points of a put
        acked += run_writer_and_kill(tmp_path, start, 60, delay_s)
        start = max(acked) + 30              # skip past whatever was in flight
        with Store.open(kv(tmp_path), background=False) as store:
            for i in acked:
                block = store.get_block(address(i))
                assert block is not None, f"acknowledged block {i} lost"
                assert bytes(block.payload) == payload(i)
            # Whatever was in flight is either absent or complete and verified, never torn.
            for i in range(max(acked) + 1, start):
                got = store.get(address(i))
                assert got is None or got == payload(i)
            stats = store.stats()
            assert stats["corrupt_blocks"]["ssd"] == 0
            assert stats["ssd"]["blocks"] == len(files_under(tmp_path))   # every file has its row
            assert not [p for p in files_under(tmp_path) if p.name.endswith(".tmp")]


def corrupt_file_of(store: Store, root: Path, i: int) -> Path:
    key = address(i).storage_key
    return root / "ssd" / f"{key[0]:02x}" / f"{key.hex()[:16]}-{address(i).layer}.kvb"


def test_flipped_bit_is_detected_counted_removed_and_never_returned(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        store.put(address(1), payload(1))
        store.put(address(2), payload(2))
        path = corrupt_file_of(store, tmp_path, 1)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(raw)

    with Store.open(kv(tmp_path), background=False) as store:
        assert store.lookup([address(1)]).tiers == (Tier.SSD,)     # same size: looks fine on open
        assert store.get(address(1)) is None
        assert store.metrics.value("kvfabric_corrupt_blocks_total", tier="ssd") == 1
        assert store.metrics.value("kvfabric_lookup_seconds_count", tier="ssd", outcome="corrupt") == 1
        assert not path.exists()
        assert store.lookup([address(1)]).tiers == (None,)
        assert store.get(address(2)) == payload(2)                   # its neighbour is unaffected
    with Store.open(kv(tmp_path), background=False) as store:
        assert store.get(address(1)) is None and store.reconciled["row_without_file"] == 0


def test_truncated_file_is_caught_on_read_and_at_open(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        for i in (1, 2):
            store.put(address(i), payload(i))
    with Store.open(kv(tmp_path), background=False) as store:
        os.truncate(corrupt_file_of(store, tmp_path, 1), 5000)        # behind the running store's back
        assert store.get(address(1)) is None
        assert store.stats()["corrupt_blocks"]["ssd"] == 1
    os.truncate(corrupt_file_of(store, tmp_path, 2), 5000)            # while no store runs
    with Store.open(kv(tmp_path), background=False) as store:
        assert store.reconciled["size_mismatch"] == 1
        assert store.get(address(2)) is None
        assert files_under(tmp_path) == []


def test_a_full_ssd_budget_makes_room_for_puts_and_refuses_only_what_can_never_fit(tmp_path: Path) -> None:
    # Write-through: the SSD budget (ssd_gib) is 1 MiB; older files give way to newer ones.
    with Store.open(kv(tmp_path, ssd_gib=MIB / GIB), background=False) as store:
        results = [store.put(address(i), payload(i)) for i in range(12)]
        assert results == [PutResult.OK] * 12
        stats = store.stats()
        assert stats["ssd"]["bytes"] <= MIB and stats["evictions"]["ssd"] > 0
        assert store.get(address(11)) == payload(11)
        assert store.put(address(99), os.urandom(2 * MIB)) is PutResult.FULL     # larger than the budget
        assert store.stats()["put_rejected"]["full"] == 1
        assert store.stats()["ssd"] == stats["ssd"]                            # and it evicted nothing
        assert store.get(address(11)) == payload(11)
    # Write-behind: RAM and SSD both make room; nothing is left pinned, reads go on.
    cfg = kv(tmp_path / "wb", ssd_gib=MIB / GIB, write_through=False, ram_gib=4 * MIB / GIB)
    with Store.open(cfg, background=False) as store:
        results = [store.put(address(i), payload(i)) for i in range(40)]
        assert results == [PutResult.OK] * 40
        assert store.flush() == 0
        assert store.stats()["ssd"]["bytes"] <= MIB
        assert store.get(address(39)) == payload(39)


FSIZE_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_store_failures import address, kv, payload
    from fabric.store import Store
    root = Path(sys.argv[1])
    Store.open(kv(root), background=False).close()          # create the index before the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    out = {}
    with Store.open(kv(root), background=False) as store:
        out["small"] = store.put(address(0), payload(0)).value       # 16 KiB: fits
        out["big"] = store.put(address(2), payload(2)).value         # 176 KiB + header: fits
        out["too_big"] = store.put(address(5), payload(5)).value     # 416 KiB: EFBIG from the kernel
        out["read_small"] = store.get(address(0)) == payload(0)
        out["read_big"] = store.get(address(2)) == payload(2)
        out["small_after"] = store.put(address(32), payload(32)).value
        out["stats"] = store.stats()["put_rejected"]
    with Store.open(kv(root / "wb", write_through=False), background=False) as store:
        out["wb_put"] = store.put(address(5), payload(5)).value
        out["wb_pending"] = store.flush()
        out["wb_read"] = store.get(address(5)) == payload(5)
    print(json.dumps(out))
""")


def test_a_real_file_size_limit_fails_puts_with_no_space_and_reads_go_on(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel answer EFBIG past 256 KiB per file: a real refusal, no mock.
    done = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, cwd=REPO, timeout=120, check=True)
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["small"] == out["big"] == out["small_after"] == "ok"
    assert out["too_big"] == "no_space"
    assert out["read_small"] and out["read_big"]
    assert out["stats"]["no_space"] == 1
    assert out["wb_put"] == "ok" and out["wb_pending"] == 1 and out["wb_read"]
    assert not [p for p in files_under(tmp_path) if p.name.endswith(".tmp")]


def test_restart_serves_every_durable_block(tmp_path: Path) -> None:
    with Store.open(kv(tmp_path), background=False) as store:
        assert all(r.ok for r in store.put_many([(address(i), payload(i)) for i in range(24)]))
    with Store.open(kv(tmp_path), background=False) as store:
        assert store.lookup([address(i) for i in range(24)]).num_leading == 24
        for i in range(24):
            block = store.get_block(address(i))
            assert block is not None and block.tier is Tier.SSD and bytes(block.payload) == payload(i)
        assert sum(store.reconciled.values()) == 0
