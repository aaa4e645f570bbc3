"""End to end on one node: a real (tiny, seeded) transformer reusing KV from its pool and its store.

The user-visible promise: a reused prefix gives the same logits as a full prefill, after a
restart too, and a corrupted stored block is recomputed, never served.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from cluster.engines.reference.paged import OutOfBlocks, PagedEngine
from cluster.engines.reference.sequence import SeqState
from cluster.engines.reference.tiny_llama import TinyLlama, TinyLlamaConfig
from fabric.config import KVConfig
from fabric.keys import BlockAddress, block_hashes
from fabric.store import Store

CFG = TinyLlamaConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128, seed=3)
BS = 8


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return TinyLlama(CFG)


def _store(tmp_path: Path) -> Store:
    return Store.open(KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"),
                               write_through=True), background=False)


def _prompt(rng: random.Random, system: list[int], extra: int) -> list[int]:
    return system + [rng.randrange(CFG.vocab_size) for _ in range(extra)]


def _assert_same_as_full(model: TinyLlama, prompt: list[int], logits: torch.Tensor, reused: int) -> None:
    full, _ = model(torch.tensor(prompt))
    torch.testing.assert_close(logits, full[reused:], rtol=1e-4, atol=1e-4)


def test_pool_reuse_matches_full_prefill(model: TinyLlama) -> None:
    rng = random.Random(1)
    system = [rng.randrange(CFG.vocab_size) for _ in range(5 * BS)]
    engine = PagedEngine(model, num_blocks=32, block_size=BS)
    first = engine.prefill(_prompt(rng, system, 3))
    assert first.num_reused_tokens == 0
    engine.finish(first.seq)
    prompt = _prompt(rng, system, 11)
    second = engine.prefill(prompt)
    assert second.num_device_hit_tokens == 5 * BS
    _assert_same_as_full(model, prompt, second.logits, second.num_reused_tokens)


def test_store_reuse_survives_restart(model: TinyLlama, tmp_path: Path) -> None:
    rng = random.Random(2)
    system = [rng.randrange(CFG.vocab_size) for _ in range(6 * BS)]
    with _store(tmp_path) as store:
        engine = PagedEngine(model, num_blocks=32, block_size=BS, store=store)
        r = engine.prefill(_prompt(rng, system, 5))
        assert r.num_stored_blocks == 6
    with _store(tmp_path) as store:  # a new process would see exactly these folders
        engine = PagedEngine(model, num_blocks=32, block_size=BS, store=store)
        prompt = _prompt(rng, system, 9)
        r = engine.prefill(prompt)
        assert r.num_device_hit_tokens == 0 and r.num_store_hit_tokens == 6 * BS
        _assert_same_as_full(model, prompt, r.logits, r.num_reused_tokens)


def test_corrupt_stored_block_is_recomputed_not_served(model: TinyLlama, tmp_path: Path) -> None:
    rng = random.Random(3)
    system = [rng.randrange(CFG.vocab_size) for _ in range(4 * BS)]
    with _store(tmp_path) as store:
        PagedEngine(model, num_blocks=32, block_size=BS, store=store).prefill(_prompt(rng, system, 2))
    files = sorted((tmp_path / "ssd").rglob("*.kvb"))
    assert len(files) == 4 * CFG.num_layers
    # Flip one payload byte in the file of the third block's layer 1.
    engine_ns = CFG.namespace(BS)
    third = BlockAddress(block_hashes(engine_ns, system)[2], 1)
    target = [f for f in files if f.name.startswith(third.storage_key.hex()[:16])]
    assert len(target) == 1
    raw = bytearray(target[0].read_bytes())
    raw[-10] ^= 0xFF
    target[0].write_bytes(bytes(raw))
    with _store(tmp_path) as store:
        engine = PagedEngine(model, num_blocks=32, block_size=BS, store=store)
        prompt = _prompt(rng, system, 4)
        r = engine.prefill(prompt)
        assert r.num_store_hit_tokens == 2 * BS  # blocks 0 and 1 only: block 2 failed its digest
        _assert_same_as_full(model, prompt, r.logits, r.num_reused_tokens)
        assert store.stats()["corrupt_blocks"]["ssd"] == 1


def test_out_of_blocks_is_reported(model: TinyLlama) -> None:
    engine = PagedEngine(model, num_blocks=2, block_size=BS)
    with pytest.raises(OutOfBlocks, match="need 3 blocks"):
        engine.prefill(list(range(3 * BS)))


def test_a_fully_cached_prompt_recomputes_its_last_block_for_the_logits(model: TinyLlama, tmp_path: Path) -> None:
    prompt = list(range(100, 100 + 4 * BS))  # exactly four full blocks
    with _store(tmp_path) as store:
        PagedEngine(model, num_blocks=32, block_size=BS, store=store).prefill(prompt)
    with _store(tmp_path) as store:
        engine = PagedEngine(model, num_blocks=32, block_size=BS, store=store)
        r = engine.prefill(prompt)  # every block is in the store: the last one is computed anyway
        assert (r.num_device_hit_tokens, r.num_store_hit_tokens) == (0, 3 * BS)
        _assert_same_as_full(model, prompt, r.logits, r.num_reused_tokens)
        engine.finish(r.seq)
        again = engine.prefill(prompt)  # now every block is in the pool too
        assert (again.num_device_hit_tokens, again.num_store_hit_tokens) == (3 * BS, 0)
        _assert_same_as_full(model, prompt, again.logits, again.num_reused_tokens)


def test_a_fully_cached_prompt_never_writes_into_a_block_another_sequence_holds(tmp_path: Path) -> None:
    # An f16 pool: the last block recomputed over the rounded cached prefix differs in its low bits
    # from the first computation, so a write into a shared block shows in the other sequence's KV.
    model = TinyLlama(dataclasses.replace(CFG, dtype="f16"))
    with _store(tmp_path) as store:
        engine = PagedEngine(model, num_blocks=32, block_size=BS, store=store)
        prompt = list(range(200, 200 + 3 * BS))  # exactly three full blocks

        def kv_of(seq: SeqState) -> list[torch.Tensor]:
            slots = engine._slots(seq, 0, len(seq.token_ids))
            return [engine.pool.layer_buffer(layer)[:, slots].clone() for layer in range(CFG.num_layers)]

        first = engine.prefill(prompt)
        kv_before = kv_of(first.seq)
        second = engine.prefill(prompt)  # every block is cached and `first` still holds them
        for layer, (before, after) in enumerate(zip(kv_before, kv_of(first.seq), strict=True)):
            assert torch.equal(before, after), f"layer {layer} of the first sequence's KV changed"
        assert second.num_device_hit_tokens == 2 * BS  # the last block is computed, so not taken as a hit
        assert second.seq.block_table[:2] == first.seq.block_table[:2]
        assert second.seq.block_table[2] != first.seq.block_table[2]
        assert [engine.blocks.ref_count(b) for b in second.seq.block_table] == [2, 2, 1]
        # The recomputed last block came from the store: it is not put again (other low bits: CONFLICT).
        assert second.num_stored_blocks == 0
        assert store.stats()["put_rejected"]["conflict"] == 0
        engine.finish(first.seq)
        engine.finish(second.seq)
        engine.blocks.check()
