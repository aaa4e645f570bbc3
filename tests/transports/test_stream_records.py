"""Provenance records named by number on an ordered stream (transports/trust/provenance_tables.py):
each record and certificate crosses a stream once, a reader resolves later frames to the very
records it decoded, and anything a writer could not have sent is a protocol error."""

from __future__ import annotations

import msgpack
import pytest

from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block
from transports.core.codec import Block, Blocks, FrameDecoder, FrameType, ProtocolError, encode
from transports.core.encoder import MAGIC, PREAMBLE, encode_parts, payload_pieces
from transports.core.frames import VERSION
from transports.trust.provenance_tables import MAX_HELD_BYTES, MAX_NEW, STREAM_WINDOW, SentRecords


def _record(i: int, cert: bytes = b"C" * 300) -> Provenance:
    return sign_block(b"n" * 32, i.to_bytes(32, "little"), [bytes([7]) * 32, bytes([8]) * 32], "node-a", cert,
                      lambda m: b"s" * 64)


def _block(record: Provenance | None, layer: int = 0) -> Block:
    h = record.block_hash if record is not None else b"u" * 32
    return Block(1, BlockAddress(BlockHash(h), layer), bytes([7 + layer]) * 32, b"xyz", record)


def _wire(frame: Block | Blocks, sent: SentRecords) -> bytes:
    head, payload = encode_parts(frame, sent=sent)
    return head + b"".join(bytes(p) for p in payload_pieces(payload))


def _header(wire: bytes) -> dict[str, object]:
    _, _, _, _, header_len, _ = PREAMBLE.unpack_from(wire)
    header: dict[str, object] = msgpack.unpackb(wire[PREAMBLE.size:PREAMBLE.size + header_len], raw=False)
    return header


def test_each_record_and_certificate_crosses_a_stream_once() -> None:
    a, b = _record(1), _record(2, cert=b"D" * 200)
    sent, reader = SentRecords(), FrameDecoder()
    mixed = Blocks(1, 0, bytes([7]) * 32 + bytes([8]) * 32 + bytes([7]) * 32, (1, 1, 1), b"xyz", (a, a, b))
    frames: list[Block | Blocks] = [_block(a), _block(a, 1), mixed, _block(None), _block(b, 1)]
    wires = [_wire(f, sent) for f in frames]
    got = [f for w in wires for f in reader.feed(w)]
    # the first frame carries a's record and certificate; the next ones name a by number
    assert _header(wires[0])["rref"] == [0, 0] and len(_header(wires[0])["provs"]) == 1   # type: ignore[arg-type]
    assert "provs" not in _header(wires[1]) and "certs" not in _header(wires[1])
    assert _header(wires[2])["pix"] == [0, 0, 1] and _header(wires[2])["certs"] == [b"D" * 200]
    assert len(wires[1]) < len(wires[0]) - 300   # neither record nor certificate again
    assert isinstance(got[0], Block) and got[0].provenance == a
    assert isinstance(got[1], Block) and got[1].provenance is got[0].provenance   # the object decoded first
    assert isinstance(got[2], Blocks) and got[2].provenances[:2] == (got[0].provenance,) * 2
    assert got[2].provenances[2] == b and got[2].provenances[2].cert_der == b"D" * 200
    assert isinstance(got[3], Block) and got[3].provenance is None
    assert isinstance(got[4], Block) and got[4].provenance is got[2].provenances[2]


def test_a_record_the_reader_may_have_dropped_is_sent_again() -> None:
    first = _record(0)
    sent, reader = SentRecords(), FrameDecoder()
    out = reader.feed(_wire(_block(first), sent))
    for i in range(1, STREAM_WINDOW):   # a window's worth of other records
        out += reader.feed(_wire(_block(_record(i)), sent))
    again = _wire(_block(first), sent)
    assert "provs" in _header(again)   # numbered anew: past the writer's margin inside the window
    got = reader.feed(again)
    assert isinstance(got[0], Block) and got[0].provenance == first
    assert len(reader._records.records) <= STREAM_WINDOW   # the reader holds a window, no more


def test_a_refused_frame_leaves_the_numbering_as_it_was() -> None:
    a = _record(1)
    sent, reader = SentRecords(), FrameDecoder()
    with pytest.raises(ValueError, match="header"):   # over the header limit: never written
        encode_parts(_block(a), max_header=64, sent=sent)
    got = reader.feed(_wire(_block(a), sent))   # still numbered 0, with its record
    assert isinstance(got[0], Block) and got[0].provenance == a


def test_a_refused_frame_is_not_numbered_by_the_next_frame_either() -> None:
    a, b = _record(1), _record(2)
    sent, reader = SentRecords(), FrameDecoder()
    big = Blocks(1, 0, bytes([7]) * 64, (1, 1), b"xy", (a, b))
    with pytest.raises(ValueError, match="header"):
        encode_parts(big, max_header=64, sent=sent)   # refused after its tables were made
    unsigned = Blocks(1, 0, bytes([7]) * 32, (1,), b"x")
    got = reader.feed(_wire(unsigned, sent)) + reader.feed(_wire(_block(b), sent)) + reader.feed(_wire(_block(a), sent))
    assert [f.provenance for f in got[1:] if isinstance(f, Block)] == [b, a]
    assert sent.next_record == 2


def _signed_wire(fields: dict[str, object]) -> bytes:
    header = msgpack.packb({"rid": 1, "hash": b"h" * 32, "layer": 0, "digest": b"d" * 32} | fields,
                           use_bin_type=True)
    return PREAMBLE.pack(MAGIC, VERSION, FrameType.BLOCK, 0, len(header), 3) + header + b"abc"


RECORD = sign_block(b"n" * 32, b"h" * 32, [b"d" * 32], "node-a", b"C" * 10, lambda m: b"s" * 64).encode()


@pytest.mark.parametrize(("frames", "message"), [
    ([{"rref": [1, 0], "pix": [0]}], "not this stream's next"),                       # skips a number
    ([{"rref": [0, 0], "pix": [0]}], "out of range"),                                 # names what was never sent
    ([{"rref": [0, 0], "certs": [b"C"], "provs": [[RECORD, 0]], "pix": [0]},
      {"rref": [0, 1], "pix": [0]}], "not this stream's next"),                        # reuses a number
    ([{"rref": [0, 0], "provs": [[RECORD, 0]], "pix": [0]}], "does not hold"),        # a certificate never sent
    ([{"rref": [0, 0], "certs": [b"C", b"D"], "provs": [[RECORD, 0]], "pix": [0]}], "2 new certificates"),
    ([{"rref": [0, 0], "certs": [b"C"], "provs": [[RECORD, 0], [RECORD, 0]], "pix": [0]}], "at most one new"),
    ([{"rref": [0, 0], "certs": [b"C"], "provs": [[RECORD, 0]], "pix": [True]}], "pix entry"),
    ([{"rref": "x", "pix": [0]}], "rref"),
])
def test_numbers_a_writer_could_not_have_sent_are_protocol_errors(frames: list[dict[str, object]],
                                                                    message: str) -> None:
    reader = FrameDecoder()
    with pytest.raises(ProtocolError, match=message):
        for fields in frames:
            reader.feed(_signed_wire(fields))


def test_a_frame_names_at_most_max_new_new_records() -> None:
    assert MAX_NEW < STREAM_WINDOW
    records = [_record(i) for i in range(MAX_NEW)]
    frame = Blocks(1, 0, bytes([7]) * 32 * MAX_NEW, (1,) * MAX_NEW, b"x" * MAX_NEW, tuple(records))
    got = FrameDecoder().feed(_wire(frame, SentRecords()))
    assert isinstance(got[0], Blocks) and got[0].provenances == tuple(records)


def test_a_writer_refuses_a_frame_the_reader_would_refuse() -> None:
    records = [_record(i) for i in range(MAX_NEW + 1)]
    frame = Blocks(1, 0, bytes([7]) * 32 * len(records), (1,) * len(records), b"x" * len(records), tuple(records))
    sent = SentRecords()
    with pytest.raises(ValueError, match="at most"):
        encode_parts(frame, sent=sent)
    assert sent.next_record == 0


def test_per_frame_tables_still_decode_on_any_stream() -> None:
    a = _record(1)
    reader = FrameDecoder()
    got = reader.feed(encode(_block(a))) + reader.feed(encode(_block(a, 1)))
    assert [f.provenance for f in got if isinstance(f, Block)] == [a, a]


@pytest.mark.parametrize("per_stream", [True, False], ids=["per_stream", "per_frame"])
def test_a_record_flood_keeps_a_reader_within_its_byte_bound(per_stream: bool) -> None:
    # Records as large as a frame's header lets them be, each new, each under a certificate of its own
    layers = [bytes([9]) * 32] * 1500
    sent, reader = SentRecords(), FrameDecoder()
    peak, refused = 0, False
    for i in range(STREAM_WINDOW):
        record = sign_block(b"n" * 32, i.to_bytes(32, "little"), layers, "node-a", i.to_bytes(4, "little") * 3000,
                            lambda m: b"s" * 64)
        frame = Block(1, BlockAddress(BlockHash(record.block_hash), 0), bytes([9]) * 32, b"xyz", record)
        head, payload = encode_parts(frame, sent=sent) if per_stream else encode_parts(frame)
        sent.commit()
        try:
            reader.feed(head + b"".join(bytes(p) for p in payload_pieces(payload)))
        except ProtocolError as e:
            assert "bound" in str(e)
            refused = True
            break
        peak = max(peak, reader.held_record_bytes)
    assert peak <= MAX_HELD_BYTES
    assert refused == per_stream   # a per-frame reader forgets instead: its cache is emptied
