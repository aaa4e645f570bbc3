"""`kvfabric demo --engine vllm`: the demo's chat workload on vLLM engines, kvfabric as their KV connector.

    driver: tokenize (manual as system prompt + question) ─► lookup on every node ─► Router.choose
        └─► VLLMEngineActor on the chosen node (vLLM, prefix caching off, KVFabricConnector):
              fabric    the prompt through the connector: its cached prefix loaded layer by layer from
                        the node's tiers or pulled from a peer, the rest computed and stored
              recompute the same vLLM with the connector turned off for the request
    table: where each request ran, blocks reused and pulled, both TTFTs, identical or not

vLLM's own prefix cache is off so that the fabric is the only reuse and the recompute is a real one.
TTFT is the wall time of a one-token request; the answer is a separate greedy request of
`--max-new-tokens`. Exit code 1 if any greedy token differs. Last line of stdout: JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from cluster.cli.demo import LOAD_WEIGHT, MANUAL, QUESTIONS, await_report, in_workdir, route, short, waves

if TYPE_CHECKING:
    from cluster.engines.vllm.engine_actor import Completion

VLLM_BLOCK = 32     # vLLM's CPU attention takes blocks of a multiple of 32 tokens


@dataclass(frozen=True, slots=True)
class Served:
    index: int
    node_id: str
    num_tokens: int
    fabric: Completion
    recompute: Completion
    num_pulled_blocks: int

    @property
    def identical(self) -> bool:
        return self.fabric.tokens == self.recompute.tokens


def run_vllm(args: argparse.Namespace) -> int:
    from cluster.cli.main import CLIError
    if not 1 <= args.questions <= len(QUESTIONS):
        raise CLIError(f"--questions must be in 1..{len(QUESTIONS)}")
    args.block_size = args.block_size or VLLM_BLOCK
    if args.block_size % 32:
        raise CLIError("--block-size must be a multiple of 32 for vLLM's CPU attention")
    console = Console(width=150)
    served, totals = in_workdir(args, lambda workdir: _serve(args, workdir, console))
    return _report(served, totals, args, console)


def _serve(args: argparse.Namespace, workdir: Path, console: Console) -> tuple[list[Served], dict[str, Any]]:
    import ray

    from cluster.client import FabricClient
    from cluster.engines.hf.engine import SMOLLM2_ID, chat_tokens, load_tokenizer, smollm2_checkpoint
    from cluster.engines.vllm.engine_actor import spawn_vllm_engines
    from cluster.engines.vllm.namespace import engine_namespace
    from cluster.launch import start_local_cluster
    from cluster.router import Router
    from fabric.config import Config, KVConfig
    from fabric.layout import KVLayout

    os.environ.setdefault("TQDM_DISABLE", "1")
    with console.status("SmolLM2-135M-Instruct: dequantising its GGUF file once (~20 s), or reading the cache"):
        checkpoint, fingerprint = smollm2_checkpoint()
        tokenizer = load_tokenizer(checkpoint)
    system = MANUAL.read_text()
    questions = QUESTIONS[:args.questions]
    prompts = [chat_tokens(tokenizer, system, q) for q in questions]
    with console.status(f"starting {args.nodes} Ray nodes with the fabric"):
        local = start_local_cluster(args.nodes, workdir / "fabric", Config(kv=KVConfig(ram_gib=0.5)))
    try:
        nodes = sorted(local.node_ids())
        extra = {"model_id": SMOLLM2_ID, "weights_fingerprint": fingerprint}
        with console.status(f"starting a vLLM engine with the kvfabric connector on each of the {len(nodes)} nodes"):
            engines = spawn_vllm_engines(nodes, str(checkpoint), block_size=args.block_size, prefix_caching=False,
                                         extra=extra, max_model_len=2048)
        ns = engine_namespace(SMOLLM2_ID, fingerprint, KVLayout.mha(30, 3, 64, "f32"), args.block_size, "cpu:default")
        clients = {n: FabricClient.connect(node_id=n) for n in nodes}
        router = Router(load_weight=LOAD_WEIGHT)
        served: list[Served] = []
        for wave in waves(len(prompts), args.wave):
            pending = []
            for i in wave:
                node, reply = route(router, clients, ns, prompts[i])
                pulled = sum(1 for loc in reply.locations if loc.where.value == "peer")
                pending.append((i, node, pulled, engines[node].serve.remote(prompts[i], args.max_new_tokens)))
                await_report(clients[node], ns, prompts[i], reply.load.requests)
            for i, node, pulled, ref in pending:
                fabric, recompute = ray.get(ref)
                reused = fabric.num_cached_tokens // args.block_size
                router.record(len(prompts[i]) // args.block_size, reused)
                served.append(Served(i, node, len(prompts[i]), fabric, recompute, min(pulled, reused)))
        stats = [clients[n].stats() for n in nodes]
        for engine in engines.values():
            ray.get(engine.shutdown.remote())
    finally:
        local.shutdown()
    answers = {s.index: str(tokenizer.decode(s.fabric.tokens, skip_special_tokens=True)) for s in served}
    return served, {"hit_ratio": router.hit_ratio, "pulled_bytes": sum(int(s["pulled_bytes"]) for s in stats),
                    "answers": answers, "nodes": nodes, "system_tokens": len(tokenizer(system)["input_ids"])}


def _report(served: list[Served], totals: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    names = {n: f"node {k + 1}" for k, n in enumerate(totals["nodes"])}
    table = Table(title=f"kvfabric demo: vLLM (SmolLM2-135M-Instruct) with the kvfabric connector on "
                        f"{len(names)} Ray nodes, {totals['system_tokens']}-token system prompt, "
                        f"block size {args.block_size}")
    for col in ("req", "node", "prompt", "blocks reused", "of which pulled", "TTFT fabric", "TTFT recompute",
                "answer (first words)", "same"):
        table.add_column(col)
    for s in sorted(served, key=lambda s: s.index):
        table.add_row(str(s.index + 1), names[s.node_id], str(s.num_tokens),
                      str(s.fabric.num_cached_tokens // args.block_size), str(s.num_pulled_blocks),
                      f"{s.fabric.seconds:.2f} s", f"{s.recompute.seconds:.2f} s", short(totals["answers"][s.index]),
                      "✓" if s.identical else "✗")
    console.print(table)
    fabric_p50 = statistics.median(s.fabric.seconds for s in served)
    recompute_p50 = statistics.median(s.recompute.seconds for s in served)
    identical = all(s.identical for s in served)
    console.print(f"hit ratio {totals['hit_ratio']:.2f} · pulled {totals['pulled_bytes'] / 1e6:.1f} MB · TTFT p50 "
                  f"{fabric_p50:.2f} s with the fabric, {recompute_p50:.2f} s recomputing · answers identical: "
                  f"{'yes' if identical else 'NO'}")
    if not identical:
        console.print("[red]FAILED[/red]: a greedy answer differs from the recompute")
    print(json.dumps({"engine": "vllm", "hit_ratio": round(totals["hit_ratio"], 4),
                      "pulled_bytes": totals["pulled_bytes"], "ttft_p50_fabric_s": round(fabric_p50, 4),
                      "ttft_p50_recompute_s": round(recompute_p50, 4), "answers_identical": identical}))
    return 0 if identical else 1
