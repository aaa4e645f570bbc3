"""vLLM's paged KV cache as fabric payloads: one (block, layer) payload is one page of one layer.

vLLM 0.32 hands every attention layer's cache to a connector as a 4-d logical view

    kv[B, H, N, C]     B pages, H KV heads (this TP rank's), N tokens per page, C content
                       (K and V of one head and token slot: 2 x head_size elements)

whose physical strides depend on the backend's layout (CPU: LBHNC, pages head-major; CUDA
FlashAttention: LBNHC, token-major inside a page; layer-interleaved BLHNC, ...). A payload is the
page's logical [H, N, C] in that order, so its bytes do not depend on the strides:

    payload(block, layer) = kv_layer[page_id].contiguous().view(uint8)    (H*N*C*itemsize bytes)
                          = KVLayout.mha(..).bytes_per_block_layer(block_size)

What the C elements of a slot mean (where K ends and V starts) is the attention backend's, so the
namespace names the backend (namespace.py) and a payload is only ever read back by the same kind.

A page of the scheduler (a "manager block") may be split into `ratio` kernel pages when the
kernel's block size is smaller; `PagedLayer` groups them back so that one manager block is one
payload: view [B * ratio, H, N', C] -> [B, ratio, H, N', C]. Gathers and scatters are one indexed
copy per layer per step (O(blocks) work, no per-token loop).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class PagedLayer:
    """One attention layer's cache with manager blocks as dimension 0."""

    cache: torch.Tensor          # [num_blocks, ...page dims], a view of vLLM's memory

    @classmethod
    def of(cls, kv: torch.Tensor, num_blocks: int) -> PagedLayer:
        """Wrap vLLM's per-layer view `kv` ([B', H, N, C]) of a cache of `num_blocks` manager blocks."""
        if kv.dim() != 4:
            raise ValueError(f"expected a 4-d [blocks, heads, tokens, content] KV view, got shape {tuple(kv.shape)}")
        if kv.shape[0] == num_blocks:
            return cls(kv)
        if kv.shape[0] % num_blocks:
            raise ValueError(f"a KV view of {kv.shape[0]} pages does not split into {num_blocks} manager blocks")
        return cls(kv.view(num_blocks, -1, *kv.shape[1:]))   # splitting dim 0 is a view for any strides

    @property
    def page_bytes(self) -> int:
        return int(self.cache[0].numel() * self.cache.element_size())

    def gather(self, block_ids: Sequence[int], out: np.ndarray) -> None:
        """Copy pages `block_ids` into `out` (uint8 [len(block_ids), page_bytes], may be strided)."""
        if len(block_ids) == 0:
            return
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.cache.device)
        pages = self.cache.index_select(0, index).contiguous()
        data = pages.view(torch.uint8).reshape(len(block_ids), -1)
        torch.from_numpy(out).copy_(data.cpu() if data.device.type != "cpu" else data)

    def scatter(self, block_ids: Sequence[int], payloads: np.ndarray) -> None:
        """Write `payloads` (uint8 [len(block_ids), page_bytes], may be read-only) into pages `block_ids`."""
        if len(block_ids) == 0:
            return
        if payloads.shape != (len(block_ids), self.page_bytes):
            raise ValueError(f"payloads of shape {payloads.shape} do not fit {len(block_ids)} pages of "
                             f"{self.page_bytes} bytes")
        with warnings.catch_warnings():
            # Payloads come zero-copy out of Ray's object store, read-only; they are only read here.
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(payloads)
        pages = source.to(self.cache.device, non_blocking=True).view(self.cache.dtype)
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.cache.device)
        self.cache.index_copy_(0, index, pages.reshape(len(block_ids), *self.cache.shape[1:]))


def layer_order(names: Sequence[str]) -> list[str]:
    """Attention layer names in model order (`model.layers.10.self_attn.attn` after `...9...`):
    the fabric's layer i is the i-th of them."""
    def index(name: str) -> tuple[int, ...]:
        return tuple(int(part) for part in name.split(".") if part.isdigit())
    return sorted(names, key=lambda n: (index(n), n))
