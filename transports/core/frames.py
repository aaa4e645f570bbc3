"""The frames of the kvfabric pull protocol: one frozen dataclass per frame type, and the enums
their headers carry. The wire encoding is encoder.py's and codec.py's; the rules of who sends what
when, session.py's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from fabric.config import MAX_PAYLOAD_BYTES
from fabric.keys import BlockAddress
from fabric.provenance import Provenance

VERSION = 1                            # the protocol version a HELLO announces
DEFAULT_MAX_PAYLOAD = MAX_PAYLOAD_BYTES      # the [transport] default (fabric/config.py)


class FrameType(enum.IntEnum):
    HELLO = 1
    PULL = 2
    BLOCK = 3
    MISS = 4
    END = 5
    ERROR = 6
    BYE = 7
    BLOCKS = 8


class MissReason(enum.StrEnum):
    NOT_FOUND = "not_found"
    DIGEST_MISMATCH = "digest_mismatch"
    PEER_ERROR = "peer_error"
    PEER_GONE = "peer_gone"
    TIMEOUT = "timeout"
    TOO_LARGE = "too_large"         # the block exceeds the payload limit the client announced
    SOURCE_ERROR = "source_error"   # the server could not read the block (disk error, bug)
    OVERLOADED = "overloaded"       # the server refused the request: this node is over its budget there


class ErrorCode(enum.StrEnum):
    PROTOCOL = "protocol"
    UNAUTHORIZED = "unauthorized"
    OVERLOADED = "overloaded"
    INTERNAL = "internal"
    TIMEOUT = "timeout"


Payload = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame on a connection: who is speaking and what it accepts."""

    TYPE: ClassVar[FrameType] = FrameType.HELLO
    node: str
    version: int = VERSION
    max_payload: int = DEFAULT_MAX_PAYLOAD


@dataclass(frozen=True, slots=True)
class Pull:
    """Ask for the payloads of `addresses`; answered by one BLOCK or MISS each, then END.
    `namespace`: the root the puller asks under (b"": none named); the server then serves only
    blocks whose provenance record names that root, and a MISS(not_found) for any other."""

    TYPE: ClassVar[FrameType] = FrameType.PULL
    request_id: int
    addresses: tuple[BlockAddress, ...]
    namespace: bytes = b""


@dataclass(frozen=True, slots=True)
class Block:
    """One (block, layer) payload and the BLAKE3 digest the receiver must check it against."""

    TYPE: ClassVar[FrameType] = FrameType.BLOCK
    request_id: int
    address: BlockAddress
    digest: bytes
    payload: bytes | bytearray | memoryview = field(repr=False)
    provenance: Provenance | None = None   # the producer's record, kept verbatim by every holder
    # The receiver's own BLAKE3 of the payload, taken as its bytes landed (receipt_digests.py);
    # b"" when it did not take one. Never sent: the peer only announces `digest`.
    receipt: bytes = field(default=b"", repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Blocks:
    """Payloads of the PULL's addresses `first`, `first + 1`, … (one per digest), back to back in
    `payload`: part i is `sizes[i]` bytes and must match `digests[32 * i: 32 * (i + 1)]`.

    Servers send one for a run of consecutive hits (the per-frame work on both ends is then paid
    once per run); the address of each part is the one the PULL asked for at that position. A
    frame to send may carry its parts as a tuple of buffers (never joined: transports write them
    one after another); a received one carries one buffer."""

    TYPE: ClassVar[FrameType] = FrameType.BLOCKS
    request_id: int
    first: int
    digests: bytes            # DIGEST_SIZE bytes per part, concatenated
    sizes: tuple[int, ...]
    payload: Payload | tuple[Payload, ...] = field(repr=False)
    provenances: tuple[Provenance | None, ...] = ()   # one per part, or () when no part is signed
    receipt: bytes = field(default=b"", repr=False, compare=False)   # as Block's, a digest per part

    @property
    def num_parts(self) -> int:
        return len(self.sizes)


@dataclass(frozen=True, slots=True)
class Miss:
    TYPE: ClassVar[FrameType] = FrameType.MISS
    request_id: int
    address: BlockAddress
    reason: MissReason = MissReason.NOT_FOUND


@dataclass(frozen=True, slots=True)
class End:
    """Every address of request `request_id` has been answered."""

    TYPE: ClassVar[FrameType] = FrameType.END
    request_id: int


@dataclass(frozen=True, slots=True)
class Error:
    """The sender gives up on `request_id` (0: the whole connection) for `code`."""

    TYPE: ClassVar[FrameType] = FrameType.ERROR
    request_id: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Bye:
    TYPE: ClassVar[FrameType] = FrameType.BYE
    reason: str = ""


Frame = Hello | Pull | Block | Blocks | Miss | End | Error | Bye
