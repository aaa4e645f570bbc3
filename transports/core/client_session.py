"""The client's side of a pull connection, sans-I/O: submit PULLs, check each arriving block against its
digest and queue every request's results (an `Outcome`) until its caller takes them.

Results leave the session one way: through their request's `Outcome`. The calls that feed the
session (`receive`, `end_of_stream`, `connection_lost`, `handle_timer`) return only the ids of the
requests whose outcomes they changed, for the adapter to wake their callers; the payload bytes
waiting in outcomes (`buffered`) are what an adapter's flow control weighs, and a `Tally` of what
was queued is what it counts in its metrics.

The protocol both sides follow, the timers and the error rules are described in `transports.core.session`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fabric import config as defaults
from fabric.keys import BlockAddress
from transports.core.base import Hit, PullResult
from transports.core.codec import (
    DEFAULT_MAX_PAYLOAD,
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
    LocalProtocolError,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
)
from transports.core.session_base import SessionBase, State
from transports.core.tracker import MAX_ADDRESSES_PER_PULL, PullTracker

__all__ = ["ClientSession", "Outcome", "Tally"]


@dataclass(slots=True)
class Tally:
    """What a session queued in its requests' outcomes since its adapter last took the tally (for
    the adapter's metrics): hits, their payload bytes, misses by reason."""

    num_hits: int = 0
    num_bytes: int = 0
    misses: dict[MissReason, int] = field(default_factory=dict)


@dataclass(slots=True)
class Outcome:
    """What one client request has given and its caller has not taken yet: results in the order
    asked (the caller `take`s them), whether it is done, whether the server answered it at all
    (anything but a PEER_GONE miss: a pooled connection that was already gone answers nothing),
    and the payload bytes of the hits waiting in `results`."""

    results: deque[PullResult] = field(default_factory=deque)
    done: bool = False
    answered: bool = False
    num_bytes: int = 0

    def put(self, results: list[PullResult], done: bool, tally: Tally) -> None:
        """Queue what the session made of the server's answers to this request (counted in `tally`)."""
        self.results.extend(results)
        self.done = self.done or done
        answered = self.answered
        num_hits = num_bytes = 0
        for r in results:
            if isinstance(r, Hit):
                num_hits += 1
                num_bytes += len(r.payload)
                answered = True
            else:
                tally.misses[r.reason] = tally.misses.get(r.reason, 0) + 1
                answered = answered or r.reason is not MissReason.PEER_GONE
        self.answered = answered
        self.num_bytes += num_bytes
        tally.num_hits += num_hits
        tally.num_bytes += num_bytes

    def clear(self) -> None:
        """Forget the results not taken (their caller gave up)."""
        self.results.clear()
        self.num_bytes = 0

    def take(self) -> PullResult:
        """The next result, in the order asked (the caller checks `results` is not empty)."""
        r = self.results.popleft()
        if isinstance(r, Hit):
            self.num_bytes -= len(r.payload)
        return r


def _refusal(frame: Error) -> MissReason:
    """What a server's ERROR for the whole connection makes of the requests still pending."""
    return MissReason.OVERLOADED if frame.code is ErrorCode.OVERLOADED else MissReason.PEER_ERROR


class ClientSession(SessionBase):
    """The client's side of one connection (or one QUIC stream, `hello=False`) to `peer_node`."""

    def __init__(self, node: str, peer_node: str, now: float, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 frame_timeout_s: float = defaults.FRAME_TIMEOUT_S, idle_timeout_s: float = defaults.IDLE_TIMEOUT_S,
                 hello: bool = True,
                 decoder: FrameDecoder | None = None) -> None:
        self.node = node
        self.peer_node = peer_node
        self.max_payload = max_payload
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.hello_done = not hello
        self.requests: dict[int, PullTracker] = {}
        self.outcomes: dict[int, Outcome] = {}   # per request submitted and not cancelled
        self.next_id = 1
        self.last_rx = now
        self.paused_since: float | None = None
        self.num_digest_mismatches = 0
        self.tally = Tally()
        self._init_session(decoder or FrameDecoder(max_payload=max_payload), now)
        self.decoder.payload_target = self._payload_target
        self.decoder.request_known = self._issued
        self.decoder.hash_payloads = True   # payloads hashed as they land, not after (tracker.py)

    def _issued(self, request_id: int) -> bool:
        """Whether `request_id` was ever sent on this connection (answers to a cancelled one may still come)."""
        return 0 < request_id < self.next_id

    def _payload_target(self, ftype: FrameType, header: dict[Any, Any], size: int) -> memoryview | None:
        # Before HELLO is checked too: a slot is only ever written by a frame for an address of a
        # live request not answered yet, and counts once its own part is verified.
        rid = header.get("rid")
        if type(rid) is not int:   # a malformed header is judged later
            return None
        tracker = self.requests.get(rid)
        if tracker is None:
            return None
        if ftype is FrameType.BLOCK:
            return tracker.place_block(header.get("hash"), header.get("layer"), size)
        return tracker.place(header.get("first"), header.get("sizes"), size)

    def hello(self) -> list[Frame]:
        return [Hello(self.node, VERSION, self.max_payload)]

    def submit(self, addresses: Sequence[BlockAddress], now: float,
               into: memoryview | None = None, namespace: bytes = b"") -> tuple[int, list[Frame]]:
        """A new request for `addresses` (at most MAX_ADDRESSES_PER_PULL) under `namespace` (a root;
        b"": none named, see `Pull`): its id and PULL frame.

        `into` (optional): one equal-size slot per address, back to back. Slot-sized hits (BLOCK
        frames and runs in BLOCKS) are then received straight into their slots (no copy); each such
        Hit's payload is its slot,
        written only by that address's verified answer. Unverified slots may hold anything."""
        if self.state is not State.OPEN:
            raise LocalProtocolError("submit on a session that is closing")
        if len(addresses) > MAX_ADDRESSES_PER_PULL:
            raise LocalProtocolError(f"a PULL holds at most {MAX_ADDRESSES_PER_PULL} addresses")
        rid = self.next_id
        self.next_id += 1
        if not self.requests:
            self.last_rx = now   # the answer timer starts now
        self.requests[rid] = PullTracker(rid, addresses, into)
        self.outcomes[rid] = Outcome()
        return rid, [Pull(rid, tuple(addresses), namespace)]

    def outcome(self, request_id: int) -> Outcome:
        """The results of a request submitted and not cancelled (see `Outcome`): the only place
        they are handed over, so an adapter keeps no copy of them."""
        return self.outcomes[request_id]

    def take_tally(self) -> Tally:
        """What was queued since the last call (see `Tally`)."""
        tally, self.tally = self.tally, Tally()
        return tally

    @property
    def blocks_pending(self) -> int:
        """Addresses of live requests not answered yet (the one being received included)."""
        return sum(tracker.num_pending for tracker in self.requests.values())

    @property
    def buffered(self) -> int:
        """Payload bytes of hits queued in outcomes and not taken yet (a cancelled request's are gone)."""
        return sum(outcome.num_bytes for outcome in self.outcomes.values())

    def cancel(self, request_id: int) -> None:
        """The caller is done with a request (it took its results, or gave up): its late frames
        are dropped, its results forgotten, and a payload being received into its slots goes on in
        a buffer of its own (the caller may reuse them now)."""
        self.requests.pop(request_id, None)
        self.outcomes.pop(request_id, None)
        if self.decoder.placed_rid == request_id:
            self.decoder.detach_payload()

    # -- input
    def receive(self, data: bytes | bytearray | memoryview, now: float) -> list[int]:
        """Bytes from the server: the ids of the requests whose outcomes changed."""
        return self._guarded(lambda: self.decoder.feed(data), now)

    def receive_frames(self, frames: list[Frame], now: float) -> list[int]:
        """Frames an adapter decoded with `self.decoder`, after every read (see ServerSession)."""
        return self._guarded(lambda: frames, now)

    def receive_bytes(self, now: float) -> None:
        """A read that completed no frame (`receive_frames` of none, which changes no outcome)."""
        if self.state is State.OPEN:
            self.last_rx = now
            self._track_frame(0, now)

    def end_of_stream(self, now: float) -> list[int]:
        touched = self._guarded(self._close_decoder, now)
        return touched + self.connection_lost(MissReason.PEER_ERROR if self.requests else MissReason.PEER_GONE)

    def _record(self, out: list[tuple[int, list[PullResult], bool]]) -> list[int]:
        """Queue what `out` holds (request id, results, request done) in the requests' outcomes;
        the ids of those touched go back to the adapter (for its wake-ups)."""
        outcomes = self.outcomes
        touched: dict[int, None] = {}   # in order, once each
        for rid, results, done in out:
            outcome = outcomes.get(rid)
            if outcome is None:
                continue
            outcome.put(results, done, self.tally)
            touched[rid] = None
        return list(touched)

    def _close_decoder(self) -> list[Frame]:
        self.decoder.close()
        return []

    def _guarded(self, decode: Callable[[], list[Frame]], now: float) -> list[int]:
        if self.state is not State.OPEN:
            return []
        self.last_rx = now
        out: list[tuple[int, list[PullResult], bool]] = []
        try:
            frames = decode()
            self._track_frame(len(frames), now)
            self._on_frames(frames, out, now)
        except ProtocolError as e:
            self.error = e
            self._close(MissReason.PEER_ERROR)
        if self.state is not State.OPEN:
            out += self._lose(self.close_reason)
        return self._record(out)

    def _on_frames(self, frames: list[Frame], out: list[tuple[int, list[PullResult], bool]], now: float) -> None:
        requests = self.requests
        for frame in frames:
            # The data path: one dict lookup; a run of one request's answers is one entry.
            if type(frame) is Blocks or type(frame) is Block:
                rid = frame.request_id
                tracker = requests.get(rid)
                if tracker is not None and self.hello_done:
                    if isinstance(frame, Blocks):
                        results = tracker.on_blocks(frame)
                        if out and out[-1][0] == rid and not out[-1][2]:
                            out[-1][1].extend(results)
                        else:
                            out.append((rid, results, False))
                    elif out and out[-1][0] == rid and not out[-1][2]:
                        out[-1][1].append(tracker.on_block(frame))
                    else:
                        out.append((rid, [tracker.on_block(frame)], False))
                elif frame.request_id >= self.next_id or not self.hello_done:
                    raise ProtocolError(f"{frame.TYPE.name} for request {frame.request_id}, which was never sent")
                continue   # a request we cancelled
            if not self.hello_done:
                if isinstance(frame, Error) and frame.request_id == 0:   # refused before HELLO (overloaded)
                    self._close(_refusal(frame))
                    return
                if not isinstance(frame, Hello):
                    raise ProtocolError(f"server's first frame must be HELLO, got {frame.TYPE.name}")
                if frame.node != self.peer_node:
                    raise ProtocolError(f"server HELLO names {frame.node!r}, expected {self.peer_node!r}")
                self.hello_done = True
            elif isinstance(frame, Miss | End | Error):
                rid = frame.request_id
                tracker = requests.get(rid)
                if tracker is not None:
                    results = tracker.on_frame(frame)
                    if tracker.done:
                        del requests[rid]
                        if not requests:
                            self.idle_since = now
                    out.append((rid, results, tracker.done))
                elif isinstance(frame, Error) and rid == 0:
                    self._close(_refusal(frame))
                    return
                elif rid >= self.next_id:
                    raise ProtocolError(f"{frame.TYPE.name} for request {rid}, which was never sent")
                # else: a request we cancelled
            elif isinstance(frame, Bye):
                self._close(MissReason.PEER_GONE)
                return
            else:
                raise ProtocolError(f"a server may not send {frame.TYPE.name} frames")

    def connection_lost(self, reason: MissReason) -> list[int]:
        """The connection is gone: every pending address becomes a miss for `reason` (the ids of the
        requests that got them)."""
        return self._record(self._lose(reason))

    def _lose(self, reason: MissReason) -> list[tuple[int, list[PullResult], bool]]:
        self._close(reason)
        out = [(rid, tracker.fail(reason), True) for rid, tracker in self.requests.items()]
        self.requests.clear()
        return out

    # -- flow control and timers
    def pause(self, now: float) -> None:
        """The adapter stopped reading (results wait for the caller): no stall timers meanwhile."""
        if self.paused_since is None:
            self.paused_since = now

    def resume(self, now: float) -> None:
        if self.paused_since is not None:
            shift = now - self.paused_since
            self.paused_since = None
            self.last_rx += shift
            if self.frame_started is not None:
                self.frame_started += shift

    def next_deadline(self) -> float | None:
        if self.state is not State.OPEN or self.paused_since is not None:
            return None
        if not self.requests:
            deadline = self.idle_since + self.idle_timeout_s / 2
        else:
            deadline = self.last_rx + self.frame_timeout_s
        started = self.frame_started
        return deadline if started is None else min(deadline, started + self.frame_timeout_s)

    def handle_timer(self, now: float) -> tuple[list[Frame], list[int]]:
        """(frames to send, ids of the requests whose outcomes changed): a stalled server ends its
        requests in TIMEOUT misses; an idle connection says BYE."""
        if self.state is not State.OPEN or self.paused_since is not None:
            return [], []
        deadline = self._frame_deadline()
        if (deadline is not None and now >= deadline) or (self.requests and now >= self.last_rx + self.frame_timeout_s):
            self.error = ProtocolError(f"server stalled for {self.frame_timeout_s:.1f} s", ErrorCode.TIMEOUT)
            return [], self.connection_lost(MissReason.TIMEOUT)
        if not self.requests and now >= self.idle_since + self.idle_timeout_s / 2:
            self._close(MissReason.PEER_GONE)
            return [Bye("idle")], []
        return [], []
