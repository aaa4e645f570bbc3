"""The cross-node read path end to end (without Ray): node B reuses node A's prefix over mTLS."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch
from testkit import Pki

from cluster.engines.reference.paged import PagedEngine
from cluster.engines.reference.tiny_llama import TinyLlama, TinyLlamaConfig
from examples.two_node_pull import open_store, pull_prefix, run
from fabric.keys import BlockAddress, addresses, block_hashes


@pytest.mark.parametrize("kind", ["tls-tcp", "quic"])
def test_node_b_reuses_node_a_prefix(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(kind, tmp_path, system_tokens=64) == 0
    out = capsys.readouterr().out
    assert "OK: node B reused 64 tokens pulled from node A" in out
    # The pulled blocks were mirrored into node B's SSD tier: real files, one per (block, layer).
    assert len(list((tmp_path / "node-b" / "ssd").rglob("*.kvb"))) >= 4 * 4


def test_a_corrupt_block_on_the_owner_is_recomputed_by_the_puller(tmp_path: Path, pki: Pki) -> None:
    """Bit rot on node A's SSD: A refuses to serve the block, B pulls what verifies and recomputes the rest."""
    cfg = TinyLlamaConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128)
    model = TinyLlama(cfg)
    rng = random.Random(5)
    system = [rng.randrange(cfg.vocab_size) for _ in range(4 * 16)]
    prompt = system + [rng.randrange(cfg.vocab_size) for _ in range(7)]
    with open_store(tmp_path, "node-a") as store_a:
        assert PagedEngine(model, 16, 16, store=store_a).prefill(prompt).num_stored_blocks == 4
    hashes = block_hashes(cfg.namespace(16), prompt)
    bad = BlockAddress(hashes[2], 1)
    (victim,) = (tmp_path / "node-a" / "ssd").rglob(f"{bad.storage_key.hex()[:16]}-1.kvb")
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0x01
    victim.write_bytes(bytes(raw))

    with open_store(tmp_path, "node-a") as store_a, open_store(tmp_path, "node-b") as store_b:
        wanted = addresses(hashes, cfg.num_layers)
        pulled, _, misses = asyncio.run(pull_prefix("tls-tcp", tmp_path, store_a, store_b, wanted))
        assert misses == 1 and bad not in pulled and len(pulled) == len(wanted) - 1
        assert store_a.stats()["corrupt_blocks"]["ssd"] == 1
        result = PagedEngine(model, 16, 16, store=store_b).prefill(prompt, pulled=pulled)
    assert result.num_reused_tokens == 2 * 16  # blocks 0 and 1; block 2 failed on A, so 2 and 3 are recomputed
    full, _ = model(torch.tensor(prompt))
    torch.testing.assert_close(result.logits, full[result.num_reused_tokens:], rtol=1e-4, atol=1e-4)
