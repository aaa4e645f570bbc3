"""A small Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU) with an explicit KV cache.

Built from a config with seeded random weights — nothing is downloaded — so end-to-end checks run a
real transformer: prefill from a cached prefix must give the same logits as a full prefill.

KV per layer is returned as one tensor shaped (2, tokens, kv_heads, head_dim): plane 0 is K
(after RoPE), plane 1 is V, the same [K/V][token][head][dim] order as the pools' payloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fabric.keys import Namespace
from fabric.layout import KVLayout


@dataclass(frozen=True, slots=True)
class TinyLlamaConfig:
    vocab_size: int = 2048
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    ffn_dim: int = 512
    rope_theta: float = 10000.0
    seed: int = 0
    dtype: str = "f32"

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def layout(self) -> KVLayout:
        return KVLayout.mha(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    def namespace(self, block_size: int, tenant_salt: bytes = b"") -> Namespace:
        fingerprint = f"seed={self.seed};dim={self.dim};ffn={self.ffn_dim};vocab={self.vocab_size}"
        return Namespace(f"tiny-llama-{self.num_layers}l", self.layout(), block_size,
                         weights_fingerprint=fingerprint, tenant_salt=tenant_salt)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding on (tokens, heads, head_dim)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class _Layer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hd = cfg.head_dim
        self.attn_norm = _RMSNorm(cfg.dim)
        self.wq = nn.Linear(cfg.dim, cfg.num_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.num_kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.num_heads * hd, cfg.dim, bias=False)
        self.ffn_norm = _RMSNorm(cfg.dim)
        self.w_gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w_down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                past: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, hd = self.cfg, self.cfg.head_dim
        t = x.shape[0]
        h = self.attn_norm(x)
        q = _rope(self.wq(h).view(t, cfg.num_heads, hd), positions, cfg.rope_theta)
        k = _rope(self.wk(h).view(t, cfg.num_kv_heads, hd), positions, cfg.rope_theta)
        v = self.wv(h).view(t, cfg.num_kv_heads, hd)
        new_kv = torch.stack([k, v])
        kv = new_kv if past is None else torch.cat([past.to(new_kv.dtype), new_kv], dim=1)
        group = cfg.num_heads // cfg.num_kv_heads
        keys = kv[0].repeat_interleave(group, dim=1).transpose(0, 1)    # (heads, total, hd)
        values = kv[1].repeat_interleave(group, dim=1).transpose(0, 1)
        total = kv.shape[1]
        # Query i (absolute position total - t + i) sees keys 0..total - t + i.
        mask = torch.ones(t, total, dtype=torch.bool).tril(diagonal=total - t)
        out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
        x = x + self.wo(out.transpose(0, 1).reshape(t, -1))
        h = self.ffn_norm(x)
        x = x + self.w_down(nn.functional.silu(self.w_gate(h)) * self.w_up(h))
        return x, new_kv


class TinyLlama(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))
        self.norm = _RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() > 1:
                    p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5))
        self.eval()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, past: list[torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits for `tokens` given the KV of the tokens before them; returns the new tokens' KV."""
        start = 0 if past is None else past[0].shape[1]
        positions = torch.arange(start, start + tokens.shape[0])
        x = self.embed(tokens)
        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, positions, None if past is None else past[i])
            new_kv.append(kv)
        return self.lm_head(self.norm(x)), new_kv
