"""The kvfabric frame codec, shared by every transport. Sans-I/O: bytes in, frames out (the frame
types themselves are frames.py's; this module exports them too).

Wire layout of one frame (all integers little-endian):

    0      4   5   6       8           12                  20
    +------+---+---+-------+-----------+-------------------+----------------+-------------+
    | KVFB |ver|typ| flags | header_len|    payload_len    | msgpack header |   payload   |
    +------+---+---+-------+-----------+-------------------+----------------+-------------+
      magic u8  u8   u16       u32            u64            header_len B    payload_len B

The header is a msgpack map whose schema depends on the frame type; only BLOCK and BLOCKS frames
carry a payload. A BLOCKS frame answers a run of consecutive addresses of one PULL that are all
hits: one header and one payload (the parts back to back) instead of a frame per part, each part
with its own digest. BLOCK and BLOCKS frames may carry the producers' provenance records (see
"Provenance" below). Limits are checked on the preamble, before anything is buffered, so a peer
cannot make us allocate more than `max_header` + `max_payload` bytes per connection.

Provenance: optional `certs` / `provs` / `pix` header fields of BLOCK and BLOCKS, laid out and
read by `provenance_tables.py`.

Error strategy (one place): anything malformed raises `ProtocolError` with a message saying what
was wrong. The decoder is then poisoned (every later call raises the same error): the transport
catches it once, at its boundary, answers an ERROR frame where it still can, and closes that
stream or connection. Other peers are unaffected. No pickle anywhere.
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable
from typing import Any, cast

import msgpack

from fabric.keys import HASH_SIZE, BlockAddress, BlockHash
from fabric.provenance import Provenance
from transports.core.frames import (
    DEFAULT_MAX_PAYLOAD,
    VERSION,
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
    Payload,
    Pull,
)
from transports.core.provenance_tables import KnownRecords, part_records, record_tables

# The frames are defined in frames.py and are part of the codec's interface.
__all__ = [
    "DEFAULT_MAX_HEADER",
    "DEFAULT_MAX_PAYLOAD",
    "VERSION",
    "Block",
    "Blocks",
    "Bye",
    "End",
    "Error",
    "ErrorCode",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "Hello",
    "LocalProtocolError",
    "Miss",
    "MissReason",
    "Payload",
    "ProtocolError",
    "Pull",
    "encode",
    "encode_many",
    "encode_parts",
    "payload_pieces",
    "unpack_map",
]

MAGIC = b"KVFB"
PREAMBLE = struct.Struct("<4sBBHIQ")
PREAMBLE_SIZE = PREAMBLE.size  # 20
DEFAULT_MAX_HEADER = 64 * 1024
DIGEST_SIZE = 32
# Reads smaller than this go through a staging buffer; larger payload remainders are received
# straight into the payload's own buffer (see FrameDecoder.get_buffer).
STAGING_SIZE = 256 * 1024
DIRECT_MIN = 4 * 1024       # a payload rest at least this large is received straight into its buffer


class ProtocolError(Exception):
    """The peer broke the protocol (h11's RemoteProtocolError): bytes that are not a valid frame
    stream, or valid frames that break the session rules. `code` is what the ERROR frame that
    answers it carries."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


RemoteProtocolError = ProtocolError


class LocalProtocolError(RuntimeError):
    """We broke the protocol: a transport called a session out of turn (a bug of ours)."""


_FRAME_TYPES = {int(t): t for t in FrameType}
_PAYLOAD_TYPES = (FrameType.BLOCK, FrameType.BLOCKS)


def payload_pieces(payload: Payload | tuple[Payload, ...]) -> tuple[Payload, ...]:
    """The buffers of what `encode_parts` returned as payload, in the order they are sent."""
    return payload if isinstance(payload, tuple) else (payload,)


# ---------------------------------------------------------------------------------------------
# Encoding


def _header(frame: Frame) -> dict[str, Any]:
    match frame:
        case Hello(node=node, version=version, max_payload=max_payload):
            return {"node": node, "version": version, "max_payload": max_payload}
        case Pull(request_id=rid, addresses=addrs, namespace=ns):
            header = {"rid": rid, "addrs": [[a.hash, a.layer] for a in addrs]}
            return header | {"ns": ns} if ns else header
        case Block(request_id=rid, address=a, digest=digest, provenance=prov):
            header = {"rid": rid, "hash": a.hash, "layer": a.layer, "digest": digest}
            return header if prov is None else header | record_tables((prov,))
        case Blocks(request_id=rid, first=first, digests=digests, sizes=sizes, provenances=provs):
            header = {"rid": rid, "first": first, "digests": digests, "sizes": list(sizes)}
            return header | record_tables(provs) if any(p is not None for p in provs) else header
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


def encode_parts(frame: Frame, max_header: int = DEFAULT_MAX_HEADER,
                 max_payload: int = DEFAULT_MAX_PAYLOAD) -> tuple[bytes, Payload | tuple[Payload, ...]]:
    """Preamble + header as one bytes object, and the payload unchanged (for vectored writes): one
    buffer, or a BLOCKS frame's tuple of part buffers, to be written in order after the head."""
    if type(frame) is Block and frame.provenance is None:  # the unsigned data path: the same checks, no matching
        body = frame.payload
        size = len(body) if type(body) is bytes else memoryview(body).nbytes
        a = frame.address
        header = msgpack.packb({"rid": frame.request_id, "hash": a.hash, "layer": a.layer, "digest": frame.digest},
                               use_bin_type=True)
        if len(header) > max_header:
            raise ValueError(f"BLOCK header is {len(header)} bytes, over the {max_header}-byte limit")
        if size > max_payload:
            raise ValueError(f"BLOCK payload is {size} bytes, over the {max_payload}-byte limit")
        if len(frame.digest) != DIGEST_SIZE:
            raise ValueError(f"BLOCK digest must be {DIGEST_SIZE} bytes, got {len(frame.digest)}")
        return PREAMBLE.pack(MAGIC, VERSION, _BLOCK_TYPE, 0, len(header), size) + header, body
    header = msgpack.packb(_header(frame), use_bin_type=True)
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
        _check_parts(frame.digests, frame.sizes, payload_len, ValueError)
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


# ---------------------------------------------------------------------------------------------
# Decoding


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


def _check_parts(digests: Any, sizes: Any, payload_len: int, error: type[Exception]) -> int:
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


def _records(header: dict[Any, Any], num_parts: int, ftype: FrameType,
             known: KnownRecords | None) -> tuple[Provenance | None, ...]:
    try:
        return part_records(header, num_parts, ftype.name, known)
    except ValueError as e:
        raise ProtocolError(str(e)) from None


def _build(ftype: FrameType, header: dict[Any, Any], payload: bytearray | memoryview,
           known: KnownRecords | None = None) -> Frame:
    # The data path, a BLOCK unsigned (4 fields) or signed (7: its record's three as well), is
    # checked in one expression; anything else, or a BLOCK with something wrong, is built (and what
    # is wrong named) by _build_checked.
    if ftype is FrameType.BLOCK and ((fields := len(header)) == 4 or (fields == 7 and "pix" in header)):
        rid, hash_, layer, digest = header.get("rid"), header.get("hash"), header.get("layer"), header.get("digest")
        if (type(rid) is int and 0 <= rid < 2**64 and type(hash_) is bytes and len(hash_) == HASH_SIZE
                and type(layer) is int and 0 <= layer < 2**32 and type(digest) is bytes and len(digest) == DIGEST_SIZE):
            address = BlockAddress(BlockHash(hash_), layer)
            if fields == 4:
                return Block(rid, address, digest, payload)
            return Block(rid, address, digest, payload, _records(header, 1, ftype, known)[0])
    return _build_checked(ftype, header, payload, known)


def _build_checked(ftype: FrameType, header: dict[Any, Any], payload: bytearray | memoryview,
                   known: KnownRecords | None = None) -> Frame:
    if ftype not in _PAYLOAD_TYPES and payload:
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
        provs = _records(header, 1, ftype, known)
        return Block(_u64(header, "rid", ftype), addr, digest, payload, provs[0] if provs else None)
    if ftype is FrameType.BLOCKS:
        rid, first = _u64(header, "rid", ftype), _u64(header, "first", ftype)
        digests, sizes = header.get("digests"), header.get("sizes")
        num_parts = _check_parts(digests, sizes, len(payload), ProtocolError)   # bytes and ints from here on
        provs = _records(header, num_parts, ftype, known)
        if not any(p is not None for p in provs):
            provs = ()
        return Blocks(rid, first, cast(bytes, digests), tuple(cast(list[int], sizes)), payload, provs)
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


class _State(enum.Enum):
    PREAMBLE = 0
    HEADER = 1
    PAYLOAD = 2


_NO_PAYLOAD = bytearray()   # never written: the decoder's payload between frames
_NO_PAYLOAD_VIEW = memoryview(_NO_PAYLOAD)


class FrameDecoder:
    """Incremental decoder: accepts any split of the byte stream.

    Two ways to drive it:
      * `feed(data) -> list[Frame]` for transports that hand over bytes (QUIC streams);
      * `get_buffer()` / `buffer_updated(n)` for `asyncio.BufferedProtocol` and `recv_into`:
        a payload's remaining bytes (once at least DIRECT_MIN) are received directly into the
        payload's own buffer, so they are never copied; preambles, headers and short rests go
        through a staging buffer, where one read can take several small frames.

    `payload_allocator(n)` makes each payload buffer (default `bytearray(n)`, zero-filled). A
    transport may pass one that skips the zero-filling: a BLOCK frame is only returned once every
    byte of its payload has been received, so no uninitialised byte is ever handed out.
    """

    def __init__(self, max_header: int = DEFAULT_MAX_HEADER, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 payload_allocator: Callable[[int], bytearray] = bytearray) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self._allocate = payload_allocator
        self._state = _State.PREAMBLE
        self._buf = bytearray()            # partial preamble or header
        self._ftype = FrameType.BYE
        self._header_len = 0
        self._payload: bytearray | memoryview = _NO_PAYLOAD
        self._payload_view = _NO_PAYLOAD_VIEW
        self._payload_len = 0
        # Optional: (frame type, parsed header, payload size) -> a writable buffer of exactly that
        # size to receive the payload into (a client placing pulled blocks where they belong), or
        # None for a new buffer. Called before any payload byte is received.
        self.payload_target: Callable[[FrameType, dict[Any, Any], int], memoryview | None] | None = None
        self.placed_rid: Any = None   # the request whose target the payload being received goes to
        self._payload_filled = 0
        self._header: dict[Any, Any] = {}
        self._error: ProtocolError | None = None
        self._staging = bytearray()  # allocated on first get_buffer(): feed()-only users never pay for it
        self._known: KnownRecords = {}   # provenance records this stream carried lately (provenance_tables)
        # True when the last `get_buffer()` returned (the rest of) a payload's own buffer: bytes
        # read into it belong to that payload only.
        self.receiving_payload = False

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has been received (used to detect stalled peers)."""
        return self._state is not _State.PREAMBLE or bool(self._buf)

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) + self._payload_len

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if self._error is not None:
            raise self._error
        try:
            return self._consume(memoryview(data).cast("B"))
        except ProtocolError as e:
            self._error = e
            raise

    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """A writable buffer for the next received bytes (BufferedProtocol contract)."""
        if self._state is _State.PAYLOAD and self._payload_len - self._payload_filled >= DIRECT_MIN:
            self.receiving_payload = True
            return self._payload_view[self._payload_filled:]
        self.receiving_payload = False
        if not self._staging:
            self._staging = bytearray(STAGING_SIZE)
        return memoryview(self._staging)

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        if self._error is not None:
            raise self._error
        if not self.receiving_payload:
            return self.feed(memoryview(self._staging)[:nbytes])
        self._payload_filled += nbytes
        if self._payload_filled != self._payload_len:
            return []
        try:
            return [self._finish_frame()]
        except ProtocolError as e:
            self._error = e
            raise

    def close(self) -> None:
        """Declare end of stream; raises ProtocolError if a frame was cut short."""
        if self._error is not None:
            raise self._error
        if self.mid_frame:
            self._error = ProtocolError(f"stream ended inside a {self._state.name.lower()} "
                                        f"({self._describe_progress()})")
            raise self._error

    def _describe_progress(self) -> str:
        if self._state is _State.PAYLOAD:
            return f"{self._payload_filled} of {self._payload_len} payload bytes"
        return f"{len(self._buf)} bytes buffered"

    def _consume(self, data: memoryview) -> list[Frame]:
        frames: list[Frame] = []
        pos, end = 0, len(data)
        while pos < end:
            state = self._state
            if state is _State.PAYLOAD:
                filled = self._payload_filled
                take = min(end - pos, self._payload_len - filled)
                self._payload_view[filled:filled + take] = data[pos:pos + take]
                self._payload_filled = filled = filled + take
                pos += take
                if filled == self._payload_len:
                    frames.append(self._finish_frame())
                continue
            size = PREAMBLE_SIZE if state is _State.PREAMBLE else self._header_len
            if not self._buf and end - pos >= size:  # all of it here: parse it in place
                if state is _State.PREAMBLE:
                    self._parse_preamble(PREAMBLE.unpack_from(data, pos))
                elif self._parse_header(data[pos:pos + size]):  # a frame without payload is complete here
                    frames.append(self._finish_frame())
                pos += size
                continue
            take = min(size - len(self._buf), end - pos)  # only part of it here: gather it in _buf
            self._buf += data[pos:pos + take]
            pos += take
            if len(self._buf) < size:
                break
            chunk, self._buf = self._buf, bytearray()
            if state is _State.PREAMBLE:
                self._parse_preamble(PREAMBLE.unpack(chunk))
            elif self._parse_header(chunk):
                frames.append(self._finish_frame())
        return frames

    def _parse_preamble(self, fields: tuple[bytes, int, int, int, int, int]) -> None:
        magic, version, ftype, flags, header_len, payload_len = fields
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r} (not a kvfabric peer?)")
        if version != VERSION:
            raise ProtocolError(f"unsupported codec version {version}; this side speaks {VERSION}")
        frame_type = _FRAME_TYPES.get(ftype)
        if frame_type is None:
            raise ProtocolError(f"unknown frame type {ftype}")
        self._ftype = frame_type
        if flags != 0:
            raise ProtocolError(f"reserved flags must be zero, got {flags:#x}")
        if header_len == 0 or header_len > self.max_header:
            raise ProtocolError(f"{frame_type.name} header length {header_len} outside (0, {self.max_header}]")
        if payload_len > self.max_payload:
            raise ProtocolError(f"{frame_type.name} payload of {payload_len} bytes exceeds the "
                                f"{self.max_payload}-byte limit")
        if payload_len and frame_type not in _PAYLOAD_TYPES:
            raise ProtocolError(f"{frame_type.name} frame must not carry a payload ({payload_len} bytes)")
        self._header_len = header_len
        self._payload_len = payload_len   # its buffer is chosen once the header is known
        self._payload_filled = 0
        self._state = _State.HEADER

    def _place_payload(self, header: dict[Any, Any]) -> None:
        """The buffer the payload is received into: where `payload_target` says, else a new one."""
        size = self._payload_len
        target = self.payload_target(self._ftype, header, size) if self.payload_target is not None else None
        if target is not None:
            if target.nbytes != size or target.readonly or target.format != "B":
                raise RuntimeError(f"payload target is not a writable {size}-byte buffer")
            self._payload, self._payload_view = target, target
            self.placed_rid = header.get("rid")
            return
        payload = self._allocate(size)
        if len(payload) != size:
            raise RuntimeError(f"payload allocator returned {len(payload)} bytes for {size}")
        self._payload, self._payload_view = payload, memoryview(payload)

    def _parse_header(self, chunk: bytearray | memoryview) -> bool:
        """Parse the header; True when the frame has no payload and is therefore complete."""
        try:  # the data path: a well-formed map, no error message built
            header = msgpack.unpackb(chunk, raw=False, strict_map_key=True)
        except Exception:
            header = None
        if type(header) is not dict:
            header = unpack_map(chunk, f"{self._ftype.name} header")  # raises, saying what is wrong
        self._header = header
        self._state = _State.PAYLOAD
        if self._payload_len:
            self._place_payload(header)
        return not self._payload_len

    def detach_payload(self) -> None:
        """Receive the rest of the current payload into a buffer of its own instead of the target
        it was placed in (whose owner gave up on it and may reuse that memory)."""
        if self.placed_rid is None:
            return
        own = self._allocate(self._payload_len)
        own[:self._payload_filled] = self._payload_view[:self._payload_filled]
        self._payload, self._payload_view, self.placed_rid = own, memoryview(own), None

    def _finish_frame(self) -> Frame:
        frame = _build(self._ftype, self._header, self._payload if self._payload_len else bytearray(), self._known)
        self._state = _State.PREAMBLE
        self._header = {}
        # The payload is the frame's now: keep no reference (nor an export that would pin its size).
        self._payload, self._payload_view, self._payload_len = _NO_PAYLOAD, _NO_PAYLOAD_VIEW, 0
        self.placed_rid = None
        return frame
