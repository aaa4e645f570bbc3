"""KV payloads of a transformers model: its layout, its weights fingerprint, and the byte codec.

One payload per (block, layer), `bytes_per_block_layer` bytes, in the model's KV dtype:

    payload = K [kv_heads, block_size, head_dim]  ‖  V [kv_heads, block_size, head_dim]

that is, the block's slice of the layer's `DynamicLayer.keys` / `.values` (shape
[batch=1, kv_heads, seq, head_dim]) with the batch dimension dropped, K first. GQA and MQA store
only the KV heads. Both ends of a reuse run this codec, and the namespace (model id, weights
fingerprint, layout, block size) makes sure they agree on the model.

The namespace's `weights_fingerprint` is BLAKE3 of the checkpoint file when the model came from
one, else of the state dict (names, dtypes, shapes and bytes in name order), so two models with
different weights never share a key even under the same model id.
"""

from __future__ import annotations

from pathlib import Path

import blake3
import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel

from fabric.keys import Namespace
from fabric.layout import DType, KVLayout

_DTYPES = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16}
_CHUNK = 8 << 20


def kv_dtype(dtype: torch.dtype) -> DType:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"no KV dtype for torch {dtype}; expected float32, float16 or bfloat16") from None


def layout_of(config: PretrainedConfig, dtype: torch.dtype) -> KVLayout:
    """The MHA/GQA KV layout of a decoder config (Llama, Mistral, Qwen2, SmolLM2, ...)."""
    text = config.get_text_config(decoder=True)
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    return KVLayout.mha(int(text.num_hidden_layers), num_kv_heads, head_dim, kv_dtype(dtype))


def fingerprint_file(path: str | Path) -> str:
    """BLAKE3 hex of a checkpoint file, read in chunks."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def fingerprint_state_dict(model: torch.nn.Module) -> str:
    """BLAKE3 hex over the state dict: each tensor's name, dtype, shape and bytes, in name order."""
    h = blake3.blake3()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()


def namespace_for(model: PreTrainedModel, block_size: int, *, fingerprint: str, model_id: str | None = None,
                  tenant_salt: bytes = b"") -> Namespace:
    """The namespace of `model`'s KV blocks; `model_id` defaults to the config's name or model type."""
    config = model.config
    name = model_id or str(getattr(config, "_name_or_path", "") or config.model_type)
    return Namespace(name, layout_of(config, model.dtype), block_size, weights_fingerprint=fingerprint,
                     tenant_salt=tenant_salt)


def encode_layer(keys: torch.Tensor, values: torch.Tensor, first_block: int, num_blocks: int,
                 block_size: int, out: np.ndarray) -> None:
    """Write blocks `first_block ..` of one layer's K/V ([1, kv_heads, seq, head_dim]) into
    `out` (uint8 [num_blocks, bytes_per_block_layer])."""
    start, stop = first_block * block_size, (first_block + num_blocks) * block_size
    k = keys[0, :, start:stop].detach()
    v = values[0, :, start:stop].detach()
    kv_heads, _, head_dim = k.shape
    # [kv_heads, blocks*B, D] -> [blocks, kv_heads, B, D]; stacking K and V gives [blocks, 2, kv_heads, B, D].
    both = torch.stack([k.reshape(kv_heads, num_blocks, block_size, head_dim).transpose(0, 1),
                        v.reshape(kv_heads, num_blocks, block_size, head_dim).transpose(0, 1)], dim=1)
    dest = torch.from_numpy(out)
    dest.copy_(both.to("cpu").contiguous().view(torch.uint8).reshape(num_blocks, -1))


def encode_cache(layers: list[tuple[torch.Tensor, torch.Tensor]], first_block: int, num_blocks: int,
                 ns: Namespace) -> np.ndarray:
    """Payloads (uint8 [num_blocks, layers, bytes]) of blocks `first_block ..` from per-layer K/V."""
    out = np.empty((num_blocks, ns.layout.num_layers, ns.layout.bytes_per_block_layer(ns.block_size)),
                   dtype=np.uint8)
    for layer, (keys, values) in enumerate(layers):
        encode_layer(keys, values, first_block, num_blocks, ns.block_size, out[:, layer])
    return out


def decode_layer(payload: np.ndarray, ns: Namespace, device: torch.device | str = "cpu",
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ([1, kv_heads, num_blocks*B, head_dim], the model dtype) from one layer's payloads
    (uint8 [num_blocks, bytes_per_block_layer]). Copies once: the result owns its memory."""
    layout = ns.layout
    num_blocks = int(payload.shape[0])
    row = layout.head_dim * layout.dtype.itemsize
    # Permute as bytes (numpy has no bfloat16): [blocks, 2, H, B, row] -> [2, H, blocks, B, row].
    grouped = payload.reshape(num_blocks, 2, layout.num_kv_heads, ns.block_size, row)
    planes = np.ascontiguousarray(grouped.transpose(1, 2, 0, 3, 4))
    kv = torch.from_numpy(planes).view(layout.dtype.torch_dtype)
    kv = kv.reshape(2, 1, layout.num_kv_heads, num_blocks * ns.block_size, layout.head_dim).to(device)
    return kv[0], kv[1]
