"""KV pools on real torch tensors: payload round trips, allocators, storage types."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.engines.reference.kv_pool import (
    DoubleFreeError,
    ReqToTokenPool,
    SlotAllocator,
    StorageType,
    StorageUnavailableError,
    TokenToKVPool,
    allocate_tensor,
    payload_from_buffer,
    payload_view,
    storage_device,
)
from fabric.layout import DType, KVLayout

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA not available on this machine")

ALL_DTYPES = list(DType)
LAYOUTS = {
    "mha": lambda dt: KVLayout.mha(num_layers=3, num_kv_heads=4, head_dim=8, dtype=dt),
    "gqa": lambda dt: KVLayout.mha(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dt),
    "mla": lambda dt: KVLayout.mla(num_layers=2, latent_dim=24, dtype=dt),
}


def fill_random(pool: TokenToKVPool, seed: int) -> None:
    """Random bit patterns in every element (NaN/inf encodings included for float types)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (pool.nbytes,), generator=gen, dtype=torch.uint8)
    pool.kv.view(torch.uint8).copy_(raw.view(pool.kv.view(torch.uint8).shape))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=[d.value for d in ALL_DTYPES])
def test_gather_scatter_round_trip_is_bit_exact(kind: str, dtype: DType) -> None:
    layout = LAYOUTS[kind](dtype)
    src = TokenToKVPool(layout, num_slots=64, storage=StorageType.SYSTEM)
    dst = TokenToKVPool(layout, num_slots=48, storage=StorageType.SYSTEM)
    fill_random(src, seed=1234 + ALL_DTYPES.index(dtype))
    src_slots = torch.tensor([5, 17, 3, 40, 41, 42, 0, 63])
    dst_slots = dst.alloc(8)
    assert dst_slots is not None
    for layer in range(layout.num_layers):
        payload = src.gather(src_slots, layer)
        assert payload.dtype == torch.uint8 and payload.is_contiguous()
        assert payload.numel() == layout.bytes_per_block_layer(8)
        dst.scatter(payload_view(payload), dst_slots, layer)
        assert torch.equal(as_bits(dst.layer_buffer(layer)[:, dst_slots]),
                           as_bits(src.layer_buffer(layer)[:, src_slots]))
        # Gathering the copy gives the same bytes back.
        assert torch.equal(dst.gather(dst_slots, layer), payload)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[dst_slots] = False
    assert not as_bits(dst.kv[:, :, untouched]).any(), "scatter wrote outside its slots"


@pytest.mark.parametrize("dtype", [DType.F32, DType.BF16, DType.FP8_E4M3, DType.FP8_E5M2])
def test_payload_layout_is_plane_token_head_dim(dtype: DType) -> None:
    layout = KVLayout.mha(num_layers=2, num_kv_heads=3, head_dim=4, dtype=dtype)
    pool = TokenToKVPool(layout, num_slots=16, storage=StorageType.SYSTEM)
    values = torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(3))
    pool.kv.copy_(values.to(dtype.torch_dtype))
    slots = [9, 2, 11]
    payload = pool.gather(slots, layer=1)
    decoded = payload.view(dtype.torch_dtype).view(2, len(slots), 3, 4)
    assert torch.equal(as_bits(decoded[0]), as_bits(pool.k_buffer(1)[slots]))
    assert torch.equal(as_bits(decoded[1]), as_bits(pool.v_buffer(1)[slots]))


def test_pool_shapes_and_dtypes() -> None:
    mha = TokenToKVPool(KVLayout.mha(4, 8, 128, "fp8_e4m3"), 32, StorageType.SYSTEM)
    assert mha.kv.shape == (4, 2, 32, 8, 128) and mha.kv.dtype == torch.float8_e4m3fn
    mla = TokenToKVPool(KVLayout.mla(3, 576, "bf16"), 32, StorageType.SYSTEM)
    assert mla.kv.shape == (3, 1, 32, 1, 576) and mla.kv.dtype == torch.bfloat16
    assert mla.gather([0, 1], 0).numel() == 2 * 576 * 2
    with pytest.raises(ValueError, match="no separate V plane"):
        mla.v_buffer(0)


def test_payload_size_mismatch_is_a_clear_value_error() -> None:
    pool = TokenToKVPool(KVLayout.mha(2, 2, 4, "f16"), 16, StorageType.SYSTEM)
    payload = pool.gather([0, 1, 2], 0)
    with pytest.raises(ValueError, match=r"payload is 96 bytes but 2 slots of layer 0 need 64 bytes"):
        pool.scatter(payload, [0, 1], 0)
    with pytest.raises(ValueError, match="payload is 95 bytes"):
        pool.scatter(bytes(payload_view(payload))[:-1], [0, 1, 2], 0)


def test_bad_slots_and_layers_are_rejected() -> None:
    pool = TokenToKVPool(KVLayout.mha(2, 2, 4, "f16"), 16, StorageType.SYSTEM)
    payload = pool.gather([0, 1], 0)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 16\)"):
        pool.gather([3, 16], 0)
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 2\)"):
        pool.gather([0], 2)
    with pytest.raises(ValueError, match="distinct"):
        pool.scatter(payload, [4, 4], 0)
    with pytest.raises(ValueError, match="non-empty"):
        pool.gather([], 0)
    with pytest.raises(ValueError, match="must be uint8"):
        pool.scatter(torch.zeros(16, dtype=torch.float32), [0, 1], 0)


def test_gather_into_preallocated_buffer() -> None:
    pool = TokenToKVPool(KVLayout.mha(2, 2, 4, "bf16"), 16, StorageType.SYSTEM)
    fill_random(pool, seed=5)
    out = allocate_tensor((pool.payload_nbytes(4),), torch.uint8, StorageType.SYSTEM)
    result = pool.gather([1, 3, 5, 7], 1, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, pool.gather([1, 3, 5, 7], 1))
    with pytest.raises(ValueError, match="out must be a contiguous uint8 tensor of 64 bytes"):
        pool.gather([1, 3], 1, out=out)


def test_payload_buffers_share_memory_when_they_can() -> None:
    tensor = torch.arange(12, dtype=torch.uint8)
    view = payload_view(tensor)
    assert view.nbytes == 12 and bytes(view) == bytes(range(12))
    tensor[0] = 99
    assert view[0] == 99, "payload_view copied a contiguous CPU tensor"
    wide = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert bytes(payload_view(wide)) == wide.view(torch.uint8).numpy().tobytes()
    writable = bytearray(b"abcd")
    shared = payload_from_buffer(writable)
    writable[0] = ord("z")
    assert shared[0] == ord("z")
    frozen = payload_from_buffer(b"abcd")  # read-only: copied once, never aliased
    assert bytes(payload_view(frozen)) == b"abcd"
    assert payload_from_buffer(np.arange(4, dtype=np.uint16)).numel() == 8


def test_slot_allocator_exhaustion_and_reuse() -> None:
    pool = TokenToKVPool(KVLayout.mha(1, 1, 2, "f32"), 10, StorageType.SYSTEM)
    first = pool.alloc(6)
    assert first is not None and first.tolist() == [0, 1, 2, 3, 4, 5]
    assert pool.alloc(5) is None
    assert pool.available() == 4, "a failed alloc must not take slots"
    rest = pool.alloc(4)
    assert rest is not None and pool.available() == 0
    assert pool.alloc(1) is None
    pool.free(first[1:3])
    again = pool.alloc(2)
    assert again is not None and sorted(again.tolist()) == [1, 2]
    empty = pool.alloc(0)
    assert empty is not None and empty.numel() == 0


def test_double_free_raises_and_changes_nothing() -> None:
    allocator = SlotAllocator(8)
    slots = allocator.alloc(4)
    assert slots is not None
    allocator.free(slots[:2])
    with pytest.raises(DoubleFreeError, match="double free"):
        allocator.free(slots[:2])
    with pytest.raises(DoubleFreeError, match="twice in one free"):
        allocator.free([int(slots[2]), int(slots[2])])
    with pytest.raises(DoubleFreeError):
        allocator.free([7])  # never allocated
    assert allocator.available() == 6
    allocator.free(slots[2:])
    assert allocator.available() == 8
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        allocator.free([8])


def test_allocator_never_hands_out_a_slot_twice() -> None:
    rng = np.random.default_rng(11)
    allocator = SlotAllocator(100)
    held: set[int] = set()
    for _ in range(500):
        if rng.random() < 0.55:
            got = allocator.alloc(int(rng.integers(0, 20)))
            if got is None:
                continue
            assert held.isdisjoint(got.tolist())
            held.update(got.tolist())
        elif held:
            victims = rng.choice(sorted(held), size=int(rng.integers(1, len(held) + 1)), replace=False)
            allocator.free(victims)
            held.difference_update(victims.tolist())
        assert allocator.available() == 100 - len(held)


def test_req_to_token_pool() -> None:
    table = ReqToTokenPool(max_requests=3, max_context=8, storage=StorageType.SYSTEM)
    assert table.table.dtype == torch.int32 and table.table.shape == (3, 8)
    rows = table.alloc(2)
    assert rows == [0, 1]
    kv = TokenToKVPool(KVLayout.mha(1, 1, 2, "f16"), 32, StorageType.SYSTEM)
    slots = kv.alloc(5)
    assert slots is not None
    table.write(rows[1], 0, slots[:3])
    table.write(rows[1], 3, slots[3:].tolist())
    assert table.read(rows[1], 5).tolist() == slots.tolist()
    assert table.alloc(2) is None
    with pytest.raises(ValueError, match="exceed max_context 8"):
        table.write(rows[0], 6, [1, 2, 3])
    table.free(rows[1])
    with pytest.raises(ValueError, match="not allocated"):
        table.read(rows[1], 1)
    with pytest.raises(DoubleFreeError):
        table.free(rows[1])
    assert table.available() == 2


def test_storage_types_on_this_machine() -> None:
    assert storage_device(StorageType.SYSTEM).type == "cpu"
    assert storage_device(StorageType.DEVICE).type == ("cuda" if HAS_CUDA else "cpu")
    pool = TokenToKVPool(KVLayout.mha(1, 2, 4, "f16"), 8)  # DEVICE by default
    assert pool.kv.device.type == ("cuda" if HAS_CUDA else "cpu")
    if not HAS_CUDA:
        with pytest.raises(StorageUnavailableError, match="PINNED storage needs CUDA"):
            allocate_tensor((4,), torch.uint8, StorageType.PINNED)


@needs_cuda
@pytest.mark.parametrize("dtype", [DType.BF16, DType.FP8_E4M3], ids=["bf16", "fp8_e4m3"])
def test_cuda_pool_round_trip_through_pinned_buffer(dtype: DType) -> None:
    layout = KVLayout.mha(2, 4, 8, dtype)
    src = TokenToKVPool(layout, 32, StorageType.DEVICE)
    dst = TokenToKVPool(layout, 32, StorageType.DEVICE)
    fill_random(src, seed=9)
    staging = allocate_tensor((layout.bytes_per_block_layer(4),), torch.uint8, StorageType.PINNED)
    assert staging.is_pinned()
    payload = src.gather([3, 1, 4, 15], 1, out=staging)
    assert payload.device.type == "cpu"
    dst.scatter(payload, [0, 1, 2, 3], 1)
    assert torch.equal(as_bits(dst.layer_buffer(1)[:, :4]), as_bits(src.layer_buffer(1)[:, [3, 1, 4, 15]]))


def test_scatter_into_scattered_slots_in_any_order() -> None:
    layout = LAYOUTS["gqa"](DType.BF16)
    src = TokenToKVPool(layout, num_slots=32, storage=StorageType.SYSTEM)
    dst = TokenToKVPool(layout, num_slots=32, storage=StorageType.SYSTEM)
    fill_random(src, seed=7)
    src_slots, dst_slots = [30, 2, 17, 9], [11, 0, 25, 4]          # neither contiguous nor sorted
    for layer in range(layout.num_layers):
        dst.scatter(payload_view(src.gather(src_slots, layer)), dst_slots, layer)
        for s, d in zip(src_slots, dst_slots, strict=True):      # token i of the block lands in slot d_i
            assert torch.equal(as_bits(dst.layer_buffer(layer)[:, d]), as_bits(src.layer_buffer(layer)[:, s]))
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[dst_slots] = False
    assert not as_bits(dst.kv[:, :, untouched]).any()
