"""KV dtypes and layouts: how many bytes one (block, layer) payload takes.

    MHA / GQA : 2 (K and V) x block_size x num_kv_heads x head_dim x itemsize
    MLA       : 1 latent vector per token: block_size x latent_dim x itemsize

GQA is MHA with fewer KV heads than query heads; only the KV heads are stored.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class DType(enum.StrEnum):
    """Element types a KV payload may hold. The value is the wire/config spelling."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    U8 = "u8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def torch_dtype(self) -> torch.dtype:
        # torch is imported here, not at module level: keys and transports need layouts but not
        # torch, and importing it is slow.
        import torch

        return {
            DType.F32: torch.float32,
            DType.F16: torch.float16,
            DType.BF16: torch.bfloat16,
            DType.FP8_E4M3: torch.float8_e4m3fn,
            DType.FP8_E5M2: torch.float8_e5m2,
            DType.U8: torch.uint8,
        }[self]

    @classmethod
    def parse(cls, name: str) -> DType:
        """Parse a config spelling; raises ValueError listing the valid names."""
        try:
            return cls(name.lower())
        except ValueError:
            valid = ", ".join(d.value for d in cls)
            raise ValueError(f"unknown KV dtype {name!r}; expected one of: {valid}") from None


_ITEMSIZE = {
    DType.F32: 4,
    DType.F16: 2,
    DType.BF16: 2,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.U8: 1,
}


class LayoutKind(enum.StrEnum):
    MHA = "mha"  # separate K and V per KV head (covers GQA and MQA)
    MLA = "mla"  # one compressed latent vector per token (DeepSeek-style)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache. For MLA, `head_dim` is the latent width and `num_kv_heads` is 1."""

    kind: LayoutKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.kind is LayoutKind.MLA and self.num_kv_heads != 1:
            raise ValueError(f"an MLA layout has one latent per token: num_kv_heads must be 1, "
                             f"got {self.num_kv_heads}")

    @classmethod
    def mha(cls, num_layers: int, num_kv_heads: int, head_dim: int, dtype: DType | str) -> KVLayout:
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        return cls(LayoutKind.MHA, num_layers, num_kv_heads, head_dim, dt)

    @classmethod
    def mla(cls, num_layers: int, latent_dim: int, dtype: DType | str) -> KVLayout:
        dt = dtype if isinstance(dtype, DType) else DType.parse(dtype)
        return cls(LayoutKind.MLA, num_layers, 1, latent_dim, dt)

    @property
    def num_kv_planes(self) -> int:
        """2 for MHA (K and V), 1 for MLA (one latent)."""
        return 2 if self.kind is LayoutKind.MHA else 1

    def bytes_per_token_layer(self) -> int:
        return self.num_kv_planes * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def bytes_per_block_layer(self, block_size: int) -> int:
        """Size of one stored unit: one block of `block_size` tokens for one layer."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return block_size * self.bytes_per_token_layer()

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * self.bytes_per_block_layer(block_size)

    def describe(self) -> dict[str, object]:
        """Canonical, order-stable description used in namespace hashing."""
        return {
            "kind": self.kind.value,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype.value,
        }
