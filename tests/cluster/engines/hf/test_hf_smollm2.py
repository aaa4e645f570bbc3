"""The adapter on the real checkpoint the demo runs: SmolLM2-135M-Instruct (GGUF, dequantised to
f32 once and cached, ~20 s on 2 cores the first time), a chat prompt over part of the demo's manual."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from cluster.engines.hf.engine import (
    SMOLLM2_FILE,
    HFEngine,
    LoadMode,
    chat_tokens,
    load_checkpoint,
    load_tokenizer,
    smollm2_checkpoint,
    smollm2_folder,
)
from cluster.engines.hf.kv import fingerprint_file
from cluster.node.local import LocalFabric
from fabric.config import KVConfig
from fabric.store import Store

MANUAL = Path(__file__).resolve().parents[4] / "cluster" / "cli" / "demo_manual.txt"
BLOCK = 16


@pytest.fixture(scope="module")
def smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    folder, fingerprint = smollm2_checkpoint()
    return load_checkpoint(folder), load_tokenizer(folder), fingerprint


@pytest.fixture
def fabric(tmp_path: Path) -> Iterator[LocalFabric]:
    kv = KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), ram_gib=0.5)
    with Store.open(kv) as store:
        yield LocalFabric(store)


def test_smollm2_continues_after_loaded_kv_exactly_as_a_recompute(
        smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase, str], fabric: LocalFabric) -> None:
    model, tokenizer, fingerprint = smollm2
    system = MANUAL.read_text().split("\n4. ")[0]   # the first sections: ~400 tokens keep this test short
    first = chat_tokens(tokenizer, system, "What is in the box?")
    second = chat_tokens(tokenizer, system, "How full should I fill the water tank?")

    engine = HFEngine(model, fabric, block_size=BLOCK, fingerprint=fingerprint)
    layout = engine.namespace.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (30, 3, 64)
    assert fingerprint == fingerprint_file(smollm2_folder() / SMOLLM2_FILE)

    engine.prefill(first)
    got = engine.generate(second, 32, mode=LoadMode.LAYERWISE)
    expected = HFEngine(model, None, block_size=BLOCK, fingerprint=fingerprint).generate(second, 32)

    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert got.prefill.num_reused_tokens == shared // BLOCK * BLOCK > 300
    assert float((got.prefill.logits - expected.prefill.logits).abs().max()) <= 1e-4
    assert got.tokens == expected.tokens
    assert "water" in str(tokenizer.decode(got.tokens)).lower()   # it answers the question it was asked
