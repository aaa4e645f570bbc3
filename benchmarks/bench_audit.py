"""How soon sampled recompute catches a lying producer, measured on a local 2-node Ray cluster.

The liar is a real node with a valid certificate: for each served prefix the bench stores KV whose
values are shifted (wrong) through that node's own API, so its key signs it as the producer. The
checker node's transformers engine (a seeded random GQA Llama, `HFEngine` over `FabricClient`)
then serves the prompt: it pulls the liar's blocks, or, when the load is sampled, computes them
and calls `Fabric.audit`. A catch quarantines the liar on every node; the bench checks that no
node then loads any of its blocks, lifts the quarantine (`release_producer`, the operator's call)
and carries on, so one run yields many independent "served prefixes until caught" samples.

    baseline   rate 0: no sampling; every served prefix hands the liar's bytes to the engine
    rate p     the boosts off (`new_boost` etc. = 1): each served prefix is sampled with
               probability p exactly, so P(caught within N) should be 1 - (1 - p)^N; with the
               default boosts a new or disputed producer is sampled more often, never less

    python benchmarks/bench_audit.py [--quick] [--rates 0.1,0.05] [--prefixes 150]

Last line: JSON with, per rate r (as "0.1"), `caught_within_{10,25,50}_{r}` measured and
`predicted_within_{10,25,50}_{r}`, `catches_{r}`, `prefixes_{r}`, `mean_prefixes_to_catch_{r}`, and
`baseline_wrong_bytes`, `wrong_blocks_after_quarantine` (0 is the bar).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_json, print_table

BLOCK = 16
VOCAB = 512
NUM_BLOCKS = 4
WITHIN = (10, 25, 50)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 prefixes per rate, 3 at rate 0 (smoke test)")
    parser.add_argument("--rates", default="0.1", help="comma-separated sampling rates")
    parser.add_argument("--prefixes", type=int, default=200, help="served prefixes per rate")
    parser.add_argument("--baseline", type=int, default=10, help="served prefixes at rate 0")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if any(not 0 < r <= 1 for r in rates):
        parser.error("rates are probabilities in (0, 1]")
    prefixes = 30 if args.quick else args.prefixes
    baseline = 3 if args.quick else args.baseline
    os.environ.setdefault("TQDM_DISABLE", "1")

    import numpy as np
    import ray
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.client import FabricClient
    from cluster.engines.hf.engine import HFEngine, LoadMode
    from cluster.engines.hf.kv import encode_cache, fingerprint_state_dict
    from cluster.launch import start_local_cluster
    from cluster.node.actor import node_actor_name
    from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,  # type: ignore[no-untyped-call]
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512))
    fingerprint = fingerprint_state_dict(model)
    reference = HFEngine(model, None, block_size=BLOCK, fingerprint=fingerprint, model_id="tiny-llama")
    ns = reference.namespace
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, o_direct=False, mirror_delay_s=0.0),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0),
                    audit=AuditConfig(rate=0.0, new_boost=1.0, stale_boost=1.0, dispute_boost=1.0, seed=11))
    rng = random.Random(5)
    served: dict[str, list[int]] = {}
    censored: dict[str, int] = {}
    wrong_after = 0
    baseline_wrong_bytes = 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-audit-") as tmp:
        local = start_local_cluster(2, Path(tmp) / "fabric", config)
        try:
            liar_id, checker_id = sorted(local.node_ids())
            liar, checker = FabricClient.connect(node_id=liar_id), FabricClient.connect(node_id=checker_id)
            checker_actor = ray.get_actor(node_actor_name(checker_id), namespace="kvfabric")
            liar_name = str(liar.stats()["node_name"])
            engine = HFEngine(model, checker, block_size=BLOCK, fingerprint=fingerprint, model_id="tiny-llama",
                              deadline_s=math.inf)

            def serve_lie() -> tuple[list[int], bool, int]:
                """One fresh prefix signed wrong by the liar, served by the checker's engine:
                (prompt, caught, wrong bytes the engine used)."""
                tokens = [rng.randrange(VOCAB) for _ in range(NUM_BLOCKS * BLOCK + 3)]
                cache = reference.prefill(tokens, export=False).cache
                true = encode_cache(HFEngine.kv_layers(cache), 0, NUM_BLOCKS, ns).view(np.float32)
                wrong = (true + 0.5).astype(np.float32).view(np.uint8)
                if liar.store(ns, tokens, wrong).num_stored != NUM_BLOCKS:
                    raise RuntimeError("the liar's node did not store its blocks")
                deadline = time.monotonic() + 30
                while checker.lookup(ns, tokens).num_blocks < NUM_BLOCKS:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the checker never saw the liar's blocks")
                    time.sleep(0.005)
                pre = engine.prefill(tokens, mode=LoadMode.FULL, export=False)
                caught = pre.audit is not None and liar_name in pre.audit.quarantined
                return tokens, caught, pre.pulled_bytes

            for _ in range(baseline):
                _, caught, used = serve_lie()
                assert not caught
                baseline_wrong_bytes += used
            for rate in rates:
                key = f"{rate:g}"
                ray.get(checker_actor.set_audit_rate.remote(rate))
                served[key], since = [], 0
                for _ in range(prefixes):
                    tokens, caught, _ = serve_lie()
                    since += 1
                    if not caught:
                        continue
                    served[key].append(since)
                    since = 0
                    # Quarantined: nobody loads any of its blocks, mirrors included; then the operator lifts it.
                    deadline = time.monotonic() + 30
                    while liar_name not in liar.stats()["quarantined"]:
                        if time.monotonic() > deadline:
                            raise RuntimeError("the quarantine did not reach the liar's node")
                        time.sleep(0.01)
                    wrong_after += sum(c.load(ns, tokens).num_blocks for c in (liar, checker))
                    checker.release_producer(liar_name)
                censored[key] = since
            ray.get(checker_actor.set_audit_rate.remote(0.0))
        finally:
            local.shutdown()

    result: dict[str, object] = {"quick": args.quick, "rates": rates, "prefixes_per_rate": prefixes,
                                 "block_size": BLOCK, "blocks_per_prefix": NUM_BLOCKS,
                                 "baseline_prefixes": baseline, "baseline_wrong_bytes": baseline_wrong_bytes,
                                 "wrong_blocks_after_quarantine": wrong_after,
                                 "seconds": round(time.perf_counter() - started, 1)}
    rows = []
    for rate in rates:
        key = f"{rate:g}"
        gaps = served[key]
        # A run still open at the end counts as "not caught within N" only once N served prefixes passed.
        for n in WITHIN:
            total = len(gaps) + (censored[key] >= n)
            result[f"caught_within_{n}_{key}"] = round(sum(g <= n for g in gaps) / total, 4) if total else None
            result[f"predicted_within_{n}_{key}"] = round(1 - (1 - rate) ** n, 4)
        result[f"catches_{key}"] = len(gaps)
        result[f"prefixes_{key}"] = prefixes
        result[f"mean_prefixes_to_catch_{key}"] = round(statistics.mean(gaps), 2) if gaps else None
        rows.append([key, prefixes, len(gaps), result[f"mean_prefixes_to_catch_{key}"], round(1 / rate, 1),
                     *(f"{result[f'caught_within_{n}_{key}']} / {result[f'predicted_within_{n}_{key}']}"
                       for n in WITHIN)])
    print_table("Catching a liar by sampled recompute (2-node cluster, the liar signs every prefix wrong; "
                "measured / predicted 1-(1-p)^N)",
                ["rate", "served prefixes", "catches", "mean prefixes to catch", "predicted mean 1/p",
                 *(f"caught within {n}" for n in WITHIN)], rows)
    print(f"baseline (rate 0): {baseline} prefixes, {baseline_wrong_bytes} wrong bytes handed to the engine; "
          f"after each quarantine: {wrong_after} of the liar's blocks loaded on any node")
    emit_json(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
