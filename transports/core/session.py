"""The server's side of a pull connection, sans-I/O, and the kvfabric pull protocol both sides follow
(the client's side is `transports.core.client_session`), decided once for every transport.

    ClientSession                                          ServerSession
    ─────────────                                          ─────────────
    hello() ─► HELLO(node, max_payload)  ───────────────►  receive(): HELLO first, its node must be
                                                           the certificate's; answered by HELLO
    submit(addresses, now) ─► PULL(rid)  ───────────────►  take_pulls(): ≤ max_inflight at once; more
                                                           wait (`reading` False: stop reading)
                                                           next_batch(): which pull to answer next
                                                           (round-robin) and what of it is left
    receive(): each digest checked,      ◄───────────────  answer(rid, addresses, blocks, now): a run
      Hit / Miss per address, in order,                    of hits as one BLOCKS frame (or a BLOCK),
      queued in the request's Outcome                      a MISS(not_found | too_large | source_error)
    done on END / ERROR                  ◄───────────────  … END with the answer to its last address

Neither side touches a socket, a thread or a clock: bytes (or decoded frames) and `now` go in;
frames to send, pull results, `closing` and the next timer deadline come out. A transport adapter
moves the bytes, fetches the batches `next_batch` names from its store, calls `handle_timer(now)`
at `next_deadline()` (with a `timer.DeadlineTimer`) and closes the connection once `closing` is set
(after sending what the call returned); it keeps no copy of what the session tracks. QUIC runs
one session per stream (`hello=False`, one PULL each); there the client opens each stream with its
HELLO (its payload limit), which is checked the same way and not answered (the TLS handshake
already named both ends).

Timers (both sides): a frame must arrive *whole* within `frame_timeout_s` of its first byte (a
total deadline: a peer dribbling one byte a second cannot hold a frame open); the server closes a
connection idle for `idle_timeout_s`, the client at half of that, so a new PULL rarely races the
server's BYE; a server whose output has been blocked for `frame_timeout_s` closes (a peer that
does not read); a client waiting for answers hears nothing for `frame_timeout_s`: TIMEOUT misses.

Errors (h11's strategy): a peer breaking the rules raises `ProtocolError` (code PROTOCOL,
UNAUTHORIZED, …) inside the session, which answers it once: an ERROR frame and `closing`; the
error is kept in `error` for the adapter's metrics. A call out of turn by the adapter raises
`LocalProtocolError`. Every address asked for ends as exactly one Hit or Miss.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fabric import config as defaults
from fabric.keys import BlockAddress
from fabric.provenance import Provenance
from transports.core.base import SourceBlock
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
    Hello,
    LocalProtocolError,
    Miss,
    MissReason,
    ProtocolError,
    Pull,
)
from transports.core.session_base import SessionBase, State
from transports.core.tracker import MAX_ADDRESSES_PER_PULL

__all__ = ["GROUP_BYTES", "GROUP_PART_MAX", "Fetched", "ServedStats", "ServerSession"]

Fetched = SourceBlock | None | Exception   # what a store read gave: a block, nothing, or a failure

# A run of consecutive hits of one PULL goes out as one BLOCKS frame of at most GROUP_BYTES payload
# bytes (and at most the client's payload limit): the per-frame work on both ends (header, decode,
# buffer, event-loop hops) is then paid once per ~1 MiB instead of once per block, which
# matters for small blocks (a 16-token layer of a small model is 24-64 KiB). A block larger than
# GROUP_PART_MAX goes alone, as a BLOCK frame: there the per-frame work is already small beside it.
GROUP_PART_MAX = 128 * 1024
GROUP_BYTES = 1024 * 1024 + GROUP_PART_MAX   # one store fetch batch (1 MiB and the block crossing it)
MAX_PARTS = 256   # keeps a BLOCKS header (~36 bytes per part) far below the 64 KiB header limit
# Provenance records and producer certificates a BLOCKS header may hold before its run is cut: a
# run of many distinct blocks (a layer-major pull of small layers) stays under the header limit.
PROVENANCE_HEADER_BUDGET = 32 * 1024


@dataclass(slots=True)
class ServedStats:
    """Answers made since the adapter last took them (metrics are flushed per batch, not per frame)."""

    num_hits: int = 0
    num_bytes: int = 0
    misses: dict[MissReason, int] = field(default_factory=dict)
    num_unauthorised: int = 0   # PULLs under a root the peer may not read (answered with misses)


class ServerSession(SessionBase):
    """The server's side of one connection (or one QUIC stream, `hello=False, one_pull=True`).

    `peer_node` is the node name the peer's verified certificate carries. `require_namespace`: a
    PULL that names no namespace root is answered with misses (see `Pull`). `authorise`: whether the
    peer may read blocks under a namespace root (None: every root); a PULL under a root it may not
    read is answered with misses, as if nothing were held there."""

    def __init__(self, node: str, peer_node: str, now: float, *, max_payload: int = DEFAULT_MAX_PAYLOAD,
                 max_inflight: int = defaults.MAX_INFLIGHT, frame_timeout_s: float = defaults.FRAME_TIMEOUT_S,
                 idle_timeout_s: float = defaults.IDLE_TIMEOUT_S,
                 hello: bool = True, one_pull: bool = False, require_namespace: bool = False,
                 authorise: Callable[[bytes], bool] | None = None) -> None:
        self.node = node
        self.peer_node = peer_node
        self.require_namespace = require_namespace
        self.authorise = authorise
        self.max_payload = max_payload
        self.max_inflight = max_inflight
        self.frame_timeout_s = frame_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.one_pull = one_pull
        self.hello_done = not hello
        self._stream_hello = False            # a QUIC stream's opening HELLO was seen
        self.peer_max_payload = max_payload   # lowered by the client's HELLO
        self.active: dict[int, Pull] = {}     # being answered
        self.answered: dict[int, int] = {}    # per active pull, how many of its addresses are answered
        self.queued: dict[int, Pull] = {}     # waiting for a slot (insertion ordered)
        self._to_start: list[Pull] = []
        self._turns: deque[int] = deque()     # active pulls handed out by take_pulls, in answering order
        self.num_pulls = 0
        self.stats = ServedStats()
        self._init_session(FrameDecoder(max_payload=0), now)   # clients never send payloads

    @property
    def reading(self) -> bool:
        """False while PULLs wait for a slot: the adapter stops reading (back-pressure)."""
        return not self.queued and self.state is State.OPEN

    # -- input
    def receive(self, data: bytes | bytearray | memoryview, now: float) -> list[Frame]:
        """Bytes from the peer; frames to send back (HELLO, ERROR, …)."""
        return self._guarded(lambda: self.decoder.feed(data), now)

    def receive_frames(self, frames: list[Frame], now: float) -> list[Frame]:
        """Frames that an adapter decoded with `self.decoder` (e.g. straight from the socket into
        payload buffers), after every read, even one that completed no frame."""
        return self._guarded(lambda: frames, now)

    def end_of_stream(self, now: float) -> list[Frame]:
        """The peer finished sending (QUIC FIN, TCP EOF)."""
        def finish() -> list[Frame]:
            self.decoder.close()
            if self.one_pull and not self.num_pulls:
                raise ProtocolError("stream ended without a PULL")
            return []
        out = self._guarded(finish, now)
        if not self.one_pull:
            self._close(MissReason.PEER_GONE)
        return out

    def _guarded(self, decode: Callable[[], list[Frame]], now: float) -> list[Frame]:
        if self.state is not State.OPEN:
            return []
        out: list[Frame] = []
        try:
            frames = decode()
            self._track_frame(len(frames), now)
            for frame in frames:
                self._on_frame(frame, out)
                if self.state is not State.OPEN:
                    break
        except ProtocolError as e:
            self.error = e
            out.append(Error(self._stream_rid(), e.code, str(e)[:500]))
            self._close(MissReason.PEER_ERROR)
        return out

    def _stream_rid(self) -> int:
        return next(iter(self.active), 0) if self.one_pull else 0

    def _on_frame(self, frame: Frame, out: list[Frame]) -> None:
        if not self.hello_done:
            if not isinstance(frame, Hello):
                raise ProtocolError(f"first frame must be HELLO, got {frame.TYPE.name}")
            self._on_hello(frame)
            out.append(Hello(self.node, VERSION, self.max_payload))
        elif isinstance(frame, Hello) and self.one_pull and not self.num_pulls and not self._stream_hello:
            self._on_hello(frame)   # a QUIC stream's opening HELLO: not answered
            self._stream_hello = True
        elif type(frame) is Pull:
            rid = frame.request_id
            if rid in self.active or rid in self.queued:
                raise ProtocolError(f"PULL reuses request id {rid} while it is in flight")
            if self.one_pull and self.num_pulls:
                raise ProtocolError("a stream carries exactly one PULL")
            if len(frame.addresses) > MAX_ADDRESSES_PER_PULL:
                raise ProtocolError(f"PULL of {len(frame.addresses)} addresses exceeds {MAX_ADDRESSES_PER_PULL}")
            self.num_pulls += 1
            if len(self.active) < self.max_inflight:
                self.active[rid] = frame
                self.answered[rid] = 0
                self._to_start.append(frame)
            else:
                self.queued[rid] = frame
        elif isinstance(frame, Bye | Error):
            self._close(MissReason.PEER_GONE)   # nobody waits for the answers any more
        else:
            raise ProtocolError(f"a client may not send {frame.TYPE.name} frames")

    def _on_hello(self, frame: Hello) -> None:
        if frame.version != VERSION:
            raise ProtocolError(f"client speaks codec version {frame.version}, this server {VERSION}")
        if frame.node != self.peer_node:
            raise ProtocolError(f"HELLO names {frame.node!r} but the certificate names {self.peer_node!r}",
                                ErrorCode.UNAUTHORIZED)
        if frame.max_payload <= 0:
            raise ProtocolError(f"HELLO announces a payload limit of {frame.max_payload}")
        self.hello_done = True
        self.peer_max_payload = min(frame.max_payload, self.max_payload)

    # -- answering
    def take_pulls(self) -> list[Pull]:
        """PULLs to start answering now: the adapter admits each (or `refuse`s it), then answers
        the admitted ones batch by batch (`next_batch`, `answer`); none once the session is
        closing: nobody waits for their answers."""
        out, self._to_start = self._to_start, []
        if self.state is not State.OPEN:
            return []
        self._turns.extend(pull.request_id for pull in out)
        return out

    def next_batch(self) -> tuple[int, Sequence[BlockAddress]] | None:
        """The pull to answer next, round-robin over the pulls handed out by `take_pulls` (fair
        between callers), and its addresses not answered yet: the adapter fetches from their start
        and hands what it got to `answer`. None when there is nothing to answer, or the session is
        closing."""
        rid = self._next_turn()
        return None if rid is None else (rid, self.active[rid].addresses[self.answered[rid]:])

    @property
    def settled(self) -> bool:
        """True while open with no PULL waiting in `take_pulls`: answering a batch changed nothing
        but what is to be sent (the reading state and the PULLs to start are as they were)."""
        return not self._to_start and self.state is State.OPEN

    @property
    def answering(self) -> bool:
        """True while `next_batch` has a batch to hand out."""
        return self._next_turn() is not None

    def _next_turn(self) -> int | None:
        if self.state is not State.OPEN:
            return None
        turns = self._turns
        while turns:
            if turns[0] in self.active:
                return turns[0]
            turns.popleft()   # finished, refused or abandoned
        return None

    def answer(self, request_id: int, addresses: Sequence[BlockAddress], fetched: Sequence[Fetched],
               now: float) -> list[Frame]:
        """The frames for the next `addresses` of an active pull (in the order asked), from what
        the store gave: runs of hits as BLOCKS frames (a lone hit as a BLOCK), a block over the
        client's payload limit MISS(too_large), a failed read MISS(source_error). A pull whose last
        address this answers is finished: its END comes last (and a queued PULL starts, see
        `reading`); one with more to answer waits for its next turn (see `next_batch`)."""
        pull = self.active.get(request_id)
        if pull is None:
            raise LocalProtocolError(f"answer for request {request_id}, which is not being answered")
        first = self.answered[request_id]
        if first + len(addresses) > len(pull.addresses) or len(fetched) != len(addresses):
            raise LocalProtocolError(f"answer for {len(addresses)} addresses of request {request_id}, which has "
                                     f"{len(pull.addresses) - first} unanswered")
        self.answered[request_id] = first + len(addresses)
        out = self._frames(request_id, first, addresses, fetched, pull.namespace)
        turns = self._turns
        if turns and turns[0] == request_id:
            turns.rotate(-1)
        if first + len(addresses) == len(pull.addresses):
            out += self.finish(request_id, now)
        return out

    def _frames(self, request_id: int, first: int, addresses: Sequence[BlockAddress],
                fetched: Sequence[Fetched], namespace: bytes) -> list[Frame]:
        limit, stats = self.peer_max_payload, self.stats
        budget = min(GROUP_BYTES, limit)
        out: list[Frame] = []
        run: list[SourceBlock] = []    # consecutive hits not yet framed, starting at address index `start`
        start = run_bytes = run_prov_bytes = 0
        last_prov: Provenance | None = None
        if self.authorise is not None and not self.authorise(namespace):
            stats.num_unauthorised += 1
            fetched = [None] * len(fetched)   # a root this peer may not read: nothing is held there for it
        for i, got in enumerate(fetched):
            reason = MissReason.NOT_FOUND
            if (namespace or self.require_namespace) and got is not None and not isinstance(got, Exception) and \
                    getattr(getattr(got, "provenance", None), "namespace", None) != namespace:
                got = None   # another namespace's block (or an unsigned one) at this address: never served here
            if got is not None and not isinstance(got, Exception):
                payload = got.payload
                size = len(payload) if type(payload) is bytes else memoryview(payload).nbytes
                if size <= limit:
                    stats.num_hits += 1
                    stats.num_bytes += size
                    # Stores hand out their records; a source without them serves unsigned blocks.
                    prov: Provenance | None = getattr(got, "provenance", None)
                    if size > GROUP_PART_MAX:   # a frame of its own
                        if run:
                            out.append(self._frame_run(request_id, first + start, addresses[start], run))
                            run = []
                        out.append(Block(request_id, addresses[i], got.digest, payload, prov))
                        continue
                    prov_bytes = 0   # header bytes this part's record (and certificate) add to the run
                    if prov is not None and prov is not last_prov:
                        prov_bytes = 128 + len(prov.layer_digests) + len(prov.path) + (
                            len(prov.cert_der) if last_prov is None or prov.cert_der != last_prov.cert_der else 0)
                        last_prov = prov
                    if run and (run_bytes + size > budget or len(run) == MAX_PARTS
                                or run_prov_bytes + prov_bytes > PROVENANCE_HEADER_BUDGET):
                        out.append(self._frame_run(request_id, first + start, addresses[start], run))
                        run = []
                    if not run:
                        start, run_bytes = i, 0
                        run_prov_bytes = 0 if prov is None else (128 + len(prov.layer_digests) + len(prov.path)
                                                                 + len(prov.cert_der))
                    else:
                        run_prov_bytes += prov_bytes
                    run.append(got)
                    run_bytes += size
                    continue
                reason = MissReason.TOO_LARGE
            elif got is not None:
                reason = MissReason.SOURCE_ERROR
            if run:
                out.append(self._frame_run(request_id, first + start, addresses[start], run))
                run = []
            out.append(Miss(request_id, addresses[i], reason))
            stats.misses[reason] = stats.misses.get(reason, 0) + 1
        if run:
            out.append(self._frame_run(request_id, first + start, addresses[start], run))
        return out

    @staticmethod
    def _frame_run(request_id: int, first: int, address: BlockAddress, run: list[SourceBlock]) -> Block | Blocks:
        provs: tuple[Provenance | None, ...] = tuple(getattr(b, "provenance", None) for b in run)
        if len(run) == 1:
            return Block(request_id, address, run[0].digest, run[0].payload, provs[0])
        payloads = tuple(b.payload for b in run)
        sizes = tuple(len(p) if type(p) is bytes else memoryview(p).nbytes for p in payloads)
        signed = provs if any(p is not None for p in provs) else ()
        return Blocks(request_id, first, b"".join([b.digest for b in run]), sizes, payloads, signed)

    def finish(self, request_id: int, now: float) -> list[Frame]:
        """END of an active pull now, whatever is left unanswered (`answer` ends a pull it answers
        fully); starts the next queued one (see `take_pulls`, `reading`)."""
        if self.active.pop(request_id, None) is None:
            raise LocalProtocolError(f"finish of request {request_id}, which is not being answered")
        self.answered.pop(request_id, None)
        self._next(now)
        return [End(request_id)]

    def refuse(self, request_id: int, now: float, message: str) -> list[Frame]:
        """Answer an active pull with ERROR overloaded instead of its blocks (the peer is over its
        budget); a QUIC stream, which carries that pull alone, is then done."""
        if self.active.pop(request_id, None) is None:
            raise LocalProtocolError(f"refusal of request {request_id}, which is not being answered")
        self.answered.pop(request_id, None)
        self._next(now)
        if self.one_pull:
            self._close(MissReason.PEER_GONE)
        return [Error(request_id, ErrorCode.OVERLOADED, message)]

    def abandon(self, request_id: int, now: float) -> None:
        """Stop answering a pull without END (the peer stopped the QUIC stream)."""
        if self.active.pop(request_id, None) is not None:
            self.answered.pop(request_id, None)
            self._next(now)

    def _next(self, now: float) -> None:
        if self.queued and self.state is State.OPEN:
            rid = next(iter(self.queued))
            pull = self.queued.pop(rid)
            self.active[rid] = pull
            self.answered[rid] = 0
            self._to_start.append(pull)
        if not self.active:
            self.idle_since = now

    def take_stats(self) -> ServedStats:
        stats, self.stats = self.stats, ServedStats()
        return stats

    # -- timers
    def next_deadline(self, blocked_since: float | None = None) -> float | None:
        """When `handle_timer` has something to do; `blocked_since`: since when output has been
        waiting for the peer to read, or None."""
        if self.state is not State.OPEN:
            return None
        started = self.frame_started
        if started is not None:
            deadline: float | None = started + self.frame_timeout_s
        elif not self.active and not self.queued and not self.one_pull:
            deadline = self.idle_since + self.idle_timeout_s
        else:
            deadline = None
        if blocked_since is not None:
            blocked = blocked_since + self.frame_timeout_s
            return blocked if deadline is None or blocked < deadline else deadline
        return deadline

    def handle_timer(self, now: float, blocked_since: float | None = None) -> list[Frame]:
        if self.state is not State.OPEN:
            return []
        deadline = self._frame_deadline()
        if deadline is not None and now >= deadline:
            self.error = ProtocolError(f"a frame took over {self.frame_timeout_s:.1f} s to arrive",
                                       ErrorCode.TIMEOUT)
        elif blocked_since is not None and now >= blocked_since + self.frame_timeout_s:
            self.error = ProtocolError(f"peer read nothing for {self.frame_timeout_s:.1f} s", ErrorCode.TIMEOUT)
        elif not self.active and not self.queued and not self.one_pull and \
                now >= self.idle_since + self.idle_timeout_s:
            self._close(MissReason.PEER_GONE)
            return [Bye("idle")]
        else:
            return []
        self._close(MissReason.TIMEOUT)
        return [Error(self._stream_rid(), ErrorCode.TIMEOUT, str(self.error))]
