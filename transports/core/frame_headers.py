"""A received frame's msgpack header, checked field by field and built into its frame (see
`transports.core.frames`), and what a peer that breaks the protocol raises: `ProtocolError`, whose
message says what was wrong. The byte-stream decoder that cuts frames is `transports.core.codec`'s.
"""

from __future__ import annotations

import enum
from typing import Any, cast

import msgpack

from fabric.keys import HASH_SIZE, BlockAddress, BlockHash
from fabric.provenance import Provenance
from transports.core.encoder import DIGEST_SIZE, check_parts
from transports.core.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from transports.core.frames import (
    Block,
    Blocks,
    Bye,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameType,
    Hello,
    Miss,
    MissReason,
    Pull,
)
from transports.trust.provenance_tables import StreamRecords, part_records

__all__ = ["PAYLOAD_TYPES", "LocalProtocolError", "ProtocolError", "RemoteProtocolError", "build_frame",
           "unpack_map"]

PAYLOAD_TYPES = (FrameType.BLOCK, FrameType.BLOCKS)


def unpack_map(data: bytes | bytearray | memoryview, what: str,
               error: type[ProtocolError] = ProtocolError) -> dict[Any, Any]:
    """The msgpack map in `data`; anything else (malformed msgpack, another type) raises `error`,
    whose message names `what`."""
    try:
        value = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise error(f"{what} is not valid msgpack: {e}") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a map, got {type(value).__name__}")
    return value


def _field(header: dict[Any, Any], name: str, kind: type | tuple[type, ...], ftype: FrameType) -> Any:
    if name not in header:
        raise ProtocolError(f"{ftype.name} header lacks field {name!r}")
    value = header[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"{ftype.name} header field {name!r} has type {type(value).__name__}")
    return value


def _u64(header: dict[Any, Any], name: str, ftype: FrameType) -> int:
    value: int = _field(header, name, int, ftype)
    if not 0 <= value < 2**64:
        raise ProtocolError(f"{ftype.name} header field {name!r} out of range: {value}")
    return value


def _address(hash_: Any, layer: Any, ftype: FrameType) -> BlockAddress:
    if not isinstance(hash_, bytes) or len(hash_) != HASH_SIZE:
        raise ProtocolError(f"{ftype.name} carries a block hash that is not {HASH_SIZE} bytes")
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < 2**32:
        raise ProtocolError(f"{ftype.name} carries an invalid layer {layer!r}")
    return BlockAddress(BlockHash(hash_), layer)


def _enum(enum_type: type[enum.StrEnum], value: str, ftype: FrameType) -> Any:
    try:
        return enum_type(value)
    except ValueError:
        raise ProtocolError(f"{ftype.name} carries unknown {enum_type.__name__} {value!r}") from None


_NAMES = {t: t.name for t in FrameType}   # for messages: Enum.name is a property, slow per frame


def _records(header: dict[Any, Any], num_parts: int, ftype: FrameType,
             stream: StreamRecords | None) -> tuple[Provenance | None, ...]:
    try:
        return part_records(header, num_parts, _NAMES[ftype], stream)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def build_frame(ftype: FrameType, header: dict[Any, Any], payload: bytearray | memoryview,
                stream: StreamRecords | None = None, receipt: bytes = b"") -> Frame:
    # The data path, a BLOCK unsigned (4 fields) or signed (its record fields as well), is checked
    # in one expression; anything else, or a BLOCK with something wrong, is built (and what is
    # wrong named) by _build_checked.
    if ftype is FrameType.BLOCK and ((fields := len(header)) == 4 or (fields <= 8 and "pix" in header)):
        rid, hash_, layer, digest = header.get("rid"), header.get("hash"), header.get("layer"), header.get("digest")
        if (type(rid) is int and 0 <= rid < 2**64 and type(hash_) is bytes and len(hash_) == HASH_SIZE
                and type(layer) is int and 0 <= layer < 2**32 and type(digest) is bytes and len(digest) == DIGEST_SIZE):
            address = BlockAddress(BlockHash(hash_), layer)
            if fields == 4:
                return Block(rid, address, digest, payload, None, receipt)
            return Block(rid, address, digest, payload, _records(header, 1, ftype, stream)[0], receipt)
    return _build_checked(ftype, header, payload, stream, receipt)


def _build_checked(ftype: FrameType, header: dict[Any, Any], payload: bytearray | memoryview,
                   stream: StreamRecords | None = None, receipt: bytes = b"") -> Frame:
    if ftype not in PAYLOAD_TYPES and payload:
        raise ProtocolError(f"{ftype.name} frame must not carry a payload ({len(payload)} bytes)")
    if ftype is FrameType.HELLO:
        return Hello(_field(header, "node", str, ftype), _u64(header, "version", ftype),
                     _u64(header, "max_payload", ftype))
    if ftype is FrameType.PULL:
        rid = _u64(header, "rid", ftype)
        raw = _field(header, "addrs", list, ftype)
        addrs = []
        for item in raw:
            if not isinstance(item, list) or len(item) != 2:
                raise ProtocolError("PULL address must be a [hash, layer] pair")
            addrs.append(_address(item[0], item[1], ftype))
        ns = header.get("ns", b"")
        if not isinstance(ns, bytes) or len(ns) not in (0, HASH_SIZE):
            raise ProtocolError(f"PULL namespace must be a {HASH_SIZE}-byte root")
        return Pull(rid, tuple(addrs), ns)
    if ftype is FrameType.BLOCK:
        digest = _field(header, "digest", bytes, ftype)
        if len(digest) != DIGEST_SIZE:
            raise ProtocolError(f"BLOCK digest must be {DIGEST_SIZE} bytes, got {len(digest)}")
        addr = _address(header.get("hash"), header.get("layer"), ftype)
        provs = _records(header, 1, ftype, stream)
        return Block(_u64(header, "rid", ftype), addr, digest, payload, provs[0] if provs else None, receipt)
    if ftype is FrameType.BLOCKS:
        rid, first = _u64(header, "rid", ftype), _u64(header, "first", ftype)
        digests, sizes = header.get("digests"), header.get("sizes")
        num_parts = check_parts(digests, sizes, len(payload), ProtocolError)   # bytes and ints from here on
        provs = _records(header, num_parts, ftype, stream)
        if not any(p is not None for p in provs):
            provs = ()
        return Blocks(rid, first, cast(bytes, digests), tuple(cast(list[int], sizes)), payload, provs, receipt)
    if ftype is FrameType.MISS:
        addr = _address(header.get("hash"), header.get("layer"), ftype)
        reason = _enum(MissReason, _field(header, "reason", str, ftype), ftype)
        return Miss(_u64(header, "rid", ftype), addr, reason)
    if ftype is FrameType.END:
        return End(_u64(header, "rid", ftype))
    if ftype is FrameType.ERROR:
        code = _enum(ErrorCode, _field(header, "code", str, ftype), ftype)
        return Error(_u64(header, "rid", ftype), code, _field(header, "message", str, ftype))
    return Bye(_field(header, "reason", str, ftype))
