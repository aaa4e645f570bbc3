"""TTFT of vLLM with shared prefixes of 1k and 4k tokens: vLLM recomputing, vLLM's own prefix cache,
vLLM's native CPU offload, kvfabric as vLLM's KV connector serving from the node's own tiers, and
kvfabric pulling the prefix from a peer. Every figure comes from this run.

    node A: vLLM + KVFabricConnector (prefix cache off)   recompute (connector off per request), local hit
            vLLM, prefix cache on, no connector           vLLM's prefix cache hit (the floor)
            vLLM + SimpleCPUOffloadConnector               native CPU offload hit (prefix cache reset first);
                                                           OffloadingConnector where CUDA is
    node B: vLLM + KVFabricConnector (prefix cache off)   pull from A

Each sample is the wall time of a one-token request whose prompt is `prefix + 32 fresh tokens`, after
another prompt with the same prefix filled the cache being measured. Every hit's token equals the
recompute's (`answers_identical`). The default run uses SmolLM2-135M-Instruct; `--quick` a small
random Llama, one sample per size (a smoke run, not figures to quote).
Last line of stdout: JSON with `<case>_p50_s_<size>` and the ratios `fabric_local_over_vllm_offload_<size>`,
`fabric_local_over_vllm_prefix_cache_<size>`, `fabric_pull_over_recompute_<size>`,
`fabric_local_over_recompute_<size>`. vLLM 0.32's CPU build cannot run its CPU offload connectors:
SimpleCPUOffloadConnector copies blocks with CUDA's batched memcpy (`cuMemcpyBatchAsync`, after asking
for CUDA stream priorities) and OffloadingConnector requires CUDA or XPU KV tensors. Without CUDA the
offload case is then left out, its figures null and `offload_error` says why.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_json, median, print_table

SIZES = {"1k": 1024, "4k": 4096}
SUFFIX = 32
CASES = ("recompute", "vllm_prefix_cache", "vllm_cpu_offload", "fabric_local", "fabric_pull")


def _model(quick: bool, root: Path) -> tuple[str, str, str, Any]:
    """(checkpoint folder, model id, weights fingerprint, KV layout) of the benchmarked model."""
    from cluster.engines.vllm.namespace import weights_fingerprint
    from fabric.layout import KVLayout

    if not quick:
        from cluster.engines.hf.engine import SMOLLM2_ID, smollm2_checkpoint

        folder, fingerprint = smollm2_checkpoint()
        return str(folder), SMOLLM2_ID, fingerprint, KVLayout.mha(30, 3, 64, "f32")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.engines.hf.engine import save_checkpoint

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=8192))  # type: ignore[no-untyped-call]
    folder = save_checkpoint(model, root / "checkpoint")
    return str(folder), "tiny-llama", weights_fingerprint(str(folder)), KVLayout.mha(4, 2, 32, "f32")


def _wait(predicate: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("the fabric did not report the stored prefix in time")
        time.sleep(0.05)


def run(quick: bool, reps: int, root: Path) -> dict[str, Any]:
    import ray
    import torch

    from cluster.client import FabricClient
    from cluster.engines.vllm.engine_actor import spawn_vllm_engines
    from cluster.engines.vllm.namespace import engine_namespace
    from cluster.launch import start_local_cluster
    from fabric.config import Config, KVConfig

    checkpoint, model_id, fingerprint, layout = _model(quick, root)
    block = 32
    local = start_local_cluster(2, root / "fabric", Config(kv=KVConfig(ram_gib=1.0)))
    try:
        head = ray.get_runtime_context().get_node_id()
        a, b = head, next(n for n in local.node_ids() if n != head)
        common: dict[str, Any] = {"block_size": block, "max_model_len": 8192}
        # Never sampled for recompute: each case times the hit it names (sampling's cost is bench_ttft's).
        extra = {"model_id": model_id, "weights_fingerprint": fingerprint, "audit": False}
        offload = "OffloadingConnector" if torch.cuda.is_available() else "SimpleCPUOffloadConnector"
        engines = {
            "fabric_a": spawn_vllm_engines([a], checkpoint, prefix_caching=False, extra=extra, **common)[a],
            "fabric_b": spawn_vllm_engines([b], checkpoint, prefix_caching=False, extra=extra, **common)[b],
            "native": spawn_vllm_engines([a], checkpoint, fabric=False, prefix_caching=True, **common)[a],
        }
        offload_error = None
        try:
            engines["offload"] = spawn_vllm_engines([a], checkpoint, fabric=False, prefix_caching=True,
                                                    offload=offload, extra={"cpu_bytes_to_use": 2 << 30}, **common)[a]
        except ray.exceptions.RayError as e:   # vLLM 0.32's CPU build cannot start it (see docs/benchmarks.md)
            offload_error = str(e).strip().splitlines()[-1][:300]
            print(f"vLLM's {offload} did not start, its case is left out: {offload_error}")
        ns = engine_namespace(model_id, fingerprint, layout, block, "cpu:default")
        at_a, at_b = FabricClient.connect(node_id=a), FabricClient.connect(node_id=b)
        samples: dict[tuple[str, str], list[float]] = {(c, s): [] for c in CASES for s in SIZES}
        identical = True
        rng = random.Random(0)

        def one(engine: str, prompt: list[int], **kw: Any) -> Any:
            return ray.get(engines[engine].generate.remote([prompt], 1, **kw))[0]

        for size, num_tokens in SIZES.items():
            for _ in range(reps):
                prefix = [rng.randrange(1, 500) for _ in range(num_tokens)]
                fill, probe, pull = ([*prefix, *(rng.randrange(1, 500) for _ in range(SUFFIX))] for _ in range(3))
                want = one("fabric_a", probe, load=False, store=False)
                samples["recompute", size].append(want.seconds)
                results = {}
                one("native", fill)
                results["vllm_prefix_cache"] = one("native", probe)
                if "offload" in engines:
                    one("offload", fill)
                    ray.get(engines["offload"].reset_prefix_cache.remote())
                    results["vllm_cpu_offload"] = one("offload", probe)
                one("fabric_a", fill)
                _wait(lambda f=fill: at_a.lookup(ns, f).num_local_blocks == len(f) // block)
                results["fabric_local"] = one("fabric_a", probe, store=False)
                _wait(lambda f=fill: at_b.lookup(ns, f).num_blocks == len(f) // block)
                results["fabric_pull"] = one("fabric_b", pull, store=False)
                want_pull = one("fabric_a", pull, load=False, store=False)
                for case, got in results.items():
                    samples[case, size].append(got.seconds)
                    expected = want_pull if case == "fabric_pull" else want
                    identical &= got.tokens == expected.tokens and got.num_cached_tokens > 0
        pulled = int(at_b.stats()["pulled_bytes"])
        for engine in engines.values():
            ray.get(engine.shutdown.remote())
    finally:
        local.shutdown()
    p50 = {key: median(v) for key, v in samples.items() if v}
    print_table(f"vLLM TTFT p50 (s), {model_id}, {reps} sample(s) per cell, block {block}", ["case", *SIZES],
                [[case, *(p50.get((case, s), "n/a") for s in SIZES)] for case in CASES])
    result: dict[str, Any] = {"model": model_id, "reps": reps, "answers_identical": identical, "pulled_bytes": pulled,
                              "offload_connector": offload, "offload_error": offload_error}
    for case in CASES:
        for size in SIZES:
            value = p50.get((case, size))
            result[f"{case}_p50_s_{size}"] = None if value is None else round(value, 4)
    for size in SIZES:
        offload_p50 = p50.get(("vllm_cpu_offload", size))
        result[f"fabric_local_over_vllm_offload_{size}"] = (
            None if offload_p50 is None else round(p50["fabric_local", size] / offload_p50, 3))
        result[f"fabric_local_over_vllm_prefix_cache_{size}"] = round(p50["fabric_local", size] /
                                                                      p50["vllm_prefix_cache", size], 3)
        result[f"fabric_pull_over_recompute_{size}"] = round(p50["fabric_pull", size] / p50["recompute", size], 3)
        result[f"fabric_local_over_recompute_{size}"] = round(p50["fabric_local", size] / p50["recompute", size], 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small random model, one sample per size")
    parser.add_argument("--reps", type=int, default=5, help="samples per case and size (default run)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-vllm-") as tmp:
        emit_json(run(args.quick, 1 if args.quick else args.reps, Path(tmp)))


if __name__ == "__main__":
    main()
