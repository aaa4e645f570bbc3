"""The transformers adapter over a real Store (RAM and SSD tiers, digest-checked), on seeded random
Llama models small enough to run in a fraction of a second: MHA and GQA, block sizes 16 and 64."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.api import IncompleteLoadError, LayerStream
from cluster.engines.hf.cache import LayerwiseCache
from cluster.engines.hf.engine import HFEngine, LoadMode
from cluster.node.local import LocalFabric
from fabric.config import KVConfig
from fabric.keys import BlockAddress, block_hashes
from fabric.store import Store
from fabric.tiers.ssd_format import HEADER_SIZE

VOCAB = 512
SYSTEM_TOKENS = 150
TOLERANCE = 1e-4


def tiny_llama(num_kv_heads: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=num_kv_heads, max_position_embeddings=512)
    return LlamaForCausalLM(config)


def prompts(seed: int = 1) -> tuple[list[int], list[int]]:
    """Two chat-like prompts: a shared system prefix, then different questions."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM_TOKENS)]
    return (system + [rng.randrange(VOCAB) for _ in range(20)],
            system + [rng.randrange(VOCAB) for _ in range(27)])


def open_store(root: Path) -> Store:
    return Store.open(KVConfig(ssd_dir=str(root / "ssd"), index_dir=str(root / "index"), ram_gib=0.1,
                               write_through=True))


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with open_store(tmp_path) as s:
        yield s


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("num_kv_heads,block_size", [(4, 16), (2, 16), (4, 64), (1, 64)],
                         ids=["mha-16", "gqa-16", "mha-64", "mqa-64"])
def test_continuing_after_loaded_kv_matches_recompute(store: Store, num_kv_heads: int, block_size: int) -> None:
    model = tiny_llama(num_kv_heads)
    first, second = prompts()
    writer = HFEngine(model, LocalFabric(store), block_size=block_size)
    wrote = writer.prefill(first)
    assert wrote.num_reused_tokens == 0 and wrote.num_stored_blocks == len(first) // block_size

    reader = HFEngine(model, LocalFabric(store), block_size=block_size)
    reused = reader.generate(second, 32)
    expected = HFEngine(model, None, block_size=block_size).generate(second, 32)

    shared_blocks = SYSTEM_TOKENS // block_size
    assert reused.prefill.num_reused_tokens == shared_blocks * block_size
    assert max_diff(reused.prefill.logits, expected.prefill.logits) <= TOLERANCE
    assert reused.tokens == expected.tokens


def test_whole_prompt_cached_still_computes_the_last_token(store: Store) -> None:
    model = tiny_llama(2)
    prompt = prompts()[0][:128]   # exactly 8 blocks of 16
    engine = HFEngine(model, LocalFabric(store), block_size=16)
    engine.prefill(prompt)
    again = engine.prefill(prompt)
    assert again.num_reused_tokens == 112   # 7 blocks: the last block holds the token whose logits we need
    assert max_diff(again.logits, HFEngine(model, None).prefill(prompt).logits) <= TOLERANCE


def test_block_corrupted_on_ssd_becomes_a_recompute(tmp_path: Path) -> None:
    model = tiny_llama(2)
    first, second = prompts()
    with open_store(tmp_path) as store:
        engine = HFEngine(model, LocalFabric(store), block_size=16)
        engine.prefill(first)
        ns = engine.namespace
    # Flip one bit in the payload of block 3, layer 2 (the store wrote it through to its SSD folder).
    key = BlockAddress(block_hashes(ns, first)[3], 2).storage_key
    path = tmp_path / "ssd" / f"{key[0]:02x}" / f"{key.hex()[:16]}-2.kvb"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x04
    path.write_bytes(bytes(data))

    with open_store(tmp_path) as store:   # a fresh process's view: everything comes off the SSD
        engine = HFEngine(model, LocalFabric(store), block_size=16)
        got = engine.generate(second, 32)
        assert got.prefill.num_reused_tokens == 3 * 16
        assert got.prefill.sources == ("ssd", "ssd", "ssd")
        expected = HFEngine(model, None).generate(second, 32)
        assert max_diff(got.prefill.logits, expected.prefill.logits) <= TOLERANCE
        assert got.tokens == expected.tokens
        # The recomputed blocks were exported again: the same prompt now reuses all but its last token.
        assert engine.prefill(second).num_reused_tokens == (len(second) - 1) // 16 * 16


@pytest.mark.parametrize("num_kv_heads,block_size", [(2, 16), (4, 64)], ids=["gqa-16", "mha-64"])
def test_layerwise_load_gives_the_same_output_as_loading_everything_first(
        store: Store, num_kv_heads: int, block_size: int) -> None:
    model = tiny_llama(num_kv_heads)
    first, second = prompts()
    engine = HFEngine(model, LocalFabric(store), block_size=block_size)
    engine.prefill(first)
    whole = engine.generate(second, 32, mode=LoadMode.FULL, export=False)
    layerwise = engine.generate(second, 32, mode=LoadMode.LAYERWISE, export=False)
    assert layerwise.prefill.num_reused_tokens == whole.prefill.num_reused_tokens > 0
    assert not layerwise.prefill.fell_back
    assert max_diff(layerwise.prefill.logits, whole.prefill.logits) <= 1e-6
    assert layerwise.tokens == whole.tokens


class DelayedFabric(LocalFabric):
    """LocalFabric whose layer stream hands out one layer every `delay_s` (a stand-in for layers
    arriving over a network), optionally failing after `fail_after` layers (a peer that dies
    midway; a real dead peer needs the cluster, tested there)."""

    def __init__(self, store: Store, delay_s: float, fail_after: int | None = None) -> None:
        super().__init__(store)
        self.delay_s = delay_s
        self.fail_after = fail_after

    def load_layers(self, ns, tokens, *, max_blocks=None, deadline_s=None, audit=False):  # type: ignore[no-untyped-def]
        return _Delayed(super().load_layers(ns, tokens, max_blocks=max_blocks), self.delay_s, self.fail_after)


class _Delayed:
    def __init__(self, inner: LayerStream, delay_s: float, fail_after: int | None) -> None:
        self.inner, self.delay_s, self.fail_after = inner, delay_s, fail_after
        self.num_blocks, self.sources, self.audit_blocks = inner.num_blocks, inner.sources, inner.audit_blocks

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        import time
        for layer, payload in self.inner:
            if self.fail_after is not None and layer >= self.fail_after:
                raise IncompleteLoadError(f"peer gone before layer {layer}")
            time.sleep(self.delay_s)
            yield layer, payload


def test_forward_pass_starts_before_the_last_layer_arrives(store: Store) -> None:
    model = tiny_llama(2)
    first, second = prompts()
    HFEngine(model, LocalFabric(store)).prefill(first)
    engine = HFEngine(model, DelayedFabric(store, delay_s=0.05))
    got = engine.prefill(second, mode=LoadMode.LAYERWISE, export=False)
    cache = got.cache
    assert isinstance(cache, LayerwiseCache)
    layer0_started = cache.streamed[0].consumed_s
    last_arrived = cache.feed.arrived_s[-1]
    assert layer0_started is not None and last_arrived is not None
    assert layer0_started < last_arrived   # layer 0 ran while layers 1.. were still on their way
    # What the engine reports (and bench_ttft prints): compute done before the last layer came.
    assert 0 < got.overlap_s < got.ttft_s
    assert engine.prefill(second, mode=LoadMode.FULL, export=False).overlap_s == 0.0   # nothing left to arrive
    expected = HFEngine(model, None).prefill(second)
    assert max_diff(got.logits, expected.logits) <= TOLERANCE


def test_layer_stream_that_breaks_midway_is_redone_as_a_plain_load(store: Store) -> None:
    model = tiny_llama(2)
    first, second = prompts()
    HFEngine(model, LocalFabric(store)).prefill(first)
    engine = HFEngine(model, DelayedFabric(store, delay_s=0.0, fail_after=2))
    got = engine.generate(second, 32, mode=LoadMode.LAYERWISE, export=False)
    expected = HFEngine(model, None).generate(second, 32)
    assert got.prefill.fell_back and got.prefill.num_reused_tokens == (SYSTEM_TOKENS // 16) * 16
    assert max_diff(got.prefill.logits, expected.prefill.logits) <= TOLERANCE
    assert got.tokens == expected.tokens


def test_models_with_different_weights_never_share_kv(store: Store) -> None:
    first, second = prompts()
    a = HFEngine(tiny_llama(2, seed=0), LocalFabric(store), model_id="llama")
    b = HFEngine(tiny_llama(2, seed=1), LocalFabric(store), model_id="llama")
    a_again = HFEngine(tiny_llama(2, seed=0), LocalFabric(store), model_id="llama")
    assert a.namespace.weights_fingerprint != b.namespace.weights_fingerprint
    assert a.namespace.root != b.namespace.root
    assert a.namespace == a_again.namespace   # same weights, same keys: another process can reuse them
    a.prefill(first)
    assert b.prefill(second, export=False).num_reused_tokens == 0
    assert a_again.prefill(second, export=False).num_reused_tokens > 0
