"""A checkpoint the project writes (`save_checkpoint`) loads in transformers and in vLLM with the same
logits. The model ties its input and output embeddings, as SmolLM2 does: vLLM's Llama loader then
reads only `model.embed_tokens.weight`, so a checkpoint without it runs on zero embeddings.

What is compared: for every prompt position, the log-probability vLLM reports for the prompt's next
token (`prompt_logprobs`) against transformers' log-softmax of the same position, float32 on both
sides, within 1e-4 (CPU kernels differ in summation order only); and 16 greedy tokens, exactly.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from cluster.engines.hf.engine import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.vllm
TOLERANCE = 1e-4
VOCAB = 512


def tied_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    # head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ...
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        tie_word_embeddings=True))


def test_checkpoint_names_the_tied_embedding_and_architecture(tmp_path: Path) -> None:
    model = tied_llama()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor("model.embed_tokens.weight"), model.model.embed_tokens.weight)
    assert "lm_head.weight" not in names      # tied: written once, under the input embedding's name
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    reloaded = load_checkpoint(folder)
    prompt = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(reloaded(prompt).logits, model(prompt).logits)


def test_checkpoint_loads_in_vllm_with_the_same_logits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model = tied_llama()
    folder = save_checkpoint(model, tmp_path / "ckpt")
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(80)]
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()

    llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              compilation_config={"mode": 0}, max_model_len=512, block_size=32, seed=0)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, prompt_logprobs=0, detokenize=False)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert out.prompt_logprobs is not None
    got = [out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))]   # type: ignore[index]
    want = [float(expected[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE
    assert list(out.outputs[0].token_ids) == greedy
