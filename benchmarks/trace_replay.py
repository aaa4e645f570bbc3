"""`bench_cluster.py --trace`: a multi-turn chat trace replayed through a real 3-node cluster.

The trace (benchmarks/chat_trace.py: Zipf-popular system prompts, conversations that grow turn by
turn) is replayed request by request. For each request the driver asks every node how much of the
prompt it has (a lookup: a peek, with the load its engine reported) and lets `cluster.router.Router`
choose; that node's engine loads the longest cached prefix (its own tiers, else pulled from a peer),
"computes" the rest and stores it. Each node holds at most `capacity` blocks (`[kv] ram_blocks` and
`ssd_blocks`), small enough that one pooled LRU of the cluster's total capacity sits well below an
unbounded cache on the same requests.

Baselines, computed in the same run on the same requests (block hashes):
- pooled LRU: one prefix LRU of 3 x capacity blocks (as if the nodes were one cache);
- isolated LRUs: one per node of `capacity` blocks, each request on the node the router chose;
- max: an unbounded cache (every repeated leading block is a hit).

JSON keys: trace_hit_ratio, trace_pooled_lru_hit_ratio, trace_isolated_lru_hit_ratio,
trace_max_hit_ratio, trace_hit_over_pooled_lru, trace_capacity_blocks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from benchmarks._common import print_table
from benchmarks.chat_trace import PrefixLru, chat_trace, hit_ratio, isolated_hit_ratio
from cluster.client import FabricClient
from cluster.launch import start_local_cluster
from cluster.router import NodeView, Router
from fabric.config import ClusterConfig, Config, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(2, 1, 64, "f16")   # 4 KiB per (block, layer): the trace is about hits, not bytes
NUM_NODES = 3


def pick_capacity(requests: list[list[bytes]], share: float = 0.7) -> int:
    """The largest per-node capacity (blocks) whose pooled LRU stays at or below `share` of an
    unbounded cache: small enough that capacity, not the workload, decides the hit ratio; but at
    least twice the longest request, so that one node can hold any one conversation."""
    best = hit_ratio(PrefixLru(None), requests)
    floor = 2 * max((len(r) for r in requests), default=8)
    chosen = floor
    for capacity in (c for c in (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024) if c > floor):
        if hit_ratio(PrefixLru(NUM_NODES * capacity), requests) > share * best:
            break
        chosen = capacity
    return chosen


def measure_trace(engine_cls: Any, args: argparse.Namespace, root: Path) -> dict[str, object]:
    trace = chat_trace(args.trace_requests, num_users=args.users, num_system_prompts=args.trace_prompts,
                       system_tokens=args.trace_system_tokens, max_turns=4, seed=args.seed)
    ns = Namespace("bench-trace", LAYOUT, 16, weights_fingerprint="synthetic")
    requests: list[list[bytes]] = [[bytes(h) for h in block_hashes(ns, r.tokens)] for r in trace]
    capacity = args.capacity or pick_capacity(requests)
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, o_direct=False, ram_blocks=capacity, ssd_blocks=capacity,
                                cpu_offload_threshold=1.0, ssd_low_water=1.0),
                    cluster=ClusterConfig(heartbeat_s=1.0, lease_s=10.0))
    local = start_local_cluster(NUM_NODES, root, config, object_store_bytes=256 << 20)
    try:
        nodes = sorted(local.node_ids())
        engines = {n: engine_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(n)
                   for n in nodes}
        clients = {n: FabricClient.connect(node_id=n) for n in nodes}
        router = Router()
        chosen: list[str] = []
        pending: list[Any] = []
        start = time.monotonic()
        for req, hashes in tqdm(list(zip(trace, requests, strict=True)), desc="trace", unit="req", file=sys.stderr):
            # Requests arrive at the trace's times (scaled by --time-scale) and overlap: each node's
            # engine reports its load, which the router reads back from the node's lookup.
            wait = start + req.arrival_s * args.time_scale - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            tokens = list(req.tokens)
            replies = {n: clients[n].lookup(ns, tokens) for n in nodes}
            views = [NodeView(n, [loc.where.value for loc in replies[n].locations], replies[n].load.requests)
                     for n in nodes]
            node = router.choose(len(hashes), views, prompt_key=hashes[0] if hashes else b"").node_id
            pending.append(engines[node].serve.remote(ns, tokens, True))
            chosen.append(node)
        results = ray.get(pending)
        hits = sum(r["hits"] for r in results)
        total = sum(r["blocks"] for r in results)
    finally:
        local.shutdown()
    cluster = hits / total if total else 0.0
    pooled = hit_ratio(PrefixLru(NUM_NODES * capacity), requests)
    isolated = isolated_hit_ratio(capacity, requests, chosen)
    best = hit_ratio(PrefixLru(None), requests)
    share = {n: chosen.count(n) / len(chosen) for n in sorted(set(chosen))}
    print_table(f"chat trace: {len(trace)} requests, {args.users} users, {args.trace_prompts} system prompts of "
                f"{args.trace_system_tokens} tokens, {NUM_NODES} nodes of {capacity} blocks each",
                ["cache", "hit ratio", "over pooled LRU"],
                [["kvfabric cluster (router + pulls)", cluster, cluster / pooled if pooled else 0.0],
                 [f"pooled LRU ({NUM_NODES * capacity} blocks)", pooled, 1.0],
                 [f"isolated LRUs ({capacity} blocks each, same routing)", isolated,
                  isolated / pooled if pooled else 0.0],
                 ["unbounded", best, best / pooled if pooled else 0.0]])
    print("requests per node: " + ", ".join(f"{n[:8]} {s:.2f}" for n, s in share.items()))
    return {"trace_hit_ratio": round(cluster, 4), "trace_pooled_lru_hit_ratio": round(pooled, 4),
            "trace_isolated_lru_hit_ratio": round(isolated, 4), "trace_max_hit_ratio": round(best, 4),
            "trace_hit_over_pooled_lru": round(cluster / pooled, 4) if pooled else 0.0,
            "trace_capacity_blocks": capacity, "trace_requests": len(trace),
            "trace_node_shares": [round(s, 3) for s in share.values()]}
