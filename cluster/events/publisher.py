"""KV events on ZMQ, as vLLM 0.32's `ZmqEventPublisher` sends them: a thin adapter over `KvEventLog`.

    PUB    (endpoint)         multipart [topic, seq as 8-byte big-endian, msgpack KVEventBatch]
    ROUTER (replay_endpoint)  replays, on their own thread (cluster/events/replay.py)

The PUB socket is used only on the owner's thread (the NodeActor's event loop) and a send never
blocks: past `hwm` queued messages a slow subscriber misses batches and asks for a replay.

Who may read: an ipc:// endpoint is a file only the node's user may open (0600, in a 0700 folder
when kvfabric makes it); a tcp:// endpoint other hosts can reach is refused unless CURVE is on
(`[events] curve_secret_key`): then both sockets encrypt, and a ZAP handler admits only consumers
whose public key is in `curve_allow_dir` (`kvfabric certs events-key`). Which tenants' token ids
events show is `token_ids_tenants`; `exposure_error` refuses the rest at start-up.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cluster.events.log import MEDIUM_CPU, MEDIUM_STORAGE, ChainHint, EventBatch, KvEventLog
from cluster.events.replay import ReplayServer
from fabric.config import ConfigError, EventsConfig, exposure_error
from fabric.event_chains import EventChains
from fabric.events import StoreEvents
from fabric.keys import BlockAddress, BlockHash

RESTART_MEDIUM = MEDIUM_STORAGE   # after a restart only the SSD tier still holds blocks
OVERFLOW_MEDIUM = MEDIUM_CPU      # blocks a lost drain stored land in RAM first
ZAP_DOMAIN = "kvfabric-events"


def resolve_endpoint(endpoint: str, node_name: str) -> str:
    """`{node}` becomes the node's name; an ipc path's folder is created (0700)."""
    resolved = endpoint.replace("{node}", node_name)
    if resolved.startswith("ipc://"):
        folder = Path(resolved[len("ipc://"):]).parent
        if not folder.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return resolved


def binds(endpoint: str) -> bool:
    """vLLM's rule for the PUB socket: bind a wildcard (`*`, `::`), ipc or inproc endpoint, connect to
    any other (a central subscriber that binds, as llm-d's indexer does)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KvEventPublisher:
    """One node's KV event stream. `start` announces a fresh view, `drain` forwards store events."""

    def __init__(self, config: EventsConfig, node_name: str, *, block_size: int, tenancy_required: bool = False,
                 chains_path: str | Path | None = None) -> None:
        problem = exposure_error(config, tenancy_required)
        if problem is not None:
            raise ConfigError(f"[events] {problem}")
        self.config = config
        self.chains = None if chains_path is None else EventChains(chains_path, ChainHint.unpack)
        self.log = KvEventLog(block_size=block_size, buffer_batches=config.buffer_batches, chains=self.chains)
        self._topic = config.topic.replace("{node}", node_name).encode()
        self._all_tokens = "*" in config.token_ids_tenants
        self._token_tenants = frozenset(config.token_ids_tenants)
        # CURVE needs its own ZAP handler, one per context: a context of our own then.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if config.curve() else zmq.Context.instance()
        self._auth: ThreadAuthenticator | None = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replays: ReplayServer | None = None
        self.replay_endpoint = ""
        endpoint = resolve_endpoint(config.endpoint, node_name)
        try:
            if config.curve():
                self._start_curve()
            if binds(endpoint):
                self._secure(self._pub, server=True)
                self._pub.bind(endpoint)
                self.endpoint = self._bound(self._pub)
            else:
                self._secure(self._pub, server=False)
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            if config.replay_endpoint:
                endpoint = resolve_endpoint(config.replay_endpoint, node_name)
                router = self._ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                # Room for one whole reply per requester: a reader that keeps up is never cut, one that
                # does not read holds little of this node's memory.
                router.set_hwm(min(config.hwm, 2 * config.replay_max_batches + 16))
                self._secure(router, server=True)
                try:
                    router.bind(endpoint)
                except zmq.ZMQError:
                    router.close(linger=0)
                    raise
                self.replay_endpoint = self._bound(router)
                self._replays = ReplayServer(router, self.log, self._topic, max_batches=config.replay_max_batches,
                                             requester_rate=config.replay_rate, total_rate=config.replay_total_rate)
        except (zmq.ZMQError, OSError, ValueError) as e:
            self.close()
            raise OSError(f"[events] cannot open KV event endpoint {endpoint}: {e}") from None

    def _start_curve(self) -> None:
        self._public, self._secret = zmq.auth.load_certificate(self.config.curve_secret_key)
        if self._secret is None:
            raise ValueError(f"{self.config.curve_secret_key} holds no secret key (want the .key_secret file)")
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        if self.config.curve_allow_dir:
            if not Path(self.config.curve_allow_dir).is_dir():
                raise ValueError(f"events.curve_allow_dir {self.config.curve_allow_dir} is not a folder")
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=self.config.curve_allow_dir)

    def _secure(self, sock: zmq.Socket[bytes], *, server: bool) -> None:
        if not self.config.curve():
            return
        sock.curve_secretkey = self._secret
        sock.curve_publickey = self._public
        if server:
            sock.zap_domain = ZAP_DOMAIN.encode()
            sock.curve_server = True
        else:
            server_key, _ = zmq.auth.load_certificate(self.config.curve_server_key)
            sock.curve_serverkey = server_key

    @staticmethod
    def _bound(sock: zmq.Socket[bytes]) -> str:
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):   # @: Linux's abstract names
            os.chmod(endpoint[len("ipc://"):], 0o600)   # only the node's user connects
        return endpoint

    def shows_tokens(self, tenants: frozenset[str] | None) -> bool:
        """Whether events show the token ids of a block of `tenants` (empty or None: the anonymous tenant)."""
        return self._all_tokens or bool(tenants and tenants & self._token_tenants)

    def start(self, held: Iterable[BlockAddress]) -> None:
        """The first batch of this publisher's life: `AllBlocksCleared`, then what the store holds."""
        self._send(self.log.reset(held, time.time(), medium=RESTART_MEDIUM))

    def note_chain(self, hashes: Sequence[BlockHash], parent: BlockHash | None,
                   token_ids: Sequence[int] | None, block_size: int, **keys: Any) -> None:
        self.log.note_chain(hashes, parent, token_ids, block_size, **keys)

    def drain(self, events: StoreEvents, held: Callable[[], Iterable[BlockAddress]]) -> None:
        """Publish one drain of store events (an overflowed one as a reset from `held()`)."""
        if events.overflowed:
            batch: EventBatch | None = self.log.reset(held(), time.time(), medium=OVERFLOW_MEDIUM)
        else:
            batch = self.log.apply(events, time.time())
        if batch is not None:
            self._send(batch)

    @property
    def replays(self) -> ReplayServer | None:
        return self._replays

    def endpoints(self) -> dict[str, str]:
        out = {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
               "topic": self._topic.decode(), "next_seq": str(self.log.next_seq),
               "curve_public_key": self._public.decode() if self.config.curve() else ""}
        if self._replays is not None:
            out["replay_requests"] = str(self._replays.num_requests)
            out["replay_markers"] = ",".join(f"{k}={v}" for k, v in sorted(self._replays.markers.items()))
        return out

    def close(self) -> None:
        if self._replays is not None:
            self._replays.close()
            self._replays = None
        self._pub.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if self._ctx is not zmq.Context.instance():
            self._ctx.term()
        if self.chains is not None:
            self.chains.close()
            self.chains = None

    def _send(self, batch: EventBatch) -> None:
        self._pub.send_multipart([self._topic, batch.seq.to_bytes(8, "big"), batch.payload])
