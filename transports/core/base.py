"""What every transport shares: peers, block sources, pull results and the transport protocols.

A server answers PULL frames from a `BlockSource` (the node's Store). A client's
`pull(peer, addresses)` yields one `PullResult` per address as frames arrive; the layers of a
block keep the order they were asked in. Every failure on the way (peer gone, timeout, digest
mismatch, peer error) is a `Miss` result, never an exception and never unverified bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from fabric.keys import BlockAddress
from fabric.provenance import Provenance
from transports.core.codec import Miss


@dataclass(frozen=True, slots=True)
class Peer:
    """Where to dial a node, and the name its certificate must carry."""

    node: str
    host: str
    port: int


class SourceBlock(Protocol):
    @property
    def payload(self) -> bytes | bytearray | memoryview: ...
    @property
    def digest(self) -> bytes: ...


class BlockSource(Protocol):
    """What a transport server serves from: `fabric.store.Store` fits."""

    def get_block(self, address: BlockAddress) -> SourceBlock | None: ...


@dataclass(frozen=True, slots=True)
class Hit:
    """A verified payload: its BLAKE3 digest matched the one the peer announced. `provenance` is
    the producer's record the peer sent with it (not yet checked: see transports/trust/provenance_check.py)."""

    address: BlockAddress
    payload: bytes | bytearray | memoryview
    digest: bytes
    provenance: Provenance | None = None


PullResult = Hit | Miss


class TransportServer(Protocol):
    require_pull_namespace: bool   # True: a PULL that names no namespace root is answered with misses
    # The tenants whose namespace a root is (None: a root not bound on this node); set by the node.
    # A peer whose certificate is restricted to tenants reads only roots of one of its tenants.
    tenant_roots: Callable[[bytes], frozenset[str] | None] | None

    async def start(self) -> tuple[str, int]: ...
    async def close(self) -> None: ...


class TransportClient(Protocol):
    def pull(self, peer: Peer, addresses: Sequence[BlockAddress], *,
             into: memoryview | None = None, namespace: bytes = b"") -> AsyncIterator[PullResult]:
        """`into`: optional equal-size slots, one per address, that a transport may receive hits
        straight into (a Hit whose payload is its slot); one that does not copies nothing there.
        `namespace`: the root asked under; the peer serves only blocks whose record names it."""
        ...
    async def close(self) -> None: ...
