"""Tiered store: lookup latency and get / put throughput per tier, beside plain-Python baselines.

Workload: random (incompressible) payloads of 64 KiB and 1 MiB, one (block, layer) each.

    put     write-through, durable: every put_many of 16 blocks returns after its files, their
            folders and the index WAL are fsynced (one group commit). Baseline, interleaved batch
            by batch: the same files written by plain Python with the same durability (temp file,
            fdatasync, rename, one folder fsync per batch), no hashing, no index. Also reported:
            single puts (no batching) and `dd`-style sequential write + one fsync of one big file.
    RAM     get_block of a RAM-resident block (storage key hash, lock, CLOCK bit, frequency, metrics)
            vs a plain `dict.get` on the precomputed storage key, sample by sample interleaved.
    SSD     get_block(promote=False) after a restart (RAM empty), page cache bypassed with
            O_DIRECT (or dropped with posix_fadvise(DONTNEED) where O_DIRECT is refused), digest
            verified, vs a plain read of a same-sized file through the same cache bypass, no
            verification, interleaved sample by sample.

Reference SLOs (from the tiering daemon we learn from): RAM lookup < 200 us, SSD < 5 ms.
The table's thresholds column: ram_lookup_p99_us < 20, ssd_get_p99_ms_1mib < 2, ssd_put_mb_s >= 500.
The disk is shared: fsync latency on it varies run to run; the raw figures beside ours say how
much of a put is the disk.

Last stdout line: JSON with ram_lookup_p99_us, ssd_get_p99_ms_1mib, ssd_put_mb_s, dict_lookup_p99_us,
file_read_p99_ms_1mib and the other figures of the table.
"""

from __future__ import annotations

import argparse
import logging
import mmap
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import emit_json, percentile, print_table
from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.store import PutResult, Store
from fabric.tiers.base import Tier
from fabric.tiers.sync import fsync_folder

logger = logging.getLogger(__name__)

KIB, MIB = 1 << 10, 1 << 20
SIZES = {"64kib": 64 * KIB, "1mib": MIB}
SLO = {"ram_lookup_us": 200.0, "ssd_get_ms": 5.0}
BOUND = {"ram_lookup_p99_us": 20.0, "ssd_get_p99_ms_1mib": 2.0, "ssd_put_mb_s": 500.0}
BATCH = 16


def address(size_name: str, i: int) -> BlockAddress:
    return BlockAddress(BlockHash(f"{size_name}-{i}".encode().ljust(32, b".")), i % 32)


def random_address() -> BlockAddress:
    return BlockAddress(BlockHash(os.urandom(32)), 0)


def config(root: Path) -> KVConfig:
    return KVConfig(ssd_dir=str(root / "ssd"), index_dir=str(root / "index"), ram_gib=2.0, ssd_gib=32.0,
                    write_through=True, durable=True, o_direct=True, io_threads=4)


# --------------------------------------------------------------------------- baselines
def raw_write_batch(folder: Path, names: list[str], payloads: list[bytes]) -> None:
    """Plain files with the store's durability: temp + fdatasync + rename, one folder fsync."""
    for name, payload in zip(names, payloads, strict=True):
        temp = folder / f".{name}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, payload)
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        os.replace(temp, folder / name)
    fsync_folder(folder)


def raw_read(path: Path, size: int, direct: bool) -> memoryview:
    """Read a whole file bypassing the page cache, no verification: the floor for an SSD get."""
    if direct:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, -(-size // 4096) * 4096)
            n = os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        return memoryview(buf)[:n]
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, size)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return memoryview(data)


def sequential_fsync_mb_s(folder: Path, total: int) -> float:
    """`dd conv=fsync`-style: one file, 1 MiB writes, one fsync at the end."""
    chunk = os.urandom(MIB)
    start = time.perf_counter()
    fd = os.open(folder / "seq.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(total // MIB):
            os.write(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    (folder / "seq.bin").unlink()
    return total / MIB / seconds


# --------------------------------------------------------------------------- phases
def bench_puts(store: Store, raw_dir: Path, name: str, size: int, count: int,
               bar: tqdm) -> tuple[list[BlockAddress], dict[str, float]]:  # type: ignore[type-arg]
    addresses = [address(name, i) for i in range(count)]
    store_s = raw_s = 0.0
    for start in range(0, count, BATCH):
        batch = addresses[start:start + BATCH]
        payloads = [os.urandom(size) for _ in batch]
        t0 = time.perf_counter()
        results = store.put_many(list(zip(batch, payloads, strict=True)))
        t1 = time.perf_counter()
        raw_write_batch(raw_dir, [f"{name}-{start + j}" for j in range(len(batch))], payloads)
        t2 = time.perf_counter()
        if any(r is not PutResult.OK for r in results):
            raise RuntimeError(f"put_many refused: {set(results)}")
        store_s += t1 - t0
        raw_s += t2 - t1
        bar.update(len(batch))
    num_mb = count * size / MIB
    singles = [random_address() for _ in range(min(16, count))]
    t0 = time.perf_counter()
    for a in singles:
        store.put(a, os.urandom(size))
    single_s = time.perf_counter() - t0
    return addresses, {"put_mb_s": num_mb / store_s, "raw_put_mb_s": num_mb / raw_s,
                       "single_put_mb_s": len(singles) * size / MIB / single_s}


def interleaved(ours: Callable[[], object], baseline: Callable[[], object],
                samples: int) -> tuple[list[float], list[float]]:
    a: list[float] = []
    b: list[float] = []
    clock = time.perf_counter_ns
    for _ in range(samples):
        t0 = clock()
        ours()
        t1 = clock()
        baseline()
        t2 = clock()
        a.append((t1 - t0) / 1e3)
        b.append((t2 - t1) / 1e3)
    return a, b


def bench_ram(store: Store, addresses: list[BlockAddress], samples: int) -> dict[str, float]:
    plain = {a.storage_key: memoryview(b"x") for a in addresses}
    order = [random.choice(addresses) for _ in range(samples)]
    it_ours, it_base = iter(order * 2), iter(order * 2)

    def ours() -> None:
        block = store.get_block(next(it_ours))
        if block is None or block.tier is not Tier.RAM:
            raise RuntimeError("expected a RAM hit")

    def base() -> None:
        plain.get(next(it_base).storage_key)

    interleaved(ours, base, samples // 10)                 # warm-up
    ours_us, base_us = interleaved(ours, base, samples)
    presence = [random.choice(addresses) for _ in range(samples // 4)]
    lookup_us = []
    for a in presence:
        t0 = time.perf_counter_ns()
        store.lookup([a])
        lookup_us.append((time.perf_counter_ns() - t0) / 1e3)
    num_bytes = 0
    start = time.perf_counter()
    for a in addresses[:64]:
        block = store.get_block(a)
        num_bytes += block.payload.nbytes if block is not None else 0
    gb_s = num_bytes / (time.perf_counter() - start) / 1e9
    return {"get_p50_us": percentile(ours_us, 50), "get_p99_us": percentile(ours_us, 99),
            "dict_p50_us": percentile(base_us, 50), "dict_p99_us": percentile(base_us, 99),
            "lookup_p99_us": percentile(lookup_us, 99), "get_gb_s": gb_s}


def bench_ssd(store: Store, raw_dir: Path, name: str, size: int, addresses: list[BlockAddress],
              rounds: int, direct: bool) -> dict[str, float]:
    files = [raw_dir / f"{name}-{i}" for i in range(len(addresses))]
    picks = [random.randrange(len(addresses)) for _ in range(rounds)]
    it_ours, it_base = iter(picks), iter(picks)

    def ours() -> None:
        block = store.get_block(addresses[next(it_ours)], promote=False)
        if block is None or block.tier is not Tier.SSD:
            raise RuntimeError("expected an SSD hit")

    def base() -> None:
        raw_read(files[next(it_base)], size, direct)

    ours_us, base_us = interleaved(ours, base, rounds)
    lookup_us = []
    for i in range(20 * len(addresses)):
        a = addresses[i % len(addresses)]
        t0 = time.perf_counter_ns()
        store.lookup([a])
        lookup_us.append((time.perf_counter_ns() - t0) / 1e3)
    lookup_us = lookup_us[len(addresses):]           # the first pass is warm-up
    mb = rounds * size / MIB
    return {"get_p50_ms": percentile(ours_us, 50) / 1e3, "get_p99_ms": percentile(ours_us, 99) / 1e3,
            "file_p50_ms": percentile(base_us, 50) / 1e3, "file_p99_ms": percentile(base_us, 99) / 1e3,
            "get_mb_s": mb / (sum(ours_us) / 1e6), "file_mb_s": mb / (sum(base_us) / 1e6),
            "lookup_p99_us": percentile(lookup_us, 99)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds, for the smoke test")
    parser.add_argument("--dir", help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    random.seed(args.seed)
    counts = {"64kib": 64, "1mib": 32} if args.quick else {"64kib": 512, "1mib": 192}
    ram_samples = 2_000 if args.quick else 40_000
    ssd_rounds = {"64kib": 100, "1mib": 50} if args.quick else {"64kib": 1_500, "1mib": 600}
    root = Path(tempfile.mkdtemp(prefix="kvfabric-bench-", dir=args.dir))
    raw_dir = root / "raw"
    raw_dir.mkdir()
    out: dict[str, dict[str, float]] = {}
    try:
        with tqdm(total=sum(counts.values()), desc="put", unit="block", file=sys.stderr) as bar, \
                Store.open(config(root), background=False) as store:
            written = {}
            for name, size in SIZES.items():
                written[name], out[f"put_{name}"] = bench_puts(store, raw_dir, name, size, counts[name], bar)
            out["ram"] = bench_ram(store, written["64kib"] + written["1mib"], ram_samples)
        seq_mb_s = sequential_fsync_mb_s(raw_dir, (64 if args.quick else 256) * MIB)
        with Store.open(config(root), background=False) as store:       # restart: RAM is empty
            direct = bool(store.stats()["ssd"]["o_direct"])
            for name, size in tqdm(SIZES.items(), desc="ssd get", file=sys.stderr):
                out[f"ssd_{name}"] = bench_ssd(store, raw_dir, name, size, written[name], ssd_rounds[name], direct)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ram, s64, s1m, p64, p1m = out["ram"], out["ssd_64kib"], out["ssd_1mib"], out["put_64kib"], out["put_1mib"]
    rows: list[list[object]] = [
        ["RAM get_block p50 / p99 (us)", f"{ram['get_p50_us']:.1f} / {ram['get_p99_us']:.1f}",
         f"dict.get {ram['dict_p50_us']:.2f} / {ram['dict_p99_us']:.2f}", f"< {BOUND['ram_lookup_p99_us']:.0f}",
         f"< {SLO['ram_lookup_us']:.0f}"],
        ["RAM lookup() p99 (us)", f"{ram['lookup_p99_us']:.1f}", "", "", ""],
        ["RAM get throughput (GB/s, views)", f"{ram['get_gb_s']:.0f}", "", "", ""],
        ["SSD get 64 KiB p50 / p99 (ms)", f"{s64['get_p50_ms']:.3f} / {s64['get_p99_ms']:.3f}",
         f"file read {s64['file_p50_ms']:.3f} / {s64['file_p99_ms']:.3f}", "", f"< {SLO['ssd_get_ms']:.0f}"],
        ["SSD get 1 MiB p50 / p99 (ms)", f"{s1m['get_p50_ms']:.3f} / {s1m['get_p99_ms']:.3f}",
         f"file read {s1m['file_p50_ms']:.3f} / {s1m['file_p99_ms']:.3f}",
         f"< {BOUND['ssd_get_p99_ms_1mib']:.0f}", f"< {SLO['ssd_get_ms']:.0f}"],
        ["SSD get throughput 64 KiB / 1 MiB (MB/s)", f"{s64['get_mb_s']:.0f} / {s1m['get_mb_s']:.0f}",
         f"file read {s64['file_mb_s']:.0f} / {s1m['file_mb_s']:.0f}", "", ""],
        ["SSD lookup() p99 (us)", f"{s1m['lookup_p99_us']:.1f}", "", "", ""],
        ["SSD put 1 MiB, group commit (MB/s)", f"{p1m['put_mb_s']:.0f}", f"raw files {p1m['raw_put_mb_s']:.0f}",
         f">= {BOUND['ssd_put_mb_s']:.0f}", ""],
        ["SSD put 1 MiB, single puts (MB/s)", f"{p1m['single_put_mb_s']:.0f}", f"dd+fsync {seq_mb_s:.0f}", "", ""],
        ["SSD put 64 KiB, group commit (MB/s)", f"{p64['put_mb_s']:.0f}", f"raw files {p64['raw_put_mb_s']:.0f}",
         "", ""],
    ]
    print_table(f"kvfabric tiers ({'quick' if args.quick else 'full'} run, O_DIRECT reads: {direct})",
                ["figure", "store", "baseline (same run)", "design bound", "reference SLO"], rows)
    emit_json({
        "ram_lookup_p99_us": ram["get_p99_us"], "dict_lookup_p99_us": ram["dict_p99_us"],
        "ram_presence_lookup_p99_us": ram["lookup_p99_us"],
        "ssd_get_p99_ms_1mib": s1m["get_p99_ms"], "file_read_p99_ms_1mib": s1m["file_p99_ms"],
        "ssd_get_p99_ms_64kib": s64["get_p99_ms"], "file_read_p99_ms_64kib": s64["file_p99_ms"],
        "ssd_get_mb_s_1mib": s1m["get_mb_s"], "file_read_mb_s_1mib": s1m["file_mb_s"],
        "ssd_put_mb_s": p1m["put_mb_s"], "raw_put_mb_s": p1m["raw_put_mb_s"],
        "ssd_single_put_mb_s": p1m["single_put_mb_s"], "dd_fsync_mb_s": seq_mb_s,
        "ssd_put_mb_s_64kib": p64["put_mb_s"], "o_direct": direct, "quick": args.quick,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
