"""KV layouts: bytes per (block, layer) for every dtype and layout variant."""

from __future__ import annotations

import pytest
import torch

from fabric.layout import DType, KVLayout, LayoutKind


@pytest.mark.parametrize(("dtype", "size"), [("f32", 4), ("f16", 2), ("bf16", 2), ("fp8_e4m3", 1),
                                             ("fp8_e5m2", 1), ("u8", 1)])
def test_itemsize_matches_torch(dtype: str, size: int) -> None:
    d = DType.parse(dtype)
    assert d.itemsize == size
    assert torch.empty(0, dtype=d.torch_dtype).element_size() == size


def test_mha_gqa_and_mla_sizes() -> None:
    llama8b = KVLayout.mha(32, 8, 128, "bf16")  # GQA: 8 KV heads
    assert llama8b.bytes_per_block_layer(16) == 2 * 16 * 8 * 128 * 2
    assert llama8b.bytes_per_block(16) == 32 * 65536
    mla = KVLayout.mla(61, 576, "fp8_e4m3")
    assert mla.kind is LayoutKind.MLA and mla.num_kv_planes == 1
    assert mla.bytes_per_block_layer(64) == 64 * 576


def test_bad_layouts() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype"):
        DType.parse("f64")
    with pytest.raises(ValueError):
        KVLayout.mha(0, 8, 128, "f16")
    with pytest.raises(ValueError):
        KVLayout(LayoutKind.MLA, 4, 2, 64, DType.F16)
    with pytest.raises(ValueError):
        KVLayout.mha(2, 2, 8, "f16").bytes_per_block_layer(0)
