"""One pure directory shard (cluster/directory/shard.py) with 1,000 nodes at 1e5, 1e6 and 1e7 (hash, node) entries.

Workload (deterministic from --seed): prompts of 64 block hashes (32 random bytes each), each prompt
held by 1-3 of 1,000 nodes, so every block is on 1-3 nodes (about 2 on average). Each owner reports
its prompt as one `Apply` report of 64 stored hashes, with hashes as fresh bytes objects per owner,
as they would arrive from separate RPCs. A `locate` query is one prompt's 64 hashes plus 16 hashes
nobody holds (the part of a prompt that was never cached), excluding the asking node, as a NodeActor
asks. Every node has a live lease.

Baseline, in the same process: a plain `dict[bytes, set[str]]` with the same reports (`setdefault(h,
set()).add(node)`, no sequence checks, no per-node index, so it cannot replace a node's entries) and
the same locate answer computed plainly (filter live and excluded nodes, sort, leading runs).
Figures are medians over rounds.

Memory: all sizes live in one process, built smallest first, ours then the baseline, and nothing is
freed in between, so `bytes_per_entry` is the growth of the process's RSS while our shard of that
size is built, divided by its entries (everything the shard holds: dict, key bytes, owner tuples,
per-node hash sets, node records). The baseline's RSS growth is measured the same way. A fresh
process also builds the smallest size under tracemalloc as a cross-check, and the shard's own
estimate (`stats()`) is shown. Peak RSS at the default sizes is about 4 GiB.
Timing: locate rounds go round-robin over every size, ours and the baseline alternating, so the
noise of a shared machine hits all sizes alike and the growth ratio is measured side by side.

Thresholds shown beside the figures: directory_lookups_per_s >= 200,000 (at the largest size),
locate_growth_1e5_to_1e7 <= 1.5, bytes_per_entry <= 200. Last stdout line: JSON with locate_us_per_hash (per size),
apply_us_per_entry, bytes_per_entry, locate_growth_1e5_to_1e7, directory_lookups_per_s and more.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import emit_json, median, print_table, rss_bytes
from cluster.directory.report import Apply, Heartbeat, Report
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import NodeAddress, NodeId, leading_runs

NUM_NODES = 1000
PROMPT_BLOCKS = 64
TAIL_BLOCKS = 16
SIZES = {"1e5": 100_000, "1e6": 1_000_000, "1e7": 10_000_000}
QUICK_SIZES = {"1e4": 10_000, "1e5": 100_000}
NODE_IDS = [f"node-{i:04d}" for i in range(NUM_NODES)]
ADDR = NodeAddress("127.0.0.1", 7000, "tls-tcp")
LEASE_S = 1e9   # every node stays live: this measures lookups, not expiry


def prompt(seed: int, p: int) -> tuple[bytes, list[int]]:
    """Prompt p's hash bytes (64 x 32) and its 1-3 distinct owner nodes."""
    rng = np.random.default_rng([seed, p])
    num_owners = int(rng.integers(1, 4))
    return rng.bytes(32 * PROMPT_BLOCKS), [int(n) for n in rng.choice(NUM_NODES, num_owners, replace=False)]


def split(buf: bytes) -> list[bytes]:
    return [buf[i:i + 32] for i in range(0, len(buf), 32)]   # fresh bytes objects every call


def num_prompts(entries: int, seed: int) -> int:
    """Prompts needed to reach `entries` (hash, node) pairs."""
    total, p = 0, 0
    while total < entries:
        rng = np.random.default_rng([seed, p])
        total += PROMPT_BLOCKS * int(rng.integers(1, 4))
        p += 1
    return p


class PlainDirectory:
    """The baseline: dict of sets, leases in a dict, everything computed per call."""

    def __init__(self) -> None:
        self.owners: dict[bytes, set[str]] = {}
        self.leases: dict[str, float] = {}

    def apply(self, node_id: str, stored: Sequence[bytes], now: float) -> None:
        self.leases[node_id] = now + LEASE_S
        for h in stored:
            self.owners.setdefault(h, set()).add(node_id)

    def locate(self, hashes: Sequence[bytes], now: float,
               exclude: Sequence[str]) -> tuple[list[tuple[NodeId, ...]], dict[NodeId, int]]:
        live = {n for n, t in self.leases.items() if now < t} - set(exclude)
        empty: set[str] = set()
        owners = [tuple(sorted(self.owners.get(h, empty) & live)) for h in hashes]
        return cast(list[tuple[NodeId, ...]], owners), leading_runs(cast(list[tuple[NodeId, ...]], owners))


def build_ours(seed: int, prompts: int, bar: tqdm[Any]) -> tuple[DirectoryShard, list[float], int]:
    shard = DirectoryShard(lease_s=LEASE_S)
    for node_id in NODE_IDS:
        shard.submit(Report(0, node_id, 1, Heartbeat(ADDR)), 0.0)
    seqs = [0] * NUM_NODES
    times: list[float] = []
    entries = 0
    for p in range(prompts):
        buf, owners = prompt(seed, p)
        for n in owners:
            batch = split(buf)
            seqs[n] += 1
            report = Report(0, NODE_IDS[n], 1, Apply(seqs[n], batch))   # as it arrives at the shard
            t0 = time.perf_counter()
            shard.submit(report, 0.0)
            times.append(time.perf_counter() - t0)
            entries += len(batch)
        bar.update(1)
    return shard, times, entries


def build_plain(seed: int, prompts: int, bar: tqdm[Any]) -> tuple[PlainDirectory, list[float]]:
    plain = PlainDirectory()
    times: list[float] = []
    for p in range(prompts):
        buf, owners = prompt(seed, p)
        for n in owners:
            batch = split(buf)
            t0 = time.perf_counter()
            plain.apply(NODE_IDS[n], batch, 0.0)
            times.append(time.perf_counter() - t0)
        bar.update(1)
    return plain, times


def make_queries(seed: int, prompts: int, num_queries: int) -> list[tuple[list[bytes], list[str]]]:
    rng = np.random.default_rng(seed + 1)
    queries = []
    for p in rng.integers(0, prompts, num_queries):
        buf, owners = prompt(seed, int(p))
        asker = NODE_IDS[(owners[0] + 1) % NUM_NODES]
        queries.append(([*split(buf), *split(rng.bytes(32 * TAIL_BLOCKS))], [asker]))
    return queries


def traced_bytes_per_entry(entries: int, seed: int) -> float:
    """Bytes the shard holds per entry, counted by the allocator (tracemalloc), in this fresh process."""
    prompts = num_prompts(entries, seed)
    tracemalloc.start()
    with tqdm(total=prompts, desc=f"{entries:.0e} traced", file=sys.stderr, leave=False) as bar:
        shard, _, n = build_ours(seed, prompts, bar)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert shard.stats(0.0)["num_entries"] == n
    return held / n


def measure(sizes: dict[str, int], seed: int, rounds: int, num_queries: int) -> dict[str, dict[str, float]]:
    """Build every size (ours, then the baseline; nothing is freed, so each RSS growth is honest), then
    time locate round-robin over all sizes in this one process, so noise hits every size alike."""
    out: dict[str, dict[str, float]] = {k: {} for k in sizes}
    shards: dict[str, DirectoryShard] = {}
    plains: dict[str, PlainDirectory] = {}
    for label, entries in sizes.items():
        prompts = num_prompts(entries, seed)
        gc.collect()
        rss0 = rss_bytes()
        with tqdm(total=prompts, desc=f"{label} build ours", file=sys.stderr, leave=False) as bar:
            shards[label], times, n = build_ours(seed, prompts, bar)
        gc.collect()
        stats = shards[label].stats(1.0)
        out[label].update(entries=n, hashes=stats["num_hashes"], bytes_per_entry=(rss_bytes() - rss0) / n,
                          estimate_bytes_per_entry=stats["bytes_per_entry"], apply_us_per_entry=sum(times) * 1e6 / n)
    for label, entries in sizes.items():
        prompts = num_prompts(entries, seed)
        gc.collect()
        rss0 = rss_bytes()
        with tqdm(total=prompts, desc=f"{label} build plain", file=sys.stderr, leave=False) as bar:
            plains[label], times = build_plain(seed, prompts, bar)
        gc.collect()
        n = int(out[label]["entries"])
        out[label].update(plain_bytes_per_entry=(rss_bytes() - rss0) / n, plain_apply_us_per_entry=sum(times) * 1e6 / n)
    queries = {label: make_queries(seed, num_prompts(entries, seed), num_queries) for label, entries in sizes.items()}
    for label, qs in queries.items():   # the same answers, and a warm-up
        for q, ex in qs[:50]:
            got = shards[label].locate(q, 1.0, ex)
            want_owners, want_runs = plains[label].locate(q, 1.0, ex)
            assert list(got.owners) == want_owners and got.runs == want_runs, "ours and the baseline disagree"
    samples: dict[tuple[str, str], list[float]] = {}
    for r in tqdm(range(rounds), desc="locate rounds", file=sys.stderr, leave=False):
        for label, qs in queries.items():
            num_hashes = sum(len(q) for q, _ in qs)
            for side in (("ours", "plain") if r % 2 == 0 else ("plain", "ours")):
                target = shards[label] if side == "ours" else plains[label]
                t0 = time.perf_counter()
                for q, ex in qs:
                    target.locate(q, 1.0, ex)
                samples.setdefault((label, side), []).append((time.perf_counter() - t0) * 1e6 / num_hashes)
    for label in sizes:
        out[label].update(locate_us_per_hash=median(samples[(label, "ours")]),
                          plain_locate_us_per_hash=median(samples[(label, "plain")]))
    out[next(iter(sizes))]["peak_rss_mib"] = rss_bytes() / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 1e4 and 1e5, a few seconds, for the smoke test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--traced-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.traced_worker:
        print(json.dumps(traced_bytes_per_entry(args.traced_worker, args.seed)), flush=True)
        return
    sizes = QUICK_SIZES if args.quick else SIZES
    smallest = next(iter(sizes.values()))
    traced = subprocess.run([sys.executable, __file__, "--traced-worker", str(smallest), "--seed", str(args.seed)],
                            stdout=subprocess.PIPE, text=True, check=True)
    traced_bpe = float(traced.stdout.strip().splitlines()[-1])
    results = measure(sizes, args.seed, args.rounds, 200 if args.quick else args.queries)
    peak = results[next(iter(sizes))].pop("peak_rss_mib")
    rows = [[label, int(r["entries"]), int(r["hashes"]), r["locate_us_per_hash"], r["plain_locate_us_per_hash"],
             r["apply_us_per_entry"], r["plain_apply_us_per_entry"], r["bytes_per_entry"],
             r["plain_bytes_per_entry"], r["estimate_bytes_per_entry"]] for label, r in results.items()]
    print_table(f"directory shard, {NUM_NODES} nodes, 1-3 owners per block, medians of {args.rounds} interleaved "
                f"rounds; peak RSS {peak:.0f} MiB; tracemalloc at {smallest:.0e}: {traced_bpe:.1f} B/entry",
                ["size", "entries", "hashes", "locate us/hash", "plain locate", "apply us/entry", "plain apply",
                 "B/entry (RSS)", "plain B/entry (RSS)", "B/entry (stats)"], rows)
    first, last = results[next(iter(sizes))], results[list(sizes)[-1]]
    growth = (results["1e7"]["locate_us_per_hash"] / results["1e5"]["locate_us_per_hash"]
              if {"1e5", "1e7"} <= results.keys() else None)
    emit_json({
        "locate_us_per_hash": {k: round(r["locate_us_per_hash"], 4) for k, r in results.items()},
        "plain_locate_us_per_hash": {k: round(r["plain_locate_us_per_hash"], 4) for k, r in results.items()},
        "apply_us_per_entry": round(last["apply_us_per_entry"], 4),
        "plain_apply_us_per_entry": round(last["plain_apply_us_per_entry"], 4),
        "bytes_per_entry": round(last["bytes_per_entry"], 1),
        "plain_bytes_per_entry": round(last["plain_bytes_per_entry"], 1),
        "estimate_bytes_per_entry": round(last["estimate_bytes_per_entry"], 1),
        "traced_bytes_per_entry": round(traced_bpe, 1),
        "bytes_per_entry_by_size": {k: round(r["bytes_per_entry"], 1) for k, r in results.items()},
        "locate_growth_1e5_to_1e7": None if growth is None else round(growth, 3),
        "locate_growth": round(last["locate_us_per_hash"] / first["locate_us_per_hash"], 3),
        "plain_locate_growth": round(last["plain_locate_us_per_hash"] / first["plain_locate_us_per_hash"], 3),
        "directory_lookups_per_s": round(1e6 / last["locate_us_per_hash"]),
        "locate_vs_plain": round(last["plain_locate_us_per_hash"] / last["locate_us_per_hash"], 3),
        "peak_rss_mib": round(peak), "largest": list(sizes)[-1], "quick": args.quick, "num_nodes": NUM_NODES,
    })


if __name__ == "__main__":
    main()
