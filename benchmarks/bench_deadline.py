"""Load or recompute: TTFT when the link to the owner is slower, or faster, than the break-even.

    python benchmarks/bench_deadline.py [--quick] [--reps N] [--tokens N]

SmolLM2-135M-Instruct on a local 2-node Ray cluster with the fabric. Node A computes and stores a
prompt's prefix; node B then answers a prompt with the same prefix, pulling it from A over TLS-TCP,
with A's egress capped (`NodeActor.set_send_rate`, the `[transport] send_rate_mb_s` knob) at:

    uncapped    the pull on this host's loopback
    fast        3x the break-even bandwidth (KV bytes per token / prefill seconds per token): B's
                load as it decides by itself, and a plain pull of everything (`deadline_s=inf`,
                no decision), alternating
    slow        1/3 of the break-even, where pulling loses to recomputing: B's load as it decides,
                and B recomputing the same prompt with nothing cached (the baseline), each first
                on every other repetition

Each link is one block of repetitions, in that order, as a link's speed changes rarely: the slow
block starts with B's estimate of A from the fast link, so its first request learns the link is
slow (its pull is cut at the deadline) and later ones do not pull. Medians over the repetitions.

JSON keys: ttft_slow_link_over_recompute, ttft_fast_link_over_pull, breakeven_mb_s, and the medians.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import emit_json, median, print_table

PHASES = ("uncapped", "fast", "fast_plain", "slow")


def prompt_pair(num_prefix: int, seed: int, vocab: int) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(100, vocab) for _ in range(num_prefix)]
    return (prefix + [rng.randrange(100, vocab) for _ in range(16)],
            prefix + [rng.randrange(100, vocab) for _ in range(16)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="256-token prefix (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per link (default 5; --quick 2)")
    parser.add_argument("--tokens", type=int, default=2048, help="prefix tokens")
    args = parser.parse_args()
    reps = args.reps or (2 if args.quick else 5)
    tokens = 256 if args.quick else args.tokens
    os.environ.setdefault("TQDM_DISABLE", "1")

    import ray
    from transformers.utils import logging as hf_logging

    from cluster.engines.hf.actor import spawn_engines
    from cluster.engines.hf.engine import SMOLLM2_ID, LoadMode, smollm2_checkpoint
    from cluster.launch import start_local_cluster
    from cluster.node.actor import node_actor_name
    from fabric.config import AuditConfig, Config, KVConfig

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    ttft: dict[str, list[float]] = {p: [] for p in (*PHASES, "recompute")}
    pulled: dict[str, list[int]] = {p: [] for p in PHASES}
    with tempfile.TemporaryDirectory(prefix="kvfabric-bench-deadline-") as tmp:
        checkpoint, fingerprint = smollm2_checkpoint()
        vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
        # No sampled recompute: which tokens were pulled is what this bench measures.
        local = start_local_cluster(2, Path(tmp) / "fabric", Config(kv=KVConfig(ram_gib=1.0),
                                                                    audit=AuditConfig(rate=0.0)),
                                    object_store_bytes=1 << 30)
        try:
            a, b = sorted(local.node_ids())
            owner = ray.get_actor(node_actor_name(a), namespace="kvfabric")
            engines = spawn_engines([a, b], str(checkpoint), fingerprint=fingerprint, model_id=SMOLLM2_ID,
                                    block_size=16, num_threads=2)
            ns = ray.get(engines[a].namespace.remote())
            # Warm-up, and the break-even: both engines recompute once (and report their prefill rate).
            warm, _ = prompt_pair(tokens, seed=999, vocab=vocab)
            ray.get(engines[a].answer.remote(warm, 1, export=False))
            base = ray.get(engines[b].recompute.remote(warm, 1))
            kv_per_token = ns.layout.bytes_per_block(16) / 16
            breakeven = kv_per_token / (base.ttft_s / len(warm)) / 1e6
            rates = {"uncapped": 0.0, "fast": 3 * breakeven, "fast_plain": 3 * breakeven, "slow": breakeven / 3}
            for k, phase in enumerate(PHASES):
                for rep in range(reps):
                    first, second = prompt_pair(tokens, seed=100 * rep + k, vocab=vocab)
                    ray.get(owner.set_send_rate.remote(0.0))
                    ray.get(engines[a].answer.remote(first, 1))          # A computes and stores the prefix
                    ray.get(owner.set_send_rate.remote(rates[phase]))
                    if phase == "slow" and rep % 2:     # the baseline first on odd repetitions: no order bias
                        ttft["recompute"].append(ray.get(engines[b].recompute.remote(second, 1)).ttft_s)
                    got = ray.get(engines[b].answer.remote(second, 1, mode=LoadMode.FULL.value, export=False,
                                                           deadline_s=math.inf if phase == "fast_plain" else None))
                    ttft[phase].append(got.ttft_s)
                    pulled[phase].append(got.num_pulled_tokens)
                    if phase == "slow" and not rep % 2:
                        ttft["recompute"].append(ray.get(engines[b].recompute.remote(second, 1)).ttft_s)
        finally:
            local.shutdown()

    med = {p: median(v) for p, v in ttft.items()}
    rows = [[p, f"{rates[p]:.1f}" if rates[p] else "-", med[p], median(pulled[p]),
             " ".join(f"{t:.2f}" for t in ttft[p])] for p in PHASES]
    rows.append(["recompute (B)", "-", med["recompute"], 0, " ".join(f"{t:.2f}" for t in ttft["recompute"])])
    print_table(f"TTFT on node B, {tokens}-token prefix held by A, A's egress capped (break-even "
                f"{breakeven:.1f} MB/s), medians of {reps}",
                ["link", "MB/s", "TTFT s", "pulled tokens", "each repetition"], rows)
    emit_json({"quick": args.quick, "reps": reps, "tokens": tokens, "breakeven_mb_s": round(breakeven, 2),
               **{f"ttft_{p}_s": round(med[p], 4) for p in med},
               "ttft_slow_link_over_recompute": round(med["slow"] / med["recompute"], 4),
               "ttft_fast_link_over_pull": round(med["fast"] / med["fast_plain"], 4)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
