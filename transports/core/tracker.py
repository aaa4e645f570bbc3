"""One pull request, sans-I/O: what a server answers and what a client still waits for.

Server side, `answer_pull(source, pull)` turns one PULL into its BLOCK / MISS frames and a final
END, lazily (kept for callers that answer from a source directly; sessions use
`ServerSession.answer`).

Client side, `PullTracker` follows one request: it accepts the frames of that request id,
checks every payload against its announced BLAKE3 digest (the digest the decoder took as the
payload landed, its `receipt`, or else one taken here) and turns a mismatch into a
`Miss(DIGEST_MISMATCH)`, and on END, ERROR, a timeout or a lost peer reports every address not
yet answered as a miss. Answers come in the order asked, so the pending addresses are a cursor
into the request: O(1) per frame, no hashing, and an answer out of turn is a ProtocolError.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence

import blake3

from fabric.keys import BlockAddress
from transports.core.base import BlockSource, Hit, PullResult
from transports.core.codec import (
    Block,
    Blocks,
    End,
    Error,
    ErrorCode,
    Frame,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
    payload_pieces,
)
from transports.core.encoder import DIGEST_SIZE

# One PULL header holds ~40 bytes per address; 1024 keeps it (~41 KiB) under the codec's 64 KiB
# header limit. Transports split longer requests into several PULLs.
MAX_ADDRESSES_PER_PULL = 1024


def answer_pull(source: BlockSource, pull: Pull) -> Iterator[Frame]:
    """BLOCK or MISS for each address of `pull`, in order, then END."""
    if len(pull.addresses) > MAX_ADDRESSES_PER_PULL:
        raise ProtocolError(f"PULL of {len(pull.addresses)} addresses exceeds {MAX_ADDRESSES_PER_PULL}")
    for address in pull.addresses:
        block = source.get_block(address)
        if block is None:
            yield Miss(pull.request_id, address, MissReason.NOT_FOUND)
        else:
            yield Block(pull.request_id, address, block.digest, block.payload)
    yield End(pull.request_id)


def verify(frame: Block) -> bool:
    return blake3.blake3(frame.payload).digest() == frame.digest


class PullTracker:
    """Client-side state of one PULL request.

    A server answers a PULL's addresses in the order asked (one BLOCK or MISS each, then END), so
    the tracker is a cursor: each answer must be for the next address, checked without hashing."""

    __slots__ = ("_addresses", "_into", "_next", "_part_size", "_placed", "_repeated", "done", "num_bytes",
                 "num_digest_mismatches", "request_id")

    def __init__(self, request_id: int, addresses: Sequence[BlockAddress], into: memoryview | None = None) -> None:
        """`into`: optional, one equal-size slot per address back to back; BLOCK payloads and BLOCKS
        parts of that size are then received straight into their slots (see `place`, `place_block`)."""
        self.request_id = request_id
        self._addresses = tuple(addresses)
        self._next = 0          # index of the next address to be answered
        self.num_digest_mismatches = 0
        self.num_bytes = 0
        self.done = not addresses
        self._into = None if into is None or not addresses else into.cast("B")
        self._part_size = 0 if self._into is None else self._into.nbytes // len(self._addresses)
        if self._into is not None and self._part_size * len(self._addresses) != self._into.nbytes:
            raise ValueError(f"{self._into.nbytes} bytes do not split into {len(self._addresses)} equal slots")
        self._placed = 0        # slots below this were handed to the decoder already
        # Addresses asked for more than once: a BLOCK names its address, not its index, so one of
        # these cannot be placed before the frames ahead of it are judged (see `place_block`).
        self._repeated = frozenset() if self._into is None else frozenset(
            a for a, n in Counter(self._addresses).items() if n > 1)

    def place(self, first: object, sizes: object, size: int) -> memoryview | None:
        """Where a BLOCKS frame of this request announcing parts `first`.. of `sizes` should be
        received: its slots, when every part is slot-sized and none of them was answered or handed
        out before; else None (a buffer of its own; `on_blocks` then judges the frame)."""
        into, part = self._into, self._part_size
        if into is None or type(first) is not int or type(sizes) is not list or not sizes:
            return None
        end = first + len(sizes)
        if first < self._next or first < self._placed or end > len(self._addresses) or size != part * len(sizes) \
                or sizes.count(part) != len(sizes):
            return None
        self._placed = end
        return into[first * part:end * part]

    def place_block(self, hash_: object, layer: object, size: int) -> memoryview | None:
        """Where a BLOCK frame of this request for (`hash_`, `layer`) should be received: the slot of
        the first address neither answered nor handed out yet, when it is that address, asked for
        once, and the payload is slot-sized; else None (a buffer of its own).

        Frames decoded before this one may not be judged yet, so its index is not known here; it
        is at least that first index (answers come in order), and an address asked for once has
        only one index: the slot is then exactly its own (`on_block` still judges the frame)."""
        into, part = self._into, self._part_size
        i = max(self._next, self._placed)
        if into is None or size != part or i >= len(self._addresses):
            return None
        expected = self._addresses[i]
        if hash_ != expected.hash or layer != expected.layer or expected in self._repeated:
            return None
        self._placed = i + 1
        return into[i * part:(i + 1) * part]

    @property
    def num_pending(self) -> int:
        return len(self._addresses) - self._next

    def _out_of_turn(self, address: BlockAddress, kind: str) -> ProtocolError:
        i = self._next
        expected = self._addresses[i] if not self.done and i < len(self._addresses) else None
        return ProtocolError(f"{kind} for {address} which request {self.request_id} did not ask for next "
                             f"(answers come in the order asked; expected {expected or 'none: it ended'})")

    def _take(self, address: BlockAddress, kind: str) -> None:
        """Advance past `address`, which must be the next one asked for."""
        i = self._next
        if self.done or i >= len(self._addresses) or self._addresses[i] != address:
            raise self._out_of_turn(address, kind)
        self._next = i + 1

    def on_block(self, frame: Block) -> PullResult:
        """The result of a BLOCK of this request: a Hit when its payload matches its digest."""
        address, addresses, i = frame.address, self._addresses, self._next
        # `_take`, inlined with a field-wise compare: this runs once per block received
        if self.done or i >= len(addresses) or (address is not (expected := addresses[i]) and (
                address.hash != expected.hash or address.layer != expected.layer)):
            raise self._out_of_turn(address, "BLOCK")
        self._next = i + 1
        payload = frame.payload
        if (frame.receipt or blake3.blake3(payload).digest()) != frame.digest:
            self.num_digest_mismatches += 1
            return Miss(self.request_id, address, MissReason.DIGEST_MISMATCH)
        self.num_bytes += payload.nbytes if isinstance(payload, memoryview) else len(payload)
        return Hit(address, payload, frame.digest, frame.provenance)

    def on_blocks(self, frame: Blocks) -> list[PullResult]:
        """The results of a BLOCKS frame of this request: one per part, each a Hit when the part
        matches its digest. The parts must be the next addresses asked for. A Hit's payload is a
        view of the frame's one buffer (the buffer lives as long as any of its parts)."""
        first, addresses, n = frame.first, self._addresses, len(frame.sizes)
        if self.done or first != self._next or first + n > len(addresses):
            raise ProtocolError(f"BLOCKS for addresses {first}..{first + n - 1} of request {self.request_id}, "
                                f"which expects {'nothing: it ended' if self.done else f'address {self._next} next'} "
                                f"of {len(addresses)}")
        self._next = first + n
        pieces = payload_pieces(frame.payload)   # a received frame has one buffer; one built in memory may have parts
        view = memoryview(pieces[0] if len(pieces) == 1 else b"".join(pieces)).cast("B")
        digests, provs = frame.digests, frame.provenances
        out: list[PullResult] = []
        rid, hasher, receipt = self.request_id, blake3.blake3, frame.receipt
        offset = 0
        for i, size in enumerate(frame.sizes):
            part = view[offset:offset + size]
            digest = digests[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE]
            offset += size
            if (receipt[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE] if receipt else hasher(part).digest()) == digest:
                out.append(Hit(addresses[first + i], part, digest, provs[i] if provs else None))
                self.num_bytes += size
            else:
                self.num_digest_mismatches += 1
                out.append(Miss(rid, addresses[first + i], MissReason.DIGEST_MISMATCH))
        return out

    def on_frame(self, frame: Frame) -> list[PullResult]:
        """Results produced by one frame of this request; raises ProtocolError on a frame that
        does not belong to it (an address not asked for next, a frame after END)."""
        if self.done:
            raise ProtocolError(f"frame {frame.TYPE.name} for request {self.request_id} after it ended")
        match frame:
            case Block(request_id=rid) if rid == self.request_id:
                return [self.on_block(frame)]
            case Blocks(request_id=rid) if rid == self.request_id:
                return self.on_blocks(frame)
            case Miss(request_id=rid, address=address) if rid == self.request_id:
                self._take(address, "MISS")
                return [frame]
            case End(request_id=rid) if rid == self.request_id:
                return self.fail(MissReason.PEER_ERROR)
            case Error(request_id=rid, code=code) if rid in (self.request_id, 0):
                return self.fail(MissReason.OVERLOADED if code is ErrorCode.OVERLOADED else MissReason.PEER_ERROR)
        raise ProtocolError(f"unexpected {frame.TYPE.name} frame for request {self.request_id}")

    def fail(self, reason: MissReason) -> list[PullResult]:
        """End the request: every address still pending becomes a miss for `reason`."""
        out: list[PullResult] = [Miss(self.request_id, address, reason)
                                 for address in self._addresses[self._next:]]
        self._next = len(self._addresses)
        self.done = True
        return out
