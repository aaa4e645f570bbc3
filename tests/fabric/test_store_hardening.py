"""The store's promises under crashes, races and full disks, each as a test on real stores: real
processes killed with SIGKILL, real threads racing close(), real full-disk errors (RLIMIT_FSIZE; a
small tmpfs where one can be mounted), real files and RocksDB. Every payload is random bytes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest
from testkit import wait_until

from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store, StoreClosedError
from fabric.tiers.ssd_format import HEADER_SIZE

KIB = 1 << 10
GIB = 1 << 30
REPO = Path(__file__).resolve().parents[2]


def kv(root: Path, **overrides: Any) -> KVConfig:
    base: dict[str, Any] = dict(ssd_dir=str(root / "ssd"), index_dir=str(root / "index"),
                                ram_gib=8192 * KIB / GIB, ssd_gib=65536 * KIB / GIB, eviction_interval_s=0.05)
    base.update(overrides)
    return KVConfig(**base)


def addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"hard" + i.to_bytes(8, "little")).digest()), layer)


# ---- a crash during an overwrite must not lose the acknowledged payload ------------------

CRASH_CHILD = textwrap.dedent("""
    import os, random, sys
    import blake3
    from fabric.config import KVConfig
    from fabric.keys import BlockAddress, BlockHash
    from fabric.store import Store, PutResult
    root, write_through, seed = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    rng = random.Random(seed)
    cfg = KVConfig(ssd_dir=root + "/ssd", index_dir=root + "/index", ram_gib=64 / 1024, ssd_gib=1.0,
                   write_through=write_through, eviction_interval_s=0.01)
    log = open(root + "/acked.log", "a", buffering=1)
    store = Store.open(cfg)
    i = 0
    while True:
        n = rng.randrange(12)                      # about half the puts hit a key already put
        a = BlockAddress(BlockHash(blake3.blake3(b"k%d" % n).digest()), 0)
        payload = os.urandom(rng.choice([1, 7, 64, 300]) * 1024)
        result = store.put(a, payload)
        if write_through and result is PutResult.OK:
            log.write(f"{n} {blake3.blake3(payload).hexdigest()}\\n")
        if not write_through and result is PutResult.OK:
            pending = (n, blake3.blake3(payload).hexdigest())
            if store.flush() == 0:                 # on SSD now: acknowledged as durable
                log.write(f"{pending[0]} {pending[1]}\\n")
        i += 1
        print(i, flush=True)                       # one line per put: the parent kills after some
""")


@pytest.mark.parametrize("write_through", [True, False])
def test_sigkill_during_overwrites_keeps_every_acknowledged_payload(tmp_path: Path, write_through: bool) -> None:
    script = tmp_path / "child.py"
    script.write_text(CRASH_CHILD)
    rng = random.Random(12)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for round_ in range(6):
        child = subprocess.Popen([sys.executable, str(script), str(tmp_path), "1" if write_through else "0",
                                  str(round_)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert child.stdout is not None
        try:
            for _ in range(rng.randrange(1, 100)):     # kill it mid-run, after a random number of puts
                if not child.stdout.readline():
                    break
        finally:
            child.send_signal(signal.SIGKILL)
        _, err = child.communicate()
        assert child.returncode == -signal.SIGKILL, err[-2000:]
        first: dict[int, str] = {}
        for line in (tmp_path / "acked.log").read_text().splitlines():
            key_no, key_digest = line.split()
            first.setdefault(int(key_no), key_digest)
        with Store.open(kv(tmp_path, ram_gib=64 / 1024, ssd_gib=1.0), background=False) as store:
            for n, digest in first.items():
                a = BlockAddress(BlockHash(blake3.blake3(b"k%d" % n).digest()), 0)
                got = store.get(a)
                assert got is not None, f"round {round_}: acknowledged key {n} lost"
                assert blake3.blake3(got).hexdigest() == digest, f"round {round_}: key {n} serves other bytes"


# ---- no stale read after an acknowledged overwrite ----------------------------------------

def test_a_second_payload_for_a_held_address_is_refused_and_never_served(tmp_path: Path) -> None:
    small, large = os.urandom(4 * KIB), os.urandom(600 * KIB)
    # RAM fits the small payload but not the large one (the old stale-read trigger).
    with Store.open(kv(tmp_path, write_through=True, ram_gib=512 * KIB / GIB), background=False) as store:
        assert store.put(addr(1), small) is PutResult.OK
        assert store.put(addr(1), large) is PutResult.CONFLICT
        assert store.put(addr(1), small) is PutResult.OK          # the same bytes again are fine
        assert bytes(store.get(addr(1)) or b"") == small
        assert store.stats()["put_rejected"]["conflict"] == 1
        assert store.delete(addr(1))
        assert store.put(addr(1), large) is PutResult.OK          # a deleted address is free again
        assert bytes(store.get(addr(1)) or b"") == large


# ---- close() while other threads put ----------------------------------------------

@pytest.mark.parametrize("write_through", [True, False])
def test_close_racing_puts_of_different_payloads_loses_and_replaces_nothing(tmp_path: Path,
                                                                           write_through: bool) -> None:
    for round_ in range(4):
        root = tmp_path / str(round_)
        store = Store.open(kv(root, write_through=write_through))
        acked: dict[int, set[str]] = {}
        failures: list[BaseException] = []
        lock = threading.Lock()

        def writer(seed: int, store: Store = store, acked: dict[int, set[str]] = acked,
                   failures: list[BaseException] = failures, lock: threading.Lock = lock) -> None:
            rng = random.Random(seed)
            try:
                while True:
                    n = rng.randrange(40)              # four threads, the same 40 keys, different bytes
                    payload = os.urandom(rng.choice([2, 16, 96]) * KIB)
                    if store.put(addr(n), payload) is PutResult.OK:
                        with lock:
                            acked.setdefault(n, set()).add(blake3.blake3(payload).hexdigest())
            except StoreClosedError:
                return
            except BaseException as e:   # anything else is the bug this test looks for
                failures.append(e)

        threads = [threading.Thread(target=writer, args=(round_ * 10 + t,)) for t in range(4)]
        for t in threads:
            t.start()
        # close() once the writers are under way: some puts acknowledged
        wait_until(lambda acked=acked, failures=failures: len(acked) >= 8 or bool(failures),
                   "the writers' first acknowledged puts", 30, poll_s=0.005)
        start = time.monotonic()
        report = store.close()
        close_s = time.monotonic() - start
        for t in threads:
            t.join(5)
        assert not any(t.is_alive() for t in threads), "a writer kept getting answers after close()"
        assert failures == [], failures
        assert close_s < 5, f"close() took {close_s:.1f} s while writers kept putting"
        assert report.errors == () and report.num_calls_abandoned == 0
        assert all(len(digests) == 1 for digests in acked.values()), "an address acknowledged two payloads"
        unflushed = set(report.unflushed)
        with Store.open(kv(root, write_through=write_through), background=False) as again:
            for n, digests in acked.items():
                if addr(n) in unflushed:
                    continue
                got = again.get(addr(n))
                assert got is not None, f"round {round_}: acknowledged key {n} lost"
                assert blake3.blake3(got).hexdigest() in digests
        assert not unflushed, "nothing stopped this flush, so nothing may be reported lost"


def test_calls_after_close_raise_store_closed_error_and_close_is_idempotent(tmp_path: Path) -> None:
    store = Store.open(kv(tmp_path))
    assert store.put(addr(1), b"x" * 100) is PutResult.OK
    report = store.close()
    assert report.clean and store.close() is report
    for call in (lambda: store.put(addr(2), b"y"), lambda: store.get(addr(1)), lambda: store.lookup([addr(1)]),
                 lambda: store.delete(addr(1)), store.flush, store.run_maintenance):
        with pytest.raises(StoreClosedError):
            call()
    assert store.held_addresses() == [addr(1)]      # drainable after close
    assert store.stats()["state"] == "closed"


# ---- a full disk in write-behind mode ------------------------------------------------------

FULL_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    import blake3
    from fabric.config import KVConfig
    from fabric.keys import BlockAddress, BlockHash
    from fabric.store import Store, PutResult
    root = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of death past RLIMIT_FSIZE
    cfg = KVConfig(ssd_dir=root + "/ssd", index_dir=root + "/index", ram_gib=2 / 1024, ram_high_water=1.25,
                   ssd_gib=1.0, write_through=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    def a(i): return BlockAddress(BlockHash(blake3.blake3(b"f%d" % i).digest()), 0)
    out = {}
    store = Store.open(cfg, background=False)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, hard))   # block files are 260 KiB: all refused
    results = [store.put(a(i), os.urandom(256 * 1024)).value for i in range(16)]
    out["pending_after_flush"] = store.flush()
    out["disk_full"] = store.stats()["disk_full"]
    results += [store.put(a(i), os.urandom(256 * 1024)).value for i in range(16, 20)]
    out["results"] = results
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))          # room returns
    out["pending_after_room"] = store.flush()
    out["report_1"] = store.close().clean
    with Store.open(cfg, background=False) as again:
        out["present_after_room"] = [again.get_block(a(i), promote=False) is not None for i in range(20)]
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, hard))
        extra = [again.put(a(100 + i), os.urandom(256 * 1024)).value for i in range(3)]
        report = again.close()
    out["extra"] = extra
    out["unflushed"] = sorted(x.hash.hex() for x in report.unflushed)
    out["expected_unflushed"] = sorted(a(100 + i).hash.hex() for i in range(3))
    out["report_errors"] = list(report.errors)
    with Store.open(cfg, background=False) as third:                   # the index lock was released
        out["reopened_in_process"] = True
    print(json.dumps(out))
""")


def test_full_disk_in_write_behind_keeps_acknowledged_blocks_and_the_store_restartable(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(FULL_CHILD)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    out = json.loads(done.stdout.decode().splitlines()[-1])
    ok = out["results"].count("ok")
    assert 0 < ok < 20 and out["pending_after_flush"] == ok and out["disk_full"]
    # The first put that finds RAM full of pinned blocks tries to flush them for its room, learns
    # that the disk is full and answers NO_SPACE, as every put after it does.
    assert set(out["results"][:16]) == {"ok", "no_space"} and out["results"][16:] == ["no_space"] * 4
    assert out["pending_after_room"] == 0 and out["report_1"]
    assert out["present_after_room"] == [r == "ok" for r in out["results"]]
    assert out["extra"] == ["ok"] * 3
    assert out["unflushed"] == out["expected_unflushed"]        # reported, not only logged
    assert out["reopened_in_process"]
    with Store.open(kv(tmp_path, ram_gib=2 / 1024, ssd_gib=1.0), background=False) as store:   # another process
        assert sum(store.get(BlockAddress(BlockHash(blake3.blake3(b"f%d" % i).digest()), 0)) is not None
                   for i in range(20)) == ok


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs of our own, so the disk really fills (ENOSPC from the kernel, RocksDB included)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_really_full_tmpfs_in_write_behind_is_a_state_not_a_crash(small_tmpfs: Path) -> None:
    payloads: dict[int, bytes] = {}
    cfg = kv(small_tmpfs, write_through=False, ram_gib=8 * 1024 * KIB / GIB, ram_high_water=1.25)
    store = Store.open(cfg, background=False)
    for i in range(16):   # 4 MiB of acknowledged write-behind blocks for a 3 MiB disk
        payloads[i] = os.urandom(256 * KIB)
        assert store.put(addr(i), payloads[i]) is PutResult.OK
    pending = store.flush()
    assert 0 < pending < 16 and store.stats()["disk_full"]
    later = [store.put(addr(100 + i), os.urandom(256 * KIB)) for i in range(40)]
    assert PutResult.NO_SPACE in later and set(later) <= {PutResult.OK, PutResult.NO_SPACE}
    payloads.update({100 + i: b"" for i, r in enumerate(later) if r is PutResult.OK})  # bytes not checked
    report = store.close()   # a result, not an exception, on a full disk
    lost = {a.hash for a in report.unflushed}
    assert lost and lost <= {addr(i).hash for i in payloads}, "close must name the blocks it could not flush"
    with Store.open(cfg, background=False) as again:   # the index lock was released; it opens on a full disk
        for i, payload in payloads.items():
            got = again.get(addr(i))
            if addr(i).hash in lost:
                assert got is None
            else:
                assert got is not None and (not payload or bytes(got) == payload), f"block {i} lost or wrong"
        subprocess.run(["mount", "-o", "remount,size=32m", str(small_tmpfs)], check=True)   # room returns
        assert again.put(addr(500), payloads[0]) is PutResult.OK
        assert again.flush() == 0 and not again.stats()["disk_full"]
    with Store.open(cfg, background=False) as third:
        assert bytes(third.get(addr(500)) or b"") == payloads[0]


# ---- the header padding is checked ----------------------------------------------------------

def test_a_flipped_byte_in_the_header_padding_is_corruption(tmp_path: Path) -> None:
    payload = os.urandom(8 * KIB)
    with Store.open(kv(tmp_path, write_through=True, ram_gib=1 * KIB / GIB), background=False) as store:
        assert store.put(addr(1), payload) is PutResult.OK
        path = next((tmp_path / "ssd").rglob("*.kvb"))
        with open(path, "r+b") as f:
            f.seek(2000)
            f.write(b"\x01")
        assert 128 < 2000 < HEADER_SIZE
        assert store.get(addr(1)) is None
        assert store.stats()["corrupt_blocks"]["ssd"] == 1


# ---- the durability order, recorded --------------------------------------------------------
# A power cut cannot be caused here (SIGKILL keeps the page cache, so a crash test passes with
# durable = false too). This test is the honest substitute: it wraps the real calls (they still run)
# and records their order; a change of the fdatasync -> rename -> folder fsync -> synced row order fails it.

@pytest.mark.parametrize(("write_through", "durable"), [(True, True), (False, True), (True, False)])
def test_commit_order_is_fdatasync_rename_folder_fsync_then_synced_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       write_through: bool, durable: bool) -> None:
    import fabric.tiers.ssd as ssd_module
    import fabric.tiers.sync as sync_module
    from fabric.index import Index

    calls: list[tuple[str, str]] = []
    real_fdatasync, real_replace, real_fsync_folder = os.fdatasync, os.replace, ssd_module.fsync_folder
    real_put_many = Index.put_many

    def fdatasync(fd: int) -> None:
        calls.append(("fdatasync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fdatasync(fd)

    def replace(src: Any, dst: Any) -> None:
        calls.append(("rename", str(dst)))
        real_replace(src, dst)

    def fsync_folder(folder: Path) -> None:
        calls.append(("fsync_folder", str(folder)))
        real_fsync_folder(folder)

    def put_many(self: Index, rows: Any, *, sync: bool = True) -> None:
        rows = list(rows)
        calls.append(("row_synced" if sync else "row", ",".join(k.hex()[:16] for k, _ in rows)))
        real_put_many(self, rows, sync=sync)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(ssd_module, "fsync_folder", fsync_folder)
    monkeypatch.setattr(sync_module, "fsync_folder", fsync_folder)   # what try_fsync_folder calls
    monkeypatch.setattr(Index, "put_many", put_many)
    with Store.open(kv(tmp_path, write_through=write_through, durable=durable), background=False) as store:
        calls.clear()
        assert store.put_many([(addr(1), os.urandom(KIB)), (addr(2), os.urandom(KIB))]) == [PutResult.OK] * 2
        calls.append(("put_returned", ""))
        if not write_through:
            assert store.flush() == 0
            calls.append(("flushed", ""))
    kinds = [kind for kind, _ in calls]
    end = "put_returned" if write_through else "flushed"
    names = {addr(i).storage_key.hex()[:16] for i in (1, 2)}
    if not durable:
        assert "fdatasync" not in kinds and "fsync_folder" not in kinds and "row_synced" not in kinds
        return
    rows_at = kinds.index("row_synced")
    assert set(calls[rows_at][1].split(",")) == names                  # one group commit, one synced batch
    for name in names:
        synced = next(i for i, (k, p) in enumerate(calls) if k == "fdatasync" and name in p)
        renamed = next(i for i, (k, p) in enumerate(calls) if k == "rename" and name in p)
        folder = str(Path(calls[renamed][1]).parent)
        folder_synced = next(i for i, (k, p) in enumerate(calls) if k == "fsync_folder" and p == folder)
        assert synced < renamed < folder_synced < rows_at < kinds.index(end), calls


@pytest.mark.skipif(not __import__("fabric.tiers.sync", fromlist=["x"]).syncfs_supported(),
                    reason="syncfs group commit needs Linux 5.8+ (elsewhere batches sync file by file)")
@pytest.mark.parametrize("write_through", [True, False])
def test_batch_commit_order_is_data_syncfs_rename_names_syncfs_then_synced_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_through: bool) -> None:
    """A batch of GROUP_SYNC_MIN+ files is made durable with two syncfs calls instead of one
    fdatasync per file and one fsync per folder: every temp file is written before the first
    syncfs (their bytes), every rename falls between the two (a final name only ever points at
    durable bytes), and the index row is written synced after the second (the names)."""
    import fabric.tiers.ssd as ssd_module
    from fabric.index import Index
    from fabric.tiers.ssd import GROUP_SYNC_MIN

    calls: list[tuple[str, str]] = []
    real_replace, real_syncfs, real_write_temp = os.replace, ssd_module.syncfs, ssd_module.SsdTier._write_temp
    real_put_many = Index.put_many

    def write_temp(self: Any, item: Any, *, sync: bool) -> tuple[Path, Path]:
        temp, final = real_write_temp(self, item, sync=sync)
        calls.append(("written" if not sync else "written_synced", final.name))
        return temp, final

    def replace(src: Any, dst: Any) -> None:
        calls.append(("rename", Path(dst).name))
        real_replace(src, dst)

    def syncfs(path: Path) -> None:
        calls.append(("syncfs", str(path)))
        real_syncfs(path)

    def put_many(self: Index, rows: Any, *, sync: bool = True) -> None:
        rows = list(rows)
        calls.append(("row_synced" if sync else "row", str(len(rows))))
        real_put_many(self, rows, sync=sync)

    monkeypatch.setattr(ssd_module.SsdTier, "_write_temp", write_temp)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(ssd_module, "syncfs", syncfs)
    monkeypatch.setattr(Index, "put_many", put_many)
    n = GROUP_SYNC_MIN + 4
    with Store.open(kv(tmp_path, write_through=write_through), background=False) as store:
        calls.clear()
        assert store.put_many([(addr(i), os.urandom(KIB)) for i in range(n)]) == [PutResult.OK] * n
        if not write_through:
            assert store.flush() == 0
        kinds = [kind for kind, _ in calls]
        assert kinds.count("written") == n and "written_synced" not in kinds   # no per-file fdatasync
        first, second = [i for i, k in enumerate(kinds) if k == "syncfs"]
        assert max(i for i, k in enumerate(kinds) if k == "written") < first
        renames = [i for i, k in enumerate(kinds) if k == "rename"]
        assert len(renames) == n and first < min(renames) and max(renames) < second
        assert kinds.index("row_synced") > second and calls[kinds.index("row_synced")][1] == str(n)
    with Store.open(kv(tmp_path), background=False) as reopened:   # and every block is there
        assert all(reopened.get(addr(i)) is not None for i in range(n))


@pytest.mark.skipif(not __import__("fabric.tiers.sync", fromlist=["x"]).syncfs_supported(),
                    reason="syncfs group commit needs Linux 5.8+ (elsewhere batches sync file by file)")
@pytest.mark.parametrize("failing_call", [1, 2])
def test_a_failed_batch_syncfs_commits_nothing_of_the_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            failing_call: int) -> None:
    """A writeback error reported by syncfs (EIO from the disk: cannot be caused here, so the call
    is replaced by one that raises on its `failing_call`-th use) fails every put of the batch with
    IO_ERROR and leaves neither a temp file nor a final file nor a row behind; a later put works."""
    import errno as errno_module

    import fabric.tiers.ssd as ssd_module
    from fabric.tiers.ssd import GROUP_SYNC_MIN

    real_syncfs, seen = ssd_module.syncfs, [0]

    def syncfs(path: Path) -> None:
        seen[0] += 1
        if seen[0] == failing_call:
            raise OSError(errno_module.EIO, "syncfs: Input/output error")
        real_syncfs(path)

    monkeypatch.setattr(ssd_module, "syncfs", syncfs)
    n = GROUP_SYNC_MIN
    with Store.open(kv(tmp_path, write_through=True), background=False) as store:
        assert store.put_many([(addr(i), os.urandom(KIB)) for i in range(n)]) == [PutResult.IO_ERROR] * n
        assert all(store.get(addr(i)) is None for i in range(n))
        leftovers = [p.name for p in (tmp_path / "ssd").rglob("*") if p.is_file() and not p.name.startswith(".o_")]
        assert leftovers == []
        assert store.put_many([(addr(100 + i), os.urandom(KIB)) for i in range(n)]) == [PutResult.OK] * n
    with Store.open(kv(tmp_path), background=False) as reopened:
        assert all(reopened.get(addr(i)) is None for i in range(n))
        assert all(reopened.get(addr(100 + i)) is not None for i in range(n))
