"""Tenant credentials and the short-lived tokens a client proves its tenant with.

    operator (CA key)                 client (tenant key)                    NodeActor (ca.pem, crl.pem)
    ─────────────────                 ───────────────────                    ───────────────────────────
    certs.issue_tenant(NAME) ──────►  TenantMinter(cert, key)
      <NAME>.tenant.pem / .key          .token(now) → token bytes  ───────►  TenantVerifier(anchor)
                                                                               .verify(token, now) → NAME

A tenant certificate is signed by the cluster CA and names its tenant in a URI SAN
`kvfabric-tenant:NAME`; it has no DNS or IP SAN, so it never proves a node identity, and a node
certificate (which has a DNS SAN) is never accepted as a tenant credential. A node certificate may
carry the same URI SANs as a restriction: the node serves only those tenants (`tenants_of_node`).

Token (msgpack array; the signature covers the canonical message below, nothing process-dependent)::

    [version, tenant certificate (DER), issued at (unix ms), expires at (unix ms), signature]
    message = DOMAIN || issued (i64 LE) || expires (i64 LE) || BLAKE3(certificate DER)

An operator credential (`certs.issue_operator`, URI SAN `kvfabric-operator:NAME`) makes tokens the
same way; a verifier tells the two apart by the certificate (`Principal.operator`), so a tenant's
token never proves an operator and an operator's never proves a tenant.

A token is a bearer credential for its lifetime (at most `MAX_TTL_S`): it is not bound to one call.
Verifying costs a certificate check and a signature check; results are cached by the token's bytes
(bounded), so a client that reuses its token pays them once. Revocation is checked on every call.
"""

from __future__ import annotations

import os
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3
import msgpack
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from transports.core.errors import TrustError
from transports.trust.certs import OPERATOR_URI_PREFIX, TENANT_URI_PREFIX, CertificateError
from transports.trust.identity import PrivateKey, PublicKey, TrustAnchor, sign_with, verify_signature

DOMAIN = b"kvfabric/tenant-token/v1\0"
TOKEN_VERSION = 1
MAX_TTL_S = 3600.0            # a verifier refuses tokens meant to live longer than this
CLOCK_SKEW_S = 60.0           # issued this far in the future still counts (clocks differ)
MAX_TOKEN_BYTES = 32 * 1024
_TIMES = struct.Struct("<qq")


class TenantError(TrustError):
    """A token that proves no tenant; `reason` is the metrics label (kvfabric_tenant_refusals_total)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class TenantToken:
    cert_der: bytes
    issued_ms: int
    expires_ms: int
    signature: bytes

    def message(self) -> bytes:
        return DOMAIN + _TIMES.pack(self.issued_ms, self.expires_ms) + blake3.blake3(self.cert_der).digest()

    def encode(self) -> bytes:
        return msgpack.packb([TOKEN_VERSION, self.cert_der, self.issued_ms, self.expires_ms, self.signature],
                             use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> TenantToken:
        """Parse a token; raises TenantError("malformed") saying what is wrong."""
        if not isinstance(raw, bytes) or len(raw) > MAX_TOKEN_BYTES:
            raise TenantError("malformed", f"a tenant token is at most {MAX_TOKEN_BYTES} bytes")
        try:
            fields = msgpack.unpackb(raw, raw=False)
        except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:
            raise TenantError("malformed", f"tenant token is not msgpack: {e}") from None
        if not isinstance(fields, list) or len(fields) != 5 or fields[0] != TOKEN_VERSION:
            raise TenantError("malformed", f"not a version-{TOKEN_VERSION} tenant token")
        _, cert_der, issued, expires, signature = fields
        if not (isinstance(cert_der, bytes) and isinstance(signature, bytes)
                and type(issued) is int and type(expires) is int):
            raise TenantError("malformed", "tenant token fields have the wrong types")
        if not (0 <= issued < 2**63 and 0 <= expires < 2**63):
            raise TenantError("malformed", "tenant token times out of range")
        return cls(cert_der, issued, expires, signature)


def tenant_names(cert: x509.Certificate) -> list[str]:
    """The tenants a certificate names in its `kvfabric-tenant:` URI SANs (none: an empty list)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [u[len(TENANT_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
            if u.startswith(TENANT_URI_PREFIX)]


def tenants_of_node(cert_pem_or_der: bytes) -> frozenset[str]:
    """The tenants a node certificate restricts its node to (empty: it serves every tenant)."""
    if cert_pem_or_der.startswith(b"-----BEGIN"):
        cert = x509.load_pem_x509_certificate(cert_pem_or_der)
    else:
        cert = x509.load_der_x509_certificate(cert_pem_or_der)
    return frozenset(tenant_names(cert))


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a verified token speaks for: a tenant, or (`operator`) the cluster's operator."""

    name: str
    operator: bool = False


def tenant_of(cert: x509.Certificate) -> str:
    """The tenant a tenant certificate names; raises TenantError("not_a_tenant") for any other
    certificate (a CA, a node certificate, an operator's, one naming no tenant or several)."""
    principal = principal_of(cert)
    if principal.operator:
        raise TenantError("not_a_tenant", "an operator credential is not a tenant credential")
    return principal.name


def principal_of(cert: x509.Certificate) -> Principal:
    """The tenant or operator a credential certificate names; raises TenantError("not_a_tenant")
    for any other certificate (a CA, a node certificate, one naming none, several, or both kinds)."""
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise TenantError("not_a_tenant", "a CA certificate is not a tenant credential")
    except x509.ExtensionNotFound:
        pass
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise TenantError("not_a_tenant", "certificate has no subjectAltName; not a tenant credential") from None
    if san.get_values_for_type(x509.DNSName) or san.get_values_for_type(x509.IPAddress):
        raise TenantError("not_a_tenant", "a node certificate is not a tenant credential")
    names = tenant_names(cert)
    operators = [u[len(OPERATOR_URI_PREFIX):] for u in san.get_values_for_type(x509.UniformResourceIdentifier)
                 if u.startswith(OPERATOR_URI_PREFIX)]
    if len(operators) == 1 and operators[0] and not names:
        return Principal(operators[0], operator=True)
    if len(names) != 1 or not names[0] or operators:
        raise TenantError("not_a_tenant", f"a tenant certificate names exactly one tenant, this one {names}"
                                          + (f" and operators {operators}" if operators else ""))
    return Principal(names[0])


class TenantMinter:
    """Makes tokens from a tenant's (or the operator's) certificate and key (the client side); reuses
    a token until half of its lifetime has passed."""

    def __init__(self, cert_path: str | os.PathLike[str], key_path: str | os.PathLike[str], *,
                 ttl_s: float = 300.0) -> None:
        if not 0 < ttl_s <= MAX_TTL_S:
            raise ValueError(f"tenant token lifetime must be in (0, {MAX_TTL_S:g}] s, got {ttl_s}")
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except (OSError, ValueError) as e:
            raise CertificateError(f"cannot read tenant credentials {cert_path}, {key_path}: {e}") from None
        if not isinstance(key, PrivateKey):
            raise CertificateError(f"{key_path} is not an EC, Ed25519 or RSA private key")
        spki = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(serialization.Encoding.DER, spki) != \
                cert.public_key().public_bytes(serialization.Encoding.DER, spki):
            raise CertificateError(f"{key_path} is not the key of {cert_path}")
        try:
            self.principal = principal_of(cert)
        except TenantError as e:
            raise CertificateError(f"{cert_path}: {e}") from None
        self.tenant = self.principal.name   # the operator's name for an operator credential
        self.cert_der = cert.public_bytes(serialization.Encoding.DER)
        self.ttl_s = ttl_s
        self._key: PrivateKey = key
        self._token: tuple[bytes, float] | None = None   # (token, renew after, unix s)

    def token(self, now: float) -> bytes:
        """A token valid at `now` (unix seconds) for at least half its lifetime."""
        if self._token is not None and now < self._token[1]:
            return self._token[0]
        issued = int(now * 1000)
        unsigned = TenantToken(self.cert_der, issued, issued + int(self.ttl_s * 1000), b"")
        raw = TenantToken(self.cert_der, issued, unsigned.expires_ms, sign_with(self._key, unsigned.message())
                          ).encode()
        self._token = (raw, now + self.ttl_s / 2)
        return raw


@dataclass(frozen=True, slots=True)
class _Checked:
    principal: Principal
    serial: int
    not_after_ms: int    # the earlier of the token's expiry and the certificate's


class TenantVerifier:
    """Decides which tokens prove a tenant: CA-issued tenant certificate, not revoked, valid now,
    token within its lifetime and signed by the certificate's key."""

    def __init__(self, trust: TrustAnchor, *, cache_size: int = 4096) -> None:
        self.trust = trust   # replaced when the revocation list changes
        self._cache: OrderedDict[bytes, _Checked] = OrderedDict()
        self._cache_size = cache_size

    def verify(self, raw: bytes, now: float) -> str:
        """The tenant `raw` proves at `now` (unix seconds); raises TenantError saying why not (an
        operator's token: "not_a_tenant")."""
        principal = self.verify_principal(raw, now)
        if principal.operator:
            raise TenantError("not_a_tenant", "an operator token is not a tenant's")
        return principal.name

    def verify_principal(self, raw: bytes, now: float) -> Principal:
        """The tenant or operator `raw` proves at `now` (unix seconds); raises TenantError saying why not."""
        now_ms = int(now * 1000)
        checked = self._cache.get(raw) if isinstance(raw, bytes) else None
        if checked is None:
            checked = self._check(raw, now_ms)
            self._cache[raw] = checked
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(raw)
        who = _who(checked.principal)
        if now_ms > checked.not_after_ms:
            raise TenantError("expired", f"the token of {who} has expired")
        if checked.serial in self.trust.revoked:
            raise TenantError("revoked", f"the certificate of {who} (serial {checked.serial:x}) is revoked")
        return checked.principal

    def _check(self, raw: bytes, now_ms: int) -> _Checked:
        token = TenantToken.decode(raw)
        try:
            cert = x509.load_der_x509_certificate(token.cert_der)
        except ValueError as e:
            raise TenantError("malformed", f"tenant token carries no X.509 certificate: {e}") from None
        try:
            cert.verify_directly_issued_by(self.trust.ca_cert)
        except (ValueError, TypeError, InvalidSignature):
            raise TenantError("untrusted", "tenant certificate was not issued by the cluster CA") from None
        principal = principal_of(cert)
        tenant = _who(principal)
        key = cert.public_key()
        if not isinstance(key, PublicKey) or not verify_signature(key, token.signature, token.message()):
            raise TenantError("bad_signature", f"the token of {tenant} is not signed by its certificate's key")
        if token.expires_ms - token.issued_ms > MAX_TTL_S * 1000 or token.expires_ms <= token.issued_ms:
            raise TenantError("expired", f"the token of {tenant} claims a lifetime over {MAX_TTL_S:g} s")
        if token.issued_ms > now_ms + CLOCK_SKEW_S * 1000:
            raise TenantError("expired", f"the token of {tenant} is issued in the future")
        cert_start = int(cert.not_valid_before_utc.timestamp() * 1000)
        if now_ms < cert_start:
            raise TenantError("expired", f"the certificate of {tenant} is not valid yet")
        cert_end = int(cert.not_valid_after_utc.timestamp() * 1000)
        return _Checked(principal, cert.serial_number, min(token.expires_ms, cert_end))


def _who(principal: Principal) -> str:
    return f"operator {principal.name}" if principal.operator else f"tenant {principal.name}"


def pull_authoriser(tenant_roots: Callable[[bytes], frozenset[str] | None] | None, peer_tenants: frozenset[str]
                    ) -> Callable[[bytes], bool] | None:
    """What a serving node lets a peer read, by namespace root: a peer whose certificate names no
    tenant serves every tenant and reads every root (None: no check); a peer restricted to tenants
    reads a root only when the root is bound here to one of them. A root this node has not bound
    (since it started), the anonymous tenant's root, and every root on a node that does not know its
    roots (`tenant_roots` None) are refused to a restricted peer: refusing costs a miss, serving
    would cost another tenant's blocks."""
    if not peer_tenants:
        return None

    def authorise(root: bytes) -> bool:
        tenants = tenant_roots(root) if tenant_roots is not None else None
        return bool(tenants and tenants & peer_tenants)

    return authorise
