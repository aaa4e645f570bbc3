"""vLLM's paged KV views <-> fabric payloads, on the shapes and strides vLLM 0.32 hands a connector:
the CPU backend's head-major pages (LBHNC), CUDA FlashAttention's token-major pages (LBNHC), a
layer-interleaved cache (BLHNC) and manager blocks split into kernel pages. The payload of a page is
the same bytes whatever the strides, so a page written by one layout reads back in any other. The
CUDA device path runs where torch sees a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.engines.vllm.paged import PagedLayer, layer_order

BLOCKS, HEADS, TOKENS, CONTENT = 12, 2, 16, 64    # C: K and V of one head and token slot, 2 x head_size
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def logical_view(layout: str, device: str, num_layers: int = 3, layer: int = 1) -> torch.Tensor:
    """One layer's [B, H, N, C] view of a cache allocated in `layout`'s physical order (as vLLM does)."""
    shape = {"L": num_layers, "B": BLOCKS, "H": HEADS, "N": TOKENS, "C": CONTENT}
    raw = torch.randn(*(shape[d] for d in layout), device=device)
    order = [layout.index(d) for d in "LBHNC"]
    return raw.permute(*order)[layer]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC"])
def test_a_page_round_trips_through_a_payload_in_every_layout(layout: str, device: str) -> None:
    source = PagedLayer.of(logical_view(layout, device), BLOCKS)
    target_view = logical_view("LBHNC", device)
    target = PagedLayer.of(target_view, BLOCKS)
    assert source.page_bytes == HEADS * TOKENS * CONTENT * 4

    payloads = np.empty((3, source.page_bytes), np.uint8)
    source.gather([7, 2, 9], payloads)
    before = target_view.clone()
    payloads.flags.writeable = False     # payloads come read-only out of the object store
    target.scatter([1, 4, 5], payloads)

    for src, dst in zip([7, 2, 9], [1, 4, 5], strict=True):
        assert torch.equal(target_view[dst], source.cache[src])
    untouched = [b for b in range(BLOCKS) if b not in (1, 4, 5)]
    assert torch.equal(target_view[untouched], before[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_pages_group_into_one_payload_per_manager_block(device: str) -> None:
    ratio = 2     # the kernel's block is half the scheduler's: 2 kernel pages per manager block
    kernel = logical_view("LBHNC", device)        # [12 kernel pages, ...] = 6 manager blocks
    paged = PagedLayer.of(kernel, BLOCKS // ratio)
    assert paged.page_bytes == ratio * HEADS * TOKENS * CONTENT * 4
    out = np.empty((1, paged.page_bytes), np.uint8)
    paged.gather([3], out)
    expected = torch.cat([kernel[6].reshape(-1), kernel[7].reshape(-1)]).cpu().numpy().view(np.uint8)
    assert np.array_equal(out[0], expected)


def test_payloads_of_the_wrong_size_are_refused_and_nothing_is_written() -> None:
    view = logical_view("LBHNC", "cpu")
    before = view.clone()
    with pytest.raises(ValueError, match="do not fit"):
        PagedLayer.of(view, BLOCKS).scatter([0, 1], np.zeros((2, 100), np.uint8))
    assert torch.equal(view, before)
    with pytest.raises(ValueError, match="manager blocks"):
        PagedLayer.of(view, 5)


def test_layers_are_numbered_in_model_order() -> None:
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]
