"""The frame encoder: a frame's wire bytes (preamble, msgpack header, payload) and the wire layout's
constants. The layout, and the decoder that reads it back, are `transports.core.codec`'s; the
frame types are `transports.core.frames`'.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from transports.core.frames import (
    DEFAULT_MAX_PAYLOAD,
    VERSION,
    Block,
    Blocks,
    Bye,
    End,
    Error,
    Frame,
    FrameType,
    Hello,
    Miss,
    Payload,
    Pull,
)
from transports.trust.provenance_tables import SentRecords, record_tables

__all__ = ["DEFAULT_MAX_HEADER", "DIGEST_SIZE", "MAGIC", "PREAMBLE", "PREAMBLE_SIZE", "check_parts", "encode",
           "encode_many", "encode_parts", "payload_pieces"]

MAGIC = b"KVFB"
PREAMBLE = struct.Struct("<4sBBHIQ")
PREAMBLE_SIZE = PREAMBLE.size  # 20
DEFAULT_MAX_HEADER = 64 * 1024
DIGEST_SIZE = 32

_packers = threading.local()   # one msgpack Packer per thread: `msgpack.packb` makes (and allocates) one per call


def _pack(header: dict[str, Any]) -> bytes:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(header)   # a failed pack leaves the packer empty for the next one


def payload_pieces(payload: Payload | tuple[Payload, ...]) -> tuple[Payload, ...]:
    """The buffers of what `encode_parts` returned as payload, in the order they are sent."""
    return payload if isinstance(payload, tuple) else (payload,)


def check_parts(digests: Any, sizes: Any, payload_len: int, error: type[Exception]) -> int:
    """The number of parts of a BLOCKS frame whose `digests` and `sizes` describe `payload_len`
    bytes; anything inconsistent raises `error`."""
    if type(digests) is not bytes or not digests or len(digests) % DIGEST_SIZE:
        raise error(f"BLOCKS digests must be a non-empty multiple of {DIGEST_SIZE} bytes")
    num_parts = len(digests) // DIGEST_SIZE
    if type(sizes) not in (list, tuple) or len(sizes) != num_parts:
        counted = len(sizes) if type(sizes) in (list, tuple) else "no"
        raise error(f"BLOCKS carries {num_parts} digests but {counted} sizes")
    if set(map(type, sizes)) != {int} or min(sizes) < 0 or sum(sizes) != payload_len:
        raise error(f"BLOCKS part sizes must be non-negative integers adding up to the {payload_len}-byte payload")
    return num_parts


def _header(frame: Frame, sent: SentRecords | None = None) -> dict[str, Any]:
    tables = record_tables if sent is None else sent.tables
    match frame:
        case Hello(node=node, version=version, max_payload=max_payload):
            return {"node": node, "version": version, "max_payload": max_payload}
        case Pull(request_id=rid, addresses=addrs, namespace=ns):
            header = {"rid": rid, "addrs": [[a.hash, a.layer] for a in addrs]}
            return header | {"ns": ns} if ns else header
        case Block(request_id=rid, address=a, digest=digest, provenance=prov):
            header = {"rid": rid, "hash": a.hash, "layer": a.layer, "digest": digest}
            return header if prov is None else header | tables((prov,))
        case Blocks(request_id=rid, first=first, digests=digests, sizes=sizes, provenances=provs):
            header = {"rid": rid, "first": first, "digests": digests, "sizes": list(sizes)}
            return header | tables(provs) if any(p is not None for p in provs) else header
        case Miss(request_id=rid, address=a, reason=reason):
            return {"rid": rid, "hash": a.hash, "layer": a.layer, "reason": reason.value}
        case End(request_id=rid):
            return {"rid": rid}
        case Error(request_id=rid, code=code, message=message):
            return {"rid": rid, "code": code.value, "message": message}
        case Bye(reason=reason):
            return {"reason": reason}
    raise TypeError(f"not a frame: {frame!r}")


_BLOCK_TYPE = int(FrameType.BLOCK)
Encoded = tuple[bytes, Payload | tuple[Payload, ...]]   # a frame's head, and its payload as `encode_parts` returns it


def encode_parts(frame: Frame, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 sent: SentRecords | None = None) -> Encoded:
    """Preamble + header as one bytes object, and the payload unchanged (for vectored writes): one
    buffer, or a BLOCKS frame's tuple of part buffers, to be written in order after the head.
    `sent`: the ordered stream this frame is written to next, whose records it names by number
    (transports/trust/provenance_tables.py); left as it was when the frame is refused."""
    if type(frame) is Block and (frame.provenance is None or sent is not None):
        # The data path, a BLOCK unsigned or on a stream that names its record by number.
        if frame.provenance is None or sent is None:
            return _encode_block(frame, max_header, max_payload, None)
        return _on_stream(sent, _encode_block, frame, max_header, max_payload)
    if sent is None or not isinstance(frame, Block | Blocks):
        return _encode_checked(frame, max_header, max_payload, None)
    return _on_stream(sent, _encode_checked, frame, max_header, max_payload)


def _on_stream(sent: SentRecords, encoder: Callable[[Any, int, int, SentRecords | None], Encoded], frame: Frame,
               max_header: int, max_payload: int) -> Encoded:
    """Encode with `sent` numbering the frame's records: its numbers hold once it is encoded, and
    are forgotten when it is refused."""
    try:
        encoded = encoder(frame, max_header, max_payload, sent)
    except Exception:
        sent.discard()
        raise
    sent.commit()
    return encoded


def _encode_block(frame: Block, max_header: int, max_payload: int, sent: SentRecords | None) -> Encoded:
    """A BLOCK frame's head and payload, checked as `_encode_checked` checks, without its matching."""
    body = frame.payload
    size = len(body) if type(body) is bytes else memoryview(body).nbytes
    a = frame.address
    fields = {"rid": frame.request_id, "hash": a.hash, "layer": a.layer, "digest": frame.digest}
    if frame.provenance is not None:
        fields |= sent.table(frame.provenance) if sent is not None else record_tables((frame.provenance,))
    header = _pack(fields)
    if len(header) > max_header:
        raise ValueError(f"BLOCK header is {len(header)} bytes, over the {max_header}-byte limit")
    if size > max_payload:
        raise ValueError(f"BLOCK payload is {size} bytes, over the {max_payload}-byte limit")
    if len(frame.digest) != DIGEST_SIZE:
        raise ValueError(f"BLOCK digest must be {DIGEST_SIZE} bytes, got {len(frame.digest)}")
    return PREAMBLE.pack(MAGIC, VERSION, _BLOCK_TYPE, 0, len(header), size) + header, body


def _encode_checked(frame: Frame, max_header: int, max_payload: int, sent: SentRecords | None) -> Encoded:
    header = _pack(_header(frame, sent))
    payload: Payload | tuple[Payload, ...] = frame.payload if isinstance(frame, Block | Blocks) else b""
    piece_sizes = tuple(memoryview(p).nbytes for p in payload_pieces(payload))
    payload_len = sum(piece_sizes)
    if len(header) > max_header:
        raise ValueError(f"{frame.TYPE.name} header is {len(header)} bytes, over the {max_header}-byte limit")
    if payload_len > max_payload:
        raise ValueError(f"{frame.TYPE.name} payload is {payload_len} bytes, over the {max_payload}-byte limit")
    if isinstance(frame, Block) and len(frame.digest) != DIGEST_SIZE:
        raise ValueError(f"BLOCK digest must be {DIGEST_SIZE} bytes, got {len(frame.digest)}")
    if isinstance(frame, Blocks):
        check_parts(frame.digests, frame.sizes, payload_len, ValueError)
        if frame.provenances and len(frame.provenances) != len(frame.sizes):
            raise ValueError(f"BLOCKS carries {len(frame.provenances)} provenances for {len(frame.sizes)} parts")
        if isinstance(payload, tuple) and piece_sizes != frame.sizes:
            raise ValueError("BLOCKS part buffers do not have the sizes the header announces")
    preamble = PREAMBLE.pack(MAGIC, VERSION, int(frame.TYPE), 0, len(header), payload_len)
    return preamble + header, payload


def encode(frame: Frame, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD) -> bytes:
    """The complete wire bytes of one frame."""
    head, payload = encode_parts(frame, max_header, max_payload)
    return b"".join((head, *payload_pieces(payload)))


def encode_many(frames: Iterable[Frame]) -> bytes:
    return b"".join(encode(f) for f in frames)
