"""Node identities: which certificates count, and signatures made and checked with node keys.

    operator (holds the CA key)          node (holds only its own key)          anyone verifying
    ───────────────────────────          ─────────────────────────────          ────────────────
    ca.pem, crl.pem  ─────────────────►  NodeSigner(cert, key)                  TrustAnchor(ca.pem, crl.pem)
    <node>.pem/.key  ─────────────────►    .sign(message) → signature  ───────►   .identity(cert_der) → NodeIdentity
                                                                                    .verify(signature, message)

A `TrustAnchor` is the cluster CA certificate plus its revocation list: a node certificate counts
only if the CA signed it, it is within its validity, it is a node certificate (not a CA, a DNS SAN
naming the node) and its serial is not revoked. A `NodeIdentity` is what such a certificate
proves: the node's name, the names and addresses it may advertise (SANs), its public key, and
the tenants it is restricted to (URI SANs `kvfabric-tenant:NAME`; none: it serves every tenant).

A node signs with the private key of its own certificate, so the key that signs a block or a
directory report is bound to the node's name by the CA's signature, and nothing else needs to be
distributed. Signatures use ECDSA / SHA-256, Ed25519 or RSA-PSS / SHA-256, whichever key the certificate has.

Checking a certificate chain costs an ECDSA verification; `TrustAnchor.identity` caches results
by the certificate's bytes (bounded), so a steady stream of signatures from the same producers
costs one signature check each.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from transports.core.errors import TrustError
from transports.trust.certs import CRL, TENANT_URI_PREFIX, CertificateError, node_name_of, revoked_serials

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey
PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey
# RSA keys (what some issuers hand out by default) sign with PSS: randomised, no PKCS#1 v1.5 pitfalls.
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)


class IdentityError(TrustError):
    """A certificate that does not prove a node identity; `reason` is a short metrics label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What a verified node certificate proves."""

    node: str
    names: frozenset[str]            # every DNS and IP SAN: the addresses the node may advertise
    serial: int
    public_key: PublicKey
    cert_der: bytes
    tenants: frozenset[str] = frozenset()   # the tenants the node is restricted to (none: every tenant)

    def may_advertise(self, host: str) -> bool:
        """True when `host` (a DNS name or an IP address) is one of the certificate's SANs."""
        try:
            return str(ipaddress.ip_address(host)) in self.names
        except ValueError:
            return host.lower() in self.names

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True when `signature` over `message` was made with this node's key."""
        return verify_signature(self.public_key, signature, message)


def verify_signature(key: PublicKey, signature: bytes, message: bytes) -> bool:
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, message)
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, message, _PSS, hashes.SHA256())
        else:
            key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


class TrustAnchor:
    """The cluster CA and its revocation list: decides which node certificates count."""

    def __init__(self, ca_cert: x509.Certificate, revoked: frozenset[int] = frozenset(), *,
                 cache_size: int = 4096) -> None:
        self.ca_cert = ca_cert
        self.revoked = revoked
        # certificate bytes -> (identity, not valid before, not valid after)
        self._cache: OrderedDict[bytes, tuple[NodeIdentity, dt.datetime, dt.datetime]] = OrderedDict()
        self._cache_size = cache_size

    @classmethod
    def from_files(cls, ca_path: str | Path, crl_path: str | Path | None = None) -> TrustAnchor:
        """Load `ca.pem` and, when it exists, the CA-signed revocation list beside it (`crl.pem`)."""
        ca = Path(ca_path)
        ca_cert = read_ca_cert(ca)
        crl = Path(crl_path) if crl_path is not None else ca.with_name(CRL)
        return cls(ca_cert, load_revoked(crl, ca_cert) if crl.is_file() else frozenset())

    def with_revoked(self, revoked: frozenset[int]) -> TrustAnchor:
        return TrustAnchor(self.ca_cert, self.revoked | revoked, cache_size=self._cache_size)

    def identity(self, cert: bytes | x509.Certificate, now: dt.datetime | None = None) -> NodeIdentity:
        """The identity `cert` (DER, PEM or parsed) proves; raises `IdentityError` if it proves none."""
        der = cert.public_bytes(serialization.Encoding.DER) if isinstance(cert, x509.Certificate) else _to_der(cert)
        when = now or dt.datetime.now(dt.UTC)
        found = self._cache.get(der)
        if found is None:
            found = self._check(der)
            self._cache[der] = found
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(der)
        ident, not_before, not_after = found
        if not not_before <= when <= not_after:
            raise IdentityError("expired", f"certificate of node {ident.node} is not valid now")
        if ident.serial in self.revoked:
            raise IdentityError("revoked", f"certificate of node {ident.node} (serial {ident.serial:x}) is revoked")
        return ident

    def _check(self, der: bytes) -> tuple[NodeIdentity, dt.datetime, dt.datetime]:
        try:
            cert = x509.load_der_x509_certificate(der)
        except ValueError as e:
            raise IdentityError("malformed", f"not an X.509 certificate: {e}") from None
        try:
            cert.verify_directly_issued_by(self.ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise IdentityError("untrusted", "certificate was not issued by the cluster CA") from None
        try:
            node = node_name_of(cert)
        except CertificateError as e:
            raise IdentityError("not_a_node", str(e)) from None
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey):
            raise IdentityError("not_a_node", f"node {node}'s certificate has an unsupported key type")
        ident = NodeIdentity(node, _sans(cert), cert.serial_number, key, der, _tenants(cert))
        return ident, cert.not_valid_before_utc, cert.not_valid_after_utc


class NodeSigner:
    """Signs with a node's own certificate key (the key never leaves the node)."""

    def __init__(self, cert_path: str | Path, key_path: str | Path) -> None:
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except (OSError, ValueError) as e:
            raise CertificateError(f"cannot read node credentials {cert_path}, {key_path}: {e}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey):
            raise CertificateError(f"{key_path} is not an EC, Ed25519 or RSA private key")
        if key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo) != \
                cert.public_key().public_bytes(serialization.Encoding.DER,
                                               serialization.PublicFormat.SubjectPublicKeyInfo):
            raise CertificateError(f"{key_path} is not the key of {cert_path}")
        self.node = node_name_of(cert)
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self._key: PrivateKey = key

    def sign(self, message: bytes) -> bytes:
        return sign_with(self._key, message)


def sign_with(key: PrivateKey, message: bytes) -> bytes:
    """`message` signed with `key` by the scheme its type implies (what `verify_signature` checks)."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(message)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(message, _PSS, hashes.SHA256())
    return key.sign(message, ec.ECDSA(hashes.SHA256()))


def read_ca_cert(ca_path: Path) -> x509.Certificate:
    """The cluster CA certificate at `ca_path`; CertificateError when it cannot be read."""
    try:
        return x509.load_pem_x509_certificate(ca_path.read_bytes())
    except (OSError, ValueError) as e:
        raise CertificateError(f"cannot read the cluster CA certificate {ca_path}: {e}") from None


def load_revoked(crl_path: str | Path, ca_cert: x509.Certificate) -> frozenset[int]:
    """Serials revoked by the CA-signed CRL at `crl_path`; a CRL the CA did not sign is refused."""
    try:
        data = Path(crl_path).read_bytes()
    except OSError as e:
        raise CertificateError(f"cannot read the revocation list {crl_path}: {e}") from None
    return revoked_serials(data, ca_cert, f"the revocation list {crl_path}")


def _to_der(cert: bytes) -> bytes:
    if cert.startswith(b"-----BEGIN"):
        try:
            return x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)
        except ValueError as e:
            raise IdentityError("malformed", f"not a PEM certificate: {e}") from None
    return cert


def _tenants(cert: x509.Certificate) -> frozenset[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return frozenset(u[len(TENANT_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                     if u.startswith(TENANT_URI_PREFIX))


def _sans(cert: x509.Certificate) -> frozenset[str]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = {n.lower() for n in san.get_values_for_type(x509.DNSName)}
    names |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return frozenset(names)
