"""Mutual TLS for aioquic servers: the client-certificate check aioquic 1.7.2 leaves out.

Stock aioquic honours `verify_mode` only on the client. Its server `tls.Context` has a private
`_request_client_certificate` flag, accepts an empty client Certificate message and checks only
the CertificateVerify signature, never the chain (aiortc/aioquic #541, #548, #586). So a server
built on it alone serves anyone. This module closes the hole:

    QuicConnection._initialize()          aioquic builds its tls.Context here (no factory hook)
        └─ install_client_auth() wraps it: the new Context becomes a `ClusterServerContext`
             · asks for the client certificate
             · empty Certificate            → alert certificate_required (116)
             · not from the cluster CA       → alert bad_certificate
             · expired / not yet valid       → alert certificate_expired
             · a CA cert, no DNS SAN, no clientAuth use → alert bad_certificate
             · CertificateVerify signature   → checked by aioquic (proves the private key)
           and records `peer_node` (the SAN) once the client proved its key.

A refused handshake never gets 1-RTT keys, so no application byte of that client is processed.

Session resumption skips certificates, so tickets carry the identity: the server issues tickets
only to a client authenticated by a full mutual handshake (or by a ticket that was), keeps them
in a `TicketStore` bound to the client's node name and certificate expiry, and accepts each
ticket once. No 0-RTT: tickets do not offer early data, and the transport closes a connection
that sends stream data before its handshake completed.
`TicketStore` is an LRU map: add / take O(1), at most `capacity` entries.

`QuicTlsMaterial` turns the node's `NodeCredentials` into aioquic configurations, one immutable
`TlsGeneration` per version of the certificate files: a rotation affects new handshakes only,
and starts a fresh ticket store (tickets never outlive the certificates they were issued under).

The hook relies on private aioquic names, hence the exact version pin checked at import.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn, cast

import aioquic
from aioquic import tls
from aioquic._buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transports.trust.certs import CertificateError, NodeCredentials, node_name_of
from transports.trust.client_auth import AuthFailure, client_auth_allowed
from transports.trust.tenant_tokens import tenant_names

PINNED_AIOQUIC = "1.7.2"
if aioquic.__version__ != PINNED_AIOQUIC:
    raise ImportError(
        f"transports.quic.tls patches aioquic {PINNED_AIOQUIC} internals (server-side client certificate "
        f"checks) but aioquic {aioquic.__version__} is installed; re-check tls.Context and "
        f"QuicConnection._initialize against the new version before moving the pin")

logger = logging.getLogger(__name__)


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class AlertCertificateRevoked(tls.Alert):
    description = tls.AlertDescription.certificate_revoked


@dataclass(slots=True)
class _Ticket:
    ticket: tls.SessionTicket
    node: str
    cert_not_after: float  # the client certificate's expiry bounds every ticket chained from it
    expires_at: float
    tenants: frozenset[str] = frozenset()   # the tenants the client's certificate restricts it to


@dataclass(slots=True)
class TicketStore:
    """Server-side session tickets, each bound to the node that earned it with a full handshake."""

    capacity: int = 4096
    lifetime_s: float = 3600.0
    _tickets: OrderedDict[bytes, _Ticket] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._tickets)

    def add(self, ticket: tls.SessionTicket, node: str, cert_not_after: float, now: float,
            tenants: frozenset[str] = frozenset()) -> None:
        self._tickets[ticket.ticket] = _Ticket(ticket, node, cert_not_after,
                                               min(now + self.lifetime_s, cert_not_after), tenants)
        while len(self._tickets) > self.capacity:
            self._tickets.popitem(last=False)

    def take(self, ticket_id: bytes, now: float) -> tuple[tls.SessionTicket, str, float, frozenset[str]] | None:
        """(ticket, node, certificate expiry, tenants), removed from the store (single use); None if
        unknown or expired."""
        entry = self._tickets.pop(ticket_id, None)
        if entry is None or now > entry.expires_at:
            return None
        return entry.ticket, entry.node, entry.cert_not_after, entry.tenants

    def clear(self) -> None:
        self._tickets.clear()


@dataclass(frozen=True, slots=True)
class TlsGeneration:
    """One generation of a node's QUIC TLS material; replaced as a whole when certificates rotate.
    `tickets` are the session tickets a server issued under it."""

    configuration: QuicConfiguration
    cluster_ca: bytes
    tickets: TicketStore
    revoked: frozenset[int] = frozenset()   # certificate serials the CA revoked (a new list is a new generation)


class QuicTlsMaterial:
    """A node's certificate, key and cluster CA as aioquic configurations, reloaded on rotation.

    `base` carries everything but the TLS material (ALPN, windows, datagram size, timeouts).
    A generation is never mutated, so handshakes already under way keep theirs.
    """

    def __init__(self, credentials: NodeCredentials, base: QuicConfiguration,
                 ticket_lifetime_s: float = 3600.0) -> None:
        self.credentials = credentials
        self.generation = -1
        self._base = base
        self._ticket_lifetime_s = ticket_lifetime_s
        self._current: TlsGeneration | None = None

    def current(self) -> TlsGeneration:
        """The material for a new handshake, reloaded first if the files changed."""
        self.credentials.refresh()
        if self._current is not None and self.credentials.generation == self.generation:
            return self._current
        files = self.credentials.files
        config = dataclasses.replace(self._base)
        try:
            config.load_cert_chain(files.cert, files.key)
            cadata = files.ca.read_bytes()
        except (OSError, ValueError) as e:
            if self._current is None:
                raise CertificateError(f"cannot load QUIC credentials {files}: {e}") from None
            logger.warning("keeping the previous QUIC certificate; rotated files unreadable: %s", e)
            return self._current
        config.load_verify_locations(cadata=cadata)
        config.verify_mode = ssl.CERT_REQUIRED  # clients check the server's chain and name
        self._current = TlsGeneration(config, cadata, TicketStore(lifetime_s=self._ticket_lifetime_s),
                                      self.credentials.revoked)
        if self.generation >= 0:
            logger.info("QUIC now uses certificate generation %d", self.credentials.generation)
        self.generation = self.credentials.generation
        return self._current


class ClusterServerContext(tls.Context):
    """aioquic's server TLS context with client authentication against the cluster CA."""

    cluster_ca: bytes
    tickets: TicketStore
    revoked: frozenset[int]
    peer_node: str | None
    peer_tenants: frozenset[str]           # the tenants the client's certificate restricts it to
    auth_failure: AuthFailure | None
    _candidate: tuple[str, float, frozenset[str]] | None  # (node, certificate expiry, tenants) being checked

    def enforce(self, server_tls: TlsGeneration) -> None:
        self.cluster_ca = server_tls.cluster_ca
        self.tickets = server_tls.tickets
        self.revoked = server_tls.revoked
        self.peer_node = None
        self.peer_tenants = frozenset()
        self.auth_failure = None
        self._candidate = None
        self._request_client_certificate = True
        self._verify_mode = ssl.CERT_REQUIRED  # for readers of the context; the checks are ours
        self._max_early_data = None  # no 0-RTT: early data could be replayed
        self.get_session_ticket_cb = self._resume
        self.new_session_ticket_cb = self._issue

    # -- full handshake ------------------------------------------------------------------------

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        super()._server_handle_certificate(input_buf)
        if self._peer_certificate is None:
            self._refuse(AuthFailure.NO_CERTIFICATE,
                         AlertCertificateRequired("client sent no certificate; kvfabric requires mutual TLS"))
        cert = self._peer_certificate
        try:
            tls.verify_certificate(certificate=cert, chain=self._peer_certificate_chain, cadata=self.cluster_ca)
        except tls.AlertCertificateExpired as e:
            self._refuse(AuthFailure.EXPIRED, e)
        except tls.Alert as e:
            self._refuse(AuthFailure.UNTRUSTED, tls.AlertBadCertificate(f"not issued by the cluster CA: {e}"))
        if cert.serial_number in self.revoked:
            self._refuse(AuthFailure.REVOKED, AlertCertificateRevoked("certificate revoked by the cluster CA"))
        try:
            node = node_name_of(cert)
        except CertificateError as e:
            self._refuse(AuthFailure.NOT_A_NODE, tls.AlertBadCertificate(str(e)))
        if not client_auth_allowed(cert):
            self._refuse(AuthFailure.NOT_A_NODE,
                         tls.AlertBadCertificate("certificate is not valid for client authentication"))
        self._candidate = (node, cert.not_valid_after_utc.timestamp(), frozenset(tenant_names(cert)))

    def _server_handle_certificate_verify(self, input_buf: Buffer) -> None:
        try:
            super()._server_handle_certificate_verify(input_buf)  # proves the client holds the key
        except tls.Alert as e:
            self._refuse(AuthFailure.HANDSHAKE, e)
        assert self._candidate is not None, "CertificateVerify accepted before a verified Certificate"
        self.peer_node, self.peer_tenants = self._candidate[0], self._candidate[2]

    # -- resumption ----------------------------------------------------------------------------

    def _server_handle_hello(self, input_buf: Buffer, initial_buf: Buffer, handshake_buf: Buffer) -> None:
        super()._server_handle_hello(input_buf, initial_buf, handshake_buf)
        if self._session_resumed:
            assert self._candidate is not None, "session resumed without a ticket from our store"
            self.peer_node, self.peer_tenants = self._candidate[0], self._candidate[2]
            if self.state == tls.State.SERVER_EXPECT_CERTIFICATE:
                # aioquic sends no CertificateRequest on a PSK handshake but would still wait
                # for a client Certificate; a resumed client goes straight to Finished.
                self._server_expect_finished()

    def _resume(self, ticket_id: bytes) -> tls.SessionTicket | None:
        found = self.tickets.take(ticket_id, time.time())
        if found is None:
            return None
        ticket, node, cert_not_after, tenants = found
        self._candidate = (node, cert_not_after, tenants)
        return ticket

    def _issue(self, ticket: tls.SessionTicket) -> None:
        # Called after the client's Finished; a resumed session re-issues under the same identity.
        if self.peer_node is None or self._candidate is None:
            return
        self.tickets.add(ticket, self.peer_node, self._candidate[1], time.time(), self._candidate[2])

    def _refuse(self, reason: AuthFailure, alert: tls.Alert) -> NoReturn:
        self.auth_failure = reason
        raise alert


def install_client_auth(connection: QuicConnection, current: Callable[[], TlsGeneration]) -> None:
    """Make the server-side `connection` demand and verify a cluster client certificate.

    Call before the connection sees its first datagram. `current()` is asked for the TLS material
    when the handshake starts, so a rotated certificate applies to new connections only.
    """
    if connection._is_client:
        raise RuntimeError("install_client_auth is for server connections; clients verify with verify_mode")
    original = connection._initialize

    def _initialize(peer_cid: bytes) -> None:
        server_tls = current()
        # Only the TLS fields differ between generations, so swapping the configuration before
        # aioquic reads it leaves the transport parameters (already taken from it) consistent.
        connection._configuration = server_tls.configuration
        original(peer_cid)
        # aioquic has no factory for its tls.Context: upgrade the instance it just built.
        context = connection.tls
        context.__class__ = ClusterServerContext
        cast(ClusterServerContext, context).enforce(server_tls)

    connection._initialize = _initialize  # type: ignore[method-assign]


def server_revoked(connection: QuicConnection, revoked: frozenset[int]) -> bool:
    """On a client connection after its handshake: True when the server's certificate is revoked.
    (A resumed session shows no certificate; its ticket came from a full handshake under the same list.)"""
    cert = connection.tls._peer_certificate
    return cert is not None and cert.serial_number in revoked


def peer_node(connection: QuicConnection) -> str | None:
    """The authenticated node name of a server connection's client, once its handshake passed."""
    context = getattr(connection, "tls", None)
    return context.peer_node if isinstance(context, ClusterServerContext) else None


def peer_tenants(connection: QuicConnection) -> frozenset[str]:
    """The tenants an authenticated client's certificate restricts it to (empty: every tenant)."""
    context = getattr(connection, "tls", None)
    return context.peer_tenants if isinstance(context, ClusterServerContext) else frozenset()


def auth_failure(connection: QuicConnection) -> AuthFailure | None:
    context = getattr(connection, "tls", None)
    return context.auth_failure if isinstance(context, ClusterServerContext) else None

