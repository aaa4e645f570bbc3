"""Block hashes for callers that name blocks by their own ids instead of by tokens.

An engine such as vLLM already names each full block by a hash of its prefix (vLLM's
`ExternalBlockHash`: bytes, or an int); public traces do the same. Such an id chain maps into
kvfabric block hashes under the caller's namespace:

    id_root = BLAKE3(ID_SCHEMA || namespace root)
    h_i     = BLAKE3(id_root || enc(id_{i-1}) || enc(id_i))      id_{-1} = the chain's parent id, or none

    enc(none)  = 0x00
    enc(int)   = 0x01 || u64 big-endian      (a negative int is its two's-complement u64)
    enc(bytes) = 0x02 || length (1 byte) || bytes   (1..32 bytes)

Every block is bound to its namespace (so tenants never share blocks) and to the id before it, so
a chain given in parts (`ids[k:]` with `parent=ids[k-1]`) maps to the same hashes as the whole.
Ids are taken as they are: the fabric cannot check that an id names the tokens the caller thinks;
a caller whose ids collide gets the KV stored under the colliding id, verified as stored.
Hashes of id chains never equal token-chain hashes (`fabric.keys`): their first input differs.
Nothing depends on process state (no per-process hashing): the result is the same in every process and host.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np

from fabric.keys import BlockHash, Namespace

ID_SCHEMA = b"kvfabric/block-ids/v1"
MAX_ID_BYTES = 32
_U64 = 1 << 64

BlockId = bytes | int


def encode_block_id(block_id: BlockId | None) -> bytes:
    """The canonical bytes of one id (see the module docstring); ValueError for anything else."""
    if block_id is None:
        return b"\x00"
    if isinstance(block_id, bool):
        raise ValueError("a block id must be bytes or an int, got a bool")
    if isinstance(block_id, int | np.integer):
        value = int(block_id)
        if not -(1 << 63) <= value < _U64:
            raise ValueError(f"an int block id must fit in 64 bits (signed or unsigned), got {value}")
        return b"\x01" + (value % _U64).to_bytes(8, "big")
    if isinstance(block_id, bytes | bytearray | memoryview):
        raw = bytes(block_id)
        if not 1 <= len(raw) <= MAX_ID_BYTES:
            raise ValueError(f"a bytes block id must be 1..{MAX_ID_BYTES} bytes, got {len(raw)}")
        return b"\x02" + bytes([len(raw)]) + raw
    raise ValueError(f"a block id must be bytes or an int, got {type(block_id).__name__}")


def id_root(namespace: Namespace) -> bytes:
    return blake3.blake3(ID_SCHEMA + namespace.root).digest()


def block_id_hashes(namespace: Namespace, block_ids: Sequence[BlockId],
                    parent: BlockId | None = None) -> list[BlockHash]:
    """The kvfabric block hash of each id of a chain that continues `parent` (None: a first block)."""
    root = id_root(namespace)
    prev = encode_block_id(parent)
    out: list[BlockHash] = []
    for block_id in block_ids:
        cur = encode_block_id(block_id)
        out.append(BlockHash(blake3.blake3(root + prev + cur).digest()))
        prev = cur
    return out
