"""Mutual TLS 1.3 on a non-blocking socket, on the asyncio event loop: dial (`open_tls`) and accept
(`accept_tls`) with node certificates from the cluster CA (the client checks that the server's SAN
names the dialled node), the node name a verified peer certificate carries, why a handshake failed
(a metric label), and small control messages over the finished connection (`tls_send_all`,
`tls_recv`, for the RDMA control channel). Bulk frames go over `transports.tls.link.TlsLink`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from cryptography import x509

from transports.core.base import Peer
from transports.core.certs import CertificateError, NodeCredentials, node_name_of
from transports.core.tenant_tokens import tenant_names

__all__ = ["accept_tls", "auth_failure_reason", "open_tls", "peer_node", "peer_tenants", "tls_recv", "tls_send_all"]


async def _wait_fd(sock: socket.socket, writable: bool) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    fd = sock.fileno()

    def ready() -> None:
        if not fut.done():
            fut.set_result(None)

    if writable:
        loop.add_writer(fd, ready)
    else:
        loop.add_reader(fd, ready)
    try:
        await fut
    finally:
        (loop.remove_writer if writable else loop.remove_reader)(fd)


async def _tls_handshake(sock: ssl.SSLSocket) -> None:
    while True:
        try:
            sock.do_handshake()
            return
        except ssl.SSLWantReadError:
            await _wait_fd(sock, writable=False)
        except ssl.SSLWantWriteError:
            await _wait_fd(sock, writable=True)


async def tls_send_all(sock: ssl.SSLSocket, data: bytes) -> None:
    """Send all of `data` on a non-blocking SSLSocket (small control messages, not bulk frames)."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except ssl.SSLWantWriteError:
            await _wait_fd(sock, writable=True)
        except ssl.SSLWantReadError:
            await _wait_fd(sock, writable=False)


async def tls_recv(sock: ssl.SSLSocket, max_bytes: int = 65536) -> bytes:
    """Some bytes from a non-blocking SSLSocket; b"" when the peer closed the connection."""
    while True:
        try:
            return sock.recv(max_bytes)
        except ssl.SSLWantReadError:
            await _wait_fd(sock, writable=False)
        except ssl.SSLWantWriteError:
            await _wait_fd(sock, writable=True)


def _tune(sock: socket.socket) -> None:
    # Socket buffer sizes are left to TCP autotuning: setting SO_SNDBUF / SO_RCVBUF switches it
    # off and is capped by net.core.[wr]mem_max (208 KiB by default).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def auth_failure_reason(err: ssl.SSLError) -> str:
    """A short metric label for why a TLS handshake failed: our own verification of the peer's
    certificate, or the alert with which the peer refused ours."""
    if isinstance(err, ssl.SSLCertVerificationError):
        if err.verify_code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
            return "expired"
        if err.verify_code == 62:  # X509_V_ERR_HOSTNAME_MISMATCH
            return "wrong_name"
        if err.verify_code == 23:  # X509_V_ERR_CERT_REVOKED: on the CA's revocation list (crl.pem)
            return "revoked"
        if err.verify_code == 12:  # X509_V_ERR_CRL_HAS_EXPIRED: the operator must publish a fresh crl.pem
            return "crl_expired"
        return "untrusted"
    text = f"{err.reason or ''} {err}".upper()
    for needles, reason in ((("NO_CERTIFICATE", "DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_REQUIRED"),
                             "no_certificate"),
                            (("CERTIFICATE_EXPIRED",), "expired"),
                            (("CERTIFICATE_REVOKED",), "revoked"),
                            # a certificate whose key is not the one that signed the handshake
                            (("KEY_VALUES_MISMATCH", "BAD_SIGNATURE", "DECRYPT_ERROR"), "key_mismatch"),
                            (("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN", "UNSUPPORTED_CERTIFICATE"),
                             "untrusted")):
        if any(n in text for n in needles):
            return reason
    return "handshake"


def peer_node(sock: ssl.SSLSocket) -> str:
    """The node name in the verified peer certificate of a completed handshake."""
    return node_name_of(_peer_certificate(sock))


def peer_tenants(sock: ssl.SSLSocket) -> frozenset[str]:
    """The tenants the verified peer certificate restricts its node to (empty: every tenant)."""
    return frozenset(tenant_names(_peer_certificate(sock)))


def _peer_certificate(sock: ssl.SSLSocket) -> x509.Certificate:
    der = sock.getpeercert(binary_form=True)
    if der is None:
        raise CertificateError("peer presented no certificate")
    return x509.load_der_x509_certificate(der)


async def open_tls(peer: Peer, credentials: NodeCredentials, timeout_s: float) -> ssl.SSLSocket:
    """Dial `peer` and finish a mutual TLS 1.3 handshake; the server's SAN must name `peer.node`.

    Raises OSError (unreachable), TimeoutError, or ssl.SSLError (refused certificate)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(peer.host, peer.port, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    raw = socket.socket(family, socket.SOCK_STREAM)
    raw.setblocking(False)
    try:
        _tune(raw)
        async with asyncio.timeout(timeout_s):
            await loop.sock_connect(raw, addr)
            sock = credentials.ssl_context(server=False).wrap_socket(
                raw, server_hostname=peer.node, do_handshake_on_connect=False)
            try:
                await _tls_handshake(sock)
            except BaseException:
                sock.close()
                raise
        return sock
    except BaseException:
        raw.close()
        raise


async def accept_tls(raw: socket.socket, credentials: NodeCredentials, timeout_s: float) -> ssl.SSLSocket:
    """Server side of `open_tls`: the client must present a certificate from the cluster CA."""
    raw.setblocking(False)
    _tune(raw)
    # A fresh context per connection picks up rotated certificates; open connections keep theirs.
    sock = credentials.ssl_context(server=True).wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
    try:
        async with asyncio.timeout(timeout_s):
            await _tls_handshake(sock)
    except BaseException:
        sock.close()
        raise
    return sock
