"""One pull request, sans-I/O: what a server answers and what a client still waits for.

Server side, `answer_pull(source, pull)` turns one PULL into its BLOCK / MISS frames and a final
END, lazily (kept for callers that answer from a source directly; sessions use
`ServerSession.answer`).

Client side, `PullTracker` follows one request: it accepts the frames of that request id,
checks every payload against its announced BLAKE3 digest and turns a mismatch into a
`Miss(DIGEST_MISMATCH)`, and on END, ERROR, a timeout or a lost peer reports every address not
yet answered as a miss. Pending addresses are a count per address (the same address may be
asked twice): O(1) per frame.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import blake3

from fabric.keys import BlockAddress
from transports.base import BlockSource, Hit, PullResult
from transports.codec import Block, End, Error, Frame, Miss, MissReason, ProtocolError, Pull

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
    """Client-side state of one PULL request."""

    __slots__ = ("_pending", "done", "num_bytes", "num_digest_mismatches", "num_pending", "request_id")

    def __init__(self, request_id: int, addresses: Sequence[BlockAddress]) -> None:
        self.request_id = request_id
        self._pending: dict[BlockAddress, int] = {}
        for a in addresses:  # the same address may be asked twice; answer each ask
            self._pending[a] = self._pending.get(a, 0) + 1
        self.num_pending = len(addresses)
        self.num_digest_mismatches = 0
        self.num_bytes = 0
        self.done = not addresses

    def _take(self, address: BlockAddress) -> bool:
        left = self._pending.get(address, 0)
        if left == 0:
            return False
        if left == 1:
            del self._pending[address]
        else:
            self._pending[address] = left - 1
        self.num_pending -= 1
        return True

    def on_block(self, frame: Block) -> PullResult:
        """The result of a BLOCK of this request: a Hit when its payload matches its digest."""
        address, pending = frame.address, self._pending
        left = pending.get(address, 0)   # `_take`, inlined: this runs once per block received
        if self.done or left == 0:
            raise ProtocolError(f"BLOCK for {address} which request {self.request_id} did not ask for "
                                "(or after it ended)")
        if left == 1:
            del pending[address]
        else:
            pending[address] = left - 1
        self.num_pending -= 1
        payload = frame.payload
        if blake3.blake3(payload).digest() != frame.digest:
            self.num_digest_mismatches += 1
            return Miss(self.request_id, frame.address, MissReason.DIGEST_MISMATCH)
        self.num_bytes += payload.nbytes if isinstance(payload, memoryview) else len(payload)
        return Hit(frame.address, payload, frame.digest)

    def on_frame(self, frame: Frame) -> list[PullResult]:
        """Results produced by one frame of this request; raises ProtocolError on a frame that
        does not belong to it (an address never asked for, a frame after END)."""
        if self.done:
            raise ProtocolError(f"frame {frame.TYPE.name} for request {self.request_id} after it ended")
        match frame:
            case Block(request_id=rid) if rid == self.request_id:
                return [self.on_block(frame)]
            case Miss(request_id=rid, address=address) if rid == self.request_id:
                if not self._take(address):
                    raise ProtocolError(f"MISS for {address} which request {rid} did not ask for")
                return [frame]
            case End(request_id=rid) if rid == self.request_id:
                return self.fail(MissReason.PEER_ERROR)
            case Error(request_id=rid) if rid in (self.request_id, 0):
                return self.fail(MissReason.PEER_ERROR)
        raise ProtocolError(f"unexpected {frame.TYPE.name} frame for request {self.request_id}")

    def fail(self, reason: MissReason) -> list[PullResult]:
        """End the request: every address still pending becomes a miss for `reason`."""
        out: list[PullResult] = []
        for address, count in self._pending.items():
            out.extend(Miss(self.request_id, address, reason) for _ in range(count))
        self._pending.clear()
        self.num_pending = 0
        self.done = True
        return out
