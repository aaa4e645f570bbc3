"""Mutual TLS on the QUIC transport, over real loopback handshakes, with each QUIC library.

The server must refuse clients without a certificate, with one from a foreign CA (made by the
`openssl` CLI) or with an expired one, count and log each refusal, serve nothing to them, and
keep serving good clients. The client must refuse a server whose certificate is not from the
cluster CA or does not name the node it dialled.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aioquic
import pytest
from aioquic.asyncio.client import connect
from aioquic.quic.configuration import QuicConfiguration
from support import run
from testkit import Pki

from transports.core.base import Hit, Peer
from transports.core.codec import FrameDecoder, MissReason, Pull, encode
from transports.quic import ALPN, QuicTransportClient, QuicTransportServer
from transports.quic import tls as quic_tls
from transports.trust.certs import CredentialFiles, NodeCredentials


def node_files(cert_dir: Path, node: str) -> CredentialFiles:
    return CredentialFiles.for_node(cert_dir, node)


@asynccontextmanager
async def serving(files: CredentialFiles, source: Any, backend: str, node: str = "node-a") -> AsyncIterator[
        tuple[QuicTransportServer, Peer]]:
    server = QuicTransportServer(NodeCredentials(files), source, backend=backend)
    assert server.backend.name == backend
    host, port = await server.start()
    try:
        yield server, Peer(node, host, port)
    finally:
        await server.close()


async def pull_with(files: CredentialFiles, peer: Peer, addresses: Any,
                    backend: str) -> tuple[list[Any], QuicTransportClient]:
    client = QuicTransportClient(NodeCredentials(files), connect_timeout_s=5.0, backend=backend)
    try:
        return [r async for r in client.pull(peer, addresses)], client
    finally:
        await client.close()


def auth_failures(server_or_client: Any, reason: str) -> float:
    value = server_or_client.metrics.registry.get_sample_value(
        "kvfabric_auth_failures_total", {"transport": "quic", "reason": reason})
    return value or 0.0


async def good_client_is_served(cert_dir: Path, peer: Peer, addresses: Any, backend: str) -> None:
    results, _ = await pull_with(node_files(cert_dir, "client-1"), peer, addresses, backend)
    assert [r.address for r in results] == addresses and all(isinstance(r, Hit) for r in results)


def assert_refused(results: list[Any], addresses: Any) -> None:
    assert [r.address for r in results] == addresses
    assert all(not isinstance(r, Hit) and r.reason is MissReason.PEER_GONE for r in results)


# ---------------------------------------------------------------------------------------------
# The server refuses bad clients


def test_client_without_certificate_is_refused_counted_and_logged(
        cert_dir: Path, memory_source: Any, caplog: pytest.LogCaptureFixture, quic_backend: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(cert_dir, "node-a"), source, quic_backend) as (server, peer):
            # Stock aioquic client: trusts our CA but presents no certificate of its own.
            config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name="node-a")
            config.load_verify_locations(cadata=(cert_dir / "ca.pem").read_bytes())
            async with connect("127.0.0.1", peer.port, configuration=config) as protocol:
                reader, writer = await protocol.create_stream()
                writer.write(encode(Pull(1, tuple(source.addresses))))
                writer.write_eof()
                answer = await asyncio.wait_for(reader.read(), 10)  # EOF when the connection dies
                closed = protocol._quic._close_event
            assert FrameDecoder().feed(answer) == []
            assert closed is not None and closed.error_code == 0x100 + 116  # certificate_required alert
            assert auth_failures(server, "no_certificate") == 1
            assert source.num_gets == 0
            await good_client_is_served(cert_dir, peer, source.addresses, quic_backend)
            # The refused connection never became a peer; the good client's may already be closed.
            assert server.peer_nodes in ([], ["client-1"])

    with caplog.at_level(logging.WARNING, logger="transports.quic"):
        run(main())
    assert any("refused QUIC client" in m and "no_certificate" in m for m in caplog.messages)


def test_client_with_openssl_made_foreign_certificate_is_refused(
        cert_dir: Path, openssl_foreign: Any, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)
    intruder = CredentialFiles(cert_dir / "ca.pem", openssl_foreign.client_cert, openssl_foreign.client_key)

    async def main() -> None:
        async with serving(node_files(cert_dir, "node-a"), source, quic_backend) as (server, peer):
            results, _ = await pull_with(intruder, peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(server, "untrusted") == 1
            assert source.num_gets == 0 and server.peer_nodes == []
            await good_client_is_served(cert_dir, peer, source.addresses, quic_backend)

    run(main())


def test_client_with_expired_certificate_is_refused(cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(cert_dir, "node-a"), source, quic_backend) as (server, peer):
            results, client = await pull_with(node_files(cert_dir, "expired-1"), peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(server, "expired") == 1
            assert auth_failures(client, "refused_by_server") == 1
            assert source.num_gets == 0
            await good_client_is_served(cert_dir, peer, source.addresses, quic_backend)

    run(main())


@pytest.mark.parametrize("node", ["rogue-ca", "server-only"])
def test_cluster_signed_certificate_that_is_no_client_node_certificate_is_refused(
        odd_certs: Path, memory_source: Any, node: str, quic_backend: str) -> None:
    """Signed by the cluster CA, but a CA certificate or one not valid for client authentication."""
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(odd_certs, "node-a"), source, quic_backend) as (server, peer):
            results, _ = await pull_with(node_files(odd_certs, node), peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(server, "not_a_node") == 1
            assert source.num_gets == 0 and server.peer_nodes == []
            await good_client_is_served(odd_certs, peer, source.addresses, quic_backend)

    run(main())


def test_a_revoked_client_is_refused_once_the_revocation_list_appears(
        pki: Pki, memory_source: Any, quic_backend: str) -> None:
    d = pki.dir
    pki.node("client-2")
    source = memory_source(num_blocks=2, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(d, "node-a"), source, quic_backend) as (server, peer):
            results, _ = await pull_with(node_files(d, "client-2"), peer, source.addresses, quic_backend)
            assert all(isinstance(r, Hit) for r in results)
            pki.revoke("client-2")
            results, client = await pull_with(node_files(d, "client-2"), peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(server, "revoked") == 1
            assert auth_failures(client, "refused_by_server") == 1
            await good_client_is_served(d, peer, source.addresses, quic_backend)

    run(main())


# ---------------------------------------------------------------------------------------------
# The client refuses bad servers


def test_client_refuses_a_cluster_server_whose_certificate_expired(
        cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(cert_dir, "expired-1"), source, quic_backend, node="expired-1") as (_, peer):
            results, client = await pull_with(node_files(cert_dir, "client-1"), peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(client, "server_untrusted") == 1
            assert source.num_gets == 0

    run(main())


def test_client_refuses_a_server_certified_by_a_foreign_ca(
        cert_dir: Path, openssl_foreign: Any, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)
    impostor = CredentialFiles(openssl_foreign.ca, openssl_foreign.server_cert, openssl_foreign.server_key)

    async def main() -> None:
        async with serving(impostor, source, quic_backend) as (_, peer):  # its certificate does say "node-a"
            results, client = await pull_with(node_files(cert_dir, "client-1"), peer, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(client, "server_untrusted") == 1
            assert source.num_gets == 0

    run(main())


def test_client_refuses_a_cluster_server_that_is_not_the_dialled_node(
        cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(cert_dir, "node-b"), source, quic_backend, node="node-b") as (_, peer_b):
            posing = Peer("node-a", peer_b.host, peer_b.port)  # we dial node-a, node-b answers
            results, client = await pull_with(node_files(cert_dir, "client-1"), posing, source.addresses, quic_backend)
            assert_refused(results, source.addresses)
            assert auth_failures(client, "server_untrusted") == 1
            assert source.num_gets == 0
            await good_client_is_served(cert_dir, peer_b, source.addresses, quic_backend)

    run(main())


def test_client_refuses_a_cluster_server_whose_certificate_was_revoked(
        pki: Pki, memory_source: Any, quic_backend: str) -> None:
    d = pki.dir
    pki.revoke("node-a")
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(node_files(d, "node-a"), source, quic_backend) as (_, peer):
            results, client = await pull_with(node_files(d, "client-1"), peer, source.addresses, quic_backend)
            assert all(not isinstance(r, Hit) for r in results)
            assert auth_failures(client, "server_revoked") == 1
            assert source.num_gets == 0
            gauge = client.metrics.registry.get_sample_value("kvfabric_connections",
                                                             {"transport": "quic", "side": "client"})
            assert gauge == 0

    run(main())


# ---------------------------------------------------------------------------------------------
# The patch is tied to the aioquic version it was checked against


def test_the_mtls_patch_refuses_to_load_on_another_aioquic_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aioquic, "__version__", "1.8.0")
    with pytest.raises(ImportError, match=r"1\.7\.2"):
        importlib.reload(quic_tls)


def test_session_tickets_are_single_use_bounded_and_die_with_the_client_certificate() -> None:
    def ticket(i: int) -> Any:
        return SimpleNamespace(ticket=b"t%d" % i)  # the store only reads the ticket's id

    store = quic_tls.TicketStore(capacity=2, lifetime_s=100.0)
    store.add(ticket(1), "client-1", cert_not_after=1_000.0, now=0.0)
    assert store.take(b"t1", now=50.0) is not None
    assert store.take(b"t1", now=50.0) is None  # single use: a replayed ticket does not resume
    store.add(ticket(2), "client-1", cert_not_after=1_000.0, now=0.0)
    assert store.take(b"t2", now=101.0) is None  # past the ticket lifetime
    store.add(ticket(3), "client-1", cert_not_after=30.0, now=0.0)
    assert store.take(b"t3", now=31.0) is None  # the client certificate expired: full handshake
    for i in range(4, 8):
        store.add(ticket(i), "client-1", cert_not_after=1_000.0, now=0.0)
    assert len(store) == 2 and store.take(b"t4", now=1.0) is None and store.take(b"t7", now=1.0) is not None
