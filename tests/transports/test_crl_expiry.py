"""A revocation list past its nextUpdate, over real loopback handshakes of both transports.

The CA vouches for a list only until its nextUpdate: after it, a revocation the list misses may
exist. TLS-TCP (OpenSSL) then fails every handshake; QUIC must behave the same (fail closed,
counted as `crl_expired`), and both serve again once the operator publishes a fresh list.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from support import run, wait_until
from testkit import Pki

from transports.core.base import Hit, Peer, TransportClient, TransportServer
from transports.quic import QuicTransportClient, QuicTransportServer
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer
from transports.trust.certs import CredentialFiles, NodeCredentials, revoke


def _publish_expired_list(d: Path) -> None:
    """A CA-signed crl.pem whose nextUpdate passed a day ago (the operator forgot to republish)."""
    ca = x509.load_pem_x509_certificate((d / "ca.pem").read_bytes())
    key = serialization.load_pem_private_key((d / "ca.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.UTC)
    crl = (x509.CertificateRevocationListBuilder().issuer_name(ca.subject)
           .last_update(now - dt.timedelta(days=2)).next_update(now - dt.timedelta(days=1))
           .sign(key, hashes.SHA256()))  # type: ignore[arg-type]
    (d / "crl.pem").write_bytes(crl.public_bytes(serialization.Encoding.PEM))


def _ends(kind: str, d: Path, source: Any, client_dir: Path | None = None) -> tuple[TransportServer, TransportClient]:
    server_creds = NodeCredentials(CredentialFiles.for_node(d, "node-a"))
    client_creds = NodeCredentials(CredentialFiles.for_node(client_dir or d, "client-1"))
    if kind == "tls-tcp":
        return TlsTcpServer(server_creds, source, "127.0.0.1", 0), TlsTcpClient(client_creds)
    return QuicTransportServer(server_creds, source), QuicTransportClient(client_creds, connect_timeout_s=5.0)


def _crl_refusals(end: Any, reason: str = "server_crl_expired") -> float:
    """What `end` counted: a peer's certificate could not be checked against a current list."""
    return sum(end.metrics.registry.get_sample_value("kvfabric_auth_failures_total",
                                                     {"transport": t, "reason": reason}) or 0.0
               for t in ("tls-tcp", "quic"))


def test_an_expired_revocation_list_fails_closed_on_both_transports_until_a_fresh_one(
        pki: Pki, memory_source: Any) -> None:
    d = pki.dir
    _publish_expired_list(d)
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)
    outcome: dict[str, tuple[bool, float, bool]] = {}

    async def main(kind: str) -> None:
        server, client = _ends(kind, d, source)
        host, port = await server.start()
        peer = Peer("node-a", host, port)
        try:
            expired = [r async for r in client.pull(peer, source.addresses)]
            refusals = _crl_refusals(client)
            revoke(d, set())   # the operator re-signs the list with a fresh nextUpdate
            fresh = [r async for r in client.pull(peer, source.addresses)]
            outcome[kind] = (any(isinstance(r, Hit) for r in expired), refusals,
                             all(isinstance(r, Hit) for r in fresh))
        finally:
            await client.close()
            await server.close()
            _publish_expired_list(d)

    for kind in ("tls-tcp", "quic"):
        run(main(kind))
    assert outcome["tls-tcp"][0] is False and outcome["quic"][0] is False   # nothing served past nextUpdate
    assert outcome["tls-tcp"][1] >= 1 and outcome["quic"][1] >= 1           # and counted as crl_expired
    assert outcome["tls-tcp"][2] and outcome["quic"][2]                     # a fresh list: served again


def test_a_server_whose_list_expired_refuses_a_client_whose_list_is_fresh_on_both_transports(
        tmp_path: Path, pki: Pki, memory_source: Any) -> None:
    d, fresh = pki.dir, tmp_path / "client-certs"
    fresh.mkdir()
    for name in ("ca.pem", "ca.key", "client-1.pem", "client-1.key"):
        (fresh / name).write_bytes((d / name).read_bytes())
    revoke(fresh, set())          # the client's copy of the list is current ...
    _publish_expired_list(d)      # ... the server's is not
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)
    refused: dict[str, tuple[bool, float]] = {}

    async def main(kind: str) -> None:
        server, client = _ends(kind, d, source, client_dir=fresh)
        host, port = await server.start()
        try:
            results = [r async for r in client.pull(Peer("node-a", host, port), source.addresses)]
            await wait_until(lambda: _crl_refusals(server, "crl_expired") >= 1)
        finally:
            await client.close()
            await server.close()
        refused[kind] = (not any(isinstance(r, Hit) for r in results), _crl_refusals(server, "crl_expired"))

    for kind in ("tls-tcp", "quic"):
        run(main(kind))
    assert refused["tls-tcp"][0] and refused["quic"][0]
    assert refused["tls-tcp"][1] >= 1 and refused["quic"][1] >= 1
