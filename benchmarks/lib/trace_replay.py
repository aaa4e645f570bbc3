"""`bench_cluster.py --trace`: multi-turn chat traces replayed through a real 3-node cluster.

Two traces (benchmarks/lib/chat_trace.py: conversations that grow turn by turn), each on a fresh cluster:
- chat: 8 Zipf-popular system prompts;
- shared: one system prompt that every request starts with (its first blocks are shared by all), the
  shape that piles every request on one node when a router breaks ties by the first block.

Each is replayed request by request at its own arrival times. For each request the driver asks every
node how much of the prompt it has (a lookup: a peek, with the load its engine reported and how full
its cache is) and lets `cluster.router.Router` choose; that node's engine loads the longest cached
prefix (its own tiers, else pulled from a peer), "computes" the rest and stores it, reporting its load
(running requests, prompt tokens not yet computed) to its node as it goes. Each node holds at most
`capacity` blocks (`[kv] ram_blocks` and `ssd_blocks`), small enough that one pooled LRU of the
cluster's total capacity sits well below an unbounded cache on the same requests.

Baselines, computed in the same run on the same requests (block hashes):
- pooled LRU: one prefix LRU of 3 x capacity blocks (as if the nodes were one cache);
- isolated LRUs: one per node of `capacity` blocks, each request on the node the router chose;
- max: an unbounded cache (every repeated leading block is a hit).
Beside them, the requests each node served and the busiest node's count over the mean.

JSON keys, chat trace: trace_hit_ratio, trace_pooled_lru_hit_ratio, trace_isolated_lru_hit_ratio,
trace_max_hit_ratio, trace_hit_over_pooled_lru, trace_capacity_blocks, trace_requests,
trace_node_shares, trace_requests_per_node, trace_busiest_over_mean; shared trace: the same with the
prefix shared_trace_ (shared_trace_hit_over_pooled_lru, shared_trace_busiest_over_mean, ...).
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

from benchmarks.harness import print_table
from benchmarks.lib.chat_trace import PrefixLru, TraceRequest, chat_trace, hit_ratio, isolated_hit_ratio
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
    """Both traces, each on its own fresh cluster; the keys of each (see the module docstring)."""
    shapes = {"trace": args.trace_prompts, "shared_trace": 1}
    result: dict[str, object] = {}
    for prefix, num_system_prompts in shapes.items():
        trace = chat_trace(args.trace_requests, num_users=args.users, num_system_prompts=num_system_prompts,
                           system_tokens=args.trace_system_tokens, max_turns=4, seed=args.seed)
        label = (f"{num_system_prompts} system prompts" if num_system_prompts > 1
                 else "one system prompt shared by every request")
        result.update(_replay(engine_cls, trace, args, root / prefix, prefix, label))
    return result


def _route(trace: list[TraceRequest], requests: list[list[bytes]], ns: Namespace,
           clients: dict[str, FabricClient], engines: dict[str, Any], time_scale: float, prefix: str
           ) -> tuple[list[str], list[Any]]:
    """Send each request at its time (scaled by `time_scale`; later when the lookups take longer) to the
    node the router chooses from every node's lookup; requests overlap, and each node's engine reports
    its load, which the router reads back from the node's lookup. The chosen nodes, and the engines'
    replies to come."""
    router = Router()
    nodes = sorted(clients)
    chosen: list[str] = []
    pending: list[Any] = []
    start = time.monotonic()
    for req, hashes in tqdm(list(zip(trace, requests, strict=True)), desc=prefix, unit="req", file=sys.stderr):
        wait = start + req.arrival_s * time_scale - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        tokens = list(req.tokens)
        views = [NodeView.of(n, clients[n].lookup(ns, tokens)) for n in nodes]
        node = router.choose(hashes, views).node_id
        pending.append(engines[node].serve.remote(ns, tokens, True))
        chosen.append(node)
    return chosen, pending


def _replay(engine_cls: Any, trace: list[TraceRequest], args: argparse.Namespace, root: Path, prefix: str,
            label: str) -> dict[str, object]:
    ns = Namespace("bench-trace", LAYOUT, 16, weights_fingerprint="synthetic")
    requests: list[list[bytes]] = [[bytes(h) for h in block_hashes(ns, r.tokens)] for r in trace]
    capacity = args.capacity or pick_capacity(requests)
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, o_direct=False, ram_blocks=capacity, ssd_blocks=capacity,
                                cpu_offload_threshold=1.0, ssd_low_water=1.0),
                    cluster=ClusterConfig(heartbeat_s=1.0, lease_s=10.0))
    local = start_local_cluster(NUM_NODES, root, config, object_store_bytes=256 << 20)
    try:
        nodes = sorted(local.node_ids())
        engines = {n: engine_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(
            n, lookup_first=True) for n in nodes}
        clients = {n: FabricClient.connect(node_id=n) for n in nodes}
        ray.get([e.ready.remote() for e in engines.values()])   # started: the first requests do not wait for them
        chosen, pending = _route(trace, requests, ns, clients, engines, args.time_scale, prefix)
        results = ray.get(pending)
        hits = sum(r["hits"] for r in results)
        total = sum(r["blocks"] for r in results)
    finally:
        local.shutdown()
    cluster = hits / total if total else 0.0
    pooled = hit_ratio(PrefixLru(NUM_NODES * capacity), requests)
    isolated = isolated_hit_ratio(capacity, requests, chosen)
    best = hit_ratio(PrefixLru(None), requests)
    per_node = [chosen.count(n) for n in nodes]
    busiest = max(per_node) / (len(chosen) / len(nodes)) if chosen else 0.0
    spread = " / ".join(str(c) for c in per_node)
    print_table(f"{label}: {len(trace)} requests, {args.users} users, system prompts of {args.trace_system_tokens} "
                f"tokens, {NUM_NODES} nodes of {capacity} blocks each",
                ["cache", "hit ratio", "over pooled LRU", "requests per node", "busiest / mean"],
                [["kvfabric cluster (router + pulls)", cluster, cluster / pooled if pooled else 0.0, spread, busiest],
                 [f"pooled LRU ({NUM_NODES * capacity} blocks)", pooled, 1.0, "", ""],
                 [f"isolated LRUs ({capacity} blocks each, same routing)", isolated,
                  isolated / pooled if pooled else 0.0, spread, busiest],
                 ["unbounded", best, best / pooled if pooled else 0.0, "", ""]])
    return {f"{prefix}_hit_ratio": round(cluster, 4), f"{prefix}_pooled_lru_hit_ratio": round(pooled, 4),
            f"{prefix}_isolated_lru_hit_ratio": round(isolated, 4), f"{prefix}_max_hit_ratio": round(best, 4),
            f"{prefix}_hit_over_pooled_lru": round(cluster / pooled, 4) if pooled else 0.0,
            f"{prefix}_capacity_blocks": capacity, f"{prefix}_requests": len(trace),
            f"{prefix}_node_shares": [round(c / len(chosen), 3) for c in per_node] if chosen else [],
            f"{prefix}_requests_per_node": per_node, f"{prefix}_busiest_over_mean": round(busiest, 3)}
