"""Per-peer budgets on real servers (127.0.0.1, real certificates): a peer over its PULLs, bytes or
connections is answered ERROR overloaded, counted under its node name, and other peers are served."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path
from typing import Any

from support import closing, creds, pull_all, raw_peer, run, started

from fabric.config import Config
from transports.core.base import Hit, Miss, Peer
from transports.core.budget import PeerRates, peer_rates
from transports.core.codec import End, Error, ErrorCode, FrameDecoder, Hello, MissReason, Pull, encode
from transports.core.metrics import TransportMetrics
from transports.quic import QuicTransportClient, QuicTransportServer
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer

MemorySourceFactory = Any   # tests/transports/conftest.py
STINGY = PeerRates(pulls_per_s=0.5, pull_burst=3.0)   # 3 PULLs, then one every 2 s


def overloaded(metrics: TransportMetrics, transport: str, peer: str, budget: str) -> float:
    value = metrics.registry.get_sample_value("kvfabric_peer_overloaded_total",
                                              {"transport": transport, "peer": peer, "budget": budget})
    return value or 0.0


async def tls_frames(cert_dir: Path, peer: Peer, data: bytes, count: int) -> list[Any]:
    """Send `data` on a raw TLS connection as client-1; the first `count` frames answered."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(cert_dir / "ca.pem"))
    ctx.load_cert_chain(cert_dir / "client-1.pem", cert_dir / "client-1.key")
    reader, writer = await asyncio.open_connection(peer.host, peer.port, ssl=ctx, server_hostname=peer.node)
    writer.write(data)
    decoder, frames = FrameDecoder(), []
    while len(frames) < count:
        frames += decoder.feed(await asyncio.wait_for(reader.read(65536), 5))
    writer.close()
    with contextlib.suppress(ConnectionError, ssl.SSLError):
        await writer.wait_closed()
    return frames


def test_tls_pulls_over_the_rate_get_error_overloaded_and_the_connection_stays(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        server = TlsTcpServer(creds(cert_dir, "node-a"), source, peer_rates=STINGY)
        async with started(server, "node-a") as (_, peer):
            pulls = b"".join(encode(Pull(rid, tuple(source.addresses))) for rid in range(1, 7))
            frames = await tls_frames(cert_dir, peer, encode(Hello("client-1")) + pulls, 1 + 3 * 2 + 3)
            ends = [f.request_id for f in frames if isinstance(f, End)]
            refused = [f for f in frames if isinstance(f, Error)]
            assert isinstance(frames[0], Hello) and ends == [1, 2, 3]
            assert [f.request_id for f in refused] == [4, 5, 6]
            assert all(f.code is ErrorCode.OVERLOADED for f in refused)
            assert overloaded(server.metrics, "tls-tcp", "client-1", "pulls") == 3
            async with closing(TlsTcpClient(creds(cert_dir, "node-b"))) as other:   # its own budget
                assert all(isinstance(r, Hit) for r in await pull_all(other, peer, source.addresses))

    run(main())


def test_quic_pulls_over_the_rate_get_an_overloaded_error_on_their_stream(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), source, peer_rates=STINGY)
        async with started(server, "node-a") as (_, peer), raw_peer(cert_dir, peer.port) as raw:
            answers = []
            for rid in range(1, 5):
                reader, writer = await raw.create_stream()
                writer.write(encode(Pull(rid, tuple(source.addresses))))
                writer.write_eof()
                answers.append(FrameDecoder(max_payload=1 << 20).feed(await asyncio.wait_for(reader.read(), 5)))
            assert [type(a[-1]) for a in answers] == [End, End, End, Error]
            assert answers[3][-1].code is ErrorCode.OVERLOADED
            assert overloaded(server.metrics, "quic", "client-1", "pulls") == 1
            async with closing(QuicTransportClient(creds(cert_dir, "node-b"))) as other:
                assert all(isinstance(r, Hit) for r in await pull_all(other, peer, source.addresses))

    run(main())


def test_a_peer_served_past_its_bytes_gets_overloaded_misses(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=4, num_layers=1, payload_size=64 * 1024)
    rates = PeerRates(bytes_per_s=1024.0, bytes_burst=64 * 1024)

    async def main() -> None:
        for server_class, client_class, transport in ((TlsTcpServer, TlsTcpClient, "tls-tcp"),
                                                      (QuicTransportServer, QuicTransportClient, "quic")):
            server = server_class(creds(cert_dir, "node-a"), source, peer_rates=rates)
            async with started(server, "node-a") as (_, peer), \
                    closing(client_class(creds(cert_dir, "client-1"))) as client:
                first = await pull_all(client, peer, source.addresses)   # served whole, then in debt
                assert all(isinstance(r, Hit) for r in first)
                second = await pull_all(client, peer, source.addresses[:1])
                assert isinstance(second[0], Miss) and second[0].reason is MissReason.OVERLOADED, transport
                assert overloaded(server.metrics, transport, "client-1", "bytes") == 1

    run(main())


def test_bytes_the_pump_served_count_and_are_charged_before_the_peer_is_read_again(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """A pull of 8 blocks of 256 KiB is answered in two batches: the first from the read that
    brought the PULL, the second by the pump. The burst (1.5 MiB) covers the first batch but
    not both, so the next PULL is refused only if the pump's batch was charged before it was read;
    the served counters hold both batches."""
    source = memory_source(num_blocks=8, num_layers=1, payload_size=256 * 1024)
    rates = PeerRates(bytes_per_s=1024.0, bytes_burst=1.5 * 1024 * 1024)

    async def main() -> None:
        server = TlsTcpServer(creds(cert_dir, "node-a"), source, peer_rates=rates)
        async with started(server, "node-a") as (_, peer), closing(TlsTcpClient(creds(cert_dir, "client-1"))) as client:
            first = await pull_all(client, peer, source.addresses)
            assert all(isinstance(r, Hit) for r in first)
            registry = server.metrics.registry
            assert registry.get_sample_value("kvfabric_served_total", {"transport": "tls-tcp", "outcome": "hit"}) == 8
            assert registry.get_sample_value("kvfabric_served_bytes_total", {"transport": "tls-tcp"}) == 2 << 20
            second = await pull_all(client, peer, source.addresses[:1])
            assert isinstance(second[0], Miss) and second[0].reason is MissReason.OVERLOADED
            assert overloaded(server.metrics, "tls-tcp", "client-1", "bytes") == 1

    run(main())


def test_quic_connections_past_the_per_peer_cap_are_refused_as_overloaded(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), source, max_connections_per_peer=2)
        async with started(server, "node-a") as (_, peer), raw_peer(cert_dir, peer.port), \
                raw_peer(cert_dir, peer.port):
            async with raw_peer(cert_dir, peer.port) as third:
                await asyncio.wait_for(third.wait_closed(), 5)
                closed = third._quic._close_event
            assert closed is not None and "overloaded" in closed.reason_phrase
            assert server.num_connections == 2
            assert overloaded(server.metrics, "quic", "client-1", "connections") == 1
            async with closing(QuicTransportClient(creds(cert_dir, "node-b"))) as other:
                assert all(isinstance(r, Hit) for r in await pull_all(other, peer, source.addresses))

    run(main())


def test_budgets_come_from_the_transport_section() -> None:
    config = Config.from_dict({"transport": {"max_connections_per_peer": 3, "peer_pulls_per_s": 50.0,
                                             "peer_pull_burst": 100.0, "peer_bytes_per_s": 1e6,
                                             "peer_bytes_burst": 2e6}})

    assert peer_rates(config.transport) == PeerRates(50.0, 100.0, 1e6, 2e6)
    assert config.transport.max_connections_per_peer == 3


def test_past_the_nodes_shared_bytes_a_flood_of_another_certificate_is_refused_and_a_light_peer_served(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=4, num_layers=1, payload_size=64 * 1024)
    rates = PeerRates(node_bytes_per_s=1024.0, node_bytes_burst=64 * 1024)   # per peer: the roomy defaults

    async def main() -> None:
        for server_class, client_class, transport in ((TlsTcpServer, TlsTcpClient, "tls-tcp"),
                                                      (QuicTransportServer, QuicTransportClient, "quic")):
            server = server_class(creds(cert_dir, "node-a"), source, peer_rates=rates)
            async with started(server, "node-a") as (_, peer), \
                    closing(client_class(creds(cert_dir, "node-b"))) as flood, \
                    closing(client_class(creds(cert_dir, "client-1"))) as good:
                assert all(isinstance(r, Hit) for r in await pull_all(flood, peer, source.addresses))
                # the node's shared bytes are spent: a peer that used little is still served ...
                assert all(isinstance(r, Hit) for r in await pull_all(good, peer, source.addresses[:1]))
                # ... the one that used most is refused until the node has bytes again
                again = await pull_all(flood, peer, source.addresses[:1])
                assert isinstance(again[0], Miss) and again[0].reason is MissReason.OVERLOADED, transport
                assert overloaded(server.metrics, transport, "node-b", "fair_share") == 1
                assert all(isinstance(r, Hit) for r in await pull_all(good, peer, source.addresses[:1]))

    run(main())
