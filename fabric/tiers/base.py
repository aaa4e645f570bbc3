"""What every storage tier shares: the `Tier` enum, the verified `StoredBlock`, digests, errors.

A tier maps a 32-byte storage key (`fabric.keys.BlockAddress.storage_key`) to one payload and
its BLAKE3-256 digest. The digest is computed once, when the payload first enters the node
(`Store.put`), and travels with it: RAM keeps it beside the payload, the SSD file header and the
index row hold it too. Anything that comes back from a file is re-hashed and compared before it is
returned; a `StoredBlock` therefore always holds a payload whose digest verified.

Tiers, hottest first::

    DEVICE  the engine's KV pool (GPU pages); the fabric only tracks which block hashes are resident
    RAM     host memory, byte-capacity bounded, approximate LRU             (fabric/tiers/ram.py)
    SSD     one file per (block, layer) with a digest header, persistent    (fabric/tiers/ssd.py)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import blake3

from fabric.errors import FabricError
from fabric.keys import StorageKey
from fabric.provenance import Provenance

DIGEST_SIZE = 32

# Payloads a caller may hand to a tier. `bytes` is kept as is (immutable, so no copy is needed);
# mutable buffers are copied once on the way in because the caller may reuse them.
Payload = bytes | bytearray | memoryview


class Tier(enum.Enum):
    """Where a block is, hottest first. The value is the metrics / index spelling."""

    DEVICE = "device"
    RAM = "ram"
    SSD = "ssd"


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """A payload whose BLAKE3 digest verified, the digest itself, and the tier that served it.

    `payload` is a read-only view over the tier's own buffer (no copy); it stays valid as long as
    the caller holds it, even if the block is evicted meanwhile.
    """

    payload: memoryview
    digest: bytes
    tier: Tier
    provenance: Provenance | None = None   # the producer's signed record; None: unsigned, never vouched for


@dataclass(frozen=True, slots=True)
class TierStats:
    num_blocks: int
    num_bytes: int
    capacity_bytes: int


class CorruptBlockError(FabricError):
    """A stored block failed verification (bad header, wrong key, wrong length or digest mismatch).

    Raised by the SSD tier's readers; the Store catches it at its boundary, counts it, removes the
    block and answers a miss.
    """

    def __init__(self, key: StorageKey, reason: str) -> None:
        super().__init__(f"block {key.hex()[:16]}: {reason}")
        self.key = key
        self.reason = reason


def as_bytes_view(payload: Payload) -> memoryview:
    """A flat, byte-format view of `payload` (no copy); raises ValueError if not contiguous."""
    view = payload if isinstance(payload, memoryview) else memoryview(payload)
    if not view.c_contiguous:
        raise ValueError("payload must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def digest_of(payload: Payload) -> bytes:
    """BLAKE3-256 of the payload bytes: the digest every tier and the wire carry."""
    return blake3.blake3(payload).digest()
