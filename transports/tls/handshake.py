"""Mutual TLS 1.3 on a non-blocking socket, on the asyncio event loop: dial (`open_tls`) and accept
(`accept_tls`) with node certificates from the cluster CA (the client checks that the server's SAN
names the dialled node), the node name a verified peer certificate carries, why a handshake failed
(a metric label), and small control messages over the finished connection (`tls_send_all`,
`tls_recv`, for the RDMA control channel). A connection is a `transports.tls.channel.TlsChannel`
(OpenSSL over memory BIOs); bulk frames go over `transports.tls.link.TlsLink`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

from cryptography import x509

from transports.core.base import Peer
from transports.tls.channel import HANDSHAKE_READ, TlsChannel
from transports.trust.certs import CertificateError, NodeCredentials, node_name_of
from transports.trust.tenant_tokens import tenant_names

__all__ = ["accept_tls", "auth_failure_reason", "open_tls", "peer_node", "peer_tenants", "tls_recv", "tls_send_all"]


async def tls_send_all(channel: TlsChannel, data: bytes) -> None:
    """Send all of `data` over a finished TLS connection (small control messages, not bulk frames)."""
    await channel.send_all(data)


async def tls_recv(channel: TlsChannel, max_bytes: int = HANDSHAKE_READ) -> bytes:
    """Some bytes from a finished TLS connection; b"" when the peer closed the connection."""
    return await channel.recv_some(max_bytes)


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


def peer_node(channel: TlsChannel) -> str:
    """The node name in the verified peer certificate of a completed handshake."""
    return node_name_of(_peer_certificate(channel))


def peer_tenants(channel: TlsChannel) -> frozenset[str]:
    """The tenants the verified peer certificate restricts its node to (empty: every tenant)."""
    return frozenset(tenant_names(_peer_certificate(channel)))


def _peer_certificate(channel: TlsChannel) -> x509.Certificate:
    der = channel.getpeercert(binary_form=True)
    if der is None:
        raise CertificateError("peer presented no certificate")
    return x509.load_der_x509_certificate(der)


async def open_tls(peer: Peer, credentials: NodeCredentials, timeout_s: float) -> TlsChannel:
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
            channel = TlsChannel(raw, credentials.ssl_context(server=False), server_side=False,
                                 server_hostname=peer.node)
            await channel.handshake()
        return channel
    except BaseException:
        raw.close()
        raise


async def accept_tls(raw: socket.socket, credentials: NodeCredentials, timeout_s: float) -> TlsChannel:
    """Server side of `open_tls`: the client must present a certificate from the cluster CA."""
    raw.setblocking(False)
    try:
        _tune(raw)
        # A fresh context per connection picks up rotated certificates; open connections keep theirs.
        channel = TlsChannel(raw, credentials.ssl_context(server=True), server_side=True)
        async with asyncio.timeout(timeout_s):
            await channel.handshake()
    except BaseException:
        raw.close()
        raise
    return channel
