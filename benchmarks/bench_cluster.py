"""The fabric on a local 3-node Ray cluster under a shared-prefix workload.

    .venv/bin/python benchmarks/bench_cluster.py [--quick] [--requests N] [--prompts P]

Requests (a system prompt of several thousand tokens, one of P, plus a random suffix) arrive at a
random node. On each node a small engine actor (pinned to the node, as a real engine is) asks its
NodeActor to `load` the longest cached prefix (local, else pulled from a peer), "computes" the rest
and `store`s it. The KV of a block is derived from its hash (BLAKE3 XOF: random-looking bytes, the
same on every node), so a wrong byte anywhere would be caught: every load is compared.

Same run, same workload, as baselines:
- ideal: every full block that any earlier request produced is a hit;
- local only: pulls off (a fresh tenant, so nothing is shared with the first pass);
- handoff: engine -> NodeActor `store` of a 32 MiB payload array vs a bare `ray.put` + actor read.

JSON keys: hit_ratio, ideal_hit_ratio, local_only_hit_ratio, hit_over_ideal, pull_mb_s, load_p50_ms,
load_p99_ms, handoff_mb_s, object_store_mb_s, handoff_over_object_store.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import emit_json, percentile, print_table
from cluster.client import FabricClient
from cluster.launch import start_local_cluster  # keeps Ray on 127.0.0.1 (see cluster/launch.py)
from fabric.config import ClusterConfig, Config, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(8, 2, 64, "f16")   # 8 KiB per (block, layer) at 16 tokens: 64 KiB per block


def kv_of(ns: Namespace, hashes: Sequence[bytes]) -> np.ndarray:
    per_block = ns.layout.bytes_per_block(ns.block_size)
    out = np.empty((len(hashes), ns.layout.num_layers, ns.layout.bytes_per_block_layer(ns.block_size)), np.uint8)
    flat = out.reshape(len(hashes), per_block)
    for i, h in enumerate(hashes):
        flat[i] = np.frombuffer(blake3.blake3(h).digest(length=per_block), dtype=np.uint8)
    return out


@ray.remote(num_cpus=0)
class Engine:
    """Stands in for an inference engine on one node: load what is cached, make and store the rest."""

    def __init__(self, node_id: str) -> None:
        self.client = FabricClient.connect(node_id=node_id)

    def serve(self, ns: Namespace, tokens: list[int], pulls: bool) -> dict[str, Any]:
        hashes = block_hashes(ns, tokens)
        start = time.perf_counter()
        reply = self.client.load(ns, tokens, pulls=pulls)
        load_s = time.perf_counter() - start
        expected = kv_of(ns, hashes[:reply.num_blocks])
        if not np.array_equal(reply.payloads, expected):
            raise AssertionError("a load returned KV that differs from what was stored")
        if reply.num_blocks < len(hashes):
            rest = kv_of(ns, hashes[reply.num_blocks:])
            self.client.store(ns, tokens, rest, first_block=reply.num_blocks)
        return {"blocks": len(hashes), "hits": reply.num_blocks, "pulled": reply.num_pulled_blocks,
                "pulled_bytes": reply.pulled_bytes, "load_s": load_s}

    def handoff(self, payloads: np.ndarray, ns: Namespace, tokens: list[int], repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            self.client.store(ns, tokens, payloads)
        return time.perf_counter() - start

    def read(self, ref_holder: list[Any]) -> int:
        arr = ray.get(ref_holder[0])
        return int(arr.nbytes)


def workload(num_requests: int, num_prompts: int, system_tokens: int, seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(50_000) for _ in range(system_tokens + rng.randrange(-256, 256))]
               for _ in range(num_prompts)]
    out = []
    for _ in range(num_requests):
        p = rng.randrange(num_prompts)
        out.append((p, systems[p] + [rng.randrange(50_000) for _ in range(rng.randrange(8, 200))]))
    return out


def run_pass(engines: list[Any], ns: Namespace, requests: list[tuple[int, list[int]]], pulls: bool,
             seed: int, label: str) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    results = []
    for _, tokens in tqdm(requests, desc=label, unit="req", file=sys.stderr):
        results.append(ray.get(rng.choice(engines).serve.remote(ns, tokens, pulls)))
    return results


def ideal_hits(ns: Namespace, requests: list[tuple[int, list[int]]]) -> tuple[int, int]:
    seen: set[bytes] = set()
    hits = total = 0
    for _, tokens in requests:
        hashes = block_hashes(ns, tokens)
        n = 0
        while n < len(hashes) and hashes[n] in seen:
            n += 1
        hits += n
        total += len(hashes)
        seen.update(hashes)
    return hits, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run (smoke test)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--system-tokens", type=int, default=3072)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompts, args.system_tokens = 24, 4, 512
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-cluster-") as tmp:
        config = Config(kv=KVConfig(ram_gib=1.0, ssd_gib=4.0, o_direct=False),
                        cluster=ClusterConfig(heartbeat_s=1.0, lease_s=5.0))
        local = start_local_cluster(3, Path(tmp), config, object_store_bytes=512 << 20)
        try:
            result = measure(local.node_ids(), args)
        finally:
            local.shutdown()
    # After the shutdown: Ray reports the NodeActors it kills there on this stdout, which must end
    # with the JSON line.
    emit_json(result)
    return 0


def measure(node_ids: list[str], args: argparse.Namespace) -> dict[str, object]:
    engines = [Engine.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(n)
               for n in node_ids]
    requests = workload(args.requests, args.prompts, args.system_tokens, args.seed)
    ns = Namespace("bench-cluster", LAYOUT, 16, weights_fingerprint="synthetic")
    ns_local = Namespace("bench-cluster", LAYOUT, 16, weights_fingerprint="synthetic", tenant_salt=b"local-only")
    fabric = run_pass(engines, ns, requests, True, args.seed, "with pulls")
    local_only = run_pass(engines, ns_local, requests, False, args.seed, "local only")
    ideal, total = ideal_hits(ns, requests)

    # Handoff: a 32 MiB payload array from the engine process to its NodeActor, vs a bare object-store hop.
    num_blocks = (32 << 20) // LAYOUT.bytes_per_block(16)
    tokens = [random.Random(1).randrange(50_000) for _ in range(num_blocks * 16)]
    payloads = kv_of(ns, block_hashes(ns, tokens))
    repeats = 3 if args.quick else 8
    ray.get(engines[0].handoff.remote(payloads, ns, tokens, 1))            # first put: writes the store
    handoff_s = ray.get(engines[0].handoff.remote(payloads, ns, tokens, repeats))
    start = time.perf_counter()
    for _ in range(repeats):
        ray.get(engines[0].read.remote([ray.put(payloads)]))
    object_s = time.perf_counter() - start
    handoff_mb_s = repeats * payloads.nbytes / handoff_s / 1e6
    object_mb_s = repeats * payloads.nbytes / object_s / 1e6

    def ratio(rs: list[dict[str, Any]]) -> float:
        return float(sum(r["hits"] for r in rs) / sum(r["blocks"] for r in rs))
    pulled = [r for r in fabric if r["pulled"]]
    pull_mb_s = sum(r["pulled_bytes"] for r in pulled) / max(1e-9, sum(r["load_s"] for r in pulled)) / 1e6
    loads_ms = [r["load_s"] * 1e3 for r in fabric]
    hit, ideal_ratio, local_ratio = ratio(fabric), ideal / total, ratio(local_only)
    print_table(f"{len(requests)} requests, {args.prompts} system prompts of ~{args.system_tokens} tokens, "
                f"3 Ray nodes, {LAYOUT.bytes_per_block(16) // 1024} KiB per block",
                ["what", "hit ratio", "pulled MB", "load p50 ms", "load p99 ms"],
                [["fabric (local + pulls)", hit, sum(r["pulled_bytes"] for r in fabric) / 1e6,
                  percentile(loads_ms, 50), percentile(loads_ms, 99)],
                 ["ideal (every repeated block)", ideal_ratio, "", "", ""],
                 ["local only (pulls off)", local_ratio, 0, percentile([r["load_s"] * 1e3 for r in local_only], 50),
                  percentile([r["load_s"] * 1e3 for r in local_only], 99)]])
    print_table("engine -> NodeActor handoff (32 MiB arrays through the object store)", ["path", "MB/s"],
                [["FabricClient.store (incl. store put)", handoff_mb_s], ["ray.put + actor ray.get", object_mb_s]])
    return {"hit_ratio": round(hit, 4), "ideal_hit_ratio": round(ideal_ratio, 4),
            "local_only_hit_ratio": round(local_ratio, 4), "hit_over_ideal": round(hit / ideal_ratio, 4),
            "pull_mb_s": round(pull_mb_s, 1), "load_p50_ms": round(percentile(loads_ms, 50), 2),
            "load_p99_ms": round(percentile(loads_ms, 99), 2), "handoff_mb_s": round(handoff_mb_s, 1),
            "object_store_mb_s": round(object_mb_s, 1),
            "handoff_over_object_store": round(handoff_mb_s / object_mb_s, 3),
            "requests": len(requests), "nodes": 3}


if __name__ == "__main__":
    sys.exit(main())
