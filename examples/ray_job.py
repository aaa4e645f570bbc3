"""A Ray job against a running kvfabric: a shared-prefix workload spread over every Ray node.

    ray job submit --address http://<head>:8265 --working-dir . -- python examples/ray_job.py
    RAY_ADDRESS=127.0.0.1:6379 python examples/ray_job.py        # e.g. after `kvfabric up`

One small "engine" actor runs on each Ray node and talks to its own node's NodeActor through
`FabricClient`. Requests (a few long system prompts, each followed by a random user suffix) arrive at
random nodes; each one loads the longest cached prefix of its prompt from the fabric (local tiers or
pulled from the node that computed it), "prefills" only the rest and stores the new blocks.

The KV here is not from a model: a block's payload for layer l is BLAKE3(block hash ‖ l) stretched to
the layer's size, a deterministic stand-in for an engine's output, so every loaded byte is checked
against what the engine would have computed. Prints the hit ratio (cached blocks / requested blocks)
and the bytes pulled across nodes, then one JSON line; exits 1 if any loaded block was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from tqdm import tqdm

from cluster.client import FabricClient
from cluster.launch import loopback_env
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout


@dataclass(frozen=True)
class Workload:
    num_prompts: int = 4          # distinct system prompts
    prompt_tokens: int = 1024     # tokens per system prompt (shared by every request that uses it)
    suffix_tokens: int = 64       # random tokens after it (mostly not shared)
    num_requests: int = 32
    seed: int = 0

    def requests(self) -> list[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        prompts = [rng.integers(0, 32000, self.prompt_tokens, dtype=np.uint32) for _ in range(self.num_prompts)]
        # Each system prompt is seen once before any repeat, as a cold start would.
        order = list(range(self.num_prompts)) + [int(i) for i in rng.integers(
            0, self.num_prompts, max(0, self.num_requests - self.num_prompts))]
        return [np.concatenate([prompts[i], rng.integers(0, 32000, self.suffix_tokens, dtype=np.uint32)])
                for i in order[: self.num_requests]]


def reference_kv(ns: Namespace, tokens: np.ndarray, first_block: int, num_blocks: int) -> np.ndarray:
    """The payloads an engine would compute for blocks [first_block, first_block + num_blocks)."""
    size = ns.layout.bytes_per_block_layer(ns.block_size)
    hashes = block_hashes(ns, tokens)[first_block: first_block + num_blocks]
    out = np.empty((len(hashes), ns.layout.num_layers, size), dtype=np.uint8)
    for b, h in enumerate(hashes):
        for layer in range(ns.layout.num_layers):
            digest = blake3.blake3(bytes(h) + layer.to_bytes(4, "little")).digest(length=size)
            out[b, layer] = np.frombuffer(digest, dtype=np.uint8)
    return out


@ray.remote(num_cpus=0)
class Engine:
    """Stands in for an inference engine on one Ray node."""

    def __init__(self, namespace: str) -> None:
        self.client = FabricClient.connect(namespace=namespace)

    def serve(self, ns: Namespace, tokens: np.ndarray) -> dict[str, Any]:
        requested = len(tokens) // ns.block_size
        reply = self.client.load(ns, tokens)
        hit = reply.num_blocks
        correct = bool(np.array_equal(reply.payloads, reference_kv(ns, tokens, 0, hit)))
        if hit < requested:
            self.client.store(ns, tokens, reference_kv(ns, tokens, hit, requested - hit), first_block=hit)
        return {"node_id": self.client.node_id, "requested": requested, "hit": hit,
                "pulled_bytes": reply.pulled_bytes, "correct": correct}


def run(workload: Workload, ns: Namespace, *, fabric_namespace: str = "kvfabric", concurrency: int = 4,
        progress: bool = True) -> dict[str, Any]:
    """Run the workload on the connected Ray cluster; returns the totals."""
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    pinned = [NodeAffinitySchedulingStrategy(node, soft=False) for node in nodes]
    engines = [Engine.options(scheduling_strategy=s).remote(fabric_namespace) for s in pinned]  # type: ignore[attr-defined]
    rng = np.random.default_rng(workload.seed + 1)
    requests = workload.requests()
    totals: dict[str, Any] = {"requests": 0, "requested_blocks": 0, "hit_blocks": 0, "pulled_bytes": 0,
                              "wrong_loads": 0}
    start = time.monotonic()
    pending: list[Any] = []
    with tqdm(total=len(requests), desc="requests", unit="req", disable=not progress, file=sys.stderr) as bar:
        for i, tokens in enumerate(requests):
            if i == workload.num_prompts:  # every system prompt is stored before the repeats start
                _count(ray.get(pending), totals, bar)
                pending = []
            while len(pending) >= concurrency:
                done, pending = ray.wait(pending, num_returns=1)
                _count(ray.get(done), totals, bar)
            pending.append(engines[int(rng.integers(len(engines)))].serve.remote(ns, tokens))
        _count(ray.get(pending), totals, bar)
    totals["num_nodes"] = len(nodes)
    totals["seconds"] = round(time.monotonic() - start, 3)
    totals["hit_ratio"] = totals["hit_blocks"] / max(1, totals["requested_blocks"])
    return totals


def _count(results: list[dict[str, Any]], totals: dict[str, Any], bar: tqdm[Any]) -> None:
    for r in results:
        totals["requests"] += 1
        totals["requested_blocks"] += r["requested"]
        totals["hit_blocks"] += r["hit"]
        totals["pulled_bytes"] += r["pulled_bytes"]
        totals["wrong_loads"] += 0 if r["correct"] else 1
        bar.update(1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="Ray address (default: $RAY_ADDRESS, else auto)")
    p.add_argument("--namespace", default="kvfabric", help="Ray namespace of the fabric ([cluster] namespace)")
    p.add_argument("--requests", type=int, default=Workload.num_requests)
    p.add_argument("--prompts", type=int, default=Workload.num_prompts)
    p.add_argument("--prompt-tokens", type=int, default=Workload.prompt_tokens)
    p.add_argument("--block-size", type=int, default=16, help="must match the fabric's [kv] block_size")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    workload = Workload(num_prompts=args.prompts, prompt_tokens=args.prompt_tokens, num_requests=args.requests,
                        seed=args.seed)
    ns = Namespace("example-model", KVLayout.mha(4, 2, 64, "f16"), args.block_size, weights_fingerprint="example")
    if args.address.startswith(("127.", "localhost")):
        loopback_env()  # a local cluster (`kvfabric up`): keep this driver on 127.0.0.1 too
    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    try:
        totals = run(workload, ns, fabric_namespace=args.namespace, concurrency=args.concurrency,
                     progress=not args.no_progress)
    finally:
        ray.shutdown()
    print(f"{totals['requests']} requests on {totals['num_nodes']} Ray nodes in {totals['seconds']:.1f} s")
    print(f"hit ratio     {totals['hit_ratio']:.3f}  ({totals['hit_blocks']} of {totals['requested_blocks']} "
          "blocks came from the fabric)")
    print(f"bytes pulled  {totals['pulled_bytes']:,}  (over the transport, between nodes)")
    print(f"wrong loads   {totals['wrong_loads']}")
    print(json.dumps(totals))
    return 1 if totals["wrong_loads"] else 0


if __name__ == "__main__":
    sys.exit(main())
