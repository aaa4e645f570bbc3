"""Hostile peers against real servers on 127.0.0.1: each attack as a test that a server without the
protocol sessions' deadlines and the servers' bounds fails.

Budget: about 15 s on 2 cores (the slowloris cases wait out a 0.5 s frame deadline, the stream
that ends right after its PULL runs against a node in its own process, the half-open cases wait
out a 1 s handshake timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from support import closing, creds, node_process, pull_all, raw_peer, run, started, wait_until

from benchmarks.lib.hostile_attacks import hold_half_open
from benchmarks.lib.soak_node import address
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.core.codec import Bye, Error, ErrorCode, Frame, FrameDecoder, Hello, Miss, MissReason, Pull, encode
from transports.core.serving import BATCH_BYTES
from transports.quic import ALPN, QuicTransportClient, QuicTransportServer
from transports.tls.client import TlsTcpClient
from transports.tls.server import SERVER_WRITE_HIGH, TlsTcpServer

MemorySourceFactory = Any   # tests/transports/conftest.py: memory_source(num_blocks, num_layers, payload_size)


def client_context(cert_dir: Path, cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(cert_dir / "ca.pem"))
    ctx.load_cert_chain(cert, key)
    return ctx


async def tls_raw(cert_dir: Path, peer: Peer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    ctx = client_context(cert_dir, cert_dir / "client-1.pem", cert_dir / "client-1.key")
    return await asyncio.open_connection(peer.host, peer.port, ssl=ctx, server_hostname=peer.node)


def test_tls_slowloris_is_cut_by_the_total_frame_deadline(cert_dir: Path) -> None:
    """Slowloris: one byte every 0.1 s would keep a frame open forever if frame_timeout_s counted
    from the last byte. With a 0.5 s total deadline the server closes within about a second."""
    class Empty:
        def get_block(self, address: BlockAddress) -> None:
            return None

    async def main() -> None:
        async with started(TlsTcpServer(creds(cert_dir, "node-a"), Empty(), frame_timeout_s=0.5), "node-a") as \
                (server, peer):
            _, writer = await tls_raw(cert_dir, peer)
            loop = asyncio.get_running_loop()
            start = loop.time()
            data = encode(Hello("client-1"))
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                for i in range(len(data) - 1):   # never completes the frame
                    writer.write(data[i:i + 1])
                    await writer.drain()
                    await asyncio.sleep(0.1)
                    if server.num_connections == 0:
                        break
            assert server.num_connections == 0 and loop.time() - start < 1.5
            writer.close()

    run(main())


def test_a_node_gets_at_most_max_connections_per_peer(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        server = TlsTcpServer(creds(cert_dir, "node-a"), source, max_connections_per_peer=3)
        async with started(server, "node-a") as (_, peer):
            conns = [await tls_raw(cert_dir, peer) for _ in range(5)]
            for _, writer in conns:
                writer.write(encode(Hello("client-1")))
            await wait_until(lambda: server.num_connections == 3)
            await asyncio.sleep(0.1)
            assert server.num_connections == 3
            refused = server.metrics.registry.get_sample_value(
                "kvfabric_auth_failures_total", {"transport": "tls-tcp", "reason": "too_many_connections"})
            assert refused == 2
            # The refused ones are told why (ERROR overloaded), not just closed; the others got HELLO.
            answers = [FrameDecoder().feed(await asyncio.wait_for(reader.read(4096), 5)) for reader, _ in conns]
            assert sorted(type(a[0]).__name__ for a in answers) == ["Error", "Error", "Hello", "Hello", "Hello"]
            assert all(a[0].code is ErrorCode.OVERLOADED for a in answers if isinstance(a[0], Error))
            for _, writer in conns:
                writer.close()

    run(main())


def test_peers_that_do_not_read_make_the_server_buffer_a_bounded_amount(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """A peer that never reads must not make the server queue a batch per PULL in flight without
    bound: what waits to be sent per connection stays under the send high-water mark plus one batch."""
    source = memory_source(num_blocks=64, num_layers=1, payload_size=256 * 1024)   # 16 MiB

    async def main() -> None:
        server = TlsTcpServer(creds(cert_dir, "node-a"), source, max_connections_per_peer=8)
        async with started(server, "node-a") as (_, peer):
            def dial() -> ssl.SSLSocket:   # blocking: runs in a thread while the server's loop serves
                ctx = client_context(cert_dir, cert_dir / "client-1.pem", cert_dir / "client-1.key")
                sock = socket.create_connection((peer.host, peer.port))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # and never read
                tls = ctx.wrap_socket(sock, server_hostname=peer.node)
                pulls = b"".join(encode(Pull(rid, tuple(source.addresses))) for rid in range(1, 33))
                tls.sendall(encode(Hello("client-1")) + pulls)
                return tls

            conns = [await asyncio.to_thread(dial) for _ in range(4)]
            await wait_until(lambda: server.num_connections == 4)
            await asyncio.sleep(0.5)   # let the pumps run until the sockets push back
            queued = [c.link.write_pending and c.link._queued_bytes() for c in server._connections]  # type: ignore[attr-defined]
            bound = SERVER_WRITE_HIGH + BATCH_BYTES + 256 * 1024
            assert max(queued) <= bound, (queued, bound)
            # and a well-behaved client is still served
            async with closing(TlsTcpClient(creds(cert_dir, "client-1"))) as client:
                results = await pull_all(client, peer, source.addresses[:4])
                assert all(isinstance(r, Hit) for r in results)
            for tls in conns:
                tls.close()

    run(main())


@pytest.mark.parametrize("error", [OSError(errno.ECONNABORTED, "Software caused connection abort"),
                                   MemoryError()], ids=["econnaborted", "memory_error"])
def test_accept_loop_survives_transient_accept_errors(cert_dir: Path, memory_source: MemorySourceFactory,
                                                      error: BaseException) -> None:
    """An OSError other than EMFILE/… (e.g. ECONNABORTED) must not end the accept loop, and neither
    may an exception that is not an OSError (e.g. MemoryError). Neither can be caused on
    demand on loopback, so `_accept` raises it once (a stand-in)."""
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        server = TlsTcpServer(creds(cert_dir, "node-a"), source)
        real_accept = server._accept
        raised: list[bool] = []

        async def flaky(lsock: socket.socket) -> tuple[socket.socket, tuple[str, int]]:
            if not raised:
                raised.append(True)
                raise error
            return await real_accept(lsock)

        server._accept = flaky  # type: ignore[method-assign]
        async with started(server, "node-a") as (_, peer), \
                closing(TlsTcpClient(creds(cert_dir, "client-1"))) as client:
            results = await pull_all(client, peer, source.addresses)
            assert all(isinstance(r, Hit) for r in results) and server.num_accept_errors == 1

    run(main())


def _open_files() -> set[tuple[str, str]]:
    """This process's open descriptors, each with what it points at (a socket's inode among them)."""
    found = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):   # the listing's own descriptor is gone already
            found.add((fd.name, os.readlink(fd)))
    return found


def test_server_that_cannot_bind_leaks_no_socket(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        before = _open_files()
        server = TlsTcpServer(creds(cert_dir, "node-a"), source, port=port)
        try:
            await server.start()
            raise AssertionError("bind should have failed")
        except OSError:
            pass
        # Files opened meanwhile and still open (an earlier test's objects may be collected and
        # close theirs meanwhile: only new ones count, whatever descriptor numbers they reuse).
        assert _open_files() - before == set()
        await server.close()
        blocker.close()

    run(main())


def test_quic_block_over_the_client_limit_is_a_fast_miss_and_the_rest_is_served(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """A stored block over the client's payload limit must not drop the QUIC stream (every address of
    the pull would time out): that block is a MISS and the rest is served."""
    source = memory_source(num_blocks=1, num_layers=1, payload_size=1000)
    big = BlockAddress(BlockHash(b"\x01" * 32), 0)
    source.put(big, b"x" * 300_000)

    class Broken:
        def get_block(self, address: BlockAddress) -> Any:
            if address.layer == 7:
                raise ValueError("a bug behind the store")
            return source.get_block(address)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), Broken(), max_payload=200_000)
        broken = BlockAddress(BlockHash(b"\x02" * 32), 7)
        async with started(server, "node-a") as (_, peer), \
                closing(QuicTransportClient(creds(cert_dir, "client-1"), frame_timeout_s=3.0)) as client:
            loop = asyncio.get_running_loop()
            start = loop.time()
            results = await pull_all(client, peer, [big, source.addresses[0], broken])
            assert loop.time() - start < 1.0
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.TOO_LARGE
            assert isinstance(results[1], Hit)
            assert isinstance(results[2], Miss) and results[2].reason is MissReason.SOURCE_ERROR

    run(main())


def test_quic_slowloris_stream_is_cut_by_the_total_frame_deadline(
        cert_dir: Path, memory_source: MemorySourceFactory, quic_backend: str) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), source, frame_timeout_s=0.5, backend=quic_backend)
        async with started(server, "node-a") as (_, peer):
            config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name="node-a")
            config.load_verify_locations(cadata=(cert_dir / "ca.pem").read_bytes())
            config.load_cert_chain(cert_dir / "client-1.pem", cert_dir / "client-1.key")
            from aioquic.asyncio.client import connect
            async with connect("127.0.0.1", peer.port, configuration=config) as protocol:
                reader, writer = await protocol.create_stream()
                data = encode(Pull(1, tuple(source.addresses)))
                loop = asyncio.get_running_loop()
                start = loop.time()
                got = b""

                async def dribble() -> None:
                    with contextlib.suppress(RuntimeError):   # the server reset the stream
                        for i in range(len(data) - 1):
                            writer.write(data[i:i + 1])
                            await asyncio.sleep(0.1)

                task = asyncio.create_task(dribble())
                got = await asyncio.wait_for(reader.read(), 5)   # until the server's FIN
                task.cancel()
                # the server stopped or reset the stream: no FIN to send (which aioquic reports either way)
                with contextlib.suppress(RuntimeError, ValueError):
                    writer.close()
                frames = FrameDecoder().feed(got)
                assert isinstance(frames[0], Error) and frames[0].code is ErrorCode.TIMEOUT
                assert loop.time() - start < 1.5

    run(main())


def flood_initials(port: int, count: int) -> None:
    """`count` real QUIC Initials (ClientHellos) from one socket, each a new connection that never goes on."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name="node-a")
    for _ in range(count):
        quic = QuicConnection(configuration=config)
        quic.connect(("127.0.0.1", port), now=0.0)
        for data, addr in quic.datagrams_to_send(now=0.0):
            sock.sendto(data, addr)
    sock.close()


def test_quic_initial_flood_keeps_no_state_with_retry_and_is_capped_without(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """An unauthenticated Initial flood must not make a connection per Initial (memory, then an
    event-loop stall when they expire). With Retry (the default) they make none; without it, at most `max_half_open`."""
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        for retry, cap in ((True, 16), (False, 16)):
            server = QuicTransportServer(creds(cert_dir, "node-a"), source, retry=retry, max_half_open=cap,
                                         idle_timeout_s=1.0)
            async with started(server, "node-a") as (_, peer), \
                    closing(QuicTransportClient(creds(cert_dir, "client-1"))) as client:
                await asyncio.to_thread(flood_initials, peer.port, 200)
                await asyncio.sleep(0.3)
                assert len(server._connections) <= (0 if retry else cap)
                if not retry:
                    assert server.num_dropped_initials > 0
                    await wait_until(lambda s=server, c=cap: s.num_half_open < c, 5)  # type: ignore[misc]   # half-open ones expire
                results = await pull_all(client, peer, source.addresses)
                assert all(isinstance(r, Hit) for r in results)

    run(main())


@pytest.mark.parametrize("last", [Bye("done"), Error(1, ErrorCode.INTERNAL, "gave up")], ids=["bye", "error"])
def test_a_quic_stream_ending_right_after_its_pull_leaves_the_node_serving(cert_dir: Path, last: Frame) -> None:
    """A PULL followed at once by BYE (or ERROR) on one stream: the session closed without a frame
    to send and the server's pump re-queued the stream forever, so the node's loop spun, neither
    transport answered and SIGTERM went unheard. Now the stream is ended and the node goes on."""
    wanted = [address(i) for i in range(4)]
    with node_process(cert_dir) as node:
        async def main() -> None:
            async with raw_peer(cert_dir, node.quic.port) as raw:
                reader, writer = await raw.create_stream()
                writer.write(encode(Pull(1, tuple(wanted))) + encode(last))
                writer.write_eof()
                assert await asyncio.wait_for(reader.read(), 5) == b""   # ended; nobody waits for answers
            async with closing(QuicTransportClient(creds(cert_dir, "client-1"), frame_timeout_s=5.0)) as quic, \
                    closing(TlsTcpClient(creds(cert_dir, "client-1"), frame_timeout_s=5.0)) as tls:
                assert all(isinstance(r, Hit) for r in await pull_all(quic, node.quic, wanted))
                assert all(isinstance(r, Hit) for r in await pull_all(tls, node.tls, wanted))

        run(main())
        status, printed = node.terminate()
        assert status == 0 and "STOPPED" in printed


def test_half_open_handshakes_from_one_address_do_not_lock_out_another(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """128 handshakes that answer the Retry, from one address, filled the node-wide half-open cap for
    the whole idle timeout: every new client was dropped before its Retry. Now one address holds at
    most its own share, a client from another address connects, and half-open connections expire
    after the handshake timeout, not the idle timeout."""
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), source, idle_timeout_s=30.0,
                                     handshake_timeout_s=1.0)
        async with started(server, "node-a") as (_, peer), \
                closing(QuicTransportClient(creds(cert_dir, "client-1"), connect_timeout_s=3.0)) as client:
            answered = await asyncio.to_thread(hold_half_open, peer.port, 128, "127.0.0.2")
            assert answered == 128
            assert 0 < server.num_half_open <= server.max_half_open_per_address
            results = await pull_all(client, peer, source.addresses)   # from 127.0.0.1
            assert all(isinstance(r, Hit) for r in results)
            await wait_until(lambda: server.num_half_open == 0, 5)

    run(main())


def test_half_open_handshakes_are_bounded_in_total(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        server = QuicTransportServer(creds(cert_dir, "node-a"), source, max_half_open=12,
                                     max_half_open_per_address=4, handshake_timeout_s=5.0)
        async with started(server, "node-a") as (_, peer):
            for i in range(2, 7):
                await asyncio.to_thread(hold_half_open, peer.port, 8, f"127.0.0.{i}")
            assert server.num_half_open == 12 and server.num_dropped_initials > 0

    run(main())


@pytest.mark.parametrize("transport", ["quic", "tls-tcp"])
def test_a_block_over_the_clients_payload_limit_is_its_own_miss(
        cert_dir: Path, memory_source: MemorySourceFactory, transport: str) -> None:
    """The client's limit (1 MiB) reaches the server, which answers the stored 2 MiB block with
    MISS(too_large); the other addresses of the pull arrive. Over QUIC the server used its own
    limit, the client's decoder refused the frame and every address became a peer_error miss."""
    source = memory_source(num_blocks=2, num_layers=1, payload_size=64 * 1024)
    big = BlockAddress(BlockHash(b"\x03" * 32), 0)
    source.put(big, os.urandom(2 * 1024 * 1024))
    small = source.addresses[:2]
    server_class, client_class = ((QuicTransportServer, QuicTransportClient) if transport == "quic"
                                  else (TlsTcpServer, TlsTcpClient))

    async def main() -> None:
        client = client_class(creds(cert_dir, "client-1"), max_payload=1024 * 1024, frame_timeout_s=5.0)
        async with started(server_class(creds(cert_dir, "node-a"), source), "node-a") as (server, peer), \
                closing(client):
            results = await pull_all(client, peer, [small[0], big, small[1]])
            assert isinstance(results[0], Hit) and isinstance(results[2], Hit)
            assert isinstance(results[1], Miss) and results[1].reason is MissReason.TOO_LARGE
            assert server.metrics.registry.get_sample_value(
                "kvfabric_served_total", {"transport": transport, "outcome": "too_large"}) == 1

    run(main())
