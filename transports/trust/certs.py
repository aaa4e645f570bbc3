"""Cluster certificates: one CA per cluster, one certificate per node.

    <dir>/ca.pem, ca.key            cluster CA (EC P-256, self-signed, pathlen 0)
    <dir>/<node>.pem, <node>.key    node certificate; its DNS SAN is the node name
    <dir>/crl.pem                   revocation list signed by the CA (`revoke`), when any
    <dir>/<name>.tenant.pem, .key   tenant credential (`issue_tenant`): URI SAN kvfabric-tenant:<name>
    <dir>/<name>.operator.pem, .key operator credential (`issue_operator`): URI SAN kvfabric-operator:<name>

A node's identity is the DNS name in its certificate's SAN. Node certificates carry both the
serverAuth and clientAuth usages because every node dials and answers. Private keys are written
with mode 0600. `NodeCredentials` notices when the files change (rotation) so new connections
use the new certificate while open connections carry on with the old one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import logging
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from transports.core.errors import TrustError

logger = logging.getLogger(__name__)

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
CRL = "crl.pem"   # the CA's revocation list, read by every node beside ca.pem
TENANT_URI_PREFIX = "kvfabric-tenant:"   # a URI SAN naming a tenant (transports/trust/tenant_tokens.py)
TENANT_SUFFIX = ".tenant"                # <name>.tenant.pem / .key: a tenant credential
OPERATOR_URI_PREFIX = "kvfabric-operator:"   # a URI SAN naming an operator: node-wide calls (purge, stats)
OPERATOR_SUFFIX = ".operator"            # <name>.operator.pem / .key: an operator credential


class CertificateError(TrustError):
    """Certificate material is missing, unreadable or does not fit the cluster CA."""


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _write(path: Path, data: bytes, private: bool) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def init_ca(cert_dir: str | os.PathLike[str], name: str = "kvfabric cluster CA", days: int = 3650,
            overwrite: bool = False) -> Path:
    """Create the cluster CA in `cert_dir`; refuses to replace an existing one unless `overwrite`."""
    d = Path(cert_dir)
    d.mkdir(parents=True, exist_ok=True)
    if (d / CA_CERT).exists() and not overwrite:
        raise CertificateError(f"{d / CA_CERT} already exists; a new CA would orphan every node certificate")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(d / CA_KEY, _key_pem(key), private=True)
    _write(d / CA_CERT, cert.public_bytes(serialization.Encoding.PEM), private=False)
    logger.info("created cluster CA in %s", d)
    return d / CA_CERT


def issue_node(cert_dir: str | os.PathLike[str], node: str, days: int = 365,
               not_before: dt.datetime | None = None, extra_sans: tuple[str, ...] = (),
               tenants: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """Issue `<node>.pem` / `<node>.key` signed by the CA in `cert_dir`. Returns (cert, key) paths.
    `tenants` restricts the node to serving those tenants (URI SANs `kvfabric-tenant:NAME`)."""
    d = Path(cert_dir)
    if not node or "/" in node or node.startswith("."):
        raise CertificateError(f"invalid node name {node!r}")
    ca_cert, ca_key = _load_ca(d)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (_now() - dt.timedelta(minutes=5))
    sans: list[x509.GeneralName] = [x509.DNSName(node)]
    for extra in extra_sans:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(extra)))
        except ValueError:
            sans.append(x509.DNSName(extra))
    sans += [x509.UniformResourceIdentifier(TENANT_URI_PREFIX + _tenant_name(t)) for t in tenants]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = d / f"{node}.pem", d / f"{node}.key"
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    logger.info("issued certificate for node %s in %s", node, d)
    return cert_path, key_path


def issue_tenant(cert_dir: str | os.PathLike[str], tenant: str, days: int = 365,
                 not_before: dt.datetime | None = None, out_dir: str | os.PathLike[str] | None = None
                 ) -> tuple[Path, Path]:
    """Issue a tenant credential `<tenant>.tenant.pem` / `.key` (in `out_dir`, default `cert_dir`)
    signed by the CA in `cert_dir`: its only SAN is the URI `kvfabric-tenant:<tenant>`, so it never
    proves a node identity (transports/trust/tenant_tokens.py). Returns (cert, key) paths."""
    return _issue_credential(cert_dir, "tenant", tenant, days, not_before, out_dir)


def issue_operator(cert_dir: str | os.PathLike[str], name: str = "operator", days: int = 365,
                   not_before: dt.datetime | None = None, out_dir: str | os.PathLike[str] | None = None
                   ) -> tuple[Path, Path]:
    """Issue an operator credential `<name>.operator.pem` / `.key`, as `issue_tenant` does a tenant's:
    its only SAN is the URI `kvfabric-operator:<name>`. It proves the caller of node-wide calls
    (purge, send rate, node-wide listings and stats; docs/tenants.md), never a tenant or a node."""
    return _issue_credential(cert_dir, "operator", name, days, not_before, out_dir)


def _issue_credential(cert_dir: str | os.PathLike[str], kind: str, holder: str, days: int,
                      not_before: dt.datetime | None, out_dir: str | os.PathLike[str] | None) -> tuple[Path, Path]:
    prefix, suffix = (TENANT_URI_PREFIX, TENANT_SUFFIX) if kind == "tenant" else (OPERATOR_URI_PREFIX,
                                                                                  OPERATOR_SUFFIX)
    d = Path(cert_dir)
    name = _tenant_name(holder, kind)
    ca_cert, ca_key = _load_ca(d)
    key = ec.generate_private_key(ec.SECP256R1())
    start = not_before or (_now() - dt.timedelta(minutes=5))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvfabric {kind} {name}")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(prefix + name)]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    out = Path(out_dir) if out_dir is not None else d
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / f"{name}{suffix}.pem", out / f"{name}{suffix}.key"
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), private=False)
    logger.info("issued credential for %s %s in %s", kind, name, out)
    return cert_path, key_path


def _tenant_name(tenant: str, kind: str = "tenant") -> str:
    if not tenant or not all(c.isalnum() or c in "-_." for c in tenant) or tenant.startswith("."):
        raise CertificateError(f"invalid {kind} name {tenant!r}: letters, digits, '-', '_' and '.' only")
    return tenant


def _load_ca(d: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        ca_cert = x509.load_pem_x509_certificate((d / CA_CERT).read_bytes())
        ca_key = serialization.load_pem_private_key((d / CA_KEY).read_bytes(), password=None)
    except FileNotFoundError as e:
        raise CertificateError(f"no cluster CA in {d} ({e.filename} missing); "
                               "run `kvfabric certs init` first") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise CertificateError(f"{d / CA_KEY} is not an EC private key")
    return ca_cert, ca_key


def revoke(cert_dir: str | os.PathLike[str], serials: set[int], days: int = 30) -> Path:
    """Add `serials` to the CA's revocation list `<cert_dir>/crl.pem` (signed with the CA key, so
    only the operator can write it) and return its path. Earlier revocations are kept."""
    d = Path(cert_dir)
    ca_cert, ca_key = _load_ca(d)
    crl_path = d / CRL
    revoked: set[int] = set(serials)
    if crl_path.exists():
        revoked |= {r.serial_number for r in x509.load_pem_x509_crl(crl_path.read_bytes())}
    now = _now()
    builder = (x509.CertificateRevocationListBuilder().issuer_name(ca_cert.subject)
               .last_update(now - dt.timedelta(minutes=5)).next_update(now + dt.timedelta(days=days)))
    for serial in sorted(revoked):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build())
    crl = builder.sign(ca_key, hashes.SHA256())
    _write(crl_path, crl.public_bytes(serialization.Encoding.PEM), private=False)
    logger.info("revocation list %s now names %d certificate(s)", crl_path, len(revoked))
    return crl_path


def _next_update(crl_pem: bytes) -> float | None:
    """The nextUpdate (unix s) of a revocation list; None where it names none."""
    next_update = x509.load_pem_x509_crl(crl_pem).next_update_utc
    return None if next_update is None else next_update.timestamp()


def file_stamp(path: Path) -> tuple[int, int, int]:
    """What changes whenever `path` is replaced or rewritten: (mtime ns, size, inode). The one change
    rule for the credential files and the revocation list (`revocation.RevocationFile`)."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def revoked_serials(crl_pem: bytes, ca_cert: x509.Certificate, where: str = "the revocation list") -> frozenset[int]:
    """Serials revoked by a CA-signed CRL (PEM); raises CertificateError if the CA did not sign it."""
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
    except ValueError as e:
        raise CertificateError(f"cannot read {where}: {e}") from None
    ca_key = ca_cert.public_key()
    if not isinstance(ca_key, ec.EllipticCurvePublicKey) or not crl.is_signature_valid(ca_key):
        raise CertificateError(f"{where} is not signed by the cluster CA")
    return frozenset(r.serial_number for r in crl)


def node_name_of(cert: x509.Certificate) -> str:
    """The node identity a certificate carries: its first DNS SAN. A CA certificate names no node
    (TLS chain checks accept a CA certificate as the leaf, so this is where it is refused)."""
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise CertificateError("a CA certificate is not a kvfabric node certificate")
    except x509.ExtensionNotFound:
        pass  # no basic constraints: an end-entity certificate
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CertificateError("certificate has no subjectAltName; not a kvfabric node certificate") from None
    names = san.get_values_for_type(x509.DNSName)
    if not names:
        raise CertificateError("certificate has no DNS name in its subjectAltName")
    return names[0]


@dataclass(frozen=True, slots=True)
class CredentialFiles:
    ca: Path
    cert: Path
    key: Path

    @property
    def crl(self) -> Path:
        """The CA's revocation list, beside the CA certificate; optional."""
        return self.ca.with_name(CRL)

    @classmethod
    def for_node(cls, cert_dir: str | os.PathLike[str], node: str) -> CredentialFiles:
        d = Path(cert_dir)
        return cls(d / CA_CERT, d / f"{node}.pem", d / f"{node}.key")

    def check(self) -> None:
        for p in (self.ca, self.cert, self.key):
            if not p.is_file():
                raise CertificateError(f"missing certificate file {p}")

    def stamp(self) -> tuple[int, ...]:
        """Changes whenever any of the three files, or the revocation list, is replaced or rewritten."""
        out: list[int] = []
        for p in (self.ca, self.cert, self.key):
            out += file_stamp(p)
        with contextlib.suppress(FileNotFoundError):   # the list is optional
            out += file_stamp(self.crl)
        return tuple(out)


class NodeCredentials:
    """A node's CA, certificate, key and the CA's revocation list, reloaded when their files change.

    `ssl_context(server)` returns a TLS 1.3 context that requires and verifies the peer's
    certificate against the cluster CA and refuses a revoked one (`revoked` holds the serials).
    Contexts are rebuilt after a rotation; a context in use by
    an open connection is never mutated, so open connections are not dropped.
    """

    def __init__(self, files: CredentialFiles) -> None:
        files.check()
        self.files = files
        self._stamp: tuple[int, ...] = ()
        self._contexts: dict[bool, ssl.SSLContext] = {}
        self.revoked: frozenset[int] = frozenset()
        self.crl_next_update: float | None = None   # unix s: the revocation list's nextUpdate (None: no list)
        self._crl_pem: bytes | None = None          # the list in use (kept when its file disappears)
        self.generation = 0
        self.refresh()

    def crl_expired(self, now: float) -> bool:
        """Whether the CA's revocation list is past its nextUpdate at `now` (unix s). Both transports
        then refuse every peer, as OpenSSL does for TLS-TCP: a list the CA no longer vouches for may
        miss revocations, so a handshake fails closed until the operator publishes a fresh crl.pem."""
        return self.crl_next_update is not None and now > self.crl_next_update

    @property
    def node(self) -> str:
        return node_name_of(x509.load_pem_x509_certificate(self.files.cert.read_bytes()))

    def refresh(self) -> bool:
        """Reload if the files changed; True when a reload happened."""
        try:
            stamp = self.files.stamp()
        except OSError as e:  # a rotation that deletes before it writes: keep serving with what we have
            if not self._stamp:
                raise CertificateError(f"cannot read node credentials {self.files}: {e}") from None
            logger.warning("node credentials missing mid-rotation (%s); keeping the previous ones", e)
            return False
        if stamp == self._stamp:
            return False
        # Validate the new material before switching to it: a half-written rotation keeps the old one.
        try:
            crl_pem, revoked = self._read_crl()
            contexts = {server: self._build(server, crl_pem) for server in (True, False)}
            next_update = None if crl_pem is None else _next_update(crl_pem)
        except (ssl.SSLError, OSError, ValueError, CertificateError) as e:
            if not self._stamp:
                raise CertificateError(f"cannot load node credentials {self.files}: {e}") from None
            logger.warning("ignoring unreadable rotated credentials (%s); keeping the previous ones", e)
            return False
        self._contexts = contexts
        self._crl_pem = crl_pem
        self.revoked = revoked
        self.crl_next_update = next_update
        self._stamp = stamp
        self.generation += 1
        if self.generation > 1:
            logger.info("reloaded node credentials from %s (generation %d)", self.files.cert, self.generation)
        return True

    def _read_crl(self) -> tuple[bytes | None, frozenset[int]]:
        """The revocation list to use and its serials: the file's, once checked as signed by the CA;
        the one in use when the file is gone (a list never un-revokes by disappearing, as
        `revocation.RevocationFile` holds for every other reader); none when there never was one."""
        try:
            pem = self.files.crl.read_bytes()
        except FileNotFoundError:
            if self._crl_pem is None:
                return None, frozenset()
            logger.warning("revocation list %s is gone; keeping the one in use (%d revoked)",
                           self.files.crl, len(self.revoked))
            return self._crl_pem, self.revoked
        ca = x509.load_pem_x509_certificate(self.files.ca.read_bytes())
        return pem, revoked_serials(pem, ca, str(self.files.crl))

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        self.refresh()
        return self._contexts[server]

    def _build(self, server: bool, crl_pem: bytes | None) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.load_cert_chain(self.files.cert, self.files.key)
        ctx.load_verify_locations(cafile=str(self.files.ca))
        if crl_pem is not None:
            _load_crl(ctx, crl_pem)
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF   # a revoked peer fails the handshake
        ctx.verify_mode = ssl.CERT_REQUIRED  # mTLS: the server demands a client certificate too
        if not server:
            ctx.check_hostname = True  # the dialled node name must be in the server's SAN
        return ctx


def _load_crl(ctx: ssl.SSLContext, crl_pem: bytes) -> None:
    """Load the revocation list `crl_pem` into `ctx` (the bytes checked, not whatever the file holds
    by now): OpenSSL reads lists only from files, so through a private one, removed once read."""
    fd, name = tempfile.mkstemp(prefix="kvfabric-crl-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(crl_pem)
        ctx.load_verify_locations(cafile=name)
    finally:
        os.unlink(name)
