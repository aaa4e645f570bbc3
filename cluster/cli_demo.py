"""`kvfabric demo`: prefix reuse end to end on one machine, with a real (tiny, seeded) transformer.

Phase 1 serves requests that share a long system prompt: the first computes it, later ones reuse
its blocks from the engine's pool. Phase 2 restarts the engine and the store over the same
folders: the prefix now comes back from the SSD tier (digest-checked). Every request's logits
are compared with a full prefill; any difference beyond float noise fails the demo.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from cluster.cli import CLIError
from cluster.engines.paged import PagedEngine, PrefillResult
from cluster.engines.tiny_llama import TinyLlama, TinyLlamaConfig
from fabric.config import KVConfig
from fabric.store import Store

logger = logging.getLogger(__name__)
TOLERANCE = 1e-3


def register(sub: Any) -> None:
    demo = sub.add_parser("demo", help="prefix reuse with a tiny transformer, pool and tiered store")
    demo.add_argument("--workdir", help="folder for the SSD tier and index (default: a temporary folder)")
    demo.add_argument("--system-tokens", type=int, default=512, help="length of the shared system prompt")
    demo.add_argument("--requests", type=int, default=4, help="requests per phase")
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=run)


def _store(workdir: Path) -> Store:
    kv = KVConfig(ssd_dir=str(workdir / "ssd"), index_dir=str(workdir / "index"), ram_gib=0.25,
                  write_through=True, durable=True)
    return Store.open(kv)


def _serve(engine: PagedEngine, model: TinyLlama, prompts: list[list[int]], phase: str,
           rows: list[list[str]]) -> float:
    worst = 0.0
    for i, prompt in enumerate(tqdm(prompts, desc=phase, unit="req")):
        result: PrefillResult = engine.prefill(prompt)
        t0 = time.perf_counter()
        full, _ = model(torch.tensor(prompt))
        full_s = time.perf_counter() - t0
        diff = float((full[result.num_reused_tokens:] - result.logits).abs().max())
        worst = max(worst, diff)
        engine.finish(result.seq)
        source = "+".join(name for name, n in (("pool", result.num_device_hit_tokens),
                                               ("store", result.num_store_hit_tokens)) if n)
        rows.append([phase, str(i), str(len(prompt)), str(result.num_reused_tokens), source or "-",
                     f"{result.prefill_s * 1e3:.0f}", f"{full_s * 1e3:.0f}", f"{diff:.1e}"])
    return worst


def run(args: argparse.Namespace) -> int:
    if args.system_tokens < args.block_size:
        raise CLIError(f"--system-tokens must be at least one block ({args.block_size})")
    cfg = TinyLlamaConfig(seed=args.seed)
    model = TinyLlama(cfg)
    rng = random.Random(args.seed)
    system = [rng.randrange(cfg.vocab_size) for _ in range(args.system_tokens)]
    prompts = [system + [rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(8, 40))]
               for _ in range(args.requests)]
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="kvfabric-demo-")
    workdir = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    num_blocks = 4 * (len(max(prompts, key=len)) // args.block_size + 1)
    rows: list[list[str]] = []
    try:
        with _store(workdir) as store:
            engine = PagedEngine(model, num_blocks, args.block_size, store=store)
            worst = _serve(engine, model, prompts, "fresh", rows)
            stats = store.stats()
        logger.info("store closed; starting a new engine and store over %s", workdir)
        with _store(workdir) as store:
            engine = PagedEngine(model, num_blocks, args.block_size, store=store)
            worst = max(worst, _serve(engine, model, prompts, "restarted", rows))
    finally:
        if tmp is not None:
            tmp.cleanup()
    table = Table(title=f"kvfabric demo: {cfg.num_layers}-layer GQA model, {args.system_tokens}-token system prompt, "
                        f"block size {args.block_size}")
    for col in ("phase", "request", "tokens", "reused", "from", "prefill ms", "full prefill ms", "max |Δ logits|"):
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    console = Console(width=120)
    console.print(table)
    console.print(f"store after phase 1: {stats['ram']['blocks']} (block, layer) payloads in RAM, "
                  f"{stats['ssd']['blocks']} on SSD; phase 2 reopened it from disk")
    if worst > TOLERANCE:
        console.print(f"[red]FAILED[/red]: logits differ from a full prefill by {worst:.2e} (> {TOLERANCE})")
        return 1
    console.print(f"OK: every reused prefix gave the same logits as a full prefill (max diff {worst:.1e})")
    return 0
