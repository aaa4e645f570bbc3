"""Mutual TLS for qh3 servers: the client authentication qh3 2.1.0 leaves out.

qh3's server TLS (`qh3.tls.Context`, Python; the packet core is Rust) never sends a
CertificateRequest, has no state for a client Certificate and "anticipates" the client's Finished
right after its own flight. So a server built on it alone serves anyone. `ClusterServerContext`
adds the client half of the TLS 1.3 handshake (RFC 8446 4.3.2, 4.4.2-4.4.4):

    ServerHello, {EncryptedExtensions}, {CertificateRequest}, {Certificate}, {CertificateVerify}, {Finished}
                                          ▲ inserted before the server Certificate, inside its transcript
    ◄── {Certificate}        empty → certificate_required (116); checked by `check_client_certificate`
    ◄── {CertificateVerify}  signature over the transcript with the certificate's key → decrypt_error
    ◄── {Finished}           expected value computed from the transcript that includes both

A refused handshake never gets 1-RTT keys for the client, so no application byte is processed.

No resumption on this backend: qh3 issues its session ticket inside the server's first flight,
before the client has authenticated, so a ticket could not be bound to a verified identity. The
server neither issues nor accepts tickets; every connection is a full mutual handshake. No 0-RTT.

The hook relies on private qh3 names, hence the exact version pin checked at import.
"""

from __future__ import annotations

import ssl
import time
from typing import Any, NoReturn, cast

import qh3
from cryptography import x509
from qh3 import tls
from qh3._hazmat import Buffer, SignatureError, verify_with_public_key
from qh3._hazmat import Certificate as Qh3Certificate
from qh3.quic.connection import QuicConnection

from transports.quic.tls import TlsGeneration
from transports.trust.client_auth import AuthFailure, ClientRefused, check_client_certificate
from transports.trust.tenant_tokens import tenant_names

PINNED_QH3 = "2.1.0"
if qh3.__version__ != PINNED_QH3:
    raise ImportError(
        f"transports.quic.tls_qh3 extends qh3 {PINNED_QH3} internals (server-side client certificates) "
        f"but qh3 {qh3.__version__} is installed; re-check tls.Context._server_handle_hello, "
        f"handle_message and QuicConnection._create_tls against the new version before moving the pin")


class AlertCertificateRequired(tls.Alert):
    description = tls.AlertDescription.certificate_required


class AlertCertificateRevoked(tls.Alert):
    description = tls.AlertDescription.certificate_revoked


_ALERTS: dict[AuthFailure, type[tls.Alert]] = {
    AuthFailure.NO_CERTIFICATE: AlertCertificateRequired,
    AuthFailure.EXPIRED: tls.AlertCertificateExpired,
    AuthFailure.REVOKED: AlertCertificateRevoked,
    AuthFailure.UNTRUSTED: tls.AlertBadCertificate,
    AuthFailure.NOT_A_NODE: tls.AlertBadCertificate,
}

# Where the server is in the client's second flight.
_EXPECT_CERTIFICATE, _EXPECT_VERIFY, _EXPECT_FINISHED = 0, 1, 2


def _certificate_request(signature_algorithms: list[int]) -> bytes:
    """A TLS 1.3 CertificateRequest: empty context, one signature_algorithms extension."""
    algorithms = b"".join(a.to_bytes(2, "big") for a in signature_algorithms)
    extension = (tls.ExtensionType.SIGNATURE_ALGORITHMS.to_bytes(2, "big")
                 + (len(algorithms) + 2).to_bytes(2, "big") + len(algorithms).to_bytes(2, "big") + algorithms)
    body = b"\x00" + len(extension).to_bytes(2, "big") + extension
    return bytes([tls.HandshakeType.CERTIFICATE_REQUEST]) + len(body).to_bytes(3, "big") + body


class ClusterServerContext(tls.Context):
    """qh3's server TLS context with client authentication against the cluster CA."""

    cluster_ca: bytes
    revoked: frozenset[int]
    peer_node: str | None
    peer_tenants: frozenset[str]           # the tenants the client's certificate restricts it to
    auth_failure: AuthFailure | None
    _stage: int
    _request_into: Any   # the handshake buffer while our first flight is written
    _peer_public: Any
    _candidate: str | None
    _candidate_tenants: frozenset[str]

    def enforce(self, server_tls: TlsGeneration) -> None:
        self.cluster_ca = server_tls.cluster_ca
        self.revoked = server_tls.revoked
        self.peer_node = None
        self.peer_tenants = frozenset()
        self.auth_failure = None
        self._stage = _EXPECT_CERTIFICATE
        self._request_into = None
        self._peer_public = None
        self._candidate = None
        self._candidate_tenants = frozenset()
        self._verify_mode = ssl.CERT_REQUIRED  # for readers of the context; the checks are ours
        self._max_early_data = None
        self._alps_supported = False
        self.get_session_ticket_cb = None   # no resumption: see the module docstring
        self.new_session_ticket_cb = None

    # qh3 reads `self.certificate` exactly once on the server, inside the transcript block of its
    # Certificate message, right after EncryptedExtensions: the CertificateRequest goes there.
    @property  # type: ignore[override]
    def certificate(self) -> Any:
        if self._request_into is not None:
            buf, self._request_into = self._request_into, None
            buf.push_bytes(_certificate_request(list(self._signature_algorithms)))
        return self.__dict__.get("certificate")

    @certificate.setter
    def certificate(self, value: Any) -> None:
        self.__dict__["certificate"] = value

    def _server_handle_hello(self, input_buf: Buffer, initial_buf: Buffer, handshake_buf: Buffer,
                             onertt_buf: Buffer) -> None:
        # With ALPS "negotiated" qh3 defers computing the client's Finished to when it arrives,
        # which a client Certificate and CertificateVerify in the transcript require.
        self._request_into = handshake_buf
        self._alps_negotiated = True
        try:
            super()._server_handle_hello(input_buf, initial_buf, handshake_buf, onertt_buf)
        finally:
            self._alps_negotiated = False
            self._request_into = None

    def handle_message(self, input_data: bytes, output_buf: dict[tls.Epoch, Buffer], epoch: int = -1) -> None:
        if self.state != tls.State.SERVER_EXPECT_FINISHED or self._stage == _EXPECT_FINISHED:
            super().handle_message(input_data, output_buf, epoch)
            return
        self._receive_buffer += input_data
        while self._stage != _EXPECT_FINISHED and len(self._receive_buffer) >= 4:
            length = 4 + int.from_bytes(self._receive_buffer[1:4], "big")
            if len(self._receive_buffer) < length:
                return
            message, self._receive_buffer = self._receive_buffer[:length], self._receive_buffer[length:]
            if epoch >= 0 and epoch != tls.Epoch.HANDSHAKE:
                raise tls.AlertUnexpectedMessage
            if self._stage == _EXPECT_CERTIFICATE:
                self._handle_client_certificate(message)
            else:
                self._handle_client_certificate_verify(message)
        if self._stage == _EXPECT_FINISHED:
            super().handle_message(b"", output_buf, epoch)   # the Finished, checked by qh3

    def _handle_client_certificate(self, message: bytes) -> None:
        if message[0] != tls.HandshakeType.CERTIFICATE:
            if message[0] == tls.HandshakeType.FINISHED:
                self._refuse(AuthFailure.NO_CERTIFICATE, "client sent no certificate; kvfabric requires mutual TLS")
            raise tls.AlertUnexpectedMessage
        buf = Buffer(data=message)
        entries = tls.pull_certificate(buf).certificates
        if not buf.eof():
            raise tls.AlertDecodeError("extra bytes after the client Certificate")
        self._schedule().update_hash(message)
        if not entries:
            self._refuse(AuthFailure.NO_CERTIFICATE, "client sent no certificate; kvfabric requires mutual TLS")
        try:
            cert = x509.load_der_x509_certificate(entries[0][0])
            chain = [x509.load_der_x509_certificate(e[0]) for e in entries[1:]]
        except ValueError:
            self._refuse(AuthFailure.UNTRUSTED, "client certificate does not parse")
        try:
            self.peer_node = None
            node = check_client_certificate(cert, chain, self.cluster_ca, self.revoked, time.time())
        except ClientRefused as e:
            self._refuse(e.reason, str(e))
        self._candidate = node
        self._candidate_tenants = frozenset(tenant_names(cert))
        self._peer_public = Qh3Certificate(entries[0][0]).public_key()
        self._stage = _EXPECT_VERIFY

    def _handle_client_certificate_verify(self, message: bytes) -> None:
        if message[0] != tls.HandshakeType.CERTIFICATE_VERIFY:
            raise tls.AlertUnexpectedMessage
        buf = Buffer(data=message)
        verify = tls.pull_certificate_verify(buf)
        if not buf.eof():
            raise tls.AlertDecodeError("extra bytes after the client CertificateVerify")
        if verify.algorithm not in self._signature_algorithms:
            self.auth_failure = AuthFailure.HANDSHAKE
            raise tls.AlertDecryptError("client signed with an algorithm we did not offer")
        try:   # proves the client holds the certificate's private key
            verify_with_public_key(self._peer_public, verify.algorithm,
                                   self._schedule().certificate_verify_data(b"TLS 1.3, client CertificateVerify"),
                                   verify.signature)
        except SignatureError as e:
            self.auth_failure = AuthFailure.HANDSHAKE
            raise tls.AlertDecryptError(f"client CertificateVerify: {e}") from None
        self._schedule().update_hash(message)
        assert self._dec_key is not None, "handshake keys are set before the client's second flight"
        self._expected_verify_data = self._schedule().finished_verify_data(self._dec_key)
        self.peer_node, self.peer_tenants = self._candidate, self._candidate_tenants
        self._stage = _EXPECT_FINISHED

    def _schedule(self) -> tls.KeySchedule:
        assert self.key_schedule is not None, "the key schedule exists once the ClientHello was handled"
        return self.key_schedule

    def _refuse(self, reason: AuthFailure, message: str) -> NoReturn:
        self.auth_failure = reason
        raise _ALERTS[reason](message)


def install_client_auth(connection: QuicConnection, current: Any) -> None:
    """Make the server-side `connection` demand and verify a cluster client certificate.

    Call before the connection sees its first datagram. `current()` gives the TLS material when
    the handshake starts, so a rotated certificate applies to new connections only.
    """
    if connection._is_client:
        raise RuntimeError("install_client_auth is for server connections; clients verify with verify_mode")
    original = connection._create_tls

    def _create_tls(remote_source_cid: bytes | None) -> Any:
        server_tls: TlsGeneration = current()
        connection._configuration = server_tls.configuration  # type: ignore[assignment]
        bridge = original(remote_source_cid)
        context = bridge.tls
        context.__class__ = ClusterServerContext
        cast(ClusterServerContext, context).enforce(server_tls)
        return bridge

    connection._create_tls = _create_tls  # type: ignore[method-assign]


def peer_node(connection: QuicConnection) -> str | None:
    context = connection.tls
    return context.peer_node if isinstance(context, ClusterServerContext) else None


def peer_tenants(connection: QuicConnection) -> frozenset[str]:
    """The tenants an authenticated client's certificate restricts it to (empty: every tenant)."""
    context = connection.tls
    return context.peer_tenants if isinstance(context, ClusterServerContext) else frozenset()


def auth_failure(connection: QuicConnection) -> AuthFailure | None:
    context = connection.tls
    return context.auth_failure if isinstance(context, ClusterServerContext) else None


def server_revoked(connection: QuicConnection, revoked: frozenset[int]) -> bool:
    """On a client connection after its handshake: True when the server's certificate is revoked."""
    context = connection.tls
    cert = None if context is None else context.peer_certificate
    return cert is not None and x509.load_der_x509_certificate(cert.public_bytes()).serial_number in revoked
