"""QUIC transport over real loopback connections: pulls, pooling, resumption, rotation, bad peers.

Every test runs a real server and client on 127.0.0.1 in one event loop. Peers that misbehave
are built from stock aioquic plus our codec, so the server sees exactly the bytes we choose.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import resource
import shutil
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import serve
from aioquic.quic.configuration import QuicConfiguration
from support import (
    SIGNED_NAMESPACE,
    check_namespaced_pull,
    check_signed_pull,
    check_tenant_restricted_pull,
    closing,
    creds,
    filled_store,
    pull_all,
    raw_peer,
    run,
    signed_store,
    started,
    wait_until,
)

from fabric.config import Config
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import BlockSource, Hit, Peer, PullResult
from transports.core.codec import (
    VERSION,
    Block,
    Blocks,
    End,
    Error,
    ErrorCode,
    FrameDecoder,
    FrameType,
    Miss,
    MissReason,
    Pull,
    encode,
)
from transports.core.encoder import MAGIC, PREAMBLE
from transports.core.metrics import TransportMetrics
from transports.quic import ALPN, MAX_ADDRESSES_PER_STREAM, QuicTransportClient, QuicTransportServer, QuicTuning
from transports.trust.certs import issue_node


def serving(cert_dir: Path, source: BlockSource, node: str = "node-a",
            **kwargs: Any) -> AbstractAsyncContextManager[tuple[QuicTransportServer, Peer]]:
    return started(QuicTransportServer(creds(cert_dir, node), source, **kwargs), node)


def client_of(cert_dir: Path, node: str = "client-1",
              **kwargs: Any) -> AbstractAsyncContextManager[QuicTransportClient]:
    return closing(QuicTransportClient(creds(cert_dir, node), **kwargs))


def unknown(n: int) -> list[BlockAddress]:
    return [BlockAddress(BlockHash(bytes([0xEE, i]) * 16), 0) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# Pulls


def test_pull_of_many_blocks_returns_verified_payloads_in_the_order_asked(
        cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=6, num_layers=4, payload_size=200_000)
    small = memory_source(num_blocks=MAX_ADDRESSES_PER_STREAM + 200, num_layers=1, payload_size=512)

    async def main() -> None:
        source.blocks.update(small.blocks)
        async with serving(cert_dir, source, backend=quic_backend) as (server, peer), \
                client_of(cert_dir, backend=quic_backend) as client:
            results = await pull_all(client, peer, source.addresses)
            assert [r.address for r in results] == source.addresses  # layers of each block in order
            assert all(isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload
                       for r in results)
            assert server.peer_nodes == ["client-1"]
            info = client.connection_info(peer)
            assert info is not None and info.open and info.num_connects == 1
            hits = client.metrics.registry.get_sample_value("kvfabric_pulls_total",
                                                            {"transport": "quic", "outcome": "hit"})
            assert hits == len(source.addresses)

    run(main())


def test_runs_of_small_blocks_arrive_byte_exact_over_quic(cert_dir: Path, memory_source: Any) -> None:
    """A run of hits is one BLOCKS frame, its parts queued on the stream one after another."""
    source = memory_source(num_blocks=40, num_layers=3, payload_size=24 * 1024)
    source.put(BlockAddress(BlockHash(b"b" * 32), 0), b"")   # an empty part inside a run

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            results = await pull_all(client, peer, source.addresses)
            assert [r.address for r in results] == source.addresses
            assert all(isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload
                       for r in results)

    run(main())


def test_concurrent_pulls_interleave_on_one_connection(cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=48, num_layers=1, payload_size=256 * 1024)
    groups = [source.addresses[i::6] for i in range(6)]
    arrivals: list[int] = []

    async def one(client: QuicTransportClient, peer: Peer, index: int) -> list[PullResult]:
        out = []
        async for r in client.pull(peer, groups[index]):
            arrivals.append(index)
            out.append(r)
        return out

    async def main() -> None:
        async with serving(cert_dir, source, backend=quic_backend) as (server, peer), \
                client_of(cert_dir, max_inflight=8, backend=quic_backend) as client:
            results = await asyncio.gather(*(one(client, peer, i) for i in range(len(groups))))
            for group, got in zip(groups, results, strict=True):
                assert [r.address for r in got] == group
                assert all(isinstance(r, Hit) for r in got)
            info = client.connection_info(peer)
            assert info is not None and info.num_connects == 1
            assert server.num_connections == 1
        # Answers of different pulls arrived interleaved: they were in flight at the same time.
        first_done = min(max(i for i, g in enumerate(arrivals) if g == k) for k in range(len(groups)))
        assert len(set(arrivals[:first_done + 1])) > 1

    run(main())


def test_unknown_addresses_are_misses_in_place(cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=3, num_layers=1, payload_size=1000)
    missing = unknown(2)
    asked = [source.addresses[0], missing[0], source.addresses[1], missing[1], source.addresses[2]]

    async def main() -> None:
        async with serving(cert_dir, source, backend=quic_backend) as (_, peer), \
                client_of(cert_dir, backend=quic_backend) as client:
            results = await pull_all(client, peer, asked)
            assert [r.address for r in results] == asked
            assert [type(r) for r in results] == [Hit, Miss, Hit, Miss, Hit]
            assert all(r.reason is MissReason.NOT_FOUND for r in results if isinstance(r, Miss))

    run(main())


def test_abandoned_pull_frees_the_server_stream_and_keeps_the_connection(
        cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=64, num_layers=1, payload_size=256 * 1024)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as client:
            async with contextlib.aclosing(client.pull(peer, source.addresses)) as results:
                first = await anext(results)
            assert isinstance(first, Hit)
            (conn,) = server._connections
            await wait_until(lambda: not conn._streams and not conn._ready)  # STOP_SENDING reached it
            assert source.num_gets < len(source.addresses)  # it stopped reading blocks for nobody
            (client_conn,) = client._pool
            assert not client_conn.pulls
            again = await pull_all(client, peer, source.addresses[:4])
            assert [r.address for r in again] == source.addresses[:4] and all(isinstance(r, Hit) for r in again)
            assert client.connection_info(peer).num_connects == 1  # type: ignore[union-attr]

    run(main())


def test_serves_from_the_real_store(cert_dir: Path, tmp_path: Path) -> None:
    async def main() -> tuple[list[PullResult], dict[BlockAddress, bytes]]:
        with filled_store(tmp_path) as (store, payloads):
            async with serving(cert_dir, store) as (_, peer), client_of(cert_dir) as client:
                return await pull_all(client, peer, [*payloads, *unknown(1)]), payloads

    results, payloads = run(main())
    addresses = list(payloads)
    assert [r.address for r in results] == addresses + unknown(1)
    assert all(isinstance(r, Hit) and bytes(r.payload) == payloads[r.address] for r in results[:-1])
    assert isinstance(results[-1], Miss) and results[-1].reason is MissReason.NOT_FOUND


@dataclass
class _Tampered:
    payload: bytes
    digest: bytes


class LyingSource:
    """Serves one address with a payload that does not match the digest it announces."""

    def __init__(self, inner: Any, victim: BlockAddress) -> None:
        self.inner, self.victim = inner, victim

    def get_block(self, address: BlockAddress) -> Any:
        block = self.inner.get_block(address)
        if address == self.victim and block is not None:
            return _Tampered(b"\x00" + block.payload[1:], block.digest)
        return block


def test_lying_server_payload_is_a_counted_digest_mismatch_miss(cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=4, num_layers=1, payload_size=50_000)
    victim = source.addresses[2]

    async def main() -> None:
        async with serving(cert_dir, LyingSource(source, victim)) as (_, peer), client_of(cert_dir) as client:
            results = await pull_all(client, peer, source.addresses)
            assert [r.address for r in results] == source.addresses
            bad = [r for r in results if not isinstance(r, Hit)]
            assert bad == [Miss(bad[0].request_id, victim, MissReason.DIGEST_MISMATCH)]  # type: ignore[union-attr]
            assert client.metrics.digest_mismatches("quic") == 1

    run(main())


# ---------------------------------------------------------------------------------------------
# Connection pool, resumption, rotation


def test_pool_reuses_the_connection_and_reconnects_after_restart_or_idle_drop(
        cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=10_000)

    async def main() -> None:
        async with client_of(cert_dir, idle_timeout_s=1.0) as client:
            async with serving(cert_dir, source) as (_, peer):
                await pull_all(client, peer, source.addresses)
                await pull_all(client, peer, source.addresses)
                assert client.connection_info(peer).num_connects == 1  # type: ignore[union-attr]
            # The server restarts on the same port: its close reached the client.
            async with serving(cert_dir, source, port=peer.port) as (_, peer2):
                assert peer2 == peer
                results = await pull_all(client, peer, source.addresses)
                assert all(isinstance(r, Hit) for r in results)
                assert client.connection_info(peer).num_connects == 2  # type: ignore[union-attr]
                # The idle timeout drops the connection silently; the next pull dials again.
                await wait_until(lambda: not client.connection_info(peer).open)  # type: ignore[union-attr]
                results = await pull_all(client, peer, source.addresses)
                assert all(isinstance(r, Hit) for r in results)
                assert client.connection_info(peer).num_connects == 3  # type: ignore[union-attr]

    run(main())


@pytest.mark.parametrize(("server_idle_s", "client_idle_s", "gap_s"),
                         [(1.0, 30.0, 1.3), (30.0, 1.0, 1.3), (1.0, 1.0, 1.0), (1.0, 1.0, 1.005)])
def test_a_pull_at_or_past_the_idle_timeout_is_answered_without_waiting_for_a_timeout(
        cert_dir: Path, memory_source: Any, server_idle_s: float, client_idle_s: float, gap_s: float) -> None:
    """QUIC's idle timeout is the smaller of the two sides' (RFC 9000 10.1), so neither side keeps
    using a connection the other has dropped: a pull right at the boundary dials again at once
    instead of stalling for frame_timeout_s (TLS-TCP had such a race: test_tls_tcp.py,
    test_a_pull_racing_the_servers_idle_close_reconnects)."""
    source = memory_source(num_blocks=2, num_layers=1, payload_size=10_000)

    async def main() -> None:
        async with serving(cert_dir, source, idle_timeout_s=server_idle_s) as (_, peer), \
                client_of(cert_dir, idle_timeout_s=client_idle_s, frame_timeout_s=3.0) as client:
            await pull_all(client, peer, source.addresses)
            await asyncio.sleep(gap_s)
            start = asyncio.get_running_loop().time()
            results = await pull_all(client, peer, source.addresses)
            assert all(isinstance(r, Hit) for r in results)
            assert asyncio.get_running_loop().time() - start < 1.0

    run(main())


def test_reconnect_resumes_the_session_on_aioquic_and_keeps_the_client_identity(
        cert_dir: Path, memory_source: Any, quic_backend: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=10_000)

    async def main() -> None:
        async with serving(cert_dir, source, backend=quic_backend) as (server, peer), \
                client_of(cert_dir, backend=quic_backend) as client:
            await pull_all(client, peer, source.addresses)
            assert not client.connection_info(peer).session_resumed  # type: ignore[union-attr]
            await client.disconnect(peer)
            results = await pull_all(client, peer, source.addresses)
            assert all(isinstance(r, Hit) for r in results)
            info = client.connection_info(peer)
            # qh3 cannot bind a ticket to the client's identity, so it always does a full handshake
            assert info is not None and info.num_connects == 2 and info.session_resumed == (quic_backend == "aioquic")
            # The resumed connection carries the identity; the dropped one may not be reaped yet.
            assert set(server.peer_nodes) == {"client-1"}

    run(main())


def test_a_resumed_session_keeps_the_pullers_tenant_restriction(cert_dir: Path, tmp_path: Path) -> None:
    """A ticket carries the tenants of the certificate that earned it: a puller restricted to globex
    still gets misses under acme's root after it resumes (aioquic: qh3 never resumes)."""
    issue_node(cert_dir, "puller-globex-r", tenants=("globex",))

    async def main() -> tuple[list[PullResult], list[PullResult], bool]:
        with signed_store(tmp_path, cert_dir, "node-b") as (store, payloads, _):
            async with serving(cert_dir, store, backend="aioquic") as (server, peer), \
                    client_of(cert_dir, "puller-globex-r", backend="aioquic") as client:
                server.tenant_roots = {SIGNED_NAMESPACE: frozenset({"acme"})}.get
                first = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
                await client.disconnect(peer)
                again = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
                info = client.connection_info(peer)
                return first, again, info is not None and info.session_resumed

    first, again, resumed = run(main())
    assert resumed
    assert first and again and not any(isinstance(r, Hit) for r in first + again)


def test_rotation_keeps_open_connections_and_new_handshakes_use_the_new_certificate(
        cert_dir: Path, tmp_path: Path, memory_source: Any) -> None:
    certs = tmp_path / "certs"
    shutil.copytree(cert_dir, certs)
    source = memory_source(num_blocks=2, num_layers=1, payload_size=10_000)

    async def main() -> None:
        async with serving(certs, source) as (server, peer), client_of(certs) as old:
            assert all(isinstance(r, Hit) for r in await pull_all(old, peer, source.addresses))
            # Rotate the server's files to a certificate naming "node-a-v2".
            new_cert, new_key = issue_node(certs, "node-a-v2")
            shutil.copy(new_key, certs / "node-a.key")
            shutil.copy(new_cert, certs / "node-a.pem")
            async with client_of(certs) as fresh:
                moved = Peer("node-a-v2", peer.host, peer.port)
                assert all(isinstance(r, Hit) for r in await pull_all(fresh, moved, source.addresses))
                stale = await pull_all(fresh, peer, source.addresses[:1])  # old name: not in the new cert
                assert isinstance(stale[0], Miss) and stale[0].reason is MissReason.PEER_GONE
            # The connection made before the rotation still carries pulls.
            assert all(isinstance(r, Hit) for r in await pull_all(old, peer, source.addresses))
            assert old.connection_info(peer).num_connects == 1  # type: ignore[union-attr]
            assert server.credentials.generation == 2

    run(main())


# ---------------------------------------------------------------------------------------------
# Misbehaving peers (raw aioquic client with a valid certificate, bytes of our choosing)


async def exchange(protocol: QuicConnectionProtocol, data: bytes, fin: bool = True) -> list[Any]:
    """Send `data` on a new stream; the frames the server answered before closing the stream."""
    reader, writer = await protocol.create_stream()
    writer.write(data)
    if fin:
        writer.write_eof()
    raw = await asyncio.wait_for(reader.read(), 10)  # until the server's FIN
    if not fin:
        with contextlib.suppress(RuntimeError, ValueError):  # the server stopped or finished our side
            writer.write_eof()
    return FrameDecoder(max_payload=1 << 20).feed(raw)


def preamble(ftype: FrameType, header_len: int, payload_len: int, magic: bytes = MAGIC) -> bytes:
    return PREAMBLE.pack(magic, VERSION, int(ftype), 0, header_len, payload_len)


def protocol_errors(server: QuicTransportServer) -> float:
    return server.metrics.registry.get_sample_value("kvfabric_protocol_errors_total", {"transport": "quic"}) or 0


@pytest.mark.parametrize("garbage, what", [
    (b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 40, "bad magic"),
    (preamble(FrameType.BLOCK, 10, 2**40), "oversize payload claimed"),
    (preamble(FrameType.PULL, 1 << 20, 0), "oversize header claimed"),
    (encode(Pull(7, tuple(unknown(3))))[:-5], "truncated PULL then FIN"),
    (encode(Block(7, unknown(1)[0], b"d" * 32, b"")), "a BLOCK from a client"),
    (encode(End(7)) + encode(End(8)), "not a PULL"),
])
def test_bad_frames_close_only_their_stream(cert_dir: Path, memory_source: Any, garbage: bytes, what: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1, payload_size=30_000)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), raw_peer(cert_dir, peer.port) as raw, \
                client_of(cert_dir) as other:
            frames = await exchange(raw, garbage)
            assert len(frames) == 1 and isinstance(frames[0], Error), what
            assert frames[0].code is ErrorCode.PROTOCOL
            assert protocol_errors(server) == 1
            # Another stream on the same connection, and another client, still work.
            good = await exchange(raw, encode(Pull(9, tuple(source.addresses))))
            # Both hits in one BLOCKS frame (a run of hits is framed together), then END.
            assert [type(f) for f in good] == [Blocks, End]
            assert good[0].first == 0 and len(good[0].sizes) == 2 and len(good[0].payload) == 60_000
            assert all(isinstance(r, Hit) for r in await pull_all(other, peer, source.addresses))

    run(main())


def test_stream_stalled_mid_frame_is_timed_out_and_freed(cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(cert_dir, source, frame_timeout_s=0.3) as (server, peer), \
                raw_peer(cert_dir, peer.port) as raw:
            frames = await exchange(raw, encode(Pull(3, tuple(source.addresses)))[:11], fin=False)
            assert len(frames) == 1 and isinstance(frames[0], Error) and frames[0].code is ErrorCode.TIMEOUT
            conn = next(iter(server._connections))
            assert not any(s.decoder is not None for s in conn._streams.values())  # nothing buffered
            good = await exchange(raw, encode(Pull(4, tuple(source.addresses))))
            assert [type(f) for f in good] == [Block, End]

    run(main())


def test_server_memory_stays_bounded_under_huge_length_claims(cert_dir: Path, memory_source: Any) -> None:
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), raw_peer(cert_dir, peer.port) as raw:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            claims = [preamble(FrameType.BLOCK, 100, 4 << 30), preamble(FrameType.PULL, 2**32 - 1, 0),
                      preamble(FrameType.BLOCK, 64 * 1024, 2**63)]
            answers = await asyncio.gather(*(exchange(raw, c + b"\x00" * 64, fin=False) for c in claims))
            assert all(isinstance(a[0], Error) for a in answers)
            grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
            assert grown_kib < 64 * 1024, f"server grew by {grown_kib} KiB"
            assert protocol_errors(server) == len(claims)

    run(main())


@asynccontextmanager
async def raw_server(cert_dir: Path, answer: bytes) -> AsyncIterator[Peer]:
    """Stock aioquic server with node-a's certificate that answers every stream with `answer`
    (no FIN), whatever it was asked."""
    config = QuicConfiguration(is_client=False, alpn_protocols=[ALPN])
    config.load_cert_chain(cert_dir / "node-a.pem", cert_dir / "node-a.key")

    writers = []  # a collected StreamWriter would send FIN

    def on_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(answer)
        writers.append(writer)

    server = await serve("127.0.0.1", 0, configuration=config, stream_handler=on_stream)
    assert server._transport is not None
    try:
        yield Peer("node-a", "127.0.0.1", server._transport.get_extra_info("sockname")[1])
    finally:
        server.close()


@pytest.mark.parametrize("answer, reason, frame_timeout_s", [
    (encode(Block(1, unknown(1)[0], b"d" * 32, b"p" * 5000))[:3000], MissReason.TIMEOUT, 0.3),
    (b"\x00" * 64, MissReason.PEER_ERROR, 30.0),  # garbage is refused at once, however slow the machine
])
def test_a_server_that_stalls_or_sends_garbage_yields_misses(cert_dir: Path, answer: bytes,
                                                             reason: MissReason, frame_timeout_s: float) -> None:
    async def main() -> None:
        async with raw_server(cert_dir, answer) as peer, \
                client_of(cert_dir, frame_timeout_s=frame_timeout_s) as client:
            results = await pull_all(client, peer, unknown(2))
            assert [r.address for r in results] == unknown(2)
            assert [r.reason for r in results] == [reason] * 2  # type: ignore[union-attr]
            errors = client.metrics.registry.get_sample_value("kvfabric_protocol_errors_total",
                                                              {"transport": "quic"})
            assert errors == (1 if reason is MissReason.PEER_ERROR else None)

    run(main())


def test_a_pull_to_a_peer_that_never_answers_is_peer_gone_misses(cert_dir: Path) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
        port = transport.get_extra_info("sockname")[1]
        try:
            async with client_of(cert_dir, connect_timeout_s=0.3, metrics=TransportMetrics()) as client:
                results = await pull_all(client, Peer("node-a", "127.0.0.1", port), unknown(2))
                assert [r.reason for r in results] == [MissReason.PEER_GONE] * 2  # type: ignore[union-attr]
        finally:
            transport.close()

    run(main())



def test_slow_consumer_bounds_what_the_client_buffers(cert_dir: Path, memory_source: Any) -> None:
    """aioquic opens flow-control windows as data arrives, so the bound comes from asking for at most
    MAX_ADDRESSES_PER_STREAM addresses per stream: while the caller stalls, the server is asked for
    (and the client can be holding) no more than that many answers."""
    source = memory_source(num_blocks=192, num_layers=1, payload_size=16 * 1024)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            results: list[PullResult] = []
            async for r in client.pull(peer, source.addresses):
                results.append(r)
                if len(results) == 1:
                    await asyncio.sleep(0.5)  # the caller is busy while the server keeps sending
                    assert source.num_gets <= 64
            assert [r.address for r in results] == source.addresses
            assert all(isinstance(r, Hit) for r in results)
            assert source.num_gets == len(source.addresses)

    run(main())


def test_config_sets_datagram_size_and_flow_control_windows(cert_dir: Path, memory_source: Any) -> None:
    cfg = Config.from_dict({"transport": {"kind": "quic", "max_datagram_size": 1452, "quic_max_data": 2 << 20,
                                          "quic_max_stream_data": 1 << 20}})
    source = memory_source(num_blocks=4, num_layers=2, payload_size=300_000)

    async def main() -> None:
        server = QuicTransportServer.from_config(cfg.transport, creds(cert_dir, "node-a"), source)
        client = QuicTransportClient.from_config(cfg.transport, creds(cert_dir, "client-1"))
        for side in (server, client):
            assert (side.tuning.max_datagram_size, side.tuning.max_data, side.tuning.max_stream_data) == (
                1452, 2 << 20, 1 << 20)
        host, port = await server.start()
        try:  # 300 KB payloads through a 1 MiB stream window and Ethernet-sized datagrams
            results = await pull_all(client, Peer("node-a", host, port), source.addresses)
            assert all(isinstance(r, Hit) for r in results) and len(results) == 8
        finally:
            await client.close()
            await server.close()

    run(main())


@pytest.mark.parametrize("receive_batches", [True, False])
def test_pulls_are_byte_exact_whether_datagrams_are_taken_in_batches_or_one_by_one(
        cert_dir: Path, memory_source: Any, quic_backend: str, receive_batches: bool) -> None:
    # 1452-byte datagrams: a 1 MiB payload is ~720 of them, so GRO / recvmmsg hands over batches.
    source = memory_source(num_blocks=6, num_layers=1, payload_size=1 << 20)
    tuning = QuicTuning(1452, receive_batches=receive_batches)

    async def main() -> None:
        async with serving(cert_dir, source, backend=quic_backend, tuning=tuning) as (_, peer), \
                client_of(cert_dir, backend=quic_backend, tuning=tuning) as client:
            for _ in range(2):
                results = await pull_all(client, peer, source.addresses)
                assert [r.address for r in results] == source.addresses
                assert all(isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload
                           for r in results)

    run(main())


def test_signed_blocks_arrive_with_their_producers_record(cert_dir: Path, tmp_path: Path) -> None:
    """The producer's record travels with every layer, and a puller that has never met the producer
    verifies it from the certificate the frames carry."""
    check_signed_pull(cert_dir, tmp_path, serving, client_of)


def test_a_pull_under_another_namespace_gets_misses(cert_dir: Path, tmp_path: Path) -> None:
    """A puller that knows a block's address but asks under another namespace root gets no bytes."""
    check_namespaced_pull(cert_dir, tmp_path, serving, client_of)


def test_a_node_restricted_to_tenants_reads_only_their_roots(cert_dir: Path, tmp_path: Path,
                                                             quic_backend: str) -> None:
    check_tenant_restricted_pull(cert_dir, tmp_path, functools.partial(serving, backend=quic_backend),
                                 functools.partial(client_of, backend=quic_backend))


@pytest.mark.parametrize(("setting", "expected"), [("auto", "qh3"), ("aioquic", "aioquic"), ("qh3", "qh3")])
def test_the_quic_backend_setting_picks_the_library(cert_dir: Path, memory_source: Any, setting: str,
                                                    expected: str) -> None:
    config = Config.from_dict({"transport": {"quic_backend": setting}}).transport
    server = QuicTransportServer.from_config(config, creds(cert_dir, "node-a"), memory_source())
    client = QuicTransportClient.from_config(config, creds(cert_dir, "client-1"))
    assert server.backend.name == client.backend.name == expected
