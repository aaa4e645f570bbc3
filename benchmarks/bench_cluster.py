"""The fabric on a local 3-node Ray cluster under a shared-prefix workload.

    .venv/bin/python benchmarks/bench_cluster.py [--quick] [--requests N] [--prompts P] [--events]
    .venv/bin/python benchmarks/bench_cluster.py --trace [--quick] [--trace-requests N] [--users U] [--capacity C]

Requests (a system prompt of several thousand tokens, one of P, plus a random suffix) arrive at a
random node. On each node a small engine actor (pinned to the node, as a real engine is) asks its
NodeActor to `load` the longest cached prefix (local, else pulled from a peer), "computes" the rest
and `store`s it. The KV of a block is derived from its hash (BLAKE3 XOF: random-looking bytes, the
same on every node), so a wrong byte anywhere would be caught: every load is compared.

Same run, same workload, as baselines:
- ideal: every full block that any earlier request produced is a hit;
- local only: pulls off (a fresh tenant, so nothing is shared with the first pass);
- handoff: engine -> NodeActor `store` of a 32 MiB payload array vs a bare `ray.put` + actor read.

`--events` adds a paired run of KV event publishing: a second fabric on the same Ray nodes (its own
Ray namespace and folders) publishes vLLM-format KV events to a subscriber in this process, and every
request of a fresh workload is served by both fabrics in turn (alternating which goes first), so
the two load p50s are measured side by side.

`--trace` replays two multi-turn chat traces instead (one with 8 system prompts, one whose requests all
share one system prompt), routed by the router on the nodes' own answers, against pooled and isolated
LRUs of the same capacity on the same requests (benchmarks/lib/trace_replay.py, which lists its keys).

JSON keys: hit_ratio, ideal_hit_ratio, local_only_hit_ratio, hit_over_ideal, pull_mb_s, load_p50_ms,
load_p99_ms, handoff_mb_s, object_store_mb_s, handoff_over_object_store; with `--events` also
events_off_load_p50_ms, events_on_load_p50_ms, events_load_p50_over_off, events_on_hit_ratio,
events_off_hit_ratio, events_ideal_hit_ratio (every repeated block of that workload), events_blocks_seen.
How many hits a pull adds depends on timing (a block is pullable once its owner has advertised it),
so the two hit ratios need not be equal; both are at most the ideal.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import sys
import tempfile
import threading
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

from benchmarks.harness import emit_json, percentile, print_table
from cluster.api import EngineLoad
from cluster.client import FabricClient
from cluster.launch import start_fabric, start_local_cluster, stop_fabric  # keeps Ray on 127.0.0.1
from fabric.config import ClusterConfig, Config, EventsConfig, KVConfig
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


@ray.remote(num_cpus=0, max_concurrency=16)
class Engine:
    """Stands in for an inference engine on one node: load what is cached, make and store the rest.
    Requests may overlap; like a real engine adapter it reports its load to its node on every change:
    requests running, and prompt tokens accepted but not yet computed: all of a prompt until its load
    answers, then what the load did not cover, until the rest is stored. With `lookup_first` (what a
    router reads, `--trace`), a request first asks its node what it matches, as vLLM's scheduler asks
    its KV connector before it queues a prefill, and counts its prompt less that until its load answers."""

    def __init__(self, node_id: str, namespace: str = "kvfabric", lookup_first: bool = False) -> None:
        self.client = FabricClient.connect(node_id=node_id, namespace=namespace)
        self.lookup_first = lookup_first
        self._lock = threading.Lock()
        self._running = 0
        self._queued_tokens = 0

    def _count(self, requests: int, tokens: int) -> None:
        with self._lock:
            self._running += requests
            self._queued_tokens += tokens
            self.client.report_load(EngineLoad(self._running, 0, self._queued_tokens))

    def serve(self, ns: Namespace, tokens: list[int], pulls: bool) -> dict[str, Any]:
        matched = 0
        if self.lookup_first:
            found = self.client.lookup(ns, tokens)
            matched = found.num_tokens if pulls else found.num_local_blocks * found.block_size
        left = [len(tokens) - matched]     # this request's tokens counted as queued prefill
        self._count(+1, left[0])
        try:
            return self._serve(ns, tokens, pulls, left)
        finally:
            self._count(-1, -left[0])

    def _serve(self, ns: Namespace, tokens: list[int], pulls: bool, left: list[int]) -> dict[str, Any]:
        hashes = block_hashes(ns, tokens)
        start = time.perf_counter()
        reply = self.client.load(ns, tokens, pulls=pulls)
        load_s = time.perf_counter() - start
        self._count(0, len(tokens) - reply.num_tokens - left[0])    # what the load did not cover
        left[0] = len(tokens) - reply.num_tokens
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

    def ready(self) -> str:
        """Answers once the actor has started and connected to its node."""
        return self.client.node_id

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
    parser.add_argument("--events", action="store_true",
                        help="also measure load p50 with KV event publishing on vs off (paired)")
    parser.add_argument("--trace", action="store_true", help="replay a multi-turn chat trace (see the docstring)")
    parser.add_argument("--trace-requests", type=int, default=300)
    parser.add_argument("--users", type=int, default=24, help="--trace: concurrent conversations")
    parser.add_argument("--trace-prompts", type=int, default=8, help="--trace: distinct system prompts (Zipf)")
    parser.add_argument("--trace-system-tokens", type=int, default=512)
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="--trace: arrival times are multiplied by this (smaller: more overlap)")
    parser.add_argument("--capacity", type=int, default=0,
                        help="--trace: blocks per node (0: the largest that keeps a pooled LRU well below unbounded)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.prompts, args.system_tokens = 24, 4, 512
        args.trace_requests, args.users = 60, 8
    logging.basicConfig(level=logging.WARNING)
    if args.trace:
        from benchmarks.lib.trace_replay import measure_trace
        with tempfile.TemporaryDirectory(prefix="kvfabric-bench-trace-") as tmp:
            result = measure_trace(Engine, args, Path(tmp))
        emit_json(result)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-cluster-") as tmp:
        config = Config(kv=KVConfig(ram_gib=1.0, ssd_gib=4.0, o_direct=False),
                        cluster=ClusterConfig(heartbeat_s=1.0, lease_s=5.0))
        local = start_local_cluster(3, Path(tmp), config, object_store_bytes=512 << 20)
        with_events = None
        try:
            result = measure(local.node_ids(), args)
            if args.events:
                with_events = events_config(local.config, Path(tmp))
                start_fabric(with_events)
                result.update(measure_events(local.node_ids(), local.config, with_events, args))
        finally:
            if with_events is not None:
                stop_fabric(with_events)
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
    ns_local = Namespace("bench-cluster", LAYOUT, 16, weights_fingerprint="synthetic-local-only")   # its own cache
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


def events_config(base: Config, root: Path) -> Config:
    """`base` as a second fabric that publishes KV events: its own Ray namespace and folders."""
    kv = dataclasses.replace(base.kv, ssd_dir=str(root / "events" / "ssd"), index_dir=str(root / "events" / "index"))
    cluster = dataclasses.replace(base.cluster, namespace="kvfabric-events")
    events = EventsConfig(enabled=True, endpoint=f"ipc://{root}/events/{{node}}.pub",
                          replay_endpoint=f"ipc://{root}/events/{{node}}.replay")
    return Config(kv=kv, transport=base.transport, cluster=cluster, events=events)


def measure_events(node_ids: list[str], off: Config, on: Config, args: argparse.Namespace) -> dict[str, object]:
    """The same fresh workload through a fabric without and one with KV events, request by request."""
    from examples.kv_events_subscriber import Subscriber

    def engines(cfg: Config) -> list[Any]:
        return [Engine.options(  # type: ignore[attr-defined]
            scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(n, cfg.cluster.namespace)
            for n in node_ids]
    arms = {"off": engines(off), "on": engines(on)}
    endpoints = {}
    for n in node_ids:
        ev = FabricClient.connect(node_id=n, namespace=on.cluster.namespace).stats()["kv_events"]
        endpoints[n] = (ev["endpoint"], ev["replay_endpoint"])
    sub = Subscriber(endpoints)
    stop = threading.Event()

    def follow() -> None:   # the subscriber's sockets live on this one thread
        while not stop.is_set():
            sub.poll(0.2)
    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    ns = Namespace("bench-cluster", LAYOUT, 16, weights_fingerprint="synthetic-events")   # a cache of its own
    requests = workload(args.requests, args.prompts, args.system_tokens, args.seed + 1)
    rng = random.Random(args.seed + 1)
    results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for i, (_, tokens) in enumerate(tqdm(requests, desc="events off/on", unit="req", file=sys.stderr)):
        node = rng.randrange(len(node_ids))
        for arm in (("off", "on") if i % 2 == 0 else ("on", "off")):
            results[arm].append(ray.get(arms[arm][node].serve.remote(ns, tokens, True)))
    time.sleep(1.0)    # the last batches reach the subscriber
    stop.set()
    follower.join()
    sub.close()
    p50 = {arm: percentile([r["load_s"] * 1e3 for r in rs], 50) for arm, rs in results.items()}
    hit = {arm: sum(r["hits"] for r in rs) / sum(r["blocks"] for r in rs) for arm, rs in results.items()}
    seen = sum(len(v.held) for v in sub.views.values())
    ideal, total = ideal_hits(ns, requests)
    print_table(f"KV events: {len(requests)} requests served by both fabrics in turn",
                ["publishing", "hit ratio", "load p50 ms", "load p99 ms"],
                [[arm, hit[arm], p50[arm], percentile([r["load_s"] * 1e3 for r in results[arm]], 99)]
                 for arm in ("off", "on")])
    return {"events_off_load_p50_ms": round(p50["off"], 2), "events_on_load_p50_ms": round(p50["on"], 2),
            "events_load_p50_over_off": round(p50["on"] / p50["off"], 3),
            "events_off_hit_ratio": round(hit["off"], 4), "events_on_hit_ratio": round(hit["on"], 4),
            "events_ideal_hit_ratio": round(ideal / total, 4), "events_blocks_seen": seen}


if __name__ == "__main__":
    sys.exit(main())
