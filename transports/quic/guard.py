"""The QUIC server's gate before any handshake is served: which datagrams may make a connection.

  * Retry (address validation): an Initial without a valid token gets a stateless Retry;
  * at most `max_half_open` connections mid-handshake, `max_half_open_per_address` of them from one
    source address: past the total every new Initial is dropped (a client retransmits it); under it
    an Initial without a token always gets its Retry, and only one that would make a connection
    counts against its address's share, so one address cannot lock the others out;
  * the connection-id table is indexed by connection (`CidTable`): aioquic scans the whole table on
    every close, which stalled the loop for tens of seconds after an Initial flood;
  * batches of datagrams for one known connection go to it together.

and, per connection (`GuardedConnection`, the base of the server's connection class):

  * a connection still mid-handshake after `handshake_timeout_s` is closed (the idle timeout is
    for authenticated connections);
  * a client the TLS hook refused (no certificate, another CA) is counted and logged at once;
  * an authenticated node past `max_connections_per_peer` connections is closed "overloaded:".

The serving protocol is `transports.quic.server`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol, cast

from aioquic.quic import events
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicErrorCode

from transports.core.metrics import TransportMetrics
from transports.quic.backend import QuicBackend
from transports.quic.base import TRANSPORT
from transports.trust.certs import NodeCredentials

if TYPE_CHECKING:   # typed against aioquic; at run time the bases are the chosen backend's
    from aioquic.asyncio.protocol import QuicConnectionProtocol
    from aioquic.asyncio.server import QuicServer
else:
    QuicConnectionProtocol = QuicServer = object

__all__ = ["BoundedQuicServer", "CidTable", "GuardOwner", "GuardedConnection", "HandshakeOwner"]

logger = logging.getLogger("transports.quic")


class GuardOwner(Protocol):
    """What the gate reads from and counts into its QUIC transport server."""

    backend: QuicBackend
    num_half_open: int
    max_half_open: int
    max_half_open_per_address: int
    num_dropped_initials: int

    def half_open_of(self, host: str) -> int: ...

    def admit_handshake(self, source: str, now: float) -> bool: ...


class CidTable(dict[bytes, QuicConnectionProtocol]):
    """aioquic's connection-id → connection table, also indexed by connection, so that forgetting
    a closed connection costs O(its ids) instead of a scan of every id of every connection."""

    def __init__(self) -> None:
        super().__init__()
        self.of: dict[QuicConnectionProtocol, set[bytes]] = {}

    def __setitem__(self, cid: bytes, protocol: QuicConnectionProtocol) -> None:
        super().__setitem__(cid, protocol)
        self.of.setdefault(protocol, set()).add(cid)

    def __delitem__(self, cid: bytes) -> None:
        protocol = self[cid]
        super().__delitem__(cid)
        cids = self.of.get(protocol)
        if cids is not None:
            cids.discard(cid)

    def forget(self, protocol: QuicConnectionProtocol) -> None:
        for cid in self.of.pop(protocol, ()):
            if self.get(cid) is protocol:
                super().__delitem__(cid)

    def clear(self) -> None:
        super().clear()
        self.of.clear()


class BoundedQuicServer(QuicServer):
    """aioquic's server with the cid table above and caps on connections mid-handshake, in total
    and per source address (see the module docstring)."""

    def __init__(self, *, owner: GuardOwner, connect: Callable[[QuicConnection, str], QuicConnectionProtocol],
                 **kw: Any) -> None:
        """`connect(quic, source address)` makes the serving connection of an admitted Initial."""
        super().__init__(create_protocol=self._new_connection, **kw)
        self._owner = owner
        self._connect = connect
        self._protocols = CidTable()
        self._source = ""   # the address of the datagram being handled

    def _new_connection(self, quic: QuicConnection, stream_handler: Any = None) -> QuicConnectionProtocol:
        return self._connect(quic, self._source)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        owner = self._owner
        kind = self._new_initial(cast(bytes, data))
        if kind is not None:
            host = str(addr[0])
            if owner.num_half_open >= owner.max_half_open or (
                    kind == "connects" and (owner.half_open_of(host) >= owner.max_half_open_per_address
                                            or not owner.admit_handshake(host, time.monotonic()))):
                owner.num_dropped_initials += 1
                return
            self._source = host
        super().datagram_received(data, addr)

    def datagrams_received(self, data: list[bytes], addr: Any) -> None:
        """A GRO / recvmmsg batch from one address: runs of short-header datagrams for the same known
        connection go to it together; anything else (Initials, handshakes, unknown ids) takes the
        one-datagram path above, with its checks."""
        cid_length = self._configuration.connection_id_length
        run: list[bytes] = []
        receiver: QuicConnectionProtocol | None = None
        for datagram in data:
            short = bool(datagram) and not datagram[0] & 0x80
            protocol = self._protocols.get(datagram[1:1 + cid_length]) if short else None
            if protocol is not None and protocol is receiver:
                run.append(datagram)
                continue
            if receiver is not None:
                receiver.datagrams_received(run, addr)  # type: ignore[attr-defined]
                receiver, run = None, []
            if protocol is None:
                self.datagram_received(datagram, addr)
            else:
                receiver, run = protocol, [datagram]
        if receiver is not None:
            receiver.datagrams_received(run, addr)  # type: ignore[attr-defined]

    def _new_initial(self, data: bytes) -> str | None:
        """None unless `data` is an Initial of a new connection; then "retry" if it only gets a
        (stateless) Retry, "connects" if it would make a connection."""
        header = self._owner.backend.initial_header(data, self._configuration.connection_id_length)
        if header is None:
            return None
        is_initial, destination_cid, token = header
        if not is_initial or destination_cid in self._protocols:
            return None
        return "retry" if self._retry is not None and not token else "connects"

    def _connection_terminated(self, protocol: QuicConnectionProtocol) -> None:
        cast(CidTable, self._protocols).forget(protocol)


class HandshakeOwner(GuardOwner, Protocol):
    """What a connection's handshake checks read from and count into its server."""

    metrics: TransportMetrics
    handshake_timeout_s: float
    max_connections_per_peer: int
    credentials: NodeCredentials

    @property
    def _connections(self) -> Collection[GuardedConnection]: ...

    def _half_open_ended(self, host: str) -> None: ...

    def count_overloaded(self, peer: str, budget: str) -> None: ...


class GuardedConnection(QuicConnectionProtocol):
    """A server connection's handshake: its deadline, the refused-client count and the per-peer
    connection cap. The subclass sets the attributes below and ends the connection in `_on_terminated`."""

    _server: HandshakeOwner
    _backend: QuicBackend
    host: str
    node: str | None
    tenants: frozenset[str]   # the tenants the client's certificate restricts it to (empty: none)
    _terminated: bool
    _refused: bool
    _half_open: bool
    _handshake_timer: asyncio.TimerHandle | None

    def _on_terminated(self, event: events.ConnectionTerminated) -> None:
        raise NotImplementedError

    def _check_refused(self) -> None:
        """Count and log a refused client as soon as the TLS hook refuses it (not after draining)."""
        reason = self._backend.auth_failure(self._quic)
        if reason is None:
            return
        self._refused = True
        close = self._quic._close_event
        addr = self._backend.remote_address(self._quic)
        self._server.metrics.auth_failures.labels(TRANSPORT, reason.value).inc()
        logger.warning("refused QUIC client %s: %s (%s)", addr, reason.value, close.reason_phrase if close else "")

    def _end_half_open(self) -> None:
        if self._half_open:
            self._half_open = False
            self._server._half_open_ended(self.host)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
            self._handshake_timer = None

    def _handshake_expired(self) -> None:
        self._handshake_timer = None
        if self.node is not None or self._terminated:
            return
        logger.info("QUIC handshake from %s not done after %.1f s: closed", self.host,
                    self._server.handshake_timeout_s)
        self._quic.close(QuicErrorCode.CONNECTION_REFUSED, reason_phrase="handshake timeout")
        self._end_half_open()
        if self._quic._close_event is not None:
            self._on_terminated(self._quic._close_event)
        self.transmit()

    def _on_handshake(self, event: events.HandshakeCompleted) -> None:
        node = self._backend.peer_node(self._quic)
        self._end_half_open()
        if node is None:  # cannot happen with the hook installed; never serve an unknown peer
            self._quic.close(QuicErrorCode.CRYPTO_ERROR + 116, reason_phrase="client not authenticated")
            return
        server = self._server
        if server.credentials.crl_expired(time.time()):   # as TLS-TCP: fail closed (certs.py)
            self._refused = True
            server.metrics.auth_failures.labels(TRANSPORT, "crl_expired").inc()
            logger.warning("refused QUIC connection of %s: the revocation list crl.pem is past its nextUpdate; "
                           "publish a fresh one (kvfabric certs revoke --dir <ca>)", node)
            self._quic.close(QuicErrorCode.CONNECTION_REFUSED, reason_phrase="revocation list expired")
            return
        if sum(1 for c in server._connections if c.node == node) >= server.max_connections_per_peer:
            self._refused = True   # authenticated, but over its connection budget: no auth failure
            server.count_overloaded(node, "connections")
            logger.warning("refused QUIC connection of %s: already %d connections", node,
                           server.max_connections_per_peer)
            self._quic.close(QuicErrorCode.CONNECTION_REFUSED,
                             reason_phrase=f"overloaded: {node} already has {server.max_connections_per_peer} "
                                           "connections")
            return
        self.node, self.tenants = node, self._backend.peer_tenants(self._quic)
        self._server.metrics.connections.labels(TRANSPORT, "server").inc()
        logger.info("QUIC connection from node %s (session resumed: %s)", self.node, event.session_resumed)
