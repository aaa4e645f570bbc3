"""KV events on ZMQ, as vLLM's `ZmqEventPublisher` sends them: a thin adapter over `KvEventLog`.

    PUB    (endpoint)         multipart [topic, seq as 8-byte big-endian, msgpack EventBatch]
    ROUTER (replay_endpoint)  request  [identity, b"", start seq as 8-byte big-endian]
                              answers  [identity, b"", seq, batch] for each kept batch >= start,
                                       then [identity, b"", -1 as 8-byte signed, b""]

Every call runs on the owner's thread (the NodeActor's event loop): ZMQ sockets are not
thread-safe, and a PUB send never blocks (past `hwm` queued messages a slow subscriber misses
batches and asks for a replay). `serve_replays` answers waiting requests without blocking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import zmq

from cluster.kv_events import EventBatch, KvEventLog
from fabric.config import EventsConfig
from fabric.events import StoreEvents
from fabric.keys import BlockAddress, BlockHash

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
RESTART_MEDIUM = "DISK"      # after a restart only the SSD tier still holds blocks
OVERFLOW_MEDIUM = "CPU"      # blocks a lost drain stored land in RAM first


def resolve_endpoint(endpoint: str, node_name: str) -> str:
    """`{node}` becomes the node's name; an ipc path's folder is created."""
    resolved = endpoint.replace("{node}", node_name)
    if resolved.startswith("ipc://"):
        Path(resolved[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
    return resolved


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard (`*`, `::`), ipc or inproc endpoint, connect to
    any other (a central subscriber that binds, as llm-d's indexer does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """One node's KV event stream. `start` announces a fresh view, `drain` forwards store events."""

    def __init__(self, config: EventsConfig, node_name: str, *, block_size: int,
                 context: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self.log = KvEventLog(block_size=block_size, buffer_batches=config.buffer_batches)
        self._topic = config.topic.replace("{node}", node_name).encode()
        ctx = context or zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._router: zmq.Socket[bytes] | None = None
        self.replay_endpoint = ""
        endpoint = resolve_endpoint(config.endpoint, node_name)
        try:
            if binds(endpoint):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            if config.replay_endpoint:
                endpoint = resolve_endpoint(config.replay_endpoint, node_name)
                self._router = ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self._router.bind(endpoint)
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"[events] cannot open KV event endpoint {endpoint}: {e}") from None
        self.num_bad_requests = 0

    def start(self, held: Iterable[BlockAddress]) -> None:
        """The first batch of this publisher's life: `AllBlocksCleared`, then what the store holds."""
        self._send(self.log.reset(held, time.time(), medium=RESTART_MEDIUM))

    def note_chain(self, hashes: Sequence[BlockHash], parent: BlockHash | None,
                   token_ids: Sequence[int] | None, block_size: int) -> None:
        self.log.note_chain(hashes, parent, token_ids, block_size)

    def drain(self, events: StoreEvents, held: Callable[[], Iterable[BlockAddress]]) -> None:
        """Publish one drain of store events (an overflowed one as a reset from `held()`), then
        answer replay requests."""
        if events.overflowed:
            batch: EventBatch | None = self.log.reset(held(), time.time(), medium=OVERFLOW_MEDIUM)
        else:
            batch = self.log.apply(events, time.time())
        if batch is not None:
            self._send(batch)
        self.serve_replays()

    def serve_replays(self) -> int:
        """Answer every waiting replay request; returns how many were answered."""
        served = 0
        while self._router is not None and self._router.poll(0):
            frames = self._router.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                # A subscriber's mistake: say so in the log and end its replay, keep serving others.
                self.num_bad_requests += 1
                logger.warning("malformed KV event replay request (%d frames); want [b'', 8-byte seq]",
                               len(frames))
                if len(frames) >= 2:
                    self._router.send_multipart([frames[0], b"", END_SEQ, b""])
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            for batch in self.log.replay(start):
                self._router.send_multipart([identity, b"", batch.seq.to_bytes(8, "big"), batch.payload])
            self._router.send_multipart([identity, b"", END_SEQ, b""])
            served += 1
        return served

    def endpoints(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self._topic.decode(), "next_seq": str(self.log.next_seq)}

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)

    def _send(self, batch: EventBatch) -> None:
        self._pub.send_multipart([self._topic, batch.seq.to_bytes(8, "big"), batch.payload])
