"""Two-level KV pools (SGLang style) and the (block, layer) payload format.

`ReqToTokenPool` maps (request row, token position) → slot; `TokenToKVPool` holds the KV
of every slot for every layer in ONE tensor:

    kv: (num_layers, num_kv_planes, num_slots, num_kv_heads, head_dim)
        MHA / GQA: planes = 2 (K, V)      MLA: planes = 1, heads = 1, head_dim = latent width

A (block, layer) payload is what the store keeps and transports send: the slots of one block
for one layer, packed contiguously as raw bytes in this order:

    payload (MHA, n tokens, H heads, D dims, s = dtype itemsize; MLA has the K plane only)
    ┌──────────────────────── K plane ─────────────────────────┬──────── V plane ────────┐
    │ token 0                    │ token 1      │ … │ token n-1 │ token 0 │ … │ token n-1 │
    │ head 0 │ head 1 │…│ head H-1│              │   │           │         │   │           │
    │ D elements × s bytes each  │              │   │           │         │   │           │
    └────────────────────────────┴──────────────┴───┴───────────┴─────────┴───┴───────────┘
    total = layout.bytes_per_block_layer(n) = planes · n · H · D · s bytes

Elements are stored bit for bit in the machine's (little-endian) byte order. Gather and
scatter move bytes through a uint8 view of the pool, never through float arithmetic, so a
round trip is exact for every dtype, fp8 NaN patterns included.

Slot allocator invariants (`SlotAllocator`, shared by both pools)
  * `stack[:num_free]` holds exactly the free indices, each once; `in_use[i]` is True exactly
    for the others. `alloc(n)` pops n, `free(ids)` pushes them back: O(n) for n indices,
    O(1) per index, vectorised with numpy, no Python object per index.
  * Freeing an index that is not allocated (double free), or the same index twice in one
    call, raises `DoubleFreeError` before anything changes.
Allocator bookkeeping lives on the CPU; `alloc` returns CPU int64 tensors and gather/scatter
move indices to the pool's device themselves. Not thread-safe: one scheduler owns a pool.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

import numpy as np
import torch

from cluster.errors import ClusterError
from fabric.layout import KVLayout, LayoutKind

logger = logging.getLogger(__name__)

Indices = Sequence[int] | np.ndarray | torch.Tensor
Buffer = bytes | bytearray | memoryview | np.ndarray | torch.Tensor


class StorageType(enum.StrEnum):
    """Where a pool's tensors live.

    DEVICE: the engine's accelerator (CUDA when available, else CPU).
    PINNED: page-locked host memory for fast DMA; needs CUDA. Asking for it on a machine
            without CUDA raises `StorageUnavailableError` rather than silently giving
            pageable memory, because the caller chose it for DMA speed it would not get.
    SYSTEM: plain pageable host memory.
    """

    DEVICE = "device"
    PINNED = "pinned"
    SYSTEM = "system"


class StorageUnavailableError(ClusterError, RuntimeError):
    """The requested storage type does not exist on this machine."""


class DoubleFreeError(ClusterError, RuntimeError):
    """An index was freed that is not currently allocated."""


def default_host_storage() -> StorageType:
    """PINNED when CUDA exists (fast host↔device copies), else SYSTEM."""
    return StorageType.PINNED if torch.cuda.is_available() else StorageType.SYSTEM


def storage_device(storage: StorageType) -> torch.device:
    """The torch device a storage type allocates on."""
    if storage is StorageType.DEVICE:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if storage is StorageType.PINNED and not torch.cuda.is_available():
        raise StorageUnavailableError(
            "PINNED storage needs CUDA, which is not available on this machine; "
            "use StorageType.SYSTEM (or default_host_storage())")
    return torch.device("cpu")


def allocate_tensor(shape: Sequence[int], dtype: torch.dtype, storage: StorageType) -> torch.Tensor:
    """A zero-filled tensor of `shape` and `dtype` in `storage`."""
    device = storage_device(storage)
    return torch.zeros(tuple(shape), dtype=dtype, device=device,
                       pin_memory=storage is StorageType.PINNED)


def _as_index_array(indices: Indices) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        arr = indices.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(indices, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"indices must be one-dimensional, got shape {arr.shape}")
    return arr


class SlotAllocator:
    """Fixed set of indices [0, capacity) handed out and taken back; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        # Reversed so a fresh allocator hands out 0, 1, 2, ... (contiguous runs copy faster).
        self._stack = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._num_free = capacity
        self._in_use = np.zeros(capacity, dtype=bool)
        self._scratch = np.zeros(capacity, dtype=np.int64)  # duplicate detection in free()

    def available(self) -> int:
        return self._num_free

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free indices as a CPU int64 tensor, or None (nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative count ({n})")
        if n > self._num_free:
            return None
        out = self._stack[self._num_free - n:self._num_free][::-1].copy()
        self._num_free -= n
        self._in_use[out] = True
        return torch.from_numpy(out)

    def free(self, indices: Indices) -> None:
        """Return `indices`; raises DoubleFreeError if any is not allocated, ValueError if out of range."""
        idx = _as_index_array(indices)
        if idx.size == 0:
            return
        if int(idx.min()) < 0 or int(idx.max()) >= self.capacity:
            raise ValueError(f"indices must lie in [0, {self.capacity}), "
                             f"got range [{int(idx.min())}, {int(idx.max())}]")
        not_allocated = idx[~self._in_use[idx]]
        if not_allocated.size:
            raise DoubleFreeError(f"double free: {not_allocated[:8].tolist()} "
                                  f"({not_allocated.size} indices) are not allocated")
        # Last write wins: an index listed twice reads back a position other than its own.
        positions = np.arange(idx.size, dtype=np.int64)
        self._scratch[idx] = positions
        if (self._scratch[idx] != positions).any():
            raise DoubleFreeError("double free: the same index appears twice in one free() call")
        self._in_use[idx] = False
        self._stack[self._num_free:self._num_free + idx.size] = idx[::-1]
        self._num_free += idx.size

    def is_allocated(self, index: int) -> bool:
        return 0 <= index < self.capacity and bool(self._in_use[index])


def payload_from_buffer(payload: Buffer) -> torch.Tensor:
    """A flat uint8 CPU tensor over `payload`, sharing memory when the buffer is writable.

    Read-only buffers (`bytes`) are copied once: torch tensors cannot be read-only, and
    sharing would let a later in-place op write into an immutable object.
    """
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8:
            raise ValueError(f"a payload tensor must be uint8, got {payload.dtype}")
        return payload.reshape(-1)
    try:
        view = (payload.data if isinstance(payload, np.ndarray) else memoryview(payload)).cast("B")
    except TypeError as exc:
        raise ValueError(f"payload must be a C-contiguous buffer: {exc}") from None
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        out = torch.empty(view.nbytes, dtype=torch.uint8)
        out.numpy()[:] = np.frombuffer(view, dtype=np.uint8)
        return out
    return torch.frombuffer(view, dtype=torch.uint8)


def payload_view(payload: torch.Tensor) -> memoryview:
    """Bytes of `payload` as a flat memoryview; no copy for a contiguous CPU tensor.

    A device tensor is copied to host first. The view keeps the tensor's memory alive.
    """
    flat = payload.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy().data


class TokenToKVPool:
    """KV of every slot for every layer (see the module docstring for shapes and payloads)."""

    def __init__(self, layout: KVLayout, num_slots: int,
                 storage: StorageType = StorageType.DEVICE) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.layout = layout
        self.num_slots = num_slots
        self.storage = storage
        self._planes = layout.num_kv_planes
        self.kv = allocate_tensor(
            (layout.num_layers, self._planes, num_slots, layout.num_kv_heads, layout.head_dim),
            layout.dtype.torch_dtype, storage)
        self.device = self.kv.device
        # Byte view of the same memory: gather/scatter copy bytes, which is exact for any dtype.
        self._bytes = self.kv.view(torch.uint8)
        self._allocator = SlotAllocator(num_slots)
        logger.info("TokenToKVPool: %d slots, %s %s, %.1f MiB on %s (%s)", num_slots,
                    layout.kind.value, layout.dtype.value, self.nbytes / 2**20, self.device,
                    storage.value)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ---------------------------------------------------------------- slots
    def available(self) -> int:
        return self._allocator.available()

    def can_alloc(self, n: int) -> bool:
        return self._allocator.can_alloc(n)

    def alloc(self, n: int) -> torch.Tensor | None:
        """`n` free slots (CPU int64 tensor), or None when fewer than `n` are free."""
        return self._allocator.alloc(n)

    def free(self, slots: Indices) -> None:
        """Return slots to the pool; raises DoubleFreeError for a slot that is not allocated."""
        self._allocator.free(slots)

    # ---------------------------------------------------------------- tensors
    def layer_buffer(self, layer: int) -> torch.Tensor:
        """View of one layer: (planes, num_slots, num_kv_heads, head_dim)."""
        self._check_layer(layer)
        return self.kv[layer]

    def k_buffer(self, layer: int) -> torch.Tensor:
        """Keys of one layer (MHA) or its latents (MLA): (num_slots, num_kv_heads, head_dim)."""
        return self.layer_buffer(layer)[0]

    def v_buffer(self, layer: int) -> torch.Tensor:
        """Values of one layer (MHA only): (num_slots, num_kv_heads, head_dim)."""
        if self.layout.kind is not LayoutKind.MHA:
            raise ValueError("an MLA pool has no separate V plane; use k_buffer() for the latent")
        return self.layer_buffer(layer)[1]

    # ---------------------------------------------------------------- payloads
    def payload_nbytes(self, num_tokens: int) -> int:
        return self.layout.bytes_per_block_layer(num_tokens)

    def gather(self, slots: Indices, layer: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Pack `slots` of `layer` into one contiguous uint8 host payload (layout in the module docstring).

        With `out` (a flat uint8 CPU tensor of the payload size, e.g. pinned) the bytes land there.
        """
        self._check_layer(layer)
        index = self._slot_index(slots)
        nbytes = self.payload_nbytes(index.numel())
        src = self._bytes[layer]
        if out is not None:
            if out.dtype != torch.uint8 or out.numel() != nbytes or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous uint8 tensor of {nbytes} bytes, "
                                 f"got {out.dtype} with {out.numel()} elements")
            shaped = out.view(self._planes, index.numel(), *src.shape[2:])
            if out.device == self.device:
                torch.index_select(src, 1, index, out=shaped)
            else:
                shaped.copy_(src.index_select(1, index))
            return out.reshape(-1)
        packed = src.index_select(1, index).reshape(-1)
        return packed if packed.device.type == "cpu" else packed.cpu()

    def scatter(self, payload: Buffer, slots: Indices, layer: int) -> None:
        """Write a payload made by `gather` (same layout) into `slots` of `layer`.

        Raises ValueError when the payload size does not match the slots and layout.
        """
        self._check_layer(layer)
        index = self._slot_index(slots)
        if index.numel() > 1 and torch.unique(index).numel() != index.numel():
            raise ValueError("scatter slots must be distinct: a slot listed twice gets undefined KV")
        data = payload_from_buffer(payload)
        expected = self.payload_nbytes(index.numel())
        if data.numel() != expected:
            raise ValueError(
                f"payload is {data.numel()} bytes but {index.numel()} slots of layer {layer} need "
                f"{expected} bytes ({self.layout.kind.value}, {self.layout.num_kv_heads} kv heads x "
                f"{self.layout.head_dim} dims, {self.layout.dtype.value})")
        dst = self._bytes[layer]
        src = data.view(self._planes, index.numel(), *dst.shape[2:]).to(self.device)
        dst.index_copy_(1, index, src)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer must lie in [0, {self.layout.num_layers}), got {layer}")

    def _slot_index(self, slots: Indices) -> torch.Tensor:
        idx = slots.detach().to("cpu", torch.int64) if isinstance(slots, torch.Tensor) \
            else torch.as_tensor(np.asarray(slots, dtype=np.int64))
        if idx.ndim != 1 or idx.numel() == 0:
            raise ValueError(f"slots must be a non-empty 1-D index list, got shape {tuple(idx.shape)}")
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.num_slots:
            raise ValueError(f"slots must lie in [0, {self.num_slots}), got range [{lo}, {hi}]")
        return idx.to(self.device)


class ReqToTokenPool:
    """Table (request row, token position) → slot, with a row allocator."""

    def __init__(self, max_requests: int, max_context: int,
                 storage: StorageType = StorageType.DEVICE, dtype: torch.dtype = torch.int32) -> None:
        if max_context <= 0:
            raise ValueError(f"max_context must be positive, got {max_context}")
        if dtype not in (torch.int32, torch.int64):
            raise ValueError(f"the slot table holds int32 or int64, got {dtype}")
        self.max_requests = max_requests
        self.max_context = max_context
        self.table = allocate_tensor((max_requests, max_context), dtype, storage)
        self._rows = SlotAllocator(max_requests)

    def available(self) -> int:
        return self._rows.available()

    def alloc(self, num_requests: int = 1) -> list[int] | None:
        """Row ids for `num_requests` requests, or None when fewer rows are free."""
        rows = self._rows.alloc(num_requests)
        return None if rows is None else rows.tolist()

    def free(self, req_ids: int | Sequence[int]) -> None:
        """Release rows; raises DoubleFreeError for a row that is not allocated."""
        self._rows.free([req_ids] if isinstance(req_ids, int) else req_ids)

    def write(self, req_id: int, start: int, slots: Indices) -> None:
        """Record `slots` as the KV slots of positions start, start + 1, ... of request `req_id`."""
        values = slots.detach() if isinstance(slots, torch.Tensor) else torch.as_tensor(
            np.asarray(slots, dtype=np.int64))
        self._check_span(req_id, start, values.numel())
        self.table[req_id, start:start + values.numel()] = values.to(self.table.device, self.table.dtype)

    def read(self, req_id: int, length: int, start: int = 0) -> torch.Tensor:
        """Slots of positions [start, start + length) of `req_id` (a view of the table)."""
        self._check_span(req_id, start, length)
        return self.table[req_id, start:start + length]

    def _check_span(self, req_id: int, start: int, length: int) -> None:
        if not self._rows.is_allocated(req_id):
            raise ValueError(f"request row {req_id} is not allocated")
        if start < 0 or length < 0 or start + length > self.max_context:
            raise ValueError(f"positions [{start}, {start + length}) exceed max_context {self.max_context}")
