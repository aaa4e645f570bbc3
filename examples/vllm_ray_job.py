"""A Ray job that runs vLLM with kvfabric as its KV connector on every node of a running cluster and
serves a shared-prefix workload.

    ray job submit --address http://<head>:8265 --working-dir . -- \
        python examples/vllm_ray_job.py --model /models/your-model
    RAY_ADDRESS=127.0.0.1:6379 python examples/vllm_ray_job.py --model <checkpoint folder>  # after `kvfabric up`

One `VLLMEngineActor` (cluster/engines/vllm/engine_actor.py) is pinned to each alive node; each
request (a long shared system prompt, then a fresh question) goes to the next node in turn. The
first request computes the prefix and its node stores it; every other node loads it from its own
tiers or pulls it from a peer. Each answer is checked against the same engine recomputing the
prompt. Prints one line per request, then JSON; exit 1 if any greedy answer differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import ray

from cluster.engines.vllm.engine_actor import spawn_vllm_engines
from cluster.launch import loopback_env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    p.add_argument("--namespace", default="kvfabric", help="Ray namespace of the fabric ([cluster] namespace)")
    p.add_argument("--model", required=True, help="a local checkpoint folder vLLM can load")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=500, help="token ids are drawn below this")
    args = p.parse_args(argv)
    if args.address.startswith("127.0.0.1"):
        loopback_env()
    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
    engines = spawn_vllm_engines(nodes, args.model, block_size=args.block_size, prefix_caching=False)
    rng = random.Random(0)
    prefix = [rng.randrange(1, args.vocab) for _ in range(args.prefix_tokens)]
    identical, reused = True, 0
    for i in range(args.requests):
        node = nodes[i % len(nodes)]
        prompt = prefix + [rng.randrange(1, args.vocab) for _ in range(32)]
        fabric, recompute = ray.get(engines[node].serve.remote(prompt, args.max_tokens))
        same = fabric.tokens == recompute.tokens
        identical &= same
        reused += fabric.num_cached_tokens
        print(f"request {i + 1} on {node[:8]}: {fabric.num_cached_tokens} prompt tokens from the fabric, "
              f"TTFT {fabric.seconds:.3f} s vs {recompute.seconds:.3f} s recomputing, same answer: {same}")
    for engine in engines.values():
        ray.get(engine.shutdown.remote())
    print(json.dumps({"answers_identical": identical, "reused_tokens": reused, "nodes": len(nodes)}))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
