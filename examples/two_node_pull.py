"""Two nodes on one machine: node B reuses a prefix that node A computed, pulled over mTLS.

    .venv/bin/python examples/two_node_pull.py [--transport tls-tcp|quic] [--workdir DIR]

This is the fabric's read path without Ray (the cluster layer wraps the same steps):

  node A: engine prefill → KV blocks per (block, layer) → Store A (SSD + RAM) → transport server
  node B: tokens → block hashes → Store B misses → pull from A (certificates of one cluster CA,
          every payload checked against its BLAKE3 digest) → mirror into Store B → engine B
          scatters the pulled KV and prefills only the rest → logits equal a full prefill.

Exit status 0 only when node B reused the whole shared prefix and its logits match.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from cluster.engines.reference.paged import PagedEngine
from cluster.engines.reference.tiny_llama import TinyLlama, TinyLlamaConfig
from fabric.config import KVConfig, TransportConfig, TransportKind
from fabric.keys import BlockAddress, addresses, block_hashes
from fabric.store import Store
from fabric.tiers.base import Payload
from transports.core.base import Hit, Peer
from transports.factory import create_client, create_server
from transports.trust.certs import init_ca, issue_node

logger = logging.getLogger("two_node_pull")


def open_store(root: Path, node: str) -> Store:
    return Store.open(KVConfig(ssd_dir=str(root / node / "ssd"), index_dir=str(root / node / "index"),
                               ram_gib=0.25, write_through=True))


async def pull_prefix(kind: TransportKind, root: Path, store_a: Store, store_b: Store,
                      wanted: list[BlockAddress]) -> tuple[dict[BlockAddress, Payload], float, int]:
    """Serve Store A, pull `wanted` into node B; mirror what verifies. Returns (pulled, seconds, misses)."""
    cert_dir = str(root / "certs")
    server = create_server(TransportConfig(kind=kind, cert_dir=cert_dir, node_name="node-a"), store_a)
    host, port = await server.start()
    client = create_client(TransportConfig(kind=kind, cert_dir=cert_dir, node_name="node-b"))
    pulled: dict[BlockAddress, Payload] = {}
    misses = 0
    start = time.perf_counter()
    try:
        async for result in client.pull(Peer("node-a", host, port), wanted):
            if isinstance(result, Hit):
                store_b.mirror(result.address, result.payload, digest=result.digest)
                pulled[result.address] = result.payload
            else:
                misses += 1
                logger.info("miss for %s: %s", result.address, result.reason)
    finally:
        await client.close()
        await server.close()
    return pulled, time.perf_counter() - start, misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=("tls-tcp", "quic"), default="tls-tcp")
    parser.add_argument("--workdir", help="folder for both nodes' stores and the certificates")
    parser.add_argument("--system-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="kvfabric-two-nodes-")
    root = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    try:
        return run(args.transport, root, args.system_tokens)
    finally:
        if tmp is not None:
            tmp.cleanup()


def run(kind: TransportKind, root: Path, system_tokens: int) -> int:
    init_ca(root / "certs", overwrite=True)
    for node in ("node-a", "node-b"):
        issue_node(root / "certs", node)
    cfg = TinyLlamaConfig()
    model = TinyLlama(cfg)
    rng = random.Random(0)
    system = [rng.randrange(cfg.vocab_size) for _ in range(system_tokens)]
    prompt_a = system + [rng.randrange(cfg.vocab_size) for _ in range(20)]
    prompt_b = system + [rng.randrange(cfg.vocab_size) for _ in range(30)]
    block_size = 16
    num_blocks = 4 * (len(prompt_b) // block_size + 1)
    with open_store(root, "node-a") as store_a, open_store(root, "node-b") as store_b:
        engine_a = PagedEngine(model, num_blocks, block_size, store=store_a)
        stored = engine_a.prefill(prompt_a).num_stored_blocks
        ns = engine_a.namespace
        wanted = addresses(block_hashes(ns, prompt_b), cfg.num_layers)
        local = store_b.lookup(wanted).num_leading
        pulled, seconds, misses = asyncio.run(pull_prefix(kind, root, store_a, store_b, wanted))
        mirrored = store_b.lookup(wanted).num_leading
        engine_b = PagedEngine(model, num_blocks, block_size, store=store_b)
        result = engine_b.prefill(prompt_b, pulled=pulled)
        full, _ = model(torch.tensor(prompt_b))
        diff = float((full[result.num_reused_tokens:] - result.logits).abs().max())
    nbytes = sum(memoryview(p).nbytes for p in pulled.values())
    table = Table(title=f"node B reuses node A's prefix over {kind} (mutual TLS)")
    for col in ("node A stored", "node B local before", "pulled (block, layer)", "misses", "bytes", "pull ms",
                "mirrored in B", "tokens reused by B", "max |Δ logits|"):
        table.add_column(col)
    table.add_row(f"{stored} blocks", str(local), str(len(pulled)), str(misses), str(nbytes), f"{seconds * 1e3:.0f}",
                  str(mirrored), f"{result.num_reused_tokens}/{len(prompt_b)}", f"{diff:.1e}")
    Console(width=140).print(table)
    # Node A holds the shared system prompt's full blocks; B's own tail blocks are misses by design.
    expected = (system_tokens // block_size) * block_size
    expected_pulls = expected // block_size * cfg.num_layers
    if len(pulled) < expected_pulls or result.num_reused_tokens < expected or diff > 1e-3:
        print(f"FAILED: misses={misses} reused={result.num_reused_tokens} (expected {expected}) diff={diff:.2e}")
        return 1
    print(f"OK: node B reused {result.num_reused_tokens} tokens pulled from node A; logits match a full prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())
