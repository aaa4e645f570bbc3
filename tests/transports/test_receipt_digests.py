"""A puller's digests, taken while payloads land: the same digests as hashing each part whole,
whatever the split of the stream, and never where the payload moved to a buffer of its own."""

from __future__ import annotations

import os

import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from support import receive_buffered

from fabric.keys import BlockAddress, BlockHash
from transports.core.codec import Block, Blocks, FrameDecoder, FrameType, encode
from transports.core.receipt_digests import HASH_STEP, ReceiptDigests


def _digest(data: bytes) -> bytes:
    return blake3.blake3(data).digest()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 3 * HASH_STEP), min_size=1, max_size=5), data=st.data())
def test_digests_are_those_of_each_whole_part_at_any_split(sizes: list[int], data: st.DataObject) -> None:
    payload = os.urandom(sum(sizes))
    view = memoryview(payload)
    receipt = ReceiptDigests(sizes)
    filled = 0
    while filled < len(payload):
        filled = min(len(payload), filled + data.draw(st.integers(1, 2 * HASH_STEP)))
        receipt.advance(view, filled)
    receipt.advance(view, filled)
    expected, at = b"", 0
    for size in sizes:
        expected += _digest(payload[at:at + size])
        at += size
    assert receipt.digests() == expected


def test_no_digest_before_every_byte_landed() -> None:
    payload = memoryview(os.urandom(2 * HASH_STEP))
    receipt = ReceiptDigests([HASH_STEP, HASH_STEP])
    receipt.advance(payload, HASH_STEP + 1)
    assert receipt.digests() == b""
    receipt.advance(payload, 2 * HASH_STEP)
    assert receipt.digests() == _digest(bytes(payload[:HASH_STEP])) + _digest(bytes(payload[HASH_STEP:]))


def _address(i: int) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(b"%d" % i).digest()), i)


@settings(max_examples=25, deadline=None)
@given(chunk=st.integers(1_000, 300_000))
def test_a_pullers_decoder_hands_each_payload_over_with_its_digests(chunk: int) -> None:
    one = os.urandom(700_000)
    parts = [os.urandom(90_000), b"", os.urandom(5)]
    wire = encode(Block(1, _address(0), _digest(one), one)) + encode(
        Blocks(1, 1, b"".join(_digest(p) for p in parts), tuple(len(p) for p in parts), tuple(parts)))
    decoder = FrameDecoder()
    decoder.hash_payloads = True
    block, blocks = receive_buffered(decoder, wire, chunk)
    assert isinstance(block, Block) and block.receipt == block.digest == _digest(one)
    assert isinstance(blocks, Blocks) and blocks.receipt == blocks.digests


def test_a_lying_payload_gets_the_digest_of_what_landed() -> None:
    payload = os.urandom(200_000)
    decoder = FrameDecoder()
    decoder.hash_payloads = True
    [frame] = receive_buffered(decoder, encode(Block(1, _address(0), _digest(b"something else"), payload)), 65_536)
    assert isinstance(frame, Block) and frame.receipt == _digest(payload) != frame.digest


def test_other_decoders_take_no_digest() -> None:
    payload = os.urandom(100_000)
    [frame] = receive_buffered(FrameDecoder(), encode(Block(1, _address(0), _digest(payload), payload)), 65_536)
    assert isinstance(frame, Block) and frame.receipt == b""


def test_a_payload_moved_to_its_own_buffer_is_hashed_whole_later() -> None:
    """A caller that gives up on its slot mid-payload: the rest lands elsewhere, so the digest of
    the bytes that landed in the slot no longer stands for the frame's payload."""
    payload = os.urandom(300_000)
    slot = memoryview(bytearray(len(payload)))
    decoder = FrameDecoder()
    decoder.hash_payloads = True
    decoder.payload_target = lambda ftype, header, size: slot if ftype is FrameType.BLOCK else None
    wire = encode(Block(7, _address(0), _digest(payload), payload))
    half = len(wire) // 2
    assert receive_buffered(decoder, wire[:half], 65_536) == []
    decoder.detach_payload()
    [frame] = receive_buffered(decoder, wire[half:], 65_536)
    assert isinstance(frame, Block) and frame.receipt == b"" and bytes(frame.payload) == payload
