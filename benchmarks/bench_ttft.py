"""Time to first token with SmolLM2-135M-Instruct on a local 3-node Ray cluster with the fabric.

For each prompt size (1k, 2k, 4k tokens of prefix + a 16-token suffix), in one run:

    recompute         node A, nothing cached: the whole prompt is prefilled (and exported)
    local RAM hit     node A again, another suffix: the prefix comes from A's own RAM tier
    pull              node B: the prefix is pulled from A over TLS, then the suffix is computed
    layer-wise pull   node C: the same, but layer i computes as soon as layer i has arrived
                      (the overlap: compute done while later layers were still arriving)
    sampled pull      node B, before its pull: the load is sampled for audit (B's rate set to 1 for
                      this request), so B's engine computes the prefix and the node compares it
                      with A's signed KV (docs/security.md); its TTFT is what one sampled request
                      costs. At rate p a share p of pulls costs that instead of a pull: the added
                      prefill time is p x (sampled - pull), which must stay within p x recompute.
                      Every other request runs at rate 0 (no draw changes what is measured).

B and C swap order on every repetition. Every TTFT is measured inside the engine actor (lookup +
load + suffix prefill up to the first token's logits). Before each measured request the bench waits
until no node has background work left (write-behind flushes, mirrors of pulled blocks, directory
batches): the three "nodes" share this host's cores, and on a real cluster another node's mirror
does not run on the measured node's CPU. The break-even bandwidth is KV bytes per
token divided by prefill seconds per token: a pull slower than that loses to recomputing.

Around every measured request the bench also reads the CPU time (user + system, /proc) of the six
processes that serve it: the three NodeActors and the three engine actors. On a host with few cores
that figure bounds the TTFT from below (CPU-seconds / cores): a pull costs the owner's and the
puller's CPU on top of the engine's, where a local hit costs one store read.

    python benchmarks/bench_ttft.py [--quick] [--reps N] [--sizes 1k,2k,4k]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_json, median, print_table

SIZES = {"1k": 1024, "2k": 2048, "4k": 4096}
QUICK_SIZES = {"256": 256, "512": 512}
SUFFIX = 16
BLOCK = 16   # tokens per block, vLLM's default; --block-size changes it
PATHS = ("recompute", "local", "remote", "remote_layerwise", "remote_sampled")
DEFAULT_RATE = 0.01   # [audit] rate's default


def prompt_pair(num_prefix: int, seed: int, vocab: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing `num_prefix` random tokens (random ids cost the model what text does)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(num_prefix)]
    return (prefix + [rng.randrange(100, vocab) for _ in range(SUFFIX)],
            prefix + [rng.randrange(100, vocab) for _ in range(SUFFIX)])


def settle(nodes: Sequence[Any], timeout_s: float = 60.0) -> float:
    """Wait until every NodeActor is idle (nothing to flush, mirror or tell the directory); seconds waited."""
    import ray

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        stats = ray.get([n.stats.remote() for n in nodes])
        if all(s["store"]["pending_writes"] == 0 and s["pending_mirrors"] == 0 and s["pending_directory_ops"] == 0
               for s in stats):
            return time.perf_counter() - start
        time.sleep(0.1)
    raise RuntimeError(f"the fabric nodes did not settle within {timeout_s:.0f} s")


def actor_pids(actors: Sequence[Any]) -> list[int]:
    """The process ids of Ray actors (all on this host: the cluster is local)."""
    import ray

    return [int(pid) for pid in ray.get([a.__ray_call__.remote(lambda _self: os.getpid()) for a in actors])]


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc; 0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])   # utime, stime (fields 14 and 15 of stat)
    return total / tick


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256- and 512-token prompts (smoke test)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per size (fresh prompts; medians)")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="tokens per block (a frame per block, layer)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated subset of {', '.join(SIZES)}")
    args = parser.parse_args()
    unknown = set(args.sizes.split(",")) - set(SIZES)
    if unknown:
        parser.error(f"unknown sizes {sorted(unknown)}; choose from {', '.join(SIZES)}")
    os.environ.setdefault("TQDM_DISABLE", "1")

    import ray
    from transformers.utils import logging as hf_logging

    from cluster.engines.hf.actor import Answer, spawn_engines
    from cluster.engines.hf.engine import SMOLLM2_ID, smollm2_checkpoint
    from cluster.launch import start_local_cluster
    from cluster.node.actor import node_actor_name
    from fabric.config import AuditConfig, Config, KVConfig

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    sizes = QUICK_SIZES if args.quick else {k: v for k, v in SIZES.items() if k in args.sizes.split(",")}
    samples: dict[str, dict[str, list[float]]] = {label: {p: [] for p in PATHS} for label in sizes}
    cpu: dict[str, dict[str, list[float]]] = {label: {p: [] for p in PATHS} for label in sizes}
    overlap: dict[str, list[float]] = {label: [] for label in sizes}   # layer-wise: compute while layers arrive
    pull_mb_s: list[float] = []
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-ttft-") as tmp:
        checkpoint, fingerprint = smollm2_checkpoint()
        vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        local = start_local_cluster(3, Path(tmp) / "fabric", Config(kv=KVConfig(ram_gib=2.0),
                                                                    audit=AuditConfig(rate=0.0)),
                                    object_store_bytes=1 << 30)
        try:
            a, b, c = sorted(local.node_ids())
            nodes = [ray.get_actor(node_actor_name(n), namespace="kvfabric") for n in (a, b, c)]
            engines = spawn_engines([a, b, c], str(checkpoint), fingerprint=fingerprint, model_id=SMOLLM2_ID,
                                    block_size=args.block_size, num_threads=2)
            ns = ray.get(engines[a].namespace.remote())
            pids = actor_pids([*nodes, *engines.values()])

            def measured(label: str, path: str, node: str, tokens: list[int], **kwargs: Any) -> Answer:
                """One request on `node`'s engine, its CPU seconds across the six actors recorded."""
                before = cpu_seconds(pids)
                answer: Answer = ray.get(engines[node].answer.remote(tokens, 1, **kwargs))
                cpu[label][path].append(cpu_seconds(pids) - before)
                return answer

            kv_bytes_per_token = ns.layout.bytes_per_block(args.block_size) / args.block_size
            # Warm-up at the largest size: first calls pay for imports, TLS connections, page faults
            # and each process's first growth to these tensor and reply sizes (smaller ones then fit).
            warm_first, warm_second = prompt_pair(max(sizes.values()), seed=999, vocab=vocab)
            ray.get(engines[a].answer.remote(warm_first, 1))
            settle(nodes)
            for node, mode in ((b, "full"), (c, "layerwise")):
                ray.get(engines[node].answer.remote(warm_second, 1, mode=mode, export=False, deadline_s=math.inf))
            for rep in range(args.reps):
                for k, (label, num_prefix) in enumerate(sizes.items()):
                    first, second = prompt_pair(num_prefix, seed=100 * rep + k, vocab=vocab)
                    cold = measured(label, "recompute", a, first)
                    assert cold.num_reused_tokens == 0, "the recompute found cached blocks"
                    settle(nodes)   # A's blocks are flushed and listed in the directory
                    hit = measured(label, "local", a, second, mode="full", export=False)
                    settle(nodes)   # B holds nothing of it yet: a sampled load is not mirrored
                    ray.get(nodes[1].set_audit_rate.remote(1.0))
                    sampled = measured(label, "remote_sampled", b, second, mode="full", export=False,
                                       deadline_s=math.inf)
                    ray.get(nodes[1].set_audit_rate.remote(0.0))
                    audit = sampled.audit
                    if audit is None or audit.num_checked < num_prefix // args.block_size or audit.num_mismatched:
                        raise RuntimeError(f"the sampled load on {b[:8]} was not audited as expected: {audit}")
                    samples[label]["remote_sampled"].append(sampled.ttft_s)
                    order = [(b, "full"), (c, "layerwise")]
                    for node, mode in order if rep % 2 == 0 else order[::-1]:
                        settle(nodes)
                        path = "remote" if mode == "full" else "remote_layerwise"
                        # The pull path is what is measured: pull whatever the owner holds
                        # (bench_deadline.py measures the node's own load-or-recompute choice).
                        got = measured(label, path, node, second, mode=mode, export=False, deadline_s=math.inf)
                        if got.num_pulled_tokens < num_prefix:
                            raise RuntimeError(f"{mode} pull on {node[:8]} reused {got.num_reused_tokens} tokens, "
                                               f"pulled {got.num_pulled_tokens}; expected the {num_prefix}-token "
                                               "prefix from a peer")
                        samples[label][path].append(got.ttft_s)
                        if mode == "layerwise":
                            overlap[label].append(got.overlap_s)
                        if mode == "full" and got.load_s > 0:
                            pull_mb_s.append(got.pulled_bytes / got.load_s / 1e6)
                    samples[label]["recompute"].append(cold.ttft_s)
                    samples[label]["local"].append(hit.ttft_s)
        finally:
            local.shutdown()

    result: dict[str, object] = {"quick": args.quick, "reps": args.reps, "block_size": args.block_size,
                                 "kv_bytes_per_token": kv_bytes_per_token}
    rows = []
    audit_rows: list[list[object]] = []
    for label, num_prefix in sizes.items():
        med = {p: median(samples[label][p]) for p in PATHS}
        best_remote = min(med["remote"], med["remote_layerwise"])
        for p in PATHS:
            result[f"ttft_{p}_{label}_s"] = round(med[p], 4)
        result[f"ratio_remote_{label}"] = round(best_remote / med["recompute"], 4)
        result[f"remote_over_local_{label}"] = round(best_remote / med["local"], 4)
        # What sampling at the default rate adds to a pull's prefill time, as a share of a recompute's.
        added = DEFAULT_RATE * (med["remote_sampled"] - med["remote"])
        result[f"audit_added_s_{label}"] = round(added, 5)
        result[f"audit_added_share_{label}"] = round(added / med["recompute"], 5)
        audit_rows.append([label, med["remote"], med["remote_sampled"], med["recompute"], added,
                           added / med["recompute"], DEFAULT_RATE])
        rows.append([label, num_prefix + SUFFIX, med["recompute"], med["local"], med["remote"],
                     med["remote_layerwise"], best_remote / med["recompute"], best_remote / med["local"]])
    cores = os.cpu_count() or 1
    result["cores"] = cores
    cpu_rows = []
    for label in sizes:
        med_cpu = {p: median(cpu[label][p]) for p in PATHS}
        for p in PATHS:
            result[f"cpu_{p}_{label}_s"] = round(med_cpu[p], 4)
        result[f"overlap_layerwise_{label}_s"] = round(median(overlap[label]), 4)
        cpu_rows.append([label, *(med_cpu[p] for p in PATHS), med_cpu["remote"] / med_cpu["local"],
                         med_cpu["remote"] / cores])
    largest, largest_tokens = list(sizes.items())[-1]
    prefill_s_per_token = median(samples[largest]["recompute"]) / (largest_tokens + SUFFIX)
    result["breakeven_mb_s"] = round(kv_bytes_per_token / prefill_s_per_token / 1e6, 2)
    result["pull_mb_s"] = round(median(pull_mb_s), 2)
    print_table("TTFT, SmolLM2-135M-Instruct (f32) on a local 3-node Ray cluster, medians in seconds",
                ["prompt", "tokens", "recompute", "local RAM hit", "pull", "layer-wise pull",
                 "best remote / recompute", "best remote / local"], rows)
    print_table(f"Sampled recompute (audit): what the default rate {DEFAULT_RATE:g} adds to a pull's TTFT, medians "
                "in seconds (bound: the added share of a recompute <= the rate)",
                ["prompt", "pull", "sampled pull", "recompute", "added at the default rate", "added / recompute",
                 "rate"], audit_rows)
    result["audit_default_rate"] = DEFAULT_RATE
    print_table(f"CPU seconds per request, the 3 NodeActors + 3 engines together (medians; {cores} cores here; "
                "recompute includes exporting its blocks)",
                ["prompt", "recompute", "local RAM hit", "pull", "layer-wise pull", "sampled pull", "pull / local",
                 "pull's TTFT floor (CPU / cores)"], cpu_rows)
    overlaps = [f"{label} {result[f'overlap_layerwise_{label}_s']:.3f} s of "
                f"{result[f'ttft_remote_layerwise_{label}_s']:.3f} s" for label in sizes]
    print(f"layer-wise pull, compute done while later layers were still arriving (medians): {', '.join(overlaps)}")
    print(f"break-even pull bandwidth ({largest}): {result['breakeven_mb_s']} MB/s "
          f"(KV {kv_bytes_per_token / 1e3:.1f} KB per token, prefill {prefill_s_per_token * 1e3:.2f} ms per token); "
          f"measured pull (full load, {largest} and smaller): {result['pull_mb_s']} MB/s")
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
