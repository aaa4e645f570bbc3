"""One pull request without sockets: server answers and client verification, wired in memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

import blake3
import pytest

from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit
from transports.core.codec import (
    Block,
    End,
    Error,
    ErrorCode,
    FrameDecoder,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
    encode,
)
from transports.core.tracker import MAX_ADDRESSES_PER_PULL, PullTracker, answer_pull


@dataclass(frozen=True)
class Stored:
    payload: bytes
    digest: bytes


class DictSource:
    def __init__(self) -> None:
        self.blocks: dict[BlockAddress, Stored] = {}

    def add(self, address: BlockAddress, payload: bytes) -> None:
        self.blocks[address] = Stored(payload, blake3.blake3(payload).digest())

    def get_block(self, address: BlockAddress) -> Stored | None:
        return self.blocks.get(address)


def _addr(i: int, layer: int = 0) -> BlockAddress:
    return BlockAddress(BlockHash(blake3.blake3(i.to_bytes(4, "little")).digest()), layer)


def _wire_pull(source: DictSource, request: list[BlockAddress]) -> tuple[list[object], PullTracker]:
    """Server and client joined by a byte string, as a network would join them."""
    wire = b"".join(encode(f) for f in answer_pull(source, Pull(42, tuple(request))))
    tracker = PullTracker(42, request)
    results: list[object] = []
    for frame in FrameDecoder().feed(wire):
        results += tracker.on_frame(frame)
    return results, tracker


def test_hits_and_misses_in_request_order() -> None:
    source = DictSource()
    request = [_addr(b, layer) for b in range(3) for layer in range(4)]
    for a in request[:8]:
        source.add(a, os.urandom(100))
    results, tracker = _wire_pull(source, request)
    assert tracker.done and tracker.num_pending == 0
    assert [r.address for r in results] == request  # type: ignore[attr-defined]
    assert all(isinstance(r, Hit) for r in results[:8])
    assert all(isinstance(r, Miss) and r.reason is MissReason.NOT_FOUND for r in results[8:])
    assert [bytes(r.payload) for r in results[:8]] == [source.blocks[a].payload for a in request[:8]]  # type: ignore


def test_corrupt_payload_becomes_a_digest_miss() -> None:
    source = DictSource()
    a, b = _addr(1), _addr(2)
    source.add(a, b"good" * 10)
    source.blocks[b] = Stored(b"evil" * 10, blake3.blake3(b"good" * 10).digest())  # lies about its digest
    results, tracker = _wire_pull(source, [a, b])
    assert isinstance(results[0], Hit)
    assert isinstance(results[1], Miss) and results[1].reason is MissReason.DIGEST_MISMATCH
    assert tracker.num_digest_mismatches == 1


def test_end_or_error_fails_what_is_pending() -> None:
    t = PullTracker(5, [_addr(1), _addr(2)])
    assert t.on_frame(End(5)) == [Miss(5, _addr(1), MissReason.PEER_ERROR), Miss(5, _addr(2), MissReason.PEER_ERROR)]
    t2 = PullTracker(6, [_addr(1)])
    out = t2.on_frame(Error(0, ErrorCode.PROTOCOL, "bad"))
    assert out == [Miss(6, _addr(1), MissReason.PEER_ERROR)] and t2.done
    busy = PullTracker(8, [_addr(1)])   # refused over this node's budget there: try later or elsewhere
    assert busy.on_frame(Error(8, ErrorCode.OVERLOADED, "busy")) == [Miss(8, _addr(1), MissReason.OVERLOADED)]
    t3 = PullTracker(7, [_addr(1)])
    assert t3.fail(MissReason.TIMEOUT) == [Miss(7, _addr(1), MissReason.TIMEOUT)]


def test_frames_that_do_not_belong_are_protocol_errors() -> None:
    t = PullTracker(5, [_addr(1)])
    payload = b"x"
    with pytest.raises(ProtocolError, match="did not ask for"):
        t.on_frame(Block(5, _addr(9), blake3.blake3(payload).digest(), payload))
    with pytest.raises(ProtocolError, match="unexpected"):
        t.on_frame(End(6))
    t.on_frame(End(5))
    with pytest.raises(ProtocolError, match="after it ended"):
        t.on_frame(End(5))


def test_an_answer_out_of_the_order_asked_is_a_protocol_error() -> None:
    """Servers answer a PULL's addresses in order, and the client hands results out in that order:
    an answer for any address but the next one is refused, not slotted in."""
    payload = b"p"
    digest = blake3.blake3(payload).digest()
    t = PullTracker(5, [_addr(1), _addr(2)])
    with pytest.raises(ProtocolError, match="did not ask for next"):
        t.on_frame(Block(5, _addr(2), digest, payload))
    t = PullTracker(5, [_addr(1), _addr(2)])
    with pytest.raises(ProtocolError, match="did not ask for next"):
        t.on_frame(Miss(5, _addr(2), MissReason.NOT_FOUND))
    t = PullTracker(5, [_addr(1), _addr(2)])
    assert isinstance(t.on_frame(Block(5, _addr(1), digest, payload))[0], Hit)
    assert t.on_frame(Miss(5, _addr(2), MissReason.NOT_FOUND)) == [Miss(5, _addr(2), MissReason.NOT_FOUND)]
    assert t.num_pending == 0


def test_duplicate_addresses_are_each_answered() -> None:
    source = DictSource()
    source.add(_addr(1), b"p")
    results, tracker = _wire_pull(source, [_addr(1), _addr(1)])
    assert len(results) == 2 and all(isinstance(r, Hit) for r in results) and tracker.done


def test_the_largest_pull_fits_the_header_limit() -> None:
    worst = tuple(BlockAddress(BlockHash(b"\xff" * 32), 2**32 - 1) for _ in range(MAX_ADDRESSES_PER_PULL))
    (frame,) = FrameDecoder().feed(encode(Pull(2**64 - 1, worst)))
    assert isinstance(frame, Pull) and len(frame.addresses) == MAX_ADDRESSES_PER_PULL


def test_oversized_pull_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        list(answer_pull(DictSource(), Pull(1, tuple(_addr(0) for _ in range(MAX_ADDRESSES_PER_PULL + 1)))))
