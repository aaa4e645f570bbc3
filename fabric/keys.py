"""Versioned, process-independent block keys.

    root      = BLAKE3(SCHEMA_VERSION || msgpack(canonical namespace))
    h_0       = BLAKE3(root    || tokens[0:B]   as little-endian u32)
    h_i       = BLAKE3(h_{i-1} || tokens[iB:(i+1)B] as little-endian u32)
    storage   = BLAKE3(h_i || layer as little-endian u32)        (32 bytes)

Only full blocks get a hash. Two requests share block i exactly when their namespaces and
all tokens up to the end of block i are equal. Nothing here depends on Python's builtin hashing,
PYTHONHASHSEED, or any other process state; `tests/vectors/block_hashes.json` pins the output.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import blake3
import msgpack
import numpy as np

from fabric.layout import KVLayout

SCHEMA_VERSION = "kvfabric/keys/v1"
HASH_SIZE = 32
MAX_TOKEN = 2**32 - 1

_NATIVE_U32_LE = array.array("I").itemsize == 4 and sys.byteorder == "little"

BlockHash = NewType("BlockHash", bytes)
StorageKey = NewType("StorageKey", bytes)


@dataclass(frozen=True, slots=True)
class Namespace:
    """Whose KV a block is. Any field that changes the KV bytes must be here."""

    model_id: str
    layout: KVLayout
    block_size: int
    weights_fingerprint: str = ""
    shard: int = 0
    num_shards: int = 1
    tenant_salt: bytes = b""
    _root: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ValueError("Namespace.model_id must not be empty")
        if self.block_size <= 0:
            raise ValueError(f"Namespace.block_size must be positive, got {self.block_size}")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"Namespace.shard must be in [0, {self.num_shards}), got {self.shard}")
        object.__setattr__(self, "_root", _root_hash(self))

    def canonical(self) -> dict[str, object]:
        """The exact mapping that is hashed (keys sorted when packed)."""
        return {
            "model_id": self.model_id,
            "weights_fingerprint": self.weights_fingerprint,
            "layout": self.layout.describe(),
            "block_size": self.block_size,
            "shard": self.shard,
            "num_shards": self.num_shards,
            "tenant_salt": self.tenant_salt,
        }

    @property
    def root(self) -> BlockHash:
        return BlockHash(self._root)


def _sorted(value: object) -> object:
    if isinstance(value, dict):
        return {k: _sorted(value[k]) for k in sorted(value)}
    return value


def _root_hash(ns: Namespace) -> bytes:
    packed = msgpack.packb(_sorted(ns.canonical()), use_bin_type=True)
    return blake3.blake3(SCHEMA_VERSION.encode() + packed).digest()


def tokens_to_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Little-endian u32 encoding of token ids; raises ValueError outside [0, 2**32)."""
    if isinstance(tokens, list) and _NATIVE_U32_LE:
        # array('I') converts a list of ints faster than numpy does and range-checks each one.
        try:
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            raise ValueError("token ids must be ints in [0, 2**32)") from None
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<u4"):
        if int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN:
            raise ValueError("token ids must lie in [0, 2**32)")
        arr = arr.astype("<u4")
    return arr.tobytes()


def chain_hash(parent: bytes, block_token_bytes: bytes | memoryview) -> BlockHash:
    """One link of the chain: BLAKE3(parent || tokens)."""
    h = blake3.blake3(parent)
    h.update(block_token_bytes)
    return BlockHash(h.digest())


def block_hashes(namespace: Namespace, tokens: Sequence[int] | np.ndarray,
                 parent: BlockHash | None = None) -> list[BlockHash]:
    """Chained hashes of every full block of `tokens`; a partial tail gets none.

    `parent` continues a chain (the hash of the block before `tokens[0]`); default is the root.
    """
    data = tokens_to_bytes(tokens)
    stride = namespace.block_size * 4
    num_full = len(data) // stride
    out: list[BlockHash] = []
    h: bytes = parent if parent is not None else namespace.root
    view = memoryview(data)
    new = blake3.blake3
    for i in range(num_full):
        # bytes + memoryview concatenates without first copying the slice.
        h = new(h + view[i * stride:(i + 1) * stride]).digest()  # type: ignore[operator]
        out.append(BlockHash(h))
    return out


@dataclass(frozen=True, slots=True)
class BlockAddress:
    """One stored unit: the KV of one block for one layer."""

    hash: BlockHash
    layer: int

    def __post_init__(self) -> None:
        if len(self.hash) != HASH_SIZE:
            raise ValueError(f"block hash must be {HASH_SIZE} bytes, got {len(self.hash)}")
        if not 0 <= self.layer <= MAX_TOKEN:
            raise ValueError(f"layer must be a u32, got {self.layer}")

    @property
    def storage_key(self) -> StorageKey:
        return StorageKey(blake3.blake3(self.hash + self.layer.to_bytes(4, "little")).digest())

    def __str__(self) -> str:
        return f"{self.hash.hex()[:16]}/{self.layer}"


def addresses(hashes: Sequence[BlockHash], num_layers: int) -> list[BlockAddress]:
    """Every (block, layer) address of `hashes`, block-major then layer order."""
    return [BlockAddress(h, layer) for h in hashes for layer in range(num_layers)]
