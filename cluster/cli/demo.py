"""`kvfabric demo`: a chat workload on SmolLM2 across three Ray nodes, with and without the fabric.

    driver: tokenize (manual as system prompt + question) ─► lookup on every node ─► Router.choose
        └─► HFEngineActor on the chosen node:  fabric answer  (layer-wise load of the cached prefix,
                                                               local or pulled over TLS, then the suffix)
                                               recompute answer (the same prompt from scratch)
    table: where each request ran, what it reused, both TTFTs, the answer, identical or not

The first request computes the ~1,000-token system prompt; later ones arrive in waves of three, so
the router's load term spreads a wave over the nodes: the first node serves from its own RAM, the
others pull the prefix from it (and keep a copy), after which every node has it locally. Exit code
1 if any answer differs from its recompute. The last line of stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from cluster.engines.hf.actor import Answer

MANUAL = Path(__file__).with_name("demo_manual.txt")
QUESTIONS = (
    "How long is the warranty?",
    "What does error E2 mean?",
    "How do I change the brew temperature?",
    "How much coffee goes into a double shot?",
    "How often should I descale the machine?",
    "What comes in the box?",
    "How long does the boiler take to heat up?",
    "Can I use vinegar to descale?",
    "How do I steam milk?",
    "What should I do when the shot runs too fast?",
)
# A request queued behind another on the same node waits about as long as ~20 blocks of prefill take
# on a CPU, so the router prefers a pull from a peer to queueing a second request on the owner.
LOAD_WEIGHT = 20.0
TOLERANCE = 1e-3
T = TypeVar("T")


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="SmolLM2 on a local 3-node Ray cluster: KV reuse and pulls, "
                                       "TTFT and answers against a recompute")
    demo.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                      help="the engine on every node: transformers (hf) or vLLM with kvfabric as its KV connector")
    demo.add_argument("--nodes", type=int, default=3, help="Ray nodes, one engine each")
    demo.add_argument("--questions", type=int, default=7, help=f"requests (at most {len(QUESTIONS)})")
    demo.add_argument("--wave", type=int, default=3, help="requests that arrive together after the first")
    demo.add_argument("--max-new-tokens", type=int, default=16, help="greedy answer length")
    demo.add_argument("--block-size", type=int, default=None, help="tokens per block (default: 16, vLLM 32)")
    demo.add_argument("--mode", choices=("layerwise", "full"), default="layerwise",
                      help="how an engine loads a cached prefix")
    demo.add_argument("--workdir", help="folder for the SSD tiers, indexes and certificates "
                                        "(default: a temporary folder; the dequantised checkpoint is cached "
                                        "under $KVFABRIC_HOME/checkpoints, default ~/.cache/kvfabric)")
    demo.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class Served:
    index: int
    question: str
    node_id: str
    fabric: Answer
    recompute: Answer

    @property
    def identical(self) -> bool:
        return self.fabric.tokens == self.recompute.tokens

    @property
    def logit_diff(self) -> float:
        return float(abs(self.fabric.logits - self.recompute.logits).max())


def waves(num_requests: int, size: int) -> list[list[int]]:
    """The first request alone (it computes the shared prompt), then groups of `size`."""
    rest = list(range(1, num_requests))
    return [[0]] + [rest[i:i + size] for i in range(0, len(rest), size)] if num_requests else []


def run(args: argparse.Namespace) -> int:
    from cluster.cli.main import CLIError
    if not 1 <= args.questions <= len(QUESTIONS):
        raise CLIError(f"--questions must be in 1..{len(QUESTIONS)}")
    if args.nodes < 1 or args.wave < 1 or args.max_new_tokens < 1:
        raise CLIError("--nodes, --wave and --max-new-tokens must be positive")
    if args.engine == "vllm":
        from cluster.cli.demo_vllm import run_vllm

        return run_vllm(args)
    args.block_size = args.block_size or 16
    console = Console(width=150)
    served, totals = in_workdir(args, lambda workdir: _serve(args, workdir, console))
    return _report(served, totals, args, console)


def in_workdir(args: argparse.Namespace, serve: Callable[[Path], T]) -> T:
    """`serve(workdir)` in `--workdir`, or in a temporary folder removed afterwards."""
    if args.workdir:
        return serve(Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="kvfabric-demo-") as tmp:
        return serve(Path(tmp))


def route(router: Any, clients: dict[str, Any], ns: Any, tokens: list[int]) -> tuple[str, Any]:
    """The node `router` picks for `tokens`, and that node's lookup reply. Each node's lookup carries
    the load its engine reported: the router weighs that against the cached prefix (a busy node
    holding the prefix may lose to an idle one)."""
    from cluster.router import NodeView
    from fabric.keys import block_hashes

    replies = {n: c.lookup(ns, tokens) for n, c in clients.items()}
    node = router.choose(block_hashes(ns, tokens), [NodeView.of(n, r) for n, r in replies.items()]).node_id
    return node, replies[node]


def _serve(args: argparse.Namespace, workdir: Path, console: Console) -> tuple[list[Served], dict[str, Any]]:
    # Heavy imports here: `kvfabric --help` and the other commands should not pay for torch and Ray.
    import ray
    from rich.progress import Progress
    from transformers.utils import logging as hf_logging

    from cluster.client import FabricClient
    from cluster.engines.hf.actor import spawn_engines
    from cluster.engines.hf.engine import SMOLLM2_ID, chat_tokens, load_tokenizer, smollm2_checkpoint
    from cluster.launch import start_local_cluster
    from cluster.router import Router
    from fabric.config import AuditConfig, Config, KVConfig

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    os.environ.setdefault("TQDM_DISABLE", "1")   # the GGUF loader's own progress bar
    with console.status("SmolLM2-135M-Instruct: dequantising its GGUF file once (~20 s), or reading the cache"):
        checkpoint, fingerprint = smollm2_checkpoint()
        tokenizer = load_tokenizer(checkpoint)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    system = MANUAL.read_text()
    questions = QUESTIONS[:args.questions]
    prompts = [chat_tokens(tokenizer, system, q) for q in questions]
    with console.status(f"starting {args.nodes} Ray nodes with the fabric and an engine on each"):
        # The demo shows each path once: no sampled recompute (docs/security.md) in the middle of it.
        local = start_local_cluster(args.nodes, workdir / "fabric", Config(kv=KVConfig(ram_gib=0.5),
                                                                          audit=AuditConfig(rate=0.0)))
    try:
        with console.status("loading the engines"):
            nodes = sorted(local.node_ids())
            engines = spawn_engines(nodes, str(checkpoint), fingerprint=fingerprint, model_id=SMOLLM2_ID,
                                    block_size=args.block_size, num_threads=1)
        ns = ray.get(engines[nodes[0]].namespace.remote())
        clients = {n: FabricClient.connect(node_id=n) for n in nodes}
        router = Router(load_weight=LOAD_WEIGHT)
        served: list[Served] = []
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("requests", total=len(prompts))
            for wave in waves(len(prompts), args.wave):
                pending = []
                for i in wave:
                    node, reply = route(router, clients, ns, prompts[i])
                    pending.append((i, node, engines[node].serve.remote(
                        prompts[i], args.max_new_tokens, eos_token_id=eos, mode=args.mode)))
                    await_report(clients[node], ns, prompts[i], reply.load.requests)
                for i, node, ref in pending:
                    fabric, recompute = ray.get(ref)
                    router.record(len(prompts[i]) // args.block_size, fabric.num_reused_tokens // args.block_size)
                    served.append(Served(i, questions[i], node, fabric, recompute))
                    progress.advance(task)
        stats = [clients[n].stats() for n in nodes]
    finally:
        local.shutdown()
    pulled: dict[str, int] = {}
    for s in stats:
        pulled[s["transport"]] = pulled.get(s["transport"], 0) + int(s["pulled_bytes"])
    answers = {s.index: str(tokenizer.decode(s.fabric.tokens, skip_special_tokens=True)) for s in served}
    return served, {"hit_ratio": router.hit_ratio, "pulled": pulled, "answers": answers, "nodes": nodes,
                    "system_tokens": len(tokenizer(system)["input_ids"])}


def await_report(client: Any, ns: Any, tokens: list[int], before: int, timeout_s: float = 5.0) -> None:
    """Wait until the node's engine has reported the request just sent (its load grew), so the next
    routing decision sees it."""
    deadline = time.monotonic() + timeout_s
    while client.lookup(ns, tokens).load.requests <= before and time.monotonic() < deadline:
        time.sleep(0.01)


def short(text: str, words: int = 8) -> str:
    parts = text.split()
    return " ".join(parts[:words]) + (" …" if len(parts) > words else "")


def _report(served: list[Served], totals: dict[str, Any], args: argparse.Namespace, console: Console) -> int:
    nodes: list[str] = totals["nodes"]
    node_names = {n: f"node {k + 1}" for k, n in enumerate(nodes)}
    table = Table(title=f"kvfabric demo: SmolLM2-135M-Instruct on {len(nodes)} Ray nodes, "
                        f"{totals['system_tokens']}-token system prompt, block size {args.block_size}, "
                        f"{args.mode} loading")
    for col, justify in (("req", "right"), ("node", "left"), ("prompt", "right"), ("local", "right"),
                         ("pulled", "right"), ("TTFT fabric", "right"), ("TTFT recompute", "right"),
                         ("answer (first words)", "left"), ("same", "center")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for s in sorted(served, key=lambda s: s.index):
        f = s.fabric
        table.add_row(str(s.index + 1), node_names[s.node_id], str(f.num_tokens),
                      str(f.num_reused_tokens - f.num_pulled_tokens), str(f.num_pulled_tokens),
                      f"{f.ttft_s:.2f} s", f"{s.recompute.ttft_s:.2f} s", short(totals["answers"][s.index]),
                      "✓" if s.identical else "✗")
    console.print(table)
    fabric_p50 = statistics.median(s.fabric.ttft_s for s in served)
    recompute_p50 = statistics.median(s.recompute.ttft_s for s in served)
    worst = max(s.logit_diff for s in served)
    identical = all(s.identical for s in served)
    pulled = ", ".join(f"{kind}: {n / 1e6:.1f} MB" for kind, n in sorted(totals["pulled"].items())) or "none"
    console.print(f"hit ratio {totals['hit_ratio']:.2f} (prompt blocks reused instead of computed) · "
                  f"bytes pulled per transport: {pulled}")
    console.print(f"TTFT p50: {fabric_p50:.2f} s with the fabric, {recompute_p50:.2f} s recomputing "
                  f"({recompute_p50 / fabric_p50:.1f}x) · max |Δ logits| {worst:.1e} · "
                  f"answers identical: {'yes' if identical else 'NO'}")
    ok = identical and worst <= TOLERANCE
    if not ok:
        console.print("[red]FAILED[/red]: an answer or its logits differ from the recompute")
    print(json.dumps({"hit_ratio": round(totals["hit_ratio"], 4), "ttft_p50_fabric_s": round(fabric_p50, 4),
                      "ttft_p50_recompute_s": round(recompute_p50, 4), "max_abs_logit_diff": worst,
                      "answers_identical": identical}))
    return 0 if ok else 1
