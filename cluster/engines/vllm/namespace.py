"""Whose KV a vLLM request's blocks are: the fabric's own `Namespace`, never vLLM's block hash.

    model_id  = "<model>|vllm:<device>:<attention backend>|<extra key>"
    layout    = KVLayout.mha(attention layers, KV heads per TP rank, head size, KV cache dtype)
    block     = vLLM's block size (a manager block: one payload per block and layer)
    shard     = TP rank of num_shards = TP size (each rank stores and loads its own heads)
    weights   = BLAKE3 over the checkpoint's weight files (or the fingerprint the operator gives)
    salt      = the caller's tenant, bound by the node from its credential (cluster/tenancy.py)

The extra key separates requests that must not share KV although their tokens are equal: a
`cache_salt` (vLLM's per-request isolation) and a LoRA adapter. The salt is hashed, so it never
appears in the fabric's stats or logs. Block hashes then chain over the prompt's token ids
(fabric/keys.py): two engines share a block exactly when all of this and every token before it match.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import blake3
import torch

from cluster.errors import ClusterError
from fabric.keys import Namespace
from fabric.layout import DType, KVLayout

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
SALT_CONTEXT = "kvfabric 2026-11 vllm cache_salt v1"   # BLAKE3 key derivation of a request's cache_salt
_DTYPES = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16,
           torch.float8_e4m3fn: DType.FP8_E4M3, torch.float8_e5m2: DType.FP8_E5M2, torch.uint8: DType.U8}
_CHUNK = 8 << 20


class UnsupportedModelError(ClusterError, ValueError):
    """A model whose KV the connector cannot address (several KV cache groups, MLA, ...)."""


def weights_fingerprint(model: str) -> str:
    """BLAKE3 hex over the weight files of a local checkpoint folder (names and bytes, name order);
    raises ValueError for a model that is not a local folder (give `weights_fingerprint` instead)."""
    folder = Path(model)
    files = sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []
    if not files:
        raise ValueError(f"cannot fingerprint the weights of {model!r}: not a local folder with weight files; "
                         "set kv_connector_extra_config.weights_fingerprint (e.g. the model's revision hash)")
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for path in files:
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def kv_dtype(dtype: torch.dtype) -> DType:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise UnsupportedModelError(f"no fabric KV dtype for vLLM's KV cache dtype {dtype}") from None


def base_namespace(vllm_config: Any, kv_cache_config: Any, extra: dict[str, Any]) -> Namespace:
    """The namespace of this engine's KV (TP rank 0, no extra key) from vLLM's configs."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise UnsupportedModelError(f"the fabric connector supports models with one KV cache group (full attention "
                                    f"in every layer); this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if getattr(spec, "sliding_window", None) or not hasattr(spec, "num_kv_heads") or getattr(spec, "use_mla", False):
        raise UnsupportedModelError("the fabric connector supports full-attention MHA/GQA layers, "
                                    f"not {type(spec).__name__}")
    layout = KVLayout.mha(len(groups[0].layer_names), int(spec.num_kv_heads), int(spec.head_size), kv_dtype(spec.dtype))
    model = str(extra.get("model_id") or vllm_config.model_config.model)
    fingerprint = str(extra.get("weights_fingerprint") or weights_fingerprint(vllm_config.model_config.model))
    return engine_namespace(model, fingerprint, layout, int(spec.block_size), engine_kind(vllm_config),
                            num_shards=int(vllm_config.parallel_config.tensor_parallel_size))


def engine_namespace(model_id: str, fingerprint: str, layout: KVLayout, block_size: int, kind: str, *,
                     num_shards: int = 1) -> Namespace:
    """The namespace a vLLM engine's connector uses (TP rank 0, no extra key); `kind` as `engine_kind`."""
    return Namespace(f"{model_id}|vllm:{kind}", layout, block_size, weights_fingerprint=fingerprint,
                     num_shards=num_shards)


def engine_kind(vllm_config: Any) -> str:
    """The device type and attention backend: what the bytes of a KV page mean."""
    from vllm.platforms import current_platform

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return f"{current_platform.device_type}:{getattr(backend, 'name', backend) or 'default'}"


def request_namespace(base: Namespace, *, cache_salt: str | None, lora_name: str | None) -> Namespace:
    """`base` for one request: its cache salt and LoRA adapter as an extra key."""
    if not cache_salt and not lora_name:
        return base
    parts = [base.model_id]
    if lora_name:
        parts.append(f"lora={lora_name}")
    if cache_salt:
        parts.append("salt=" + blake3.blake3(cache_salt.encode(), derive_key_context=SALT_CONTEXT).hexdigest())
    return dataclasses.replace(base, model_id="|".join(parts))


def shard_namespace(ns: Namespace, rank: int) -> Namespace:
    """`ns` for TP rank `rank` (each rank holds its own KV heads)."""
    return ns if ns.shard == rank else dataclasses.replace(ns, shard=rank)

