"""Frame codec: every frame type round-trips at any split; garbage only ever raises ProtocolError."""

from __future__ import annotations

import dataclasses
import os
import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import receive_buffered

from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block, sign_run
from transports.core.codec import (
    VERSION,
    Block,
    Blocks,
    Bye,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    Hello,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
    encode,
    encode_many,
)
from transports.core.encoder import MAGIC, PREAMBLE, PREAMBLE_SIZE

hashes = st.binary(min_size=32, max_size=32).map(BlockHash)
addresses = st.builds(BlockAddress, hashes, st.integers(0, 2**32 - 1))
rids = st.integers(0, 2**64 - 1)


def _blocks(rid: int, first: int, parts: list[bytes], digests: bytes) -> Blocks:
    return Blocks(rid, first, digests[:32 * len(parts)], tuple(len(p) for p in parts), b"".join(parts))


blocks_frames = st.builds(_blocks, rids, st.integers(0, 2**32), st.lists(st.binary(max_size=3000), min_size=1,
                                                                          max_size=6),
                          st.binary(min_size=32 * 6, max_size=32 * 6))
frames: st.SearchStrategy[Frame] = st.one_of(
    blocks_frames,
    st.builds(Hello, st.text(max_size=40), st.integers(0, 2**32), st.integers(0, 2**40)),
    st.builds(Pull, rids, st.lists(addresses, max_size=20).map(tuple)),
    st.builds(Block, rids, addresses, st.binary(min_size=32, max_size=32), st.binary(max_size=5000)),
    st.builds(Miss, rids, addresses, st.sampled_from(MissReason)),
    st.builds(End, rids),
    st.builds(Error, rids, st.sampled_from(ErrorCode), st.text(max_size=100)),
    st.builds(Bye, st.text(max_size=40)),
)


def _same(a: Frame, b: Frame) -> bool:
    if isinstance(a, Block) and isinstance(b, Block):
        return (a.request_id, a.address, a.digest, bytes(a.payload)) == (
            b.request_id, b.address, b.digest, bytes(b.payload))
    if isinstance(a, Blocks) and isinstance(b, Blocks):
        return (a.request_id, a.first, a.digests, a.sizes, bytes(a.payload)) == (
            b.request_id, b.first, b.digests, b.sizes, bytes(b.payload))
    return a == b


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=1, max_size=8), st.data())
def test_round_trip_at_random_splits(fs: list[Frame], data: st.DataObject) -> None:
    wire = encode_many(fs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=12)))
    dec = FrameDecoder()
    out: list[Frame] = []
    prev = 0
    for cut in [*cuts, len(wire)]:
        out += dec.feed(wire[prev:cut])
        prev = cut
    dec.close()
    assert len(out) == len(fs)
    assert all(_same(a, b) for a, b in zip(fs, out, strict=True))


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(frames, min_size=1, max_size=5), st.integers(1, 70000))
def test_buffered_protocol_path(fs: list[Frame], chunk: int) -> None:
    """get_buffer/buffer_updated (recv_into style) decodes the same frames."""
    out = receive_buffered(FrameDecoder(), encode_many(fs), chunk)
    assert all(_same(a, b) for a, b in zip(fs, out, strict=True)) and len(out) == len(fs)


def test_large_payload_lands_in_its_own_buffer() -> None:
    payload = os.urandom(1 << 20)
    addr = BlockAddress(BlockHash(os.urandom(32)), 1)
    wire = encode(Block(7, addr, os.urandom(32), payload))
    dec = FrameDecoder()
    first = dec.get_buffer()
    first[:4096] = wire[:4096]
    assert dec.buffer_updated(4096) == []
    direct = dec.get_buffer()
    assert len(direct) == len(wire) - 4096  # the rest goes straight into the payload buffer
    direct[:] = wire[4096:]
    (frame,) = dec.buffer_updated(len(direct))
    assert isinstance(frame, Block) and bytes(frame.payload) == payload


def test_a_returned_payload_is_the_callers_alone() -> None:
    """The decoder keeps no view of a payload it handed out (its own view is how it fills one), so
    the caller may resize it: a bytearray with a live memoryview raises BufferError. Both ways of
    driving the decoder."""
    addr = BlockAddress(BlockHash(os.urandom(32)), 1)
    wire = encode(Block(7, addr, os.urandom(32), os.urandom(64 * 1024)))
    for decode in (lambda: FrameDecoder().feed(wire), lambda: receive_buffered(FrameDecoder(), wire, len(wire))):
        (frame,) = decode()
        assert isinstance(frame, Block) and isinstance(frame.payload, bytearray)
        frame.payload.extend(b"x")
        assert len(frame.payload) == 64 * 1024 + 1


@settings(max_examples=400)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_protocol_error(blob: bytes) -> None:
    dec = FrameDecoder(max_payload=1 << 16)
    try:
        dec.feed(blob)
        dec.close()
    except ProtocolError:
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames, st.data())
def test_bit_flips_and_truncations_only_raise_protocol_error(frame: Frame, data: st.DataObject) -> None:
    wire = bytearray(encode(frame))
    if data.draw(st.booleans()):
        bit = data.draw(st.integers(0, len(wire) * 8 - 1))
        wire[bit // 8] ^= 1 << (bit % 8)
    else:
        del wire[data.draw(st.integers(0, len(wire) - 1)):]
    dec = FrameDecoder()
    try:
        dec.feed(bytes(wire))
        dec.close()
    except ProtocolError:
        pass


def _preamble(ftype: int = FrameType.END, header_len: int = 8, payload_len: int = 0, magic: bytes = MAGIC,
              version: int = VERSION, flags: int = 0) -> bytes:
    return PREAMBLE.pack(magic, version, ftype, flags, header_len, payload_len)


@pytest.mark.parametrize(("wire", "message"), [
    (_preamble(magic=b"HTTP"), "bad magic"),
    (_preamble(version=9), "unsupported codec version"),
    (_preamble(ftype=99), "unknown frame type"),
    (_preamble(flags=1), "reserved flags"),
    (_preamble(header_len=0), "header length"),
    (_preamble(header_len=70000), "header length"),
    (_preamble(ftype=FrameType.BLOCK, payload_len=2**40), "exceeds"),
    (_preamble(ftype=FrameType.END, payload_len=10), "must not carry a payload"),
])
def test_bad_preambles_are_named(wire: bytes, message: str) -> None:
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=message):
        dec.feed(wire)
    with pytest.raises(ProtocolError):  # poisoned: a broken stream stays broken
        dec.feed(encode(End(1)))


def test_oversize_payload_refused_before_buffering() -> None:
    dec = FrameDecoder(max_payload=1024)
    with pytest.raises(ProtocolError, match="exceeds the 1024-byte limit"):
        dec.feed(_preamble(ftype=FrameType.BLOCK, header_len=10, payload_len=1025))
    assert dec.buffered_bytes == 0


def _with_header(ftype: FrameType, header: object) -> bytes:
    raw = msgpack.packb(header, use_bin_type=True)
    return _preamble(ftype=ftype, header_len=len(raw)) + raw


@pytest.mark.parametrize(("wire", "message"), [
    (_preamble(header_len=3) + b"\xc1\xc1\xc1", "not valid msgpack"),
    (_with_header(FrameType.END, [1, 2]), "must be a map"),
    (_with_header(FrameType.END, {}), "lacks field 'rid'"),
    (_with_header(FrameType.END, {"rid": -1}), "out of range"),
    (_with_header(FrameType.END, {"rid": True}), "has type bool"),
    (_with_header(FrameType.PULL, {"rid": 1, "addrs": [[b"x", 0]]}), "not 32 bytes"),
    (_with_header(FrameType.PULL, {"rid": 1, "addrs": [[b"x" * 32, -3]]}), "invalid layer"),
    (_with_header(FrameType.PULL, {"rid": 1, "addrs": [b"x" * 32]}), r"\[hash, layer\] pair"),
    (_with_header(FrameType.MISS, {"rid": 1, "hash": b"x" * 32, "layer": 0, "reason": "bored"}), "unknown MissReason"),
    (_with_header(FrameType.ERROR, {"rid": 1, "code": "protocol"}), "lacks field 'message'"),
])
def test_bad_headers_are_named(wire: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(wire)


def test_block_digest_must_be_32_bytes() -> None:
    raw = msgpack.packb({"rid": 1, "hash": b"h" * 32, "layer": 0, "digest": b"d" * 5}, use_bin_type=True)
    wire = _preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc"
    with pytest.raises(ProtocolError, match="digest must be 32 bytes"):
        FrameDecoder().feed(wire)
    with pytest.raises(ValueError):
        encode(Block(1, BlockAddress(BlockHash(b"h" * 32), 0), b"short", b"abc"))


GOOD_BLOCK = {"rid": 1, "hash": b"h" * 32, "layer": 0, "digest": b"d" * 32}


@pytest.mark.parametrize(("change", "message"), [
    ({"rid": True}, "has type bool"), ({"rid": -1}, "out of range"), ({"rid": 1.5}, "has type float"),
    ({"hash": "h" * 32}, "not 32 bytes"), ({"hash": b"h" * 31}, "not 32 bytes"),
    ({"layer": False}, "invalid layer"), ({"layer": 2**32}, "invalid layer"), ({"layer": 1.0}, "invalid layer"),
    ({"digest": "d" * 32}, "has type str"), ({"rid": None}, "has type NoneType"),
])
def test_bad_block_headers_are_named(change: dict[str, object], message: str) -> None:
    # BLOCK headers take a fast path; anything it does not accept must still be named precisely.
    raw = msgpack.packb(GOOD_BLOCK | change, use_bin_type=True)
    wire = _preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc"
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(wire)
    missing = {k: v for k, v in GOOD_BLOCK.items() if k not in change}
    raw = msgpack.packb(missing, use_bin_type=True)
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(_preamble(ftype=FrameType.BLOCK, header_len=len(raw)) + raw)


GOOD_BLOCKS = {"rid": 1, "first": 0, "digests": b"d" * 64, "sizes": [1, 2]}


@pytest.mark.parametrize(("change", "message"), [
    ({"digests": b"d" * 63}, "multiple of 32 bytes"), ({"digests": b""}, "non-empty multiple"),
    ({"digests": "d" * 64}, "multiple of 32 bytes"), ({"sizes": [3]}, "2 digests but 1 sizes"),
    ({"sizes": 3}, "2 digests but no sizes"), ({"sizes": [1, 1]}, "adding up to the 3-byte payload"),
    ({"sizes": [4, -1]}, "non-negative integers"), ({"sizes": [True, 2]}, "non-negative integers"),
    ({"sizes": [1.0, 2]}, "non-negative integers"), ({"first": -1}, "out of range"), ({"first": None}, "NoneType"),
    ({"rid": "1"}, "has type str"),
])
def test_bad_blocks_headers_are_named(change: dict[str, object], message: str) -> None:
    """A BLOCKS header must describe its payload exactly: one 32-byte digest and one size per part,
    the sizes adding up to the payload, so that no part can be read from another's bytes."""
    raw = msgpack.packb(GOOD_BLOCKS | change, use_bin_type=True)
    wire = _preamble(ftype=FrameType.BLOCKS, header_len=len(raw), payload_len=3) + raw + b"abc"
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(wire)


def test_blocks_parts_are_sent_unjoined_and_received_as_one_buffer() -> None:
    parts = (b"a" * 10, bytearray(b"b" * 20000), memoryview(b"c" * 7))
    frame = Blocks(3, 5, b"d" * 96, (10, 20000, 7), parts)
    (got,) = FrameDecoder().feed(encode(frame))
    assert isinstance(got, Blocks) and (got.request_id, got.first, got.sizes) == (3, 5, (10, 20000, 7))
    assert bytes(got.payload) == b"".join(parts) and got.num_parts == 3
    with pytest.raises(ValueError, match="sizes the header announces"):
        encode(Blocks(3, 5, b"d" * 96, (10, 7, 20000), parts))
    with pytest.raises(ValueError, match="multiple of 32"):
        encode(Blocks(3, 5, b"d" * 95, (10, 20000, 7), parts))


def test_truncated_stream_reported_on_close() -> None:
    wire = encode(Block(1, BlockAddress(BlockHash(b"h" * 32), 0), b"d" * 32, b"x" * 100))
    dec = FrameDecoder()
    assert dec.feed(wire[:-1]) == []
    assert dec.mid_frame
    with pytest.raises(ProtocolError, match="stream ended inside a payload"):
        dec.close()


def test_preamble_size_is_fixed() -> None:
    assert PREAMBLE_SIZE == 20 == struct.calcsize("<4sBBHIQ")


def test_no_pickle_in_codec() -> None:
    import transports.core.codec as codec
    with open(codec.__file__) as f:
        assert "pickle" not in f.read().replace("No pickle", "")


# ---- provenance in BLOCK and BLOCKS frames


def _record(block: bytes, producer: str = "node-a", cert: bytes = b"C" * 300, num_layers: int = 2) -> Provenance:
    return sign_block(b"n" * 32, block, [bytes([i]) * 32 for i in range(num_layers)], producer, cert,
                      lambda m: b"s" * 64)


def test_provenance_round_trips_in_block_and_blocks_frames() -> None:
    a, b = _record(b"a" * 32), _record(b"b" * 32, producer="node-b", cert=b"D" * 200)
    block = Block(7, BlockAddress(BlockHash(b"a" * 32), 1), b"d" * 32, b"payload", a)
    blocks = Blocks(8, 3, b"d" * 96, (1, 2, 3), b"xyyzzz", (a, None, b))
    shared = Blocks(9, 0, b"d" * 64, (1, 1), b"xy", (a, a))
    got = FrameDecoder().feed(encode_many([block, blocks, shared]))
    assert isinstance(got[0], Block) and got[0].provenance == a and got[0].provenance.cert_der == b"C" * 300
    assert isinstance(got[1], Blocks) and got[1].provenances == (a, None, b)
    assert got[1].provenances[2].cert_der == b"D" * 200
    assert isinstance(got[2], Blocks) and got[2].provenances[0] is got[2].provenances[1]  # sent once, shared
    wire = encode(shared)
    header_len = PREAMBLE.unpack_from(wire)[4]
    header = msgpack.unpackb(wire[PREAMBLE_SIZE:PREAMBLE_SIZE + header_len], raw=False)
    assert len(header["provs"]) == 1 and len(header["certs"]) == 1
    plain = FrameDecoder().feed(encode(Block(1, BlockAddress(BlockHash(b"a" * 32), 0), b"d" * 32, b"p")))
    assert plain[0].provenance is None   # unsigned: no provenance fields at all


def test_one_connection_decodes_a_record_it_saw_before_into_the_same_object() -> None:
    # the layers of a block often arrive in separate frames: sharing the object lets the verifier
    # check the record once (its last accepted record) rather than once per frame
    a, b = _record(b"a" * 32), _record(b"b" * 32)
    other_cert = dataclasses.replace(a, cert_der=b"E" * 300)
    frames = [Block(1, BlockAddress(BlockHash(b"a" * 32), 0), b"d" * 32, b"p", a),
              Blocks(1, 1, b"d" * 64, (1, 1), b"pq", (a, b)),
              Block(1, BlockAddress(BlockHash(b"a" * 32), 1), b"d" * 32, b"p", other_cert)]
    decoder = FrameDecoder()
    got = [f for raw in map(encode, frames) for f in decoder.feed(raw)]
    assert isinstance(got[0], Block) and isinstance(got[1], Blocks) and isinstance(got[2], Block)
    assert got[0].provenance == a and got[1].provenances == (a, b) and got[2].provenance == other_cert
    assert got[1].provenances[0] is got[0].provenance          # the same bytes: the same object
    assert got[2].provenance is not got[0].provenance           # another certificate: its own
    fresh = FrameDecoder().feed(encode(frames[0]))[0]
    assert isinstance(fresh, Block) and fresh.provenance == a and fresh.provenance is not got[0].provenance


def test_records_of_a_signed_run_keep_their_inclusion_paths_on_the_wire() -> None:
    run = sign_run(b"n" * 32, [(bytes([i]) * 32, [bytes([i]) * 32]) for i in range(5)], "node-a", b"C" * 300,
                   lambda m: b"s" * 64)
    frame = Blocks(4, 0, b"d" * 96, (1, 1, 1), b"xyz", (run[3], run[3], run[4]))
    [got] = FrameDecoder().feed(encode(frame))
    assert isinstance(got, Blocks) and got.provenances == (run[3], run[3], run[4])
    assert [(p.leaf_index, p.num_leaves, p.path) for p in got.provenances[1:]] == \
        [(3, 5, run[3].path), (4, 5, run[4].path)]
    assert got.provenances[1].message() == got.provenances[2].message() == run[0].message()


RECORD = _record(b"h" * 32).encode()
GOOD_PROV = {"certs": [b"C" * 10], "provs": [[RECORD, 0]], "pix": [0, -1]}


@pytest.mark.parametrize(("change", "message"), [
    ({"certs": "x"}, "certs must be a list"), ({"certs": [1]}, "certs must be a list of bytes"),
    ({"provs": "x"}, "provs must be a list"), ({"provs": [[b"x", 0]]}, "provenance record"),
    ({"provs": [["rec", 0]]}, "provs entries"), ({"provs": [[RECORD, 5]]}, "provs entries"),
    ({"pix": [0]}, "one pix entry per part"), ({"pix": [0, 2]}, "pix entry 2 out of range"),
    ({"pix": [True, -1]}, "pix entry"), ({"pix": None}, "pix must be a list"),
    ({"certs": None}, "certs must be a list"),
])
def test_bad_provenance_headers_are_named(change: dict[str, object], message: str) -> None:
    raw = msgpack.packb(GOOD_BLOCKS | GOOD_PROV | change, use_bin_type=True)
    wire = _preamble(ftype=FrameType.BLOCKS, header_len=len(raw), payload_len=3) + raw + b"abc"
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(wire)
    raw = msgpack.packb(GOOD_BLOCK | {"certs": [b"C"], "provs": [[RECORD, 0]], "pix": [0, 0]}, use_bin_type=True)
    with pytest.raises(ProtocolError, match="one pix entry per part"):
        FrameDecoder().feed(_preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc")
    raw = msgpack.packb(GOOD_BLOCK | {"certs": [b"C"]}, use_bin_type=True)   # a partial table is not "unsigned"
    with pytest.raises(ProtocolError, match="provs must be a list"):
        FrameDecoder().feed(_preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc")


@pytest.mark.parametrize(("change", "message"), [
    ({"digest": b"d" * 31}, "digest must be 32 bytes"), ({"hash": b"h"}, "block hash"),
    ({"layer": -1}, "invalid layer"), ({"rid": "1"}, "rid"), ({"pix": [1]}, "pix entry 1 out of range"),
    ({"pix": [True]}, "pix entry"), ({"certs": [1]}, "certs must be a list of bytes"),
])
def test_a_signed_block_with_anything_wrong_is_named(change: dict[str, object], message: str) -> None:
    good = GOOD_BLOCK | {"certs": [b"C" * 10], "provs": [[RECORD, 0]], "pix": [0]}
    raw = msgpack.packb(good, use_bin_type=True)
    frame = FrameDecoder().feed(_preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc")[0]
    assert isinstance(frame, Block) and frame.provenance == Provenance.decode(RECORD, b"C" * 10)
    raw = msgpack.packb(good | change, use_bin_type=True)
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder().feed(_preamble(ftype=FrameType.BLOCK, header_len=len(raw), payload_len=3) + raw + b"abc")
