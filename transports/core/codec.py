"""The kvfabric frame codec, shared by every transport, and its decoder. Sans-I/O: bytes in, frames
out. The frame types are frames.py's, the encoder is encoder.py's and the header checks are
frame_headers.py's; this module exports them, as the codec's interface.

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
read by `transports/trust/provenance_tables.py`.

Error strategy (one place): anything malformed raises `ProtocolError` with a message saying what
was wrong. The decoder is then poisoned (every later call raises the same error): the transport
catches it once, at its boundary, answers an ERROR frame where it still can, and closes that
stream or connection. Other peers are unaffected. No pickle anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgpack

from transports.core.encoder import (
    DEFAULT_MAX_HEADER,
    MAGIC,
    PREAMBLE,
    PREAMBLE_SIZE,
    check_parts,
    encode,
    encode_many,
    encode_parts,
    payload_pieces,
)
from transports.core.frame_headers import (
    PAYLOAD_TYPES,
    LocalProtocolError,
    ProtocolError,
    build_frame,
    unpack_map,
)
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
from transports.core.receipt_digests import ReceiptDigests
from transports.trust.provenance_tables import StreamRecords

# The frames (frames.py) and the encoder (encoder.py) are part of the codec's interface.
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

# Reads smaller than this go through a staging buffer; larger payload remainders are received
# straight into the payload's own buffer (see FrameDecoder.get_buffer).
STAGING_SIZE = 256 * 1024
DIRECT_MIN = 4 * 1024       # a payload rest at least this large is received straight into its buffer

_FRAME_TYPES = {int(t): t for t in FrameType}


class _State(enum.Enum):
    PREAMBLE = 0
    HEADER = 1
    PAYLOAD = 2


_NO_PAYLOAD = bytearray()   # never written: the decoder's payload between frames
_NO_PAYLOAD_VIEW = memoryview(_NO_PAYLOAD)


_ANSWER_TYPES = frozenset({FrameType.BLOCK, FrameType.BLOCKS})   # frames that carry records and payloads


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
        # Optional: whether a BLOCK / BLOCKS frame's request id was ever issued on this stream (a
        # client's). A frame for any other id is refused from its header, before its payload is
        # received or its provenance records are decoded.
        self.request_known: Callable[[int], bool] | None = None
        # True on a puller's stream: BLOCK / BLOCKS payloads are hashed as their bytes land, and
        # each frame carries those digests as its `receipt` (receipt_digests.py).
        self.hash_payloads = False
        self._receipt: ReceiptDigests | None = None
        self._payload_filled = 0
        self._header: dict[Any, Any] = {}
        self._error: ProtocolError | None = None
        self._staging = bytearray()  # allocated on first get_buffer(): feed()-only users never pay for it
        self._records = StreamRecords()   # provenance records this stream carried (provenance_tables)
        # True when the last `get_buffer()` returned (the rest of) a payload's own buffer: bytes
        # read into it belong to that payload only.
        self.receiving_payload = False

    @property
    def mid_frame(self) -> bool:
        """True when part of a frame has been received (used to detect stalled peers)."""
        return self._state is not _State.PREAMBLE or bool(self._buf)

    @property
    def held_record_bytes(self) -> int:
        """Bytes of provenance records and certificates this stream's reader holds (both forms)."""
        return self._records.held_bytes + self._records.known_bytes

    @property
    def payload_left(self) -> int:
        """Bytes of the payload being received that have not arrived yet (0 between payloads)."""
        return self._payload_len - self._payload_filled if self._state is _State.PAYLOAD else 0

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
        if self._receipt is not None:
            self._receipt.advance(self._payload_view, self._payload_filled)
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
                if self._receipt is not None:
                    self._receipt.advance(self._payload_view, filled)
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
        frame_type = _FRAME_TYPES.get(ftype)
        if (magic == MAGIC and version == VERSION and frame_type is not None and not flags
                and 0 < header_len <= self.max_header and payload_len <= self.max_payload
                and (not payload_len or frame_type in PAYLOAD_TYPES)):   # the data path: all checks at once
            self._ftype = frame_type
            self._header_len = header_len
            self._payload_len = payload_len   # its buffer is chosen once the header is known
            self._payload_filled = 0
            self._state = _State.HEADER
            return
        self._refuse_preamble(fields)

    def _refuse_preamble(self, fields: tuple[bytes, int, int, int, int, int]) -> None:
        """Raise the ProtocolError that says which of the preamble's checks `fields` fail."""
        magic, version, ftype, flags, header_len, payload_len = fields
        if magic != MAGIC:
            raise ProtocolError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r} (not a kvfabric peer?)")
        if version != VERSION:
            raise ProtocolError(f"unsupported codec version {version}; this side speaks {VERSION}")
        frame_type = _FRAME_TYPES.get(ftype)
        if frame_type is None:
            raise ProtocolError(f"unknown frame type {ftype}")
        if flags != 0:
            raise ProtocolError(f"reserved flags must be zero, got {flags:#x}")
        if header_len == 0 or header_len > self.max_header:
            raise ProtocolError(f"{frame_type.name} header length {header_len} outside (0, {self.max_header}]")
        if payload_len > self.max_payload:
            raise ProtocolError(f"{frame_type.name} payload of {payload_len} bytes exceeds the "
                                f"{self.max_payload}-byte limit")
        if payload_len and frame_type not in PAYLOAD_TYPES:
            raise ProtocolError(f"{frame_type.name} frame must not carry a payload ({payload_len} bytes)")
        raise AssertionError(f"a preamble refused for no reason: {fields!r}")

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
        if self.request_known is not None and self._ftype in _ANSWER_TYPES and type(rid := header.get("rid")) is int \
                and not self.request_known(rid):
            raise ProtocolError(f"{self._ftype.name} for request {rid}, which was never sent")
        self._header = header
        self._state = _State.PAYLOAD
        if self._payload_len:
            self._place_payload(header)
            if self.hash_payloads and self._ftype in _ANSWER_TYPES:
                self._receipt = _receipt(self._ftype, header, self._payload_len)
        return not self._payload_len

    def detach_payload(self) -> None:
        """Receive the rest of the current payload into a buffer of its own instead of the target
        it was placed in (whose owner gave up on it and may reuse that memory)."""
        if self.placed_rid is None:
            return
        own = self._allocate(self._payload_len)
        own[:self._payload_filled] = self._payload_view[:self._payload_filled]
        self._payload, self._payload_view, self.placed_rid = own, memoryview(own), None
        self._receipt = None   # its bytes were hashed where they landed: the frame is hashed whole

    def _finish_frame(self) -> Frame:
        receipt, self._receipt = self._receipt, None
        frame = build_frame(self._ftype, self._header, self._payload if self._payload_len else bytearray(),
                            self._records, b"" if receipt is None else receipt.digests())
        self._state = _State.PREAMBLE
        self._header = {}
        # The payload is the frame's now: keep no reference (nor an export that would pin its size).
        self._payload, self._payload_view, self._payload_len = _NO_PAYLOAD, _NO_PAYLOAD_VIEW, 0
        self.placed_rid = None
        return frame


def _receipt(ftype: FrameType, header: dict[Any, Any], payload_len: int) -> ReceiptDigests | None:
    """Digests to take of an answer's payload as it lands: one part for a BLOCK, the announced
    parts of a BLOCKS (None when they do not add up: building the frame refuses it)."""
    if ftype is FrameType.BLOCK:
        return ReceiptDigests((payload_len,))
    try:
        check_parts(header.get("digests"), header.get("sizes"), payload_len, ValueError)
    except ValueError:
        return None
    return ReceiptDigests(header["sizes"])
