"""Shared fixtures of the transport tests: certificates and an in-memory block source.

* `cert_dir` (session): our cluster CA plus node certificates "node-a", "node-b", "client-1" and
  an expired "expired-1" (issued by our CA, validity window entirely in the past).
* `openssl_foreign` (session): a second CA and certificates made with the `openssl` command-line
  tool, not with our code: a client certificate whose SAN is "intruder" and a server certificate
  whose SAN is "node-a" (to impersonate a real node from outside the cluster CA).
* `odd_certs` (session): certificates signed by the cluster CA that must still not authenticate
  a node: "rogue-ca" carries CA:TRUE (a CA, not a node), "server-only" lacks the clientAuth usage.
* `quic_backend`: each QUIC library the transport runs on ("aioquic", "qh3"); a test taking it
  runs once per library.
* `memory_source`: a factory of `MemorySource`, a dict-backed `BlockSource` filled with random
  payloads whose BLAKE3 digests are computed on insertion.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import blake3
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from testkit import PkiFactory

from fabric.keys import BlockAddress, BlockHash

NODES = ("node-a", "node-b", "client-1")
EXPIRED_NODE = "expired-1"


@pytest.fixture(scope="session")
def cert_dir(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    """A cluster CA with certificates for NODES and an expired one for EXPIRED_NODE."""
    pki = make_pki(tmp_path_factory.mktemp("certs"), *NODES)
    pki.node(EXPIRED_NODE, days=1, not_before=dt.datetime.now(dt.UTC) - dt.timedelta(days=3))
    return pki.dir


@dataclass(frozen=True, slots=True)
class ForeignCerts:
    """Material made by the `openssl` CLI under a CA that is not the cluster's."""

    ca: Path
    client_cert: Path   # SAN DNS:intruder, clientAuth+serverAuth
    client_key: Path
    server_cert: Path   # SAN DNS:node-a: a foreign impersonation of a real node
    server_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _openssl_leaf(d: Path, name: str) -> tuple[Path, Path]:
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName=DNS:{name}\nbasicConstraints=critical,CA:FALSE\n"
                   "extendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-sha256", "-extfile", ext.name, "-out", f"{name}.pem", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="session")
def openssl_foreign(tmp_path_factory: pytest.TempPathFactory) -> ForeignCerts:
    d = tmp_path_factory.mktemp("foreign")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=foreign CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    client_cert, client_key = _openssl_leaf(d, "intruder")
    server_dir = d / "server"
    server_dir.mkdir()
    for f in ("ca.pem", "ca.key"):
        (server_dir / f).write_bytes((d / f).read_bytes())
    server_cert, server_key = _openssl_leaf(server_dir, "node-a")
    return ForeignCerts(d / "ca.pem", client_cert, client_key, server_cert, server_key)


def _issue_odd(d: Path, name: str, ca: bool, usages: list[x509.ObjectIdentifier]) -> None:
    """`<name>.pem/.key` signed by the cluster CA in `d`, built here rather than by `issue_node`."""
    ca_cert = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


ODD_NODES = ("rogue-ca", "server-only")


@pytest.fixture(scope="session")
def odd_certs(cert_dir: Path) -> Path:
    """`cert_dir` plus the ODD_NODES certificates (see the module docstring)."""
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    _issue_odd(cert_dir, "rogue-ca", ca=True, usages=both)
    _issue_odd(cert_dir, "server-only", ca=False, usages=[ExtendedKeyUsageOID.SERVER_AUTH])
    return cert_dir


@dataclass(frozen=True, slots=True)
class StoredBlock:
    payload: bytes
    digest: bytes


@dataclass(slots=True)
class MemorySource:
    """A real `BlockSource`: a dict from address to payload and digest. `addresses` keeps insertion order."""

    blocks: dict[BlockAddress, StoredBlock] = field(default_factory=dict)
    num_gets: int = 0

    @property
    def addresses(self) -> list[BlockAddress]:
        return list(self.blocks)

    def put(self, address: BlockAddress, payload: bytes) -> None:
        self.blocks[address] = StoredBlock(payload, blake3.blake3(payload).digest())

    def get_block(self, address: BlockAddress) -> StoredBlock | None:
        self.num_gets += 1
        return self.blocks.get(address)


MemorySourceFactory = Callable[..., MemorySource]


def random_address() -> BlockAddress:
    return BlockAddress(BlockHash(os.urandom(32)), 0)


@pytest.fixture
def memory_source() -> MemorySourceFactory:
    """`memory_source(num_blocks=4, num_layers=2, payload_size=4096)`: random payloads, block-major order."""

    def make(num_blocks: int = 4, num_layers: int = 2, payload_size: int = 4096) -> MemorySource:
        src = MemorySource()
        for _ in range(num_blocks):
            h = BlockHash(os.urandom(32))
            for layer in range(num_layers):
                src.put(BlockAddress(h, layer), os.urandom(payload_size))
        return src

    return make


@pytest.fixture(params=["aioquic", "qh3"])
def quic_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
