"""Which client certificates a kvfabric server accepts (pure: certificates and `now` in, a node name out).

Used by the QUIC backends whose TLS stack leaves client authentication to us (qh3). A node
certificate is accepted when it is within its validity period, signed directly by a cluster CA in
`cluster_ca` (PEM, one or more), not revoked, not a CA certificate, names its node in a DNS SAN and
may be used for client authentication. Each refusal names its `AuthFailure`.
"""

from __future__ import annotations

import enum

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from transports.core.errors import TrustError
from transports.trust.certs import CertificateError, node_name_of


class AuthFailure(enum.StrEnum):
    """Why a server refused a client (the `reason` label of auth_failures_total)."""

    NO_CERTIFICATE = "no_certificate"
    EXPIRED = "expired"
    REVOKED = "revoked"              # on the cluster CA's revocation list (crl.pem)
    UNTRUSTED = "untrusted"          # chain does not lead to the cluster CA
    NOT_A_NODE = "not_a_node"        # no DNS SAN, or not valid for client authentication
    HANDSHAKE = "handshake"          # any other TLS failure (bad signature, no common ALPN, ...)


class ClientRefused(TrustError):
    """A client certificate kvfabric does not accept; `reason` says why."""

    def __init__(self, reason: AuthFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def client_auth_allowed(cert: x509.Certificate) -> bool:
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # no extended key usage: valid for every purpose
    return ExtendedKeyUsageOID.CLIENT_AUTH in usage


def _issued_by_cluster(cert: x509.Certificate, cas: list[x509.Certificate]) -> bool:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def check_client_certificate(cert: x509.Certificate, chain: list[x509.Certificate], cluster_ca: bytes,
                             revoked: frozenset[int], now: float) -> str:
    """The node name `cert` authenticates, or `ClientRefused`. `chain` (intermediates a client sent)
    is ignored: node certificates are issued by the cluster CA itself, never through another CA."""
    if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
        raise ClientRefused(AuthFailure.EXPIRED, "client certificate is expired or not yet valid")
    try:
        cas = x509.load_pem_x509_certificates(cluster_ca)
    except ValueError:
        raise ClientRefused(AuthFailure.UNTRUSTED, "the cluster CA file holds no certificate") from None
    if not _issued_by_cluster(cert, cas):
        raise ClientRefused(AuthFailure.UNTRUSTED, "client certificate is not issued by the cluster CA")
    if cert.serial_number in revoked:
        raise ClientRefused(AuthFailure.REVOKED, "client certificate revoked by the cluster CA")
    try:
        node = node_name_of(cert)
    except CertificateError as e:
        raise ClientRefused(AuthFailure.NOT_A_NODE, str(e)) from None
    if not client_auth_allowed(cert):
        raise ClientRefused(AuthFailure.NOT_A_NODE, "certificate is not valid for client authentication")
    return node
