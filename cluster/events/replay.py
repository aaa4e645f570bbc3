"""Replays of KV event batches on their own thread, as vLLM 0.32's `ZmqEventPublisher` frames them,
bounded per reply and per requester, never silently cut.

    request    [identity, b"", start seq as 8-byte big-endian]          (a REQ or DEALER socket)
    batch      [identity, b"", topic, seq as 8-byte big-endian, msgpack KVEventBatch]
    end        [identity, b"", b"", -1 as 8-byte signed, b""]           (END_SEQ: this reply is complete)
    marker     [identity, b"", topic, -2 as 8-byte signed, msgpack {"reason", "first", "last"}]

A reply is the kept batches from `start` on, at most `max_batches` of them, then `end`. Whatever
the reply leaves out of `start`..newest is named by a marker (GAP_SEQ) before `end`:

    expired       batches first..last are older than the buffer; they are gone (before the batches)
    more          the reply stopped at its bound; ask again from `first` (after the batches)
    rate_limited  this requester asked for more than its share; nothing sent, ask again from `first`
    hwm           an earlier reply to this requester was cut at `first` because it read too slowly
                  (its socket's high-water mark): that reply had no `end`

A REQ socket receives only the first message of each reply, so a REQ client asks once per batch
(each answer is the batch it asked for, a marker, or `end`); a DEALER receives whole replies.

The thread owns the ROUTER socket (ZMQ sockets are not thread-safe) and reads the batches from the
log's lock-guarded buffer, so a flood of requests costs the node's event loop nothing; its own
work is capped by a global token bucket (batches and requests per second), so it cannot starve
the process either.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import msgpack
import zmq

from cluster.events.log import KvEventLog
from transports.core.budget import TokenBucket

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
GAP_SEQ = (-2).to_bytes(8, "big", signed=True)
MAX_REQUESTERS = 4096          # per-requester buckets kept (least recently seen dropped first)


def marker(reason: str, first: int, last: int) -> bytes:
    return msgpack.packb({"reason": reason, "first": first, "last": last}, use_bin_type=True)


class ReplayServer:
    """Answers replay requests on `socket` (bound, owned from now on by this server's thread)."""

    def __init__(self, socket: zmq.Socket[bytes], log: KvEventLog, topic: bytes, *, max_batches: int,
                 requester_rate: float, total_rate: float) -> None:
        self._sock = socket
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a full peer raises instead of dropping silently
        self.log = log
        self.topic = topic
        self.max_batches = max_batches
        self.requester_rate = requester_rate
        self._total = TokenBucket.full(total_rate, max(total_rate, max_batches + 1.0), time.monotonic())
        self._requesters: OrderedDict[bytes, TokenBucket] = OrderedDict()
        self._cut: dict[bytes, tuple[int, int]] = {}        # requester -> (first, last) of a reply cut by hwm
        self.num_requests = 0
        self.num_bad_requests = 0
        self.num_batches_sent = 0
        self.num_cut_replies = 0         # replies cut because the requester read too slowly
        self.markers: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfabric-kv-replay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)

    # ---- the thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(100):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
                self._throttle()
                self._serve(frames)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    return
                logger.warning("KV event replay: %s", e)
            except Exception:   # a bug in one reply must not end replays for everyone
                logger.exception("KV event replay failed")

    def _throttle(self) -> None:
        """Wait (this thread only) until the global budget has a token for one more request."""
        while self._total.available(time.monotonic()) < 1 and not self._stop.is_set():
            time.sleep(min(0.05, self._total.wait_s(1, time.monotonic())))

    def _bucket(self, identity: bytes, now: float) -> TokenBucket:
        bucket = self._requesters.pop(identity, None)
        if bucket is None:
            bucket = TokenBucket.full(self.requester_rate, max(self.requester_rate, self.max_batches + 1.0), now)
        self._requesters[identity] = bucket
        while len(self._requesters) > MAX_REQUESTERS:
            self._requesters.popitem(last=False)
        return bucket

    def _serve(self, frames: list[bytes]) -> None:
        self.num_requests += 1
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            # A subscriber's mistake: say so in the log and end its replay, keep serving others.
            self.num_bad_requests += 1
            logger.warning("malformed KV event replay request (%d frames); want [b'', 8-byte seq]", len(frames))
            self._total.charge(1, time.monotonic())
            if len(frames) >= 2:
                self._send([frames[0], b"", b"", END_SEQ, b""])
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        now = time.monotonic()
        mine = self._bucket(identity, now)
        allowed = int(min(self.max_batches, mine.available(now) - 1, self._total.available(now) - 1))
        newest = self.log.next_seq - 1
        out: list[list[bytes]] = []
        cut = self._cut.pop(identity, None)
        if cut is not None:
            out.append(self._marker(identity, "hwm", *cut))
        sent = 0
        if allowed <= 0 and start <= newest:
            out.append(self._marker(identity, "rate_limited", start, newest))
        else:
            first_kept, batches = self.log.replay(start, max(allowed, 0))
            if start < first_kept and start <= newest:
                out.append(self._marker(identity, "expired", start, first_kept - 1))
            out.extend([identity, b"", self.topic, b.seq.to_bytes(8, "big"), b.payload] for b in batches)
            sent = len(batches)
            if batches and batches[-1].seq < newest:
                out.append(self._marker(identity, "more", batches[-1].seq + 1, newest))
        if sent or allowed > 0:
            mine.charge(sent + 1, now)       # a refused request costs its requester nothing more: it waits
        self._total.charge(sent + 1, now)
        for i, message in enumerate(out):
            sent_ok = self._send(message)
            if sent_ok is None:            # it disconnected: nothing to cut for it
                return
            if not sent_ok:
                seqs = [int.from_bytes(m[3], "big") for m in out[i:] if m[3] != GAP_SEQ]
                self._cut[identity] = (seqs[0] if seqs else start, newest)
                self.num_cut_replies += 1
                while len(self._cut) > MAX_REQUESTERS:
                    del self._cut[next(iter(self._cut))]
                logger.warning("KV event replay cut at %d: the requester reads too slowly", self._cut[identity][0])
                return
            if message[3] != GAP_SEQ:
                self.num_batches_sent += 1
        self._send([identity, b"", b"", END_SEQ, b""])

    def _marker(self, identity: bytes, reason: str, first: int, last: int) -> list[bytes]:
        self.markers[reason] = self.markers.get(reason, 0) + 1
        return [identity, b"", self.topic, GAP_SEQ, marker(reason, first, last)]

    def _send(self, message: list[bytes]) -> bool | None:
        """Send without blocking; False when the requester's queue is full, None when it is gone."""
        try:
            self._sock.send_multipart(message, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return None
            raise
