"""TLS-TCP transport over real loopback sockets: pulls, limits, bad peers and certificates."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import blake3
import pytest
from cryptography import x509
from support import (
    check_namespaced_pull,
    check_signed_pull,
    check_tenant_restricted_pull,
    closing,
    creds,
    filled_store,
    pull_all,
    run,
    started,
    wait_until,
)
from testkit import Pki

from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer, PullResult
from transports.core.buffers import uninitialised_bytearray
from transports.core.codec import (
    VERSION,
    Block,
    End,
    Error,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameType,
    Hello,
    Miss,
    MissReason,
    Pull,
    encode,
)
from transports.core.encoder import MAGIC, PREAMBLE
from transports.core.metrics import TransportMetrics
from transports.core.serving import SLOW_STREAK
from transports.tls import client as tls_client
from transports.tls import server as tls_server
from transports.tls.client import ADDRESSES_PER_PULL, TlsTcpClient
from transports.tls.handshake import open_tls
from transports.tls.link import READ_BUDGET, TRANSPORT
from transports.tls.server import TlsTcpServer
from transports.trust.certs import issue_node

Scenario = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
# Fixtures of tests/transports/conftest.py (not importable as a module: tests/ is no package).
MemorySource = Any          # dict-backed BlockSource: .put, .get_block, .blocks, .addresses, .num_gets
MemorySourceFactory = Any   # memory_source(num_blocks, num_layers, payload_size) -> MemorySource
ForeignCerts = Any          # openssl-made material: .ca, .client_cert/.client_key, .server_cert/.server_key
EXPIRED_NODE = "expired-1"


def auth_failures(metrics: TransportMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("kvfabric_auth_failures_total",
                                              {"transport": TRANSPORT, "reason": reason})
    return value or 0.0


def protocol_errors(metrics: TransportMetrics) -> float:
    return metrics.registry.get_sample_value("kvfabric_protocol_errors_total", {"transport": TRANSPORT}) or 0.0


def serving(cert_dir: Path, source: Any, node: str = "node-a", port: int = 0,
            **kw: Any) -> AbstractAsyncContextManager[tuple[TlsTcpServer, Peer]]:
    return started(TlsTcpServer(creds(cert_dir, node), source, "127.0.0.1", port, **kw), node)


def client_of(cert_dir: Path, node: str = "client-1", **kw: Any) -> AbstractAsyncContextManager[TlsTcpClient]:
    return closing(TlsTcpClient(creds(cert_dir, node), **kw))


def assert_hits(results: list[PullResult], source: MemorySource, addresses: list[BlockAddress]) -> None:
    assert [r.address for r in results] == addresses
    for r in results:
        assert isinstance(r, Hit), r
        assert bytes(r.payload) == source.blocks[r.address].payload


# --- raw peers built from the codec ---------------------------------------------------------------


def client_context(cert_dir: Path, cert: Path | None, key: Path | None, ca: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(ca or cert_dir / "ca.pem"))
    if cert is not None:
        ctx.load_cert_chain(cert, key)
    return ctx


async def raw_connect(cert_dir: Path, peer: Peer, node: str = "client-1") -> tuple[asyncio.StreamReader,
                                                                                    asyncio.StreamWriter]:
    ctx = client_context(cert_dir, cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    return await asyncio.open_connection(peer.host, peer.port, ssl=ctx, server_hostname=peer.node)


async def read_frames(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> list[Frame]:
    """Frames until the peer closes (or resets) the connection."""
    decoder, frames = FrameDecoder(), []
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                data = await reader.read(65536)
            except (ConnectionError, ssl.SSLError):
                break
            if not data:
                break
            frames += decoder.feed(data)
    return frames


@asynccontextmanager
async def fake_server(ctx: ssl.SSLContext, scenario: Scenario) -> AsyncIterator[int]:
    """A TLS server that plays `scenario` instead of the real answer logic."""
    server = await asyncio.start_server(scenario, "127.0.0.1", 0, ssl=ctx)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


async def read_pull(reader: asyncio.StreamReader) -> Pull:
    decoder = FrameDecoder()
    frames: list[Frame] = []
    while not any(isinstance(f, Pull) for f in frames):
        frames += decoder.feed(await reader.read(65536))
    pull = next(f for f in frames if isinstance(f, Pull))
    return pull


# --- pulls ------------------------------------------------------------------------------------------



def test_pulls_many_blocks_verified_in_order(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=24, num_layers=4, payload_size=48 * 1024)
    for _ in range(3):  # a few 1 MiB payloads take the receive-into-payload path
        source.put(BlockAddress(BlockHash(os.urandom(32)), 0), os.urandom(1 << 20))

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), \
                client_of(cert_dir) as client:
            results = await pull_all(client, peer, source.addresses)
            assert_hits(results, source, source.addresses)
            pulled = client.metrics.registry.get_sample_value(
                "kvfabric_pull_bytes_total", {"transport": TRANSPORT})
            assert pulled == sum(len(b.payload) for b in source.blocks.values())
            served = server.metrics.registry.get_sample_value(
                "kvfabric_served_total", {"transport": TRANSPORT, "outcome": "hit"})
            assert served == len(source.blocks)

    run(main())


def test_blocks_of_mixed_sizes_and_misses_arrive_byte_exact(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """Runs of small hits travel as BLOCKS frames whose parts are queued as TLS records without
    being joined: every size around the record boundaries (0 B, 1 B, 16 KiB +- 1, 24 KiB, 64 KiB,
    over GROUP_PART_MAX) and misses between them must come out byte-exact, in order."""
    source = memory_source(num_blocks=0)
    sizes = [0, 1, 16383, 16384, 16385, 24 * 1024, 65536, 100, 200_000, 7, 32768, 16384 * 3 + 5] * 6
    for size in sizes:
        source.put(BlockAddress(BlockHash(os.urandom(32)), 0), os.urandom(size))
    asked = list(source.addresses)
    for i in range(5, len(asked), 17):
        asked.insert(i, BlockAddress(BlockHash(os.urandom(32)), 0))   # not stored: a MISS breaks the run

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            for _ in range(2):   # the second pull reuses the connection with records queued back to back
                results = await pull_all(client, peer, asked)
                assert [r.address for r in results] == asked
                for r in results:
                    stored = source.blocks.get(r.address)
                    if stored is None:
                        assert isinstance(r, Miss) and r.reason is MissReason.NOT_FOUND
                    else:
                        assert isinstance(r, Hit) and bytes(r.payload) == stored.payload

    run(main())


def test_a_pull_into_slots_receives_hits_in_place(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """`pull(..., into=slots)`: payloads land in their slots over real TLS, no copy on the client
    (a store fetch batch, 1 MiB and the block crossing it, is one BLOCKS frame)."""
    source = memory_source(num_blocks=40, num_layers=3, payload_size=24 * 1024)
    asked = source.addresses
    missing = BlockAddress(BlockHash(os.urandom(32)), 0)
    asked = [*asked[:50], missing, *asked[50:]]
    slots = bytearray(len(asked) * 24 * 1024)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            results = await pull_all_into(client, peer, asked, memoryview(slots))
            placed = []
            for i, r in enumerate(results):
                if r.address == missing:
                    assert isinstance(r, Miss)
                    continue
                assert isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload
                if isinstance(r.payload, memoryview) and r.payload.obj is slots:
                    placed.append(i)
                    assert bytes(slots[i * 24 * 1024:(i + 1) * 24 * 1024]) == source.blocks[r.address].payload
            assert sorted(set(range(len(asked))) - set(placed)) == [50]   # all but the miss

    run(main())


def test_a_pull_into_slots_receives_large_blocks_in_place(cert_dir: Path,
                                                           memory_source: MemorySourceFactory) -> None:
    """Blocks over the BLOCKS part size travel one per BLOCK frame: they land in their slots too."""
    size = 512 * 1024
    source = memory_source(num_blocks=4, num_layers=2, payload_size=size)
    asked = source.addresses
    slots = bytearray(len(asked) * size)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            results = await pull_all_into(client, peer, asked, memoryview(slots))
            assert [r.address for r in results] == asked
            for i, r in enumerate(results):
                assert isinstance(r, Hit) and isinstance(r.payload, memoryview) and r.payload.obj is slots
                assert bytes(slots[i * size:(i + 1) * size]) == source.blocks[r.address].payload

    run(main())


async def pull_all_into(client: TlsTcpClient, peer: Peer, addresses: list[BlockAddress],
                        into: memoryview) -> list[PullResult]:
    return [r async for r in client.pull(peer, addresses, into=into)]


def test_uninitialised_payload_buffers_hold_exactly_the_received_bytes() -> None:
    # Dirty the heap with freed 0xff-filled buffers of the payload size, so that unzeroed
    # allocations likely reuse them; every decoded payload must still be exactly what was sent.
    size = 300_000
    for _ in range(4):
        junk = bytearray(b"\xff" * size)
        del junk
    fresh = uninitialised_bytearray(size)
    assert isinstance(fresh, bytearray) and len(fresh) == size
    assert uninitialised_bytearray(0) == bytearray()
    payloads = [os.urandom(size) for _ in range(3)]
    wire = b"".join(encode(Block(1, BlockAddress(BlockHash(os.urandom(32)), i), blake3.blake3(p).digest(), p))
                    for i, p in enumerate(payloads))
    decoder = FrameDecoder(payload_allocator=uninitialised_bytearray)
    frames: list[Frame] = []
    pos = 0
    while pos < len(wire):  # the way TlsLink drives it: reads of at most one TLS record
        buf = decoder.get_buffer()
        n = min(len(buf), 16 * 1024 - 7, len(wire) - pos)
        buf[:n] = wire[pos:pos + n]
        pos += n
        frames += decoder.buffer_updated(n)
    assert [bytes(f.payload) for f in frames if isinstance(f, Block)] == payloads


def test_misses_keep_their_place(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=3, num_layers=2)
    unknown = [BlockAddress(BlockHash(os.urandom(32)), 0) for _ in range(2)]
    asked = [source.addresses[0], unknown[0], *source.addresses[1:4], unknown[1]]

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as client:
            results = await pull_all(client, peer, asked)
            # the server counts misses by reason, as the QUIC server does (it used to lump them as "miss")
            served = server.metrics.registry.get_sample_value(
                "kvfabric_served_total", {"transport": TRANSPORT, "outcome": MissReason.NOT_FOUND.value})
            assert served == 2
        assert [r.address for r in results] == asked
        assert [isinstance(r, Hit) for r in results] == [True, False, True, True, True, False]
        assert {r.reason for r in results if isinstance(r, Miss)} == {MissReason.NOT_FOUND}

    run(main())


def test_concurrent_pulls_share_one_connection(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=32, num_layers=2, payload_size=32 * 1024)
    groups = [source.addresses[i::8] for i in range(8)]

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as client:
            all_results = await asyncio.gather(*(pull_all(client, peer, g) for g in groups))
            for group, results in zip(groups, all_results, strict=True):
                assert_hits(results, source, group)
            assert client.num_connects == 1
            assert server.num_connections == 1

    run(main())


def test_pull_larger_than_one_frame_is_split(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=ADDRESSES_PER_PULL + 300, num_layers=1, payload_size=64)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)

    run(main())


def test_abandoned_pull_leaves_the_connection_usable(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=8, num_layers=2, payload_size=256 * 1024)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            async for _ in client.pull(peer, source.addresses):
                break  # the rest of the answer still arrives and must be skipped cleanly
            assert_hits(await pull_all(client, peer, source.addresses[:3]), source, source.addresses[:3])
            assert client.num_connects == 1
            assert protocol_errors(client.metrics) == 0

    run(main())


def test_server_limits_requests_in_flight(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=20, num_layers=2, payload_size=64 * 1024)
    groups = [source.addresses[i::10] for i in range(10)]

    async def main() -> None:
        async with serving(cert_dir, source, max_inflight=2) as (server, peer), client_of(cert_dir) as client:
            all_results = await asyncio.gather(*(pull_all(client, peer, g) for g in groups))
            for group, results in zip(groups, all_results, strict=True):
                assert_hits(results, source, group)
            assert 1 <= server.peak_inflight <= 2

    run(main())


def test_serves_from_the_real_store(cert_dir: Path, tmp_path: Path) -> None:
    async def main() -> None:
        with filled_store(tmp_path) as (store, payloads):
            async with serving(cert_dir, store) as (_, peer), client_of(cert_dir) as client:
                results = await pull_all(client, peer, list(payloads))
        assert [r.address for r in results] == list(payloads)
        assert all(isinstance(r, Hit) and bytes(r.payload) == payloads[r.address] for r in results)

    run(main())


# --- misbehaving servers ---------------------------------------------------------------------------



def test_lying_server_payload_is_a_counted_miss(cert_dir: Path) -> None:
    good, bad = os.urandom(70_000), os.urandom(70_000)
    a_good, a_bad = (BlockAddress(BlockHash(os.urandom(32)), 0) for _ in range(2))

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pull = await read_pull(reader)
        writer.write(encode(Hello("node-a")))
        writer.write(encode(Block(pull.request_id, a_bad, blake3.blake3(b"something else").digest(), bad)))
        writer.write(encode(Block(pull.request_id, a_good, blake3.blake3(good).digest(), good)))
        writer.write(encode(End(pull.request_id)))
        await writer.drain()
        await reader.read()  # until the client leaves

    async def main() -> None:
        async with fake_server(creds(cert_dir, "node-a").ssl_context(True), liar) as port, \
                client_of(cert_dir) as client:
            results = await pull_all(client, Peer("node-a", "127.0.0.1", port), [a_bad, a_good])
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.DIGEST_MISMATCH
            assert isinstance(results[1], Hit) and bytes(results[1].payload) == good
            assert client.metrics.digest_mismatches(TRANSPORT) == 1

    run(main())


@pytest.mark.parametrize("whole,payload,cut", [(0, 100_000, 5000), (1, 2 << 20, 600_000)],
                         ids=["inside-the-first-frame", "inside-a-large-payload-while-the-client-reads-ahead"])
def test_server_stalling_mid_frame_times_out(cert_dir: Path, whole: int, payload: int, cut: int) -> None:
    """A server that stops inside a frame: the pull ends in TIMEOUT misses at the frame deadline,
    after hits for the `whole` blocks sent before it. With blocks due after the one being received,
    the client lets the kernel gather that payload (SO_RCVLOWAT); a stall short of it ends the same."""
    addresses = [BlockAddress(BlockHash(os.urandom(32)), 0) for _ in range(3)]
    first = os.urandom(1 << 20)

    async def staller(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pull = await read_pull(reader)
        sent = encode(Hello("node-a"))
        if whole:
            sent += encode(Block(pull.request_id, addresses[0], blake3.blake3(first).digest(), first))
        frame = encode(Block(pull.request_id, addresses[whole], b"\0" * 32, os.urandom(payload)))
        writer.write(sent + frame[:cut])  # then nothing more
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with fake_server(creds(cert_dir, "node-a").ssl_context(True), staller) as port, \
                client_of(cert_dir, frame_timeout_s=0.3) as client:
            start = asyncio.get_running_loop().time()
            results = await pull_all(client, Peer("node-a", "127.0.0.1", port), addresses)
            assert asyncio.get_running_loop().time() - start < 10  # the frame timeout, not the 30 s idle one
        assert all(isinstance(r, Hit) and bytes(r.payload) == first for r in results[:whole])
        assert [r.reason for r in results[whole:] if isinstance(r, Miss)] == [MissReason.TIMEOUT] * (3 - whole)

    run(main())


# --- misbehaving clients ---------------------------------------------------------------------------


def _preamble(ftype: FrameType, header_len: int, payload_len: int, magic: bytes = MAGIC) -> bytes:
    return PREAMBLE.pack(magic, VERSION, int(ftype), 0, header_len, payload_len)


BAD_INPUTS = {
    "bad_magic": b"HTTP/1.1 GET /\r\n\r\n" + b"\0" * 16,
    "oversize_payload": _preamble(FrameType.BLOCK, 10, 1 << 30),      # refused before any payload
    "oversize_header": _preamble(FrameType.PULL, 10 << 20, 0),
    "malformed_header": _preamble(FrameType.PULL, 4, 0) + b"\xc1\xc1\xc1\xc1",
    "unknown_frame_type": _preamble(FrameType.PULL, 1, 0)[:5] + bytes([99]) + _preamble(FrameType.PULL, 1, 0)[6:],
    "frame_a_client_may_not_send": encode(End(7)),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_frames_get_error_and_close_only_that_connection(
        cert_dir: Path, memory_source: MemorySourceFactory, name: str) -> None:
    source = memory_source(num_blocks=4, num_layers=2)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as good:
            assert_hits(await pull_all(good, peer, source.addresses[:2]), source, source.addresses[:2])
            reader, writer = await raw_connect(cert_dir, peer)
            writer.write(encode(Hello("client-1")) + BAD_INPUTS[name])
            frames = await read_frames(reader)
            writer.close()
            errors = [f for f in frames if isinstance(f, Error)]
            assert errors and errors[-1].code is ErrorCode.PROTOCOL and errors[-1].request_id == 0
            assert protocol_errors(server.metrics) == 1
            await wait_until(lambda: server.num_connections == 1)
            assert_hits(await pull_all(good, peer, source.addresses), source, source.addresses)
            assert good.num_connects == 1  # the good client's connection was never disturbed

    run(main())


@pytest.mark.parametrize("ending", ["close_notify", "tcp_fin_only"])
def test_truncated_frame_is_a_protocol_error(cert_dir: Path, memory_source: MemorySourceFactory,
                                             ending: str) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as good:
            _, writer = await raw_connect(cert_dir, peer)
            pull = encode(Pull(1, tuple(source.addresses)))
            writer.write(encode(Hello("client-1")) + pull[: len(pull) // 2])
            await writer.drain()
            # The connection ends inside the frame: with a TLS close_notify, or with a bare TCP FIN
            # (what a crashed peer leaves; OpenSSL reports it as an EOF error, not as 0 bytes).
            if ending == "close_notify":
                writer.close()
            else:
                writer.get_extra_info("socket").shutdown(socket.SHUT_WR)
            await wait_until(lambda: protocol_errors(server.metrics) == 1)
            await wait_until(lambda: server.num_connections == 0)
            assert_hits(await pull_all(good, peer, source.addresses), source, source.addresses)

    run(main())


def test_client_stalling_mid_frame_is_timed_out(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source, frame_timeout_s=0.3) as (server, peer):
            reader, writer = await raw_connect(cert_dir, peer)
            writer.write(encode(Hello("client-1")) + encode(Pull(1, tuple(source.addresses)))[:30])
            start = asyncio.get_running_loop().time()
            frames = await read_frames(reader, timeout_s=15)
            assert asyncio.get_running_loop().time() - start < 10  # the frame timeout, not the 30 s idle one
            assert any(isinstance(f, Error) and f.code is ErrorCode.TIMEOUT for f in frames)
            await wait_until(lambda: server.num_connections == 0)
            writer.close()

    run(main())


def test_hello_must_match_the_certificate(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer):
            reader, writer = await raw_connect(cert_dir, peer)
            writer.write(encode(Hello("node-b")) + encode(Pull(1, tuple(source.addresses))))
            frames = await read_frames(reader)
            writer.close()
            assert not any(isinstance(f, Block) for f in frames)
            assert any(isinstance(f, Error) and f.code is ErrorCode.UNAUTHORIZED for f in frames)
            assert auth_failures(server.metrics, "hello_mismatch") == 1

    run(main())


# --- certificates ----------------------------------------------------------------------------------


def _refused_client(cert_dir: Path, foreign: ForeignCerts, kind: str) -> tuple[ssl.SSLContext, str, str]:
    """(client context, the server's auth failure reason, the node its HELLO names)."""
    if kind == "no_certificate":
        return client_context(cert_dir, None, None), "no_certificate", "client-1"
    if kind == "openssl_foreign_ca":
        return client_context(cert_dir, foreign.client_cert, foreign.client_key), "untrusted", "intruder"
    if kind in ODD_REASONS:  # signed by the cluster CA, yet no client node certificate
        return client_context(cert_dir, cert_dir / f"{kind}.pem", cert_dir / f"{kind}.key"), ODD_REASONS[kind], kind
    return (client_context(cert_dir, cert_dir / f"{EXPIRED_NODE}.pem", cert_dir / f"{EXPIRED_NODE}.key"), "expired",
            EXPIRED_NODE)


ODD_REASONS = {"rogue-ca": "bad_certificate", "server-only": "untrusted"}


@pytest.mark.parametrize("kind", ["no_certificate", "openssl_foreign_ca", "expired", *ODD_REASONS])
def test_server_refuses_clients_without_a_valid_certificate(
        odd_certs: Path, openssl_foreign: ForeignCerts, memory_source: MemorySourceFactory, kind: str) -> None:
    cert_dir = odd_certs
    source = memory_source(num_blocks=2, num_layers=1)
    ctx, reason, hello_node = _refused_client(cert_dir, openssl_foreign, kind)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as good:
            frames: list[Frame] = []
            try:  # TLS 1.3: the client may finish its side before the server's refusal arrives
                reader, writer = await asyncio.open_connection(peer.host, peer.port, ssl=ctx,
                                                               server_hostname="node-a")
                writer.write(encode(Hello(hello_node)) + encode(Pull(1, tuple(source.addresses))))
                frames = await read_frames(reader)
                writer.close()
            except (ssl.SSLError, ConnectionError):
                pass
            assert not any(isinstance(f, Block) for f in frames)
            await wait_until(lambda: auth_failures(server.metrics, reason) == 1)
            assert server.num_connections == 0
            assert_hits(await pull_all(good, peer, source.addresses), source, source.addresses)

    run(main())


def test_client_refuses_a_cluster_server_whose_certificate_expired(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source, node=EXPIRED_NODE) as (_, peer), client_of(cert_dir) as client:
            results = await pull_all(client, peer, source.addresses)
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.PEER_ERROR
            assert auth_failures(client.metrics, "server_expired") == 1
            assert source.num_gets == 0

    run(main())


def test_client_with_expired_certificate_gets_misses(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir, EXPIRED_NODE) as client:
            results = await pull_all(client, peer, source.addresses)
            assert all(isinstance(r, Miss) and r.reason is MissReason.PEER_ERROR for r in results)
            await wait_until(lambda: auth_failures(server.metrics, "expired") == 1)

    run(main())


def test_client_refuses_a_server_from_another_ca(cert_dir: Path, openssl_foreign: ForeignCerts) -> None:
    address = BlockAddress(BlockHash(os.urandom(32)), 0)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(openssl_foreign.server_cert, openssl_foreign.server_key)  # SAN node-a, foreign CA
    served: list[bool] = []

    async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(True)
        writer.close()

    async def main() -> None:
        async with fake_server(ctx, impostor) as port, client_of(cert_dir) as client:
            results = await pull_all(client, Peer("node-a", "127.0.0.1", port), [address])
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.PEER_ERROR
            assert auth_failures(client.metrics, "server_untrusted") == 1
            assert not served

    run(main())


def test_client_refuses_a_server_that_is_not_the_dialled_node(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=1, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source, node="node-a") as (_, peer), client_of(cert_dir) as client:
            results = await pull_all(client, Peer("node-b", peer.host, peer.port), source.addresses)
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.PEER_ERROR
            assert auth_failures(client.metrics, "server_wrong_name") == 1
            assert source.num_gets == 0

    run(main())


def test_rotation_keeps_open_connections(cert_dir: Path, tmp_path: Path, memory_source: MemorySourceFactory) -> None:
    rotating = tmp_path / "certs"
    shutil.copytree(cert_dir, rotating)
    source = memory_source(num_blocks=2, num_layers=1)

    async def server_serial(peer: Peer) -> int:
        sock = await open_tls(peer, creds(rotating, "client-1"), 5.0)
        try:
            der = sock.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number
        finally:
            sock.close()

    async def main() -> None:
        async with serving(rotating, source) as (_, peer), client_of(rotating) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            before = await server_serial(peer)
            issue_node(rotating, "node-a")  # rotate the server's certificate under its feet
            after = await server_serial(peer)
            new_pem = x509.load_pem_x509_certificate((rotating / "node-a.pem").read_bytes())
            assert before != after == new_pem.serial_number
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert client.num_connects == 1  # the open connection carried on

    run(main())


# --- reconnects --------------------------------------------------------------------------------------


def test_reconnects_after_server_restart(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=3, num_layers=1)

    async def main() -> None:
        async with client_of(cert_dir) as client:
            async with serving(cert_dir, source) as (_, peer):
                assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            down = await pull_all(client, peer, source.addresses)  # whether or not the BYE arrived yet
            assert {r.reason for r in down if isinstance(r, Miss)} == {MissReason.PEER_GONE}
            async with serving(cert_dir, source, port=peer.port) as (_, again):
                assert again.port == peer.port
                assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert client.num_connects == 2

    run(main())


def test_connect_timeout_is_a_miss(cert_dir: Path) -> None:
    address = BlockAddress(BlockHash(os.urandom(32)), 0)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # accepts TCP but never answers the TLS handshake

    async def main() -> None:
        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            async with client_of(cert_dir, connect_timeout_s=0.3) as client:
                results = await pull_all(client, Peer("node-a", "127.0.0.1", port), [address])
            assert isinstance(results[0], Miss) and results[0].reason is MissReason.TIMEOUT
        finally:
            server.close()

    run(main())


def test_idle_connections_close_and_pulls_reconnect(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source, idle_timeout_s=0.3) as (server, peer), \
                client_of(cert_dir, idle_timeout_s=30.0) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            await wait_until(lambda: server.num_connections == 0)  # the server's BYE, maybe not yet read
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert client.num_connects == 2
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir, idle_timeout_s=0.4) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            await wait_until(lambda: server.num_connections == 0)  # the client left first, politely
            assert protocol_errors(server.metrics) == 0

    run(main())


def test_a_pull_racing_the_servers_idle_close_reconnects(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    """The server closes an idle connection (BYE) just as the client sends a new PULL on it: the
    client reads the BYE only after submitting. Nothing of the PULL was answered, so the pull is
    made again on a new connection instead of failing as PEER_GONE (it used to, intermittently, in
    `test_idle_connections_close_and_pulls_reconnect`). The race is forced by holding the client's
    reading until the server has closed."""
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source, idle_timeout_s=0.3) as (server, peer), \
                client_of(cert_dir, idle_timeout_s=30.0) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            conn = client._pool.entry(peer.node)
            assert conn is not None
            conn.link.pause_reading()                      # the BYE stays unread ...
            await wait_until(lambda: server.num_connections == 0)
            assert not conn.link.closed                    # ... so the pooled connection looks alive
            asyncio.get_running_loop().call_later(0.05, conn.link.resume_reading)
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert client.num_connects == 2

    run(main())


class FailingSource:
    """A source whose disk fails for one address."""

    def __init__(self, inner: MemorySource, broken: BlockAddress) -> None:
        self.inner, self.broken = inner, broken

    def get_block(self, address: BlockAddress) -> Any:
        if address == self.broken:
            raise OSError(5, "Input/output error")
        return self.inner.get_block(address)


def test_source_failure_is_a_miss_for_that_block_only(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    inner = memory_source(num_blocks=4, num_layers=1)
    broken = inner.addresses[1]

    async def main() -> None:
        async with serving(cert_dir, FailingSource(inner, broken)) as (_, peer), client_of(cert_dir) as client:
            failed = await pull_all(client, peer, inner.addresses[:3])
            assert isinstance(failed[0], Hit) and isinstance(failed[2], Hit)
            assert isinstance(failed[1], Miss) and failed[1].reason is MissReason.SOURCE_ERROR
            ok = [inner.addresses[0], inner.addresses[3]]
            assert_hits(await pull_all(client, peer, ok), inner, ok)
            assert client.num_connects == 1

    run(main())


class SlowSource:
    """Every fetch takes a few milliseconds, like a block read from disk; records which thread asked."""

    def __init__(self, inner: MemorySource, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s
        self.threads: list[int] = []

    def get_block(self, address: BlockAddress) -> Any:
        self.threads.append(threading.get_ident())
        time.sleep(self.delay_s)
        return self.inner.get_block(address)


def test_slow_source_is_read_off_the_event_loop(cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    inner = memory_source(num_blocks=12, num_layers=1)
    slow = SlowSource(inner, 0.004)

    async def main() -> None:
        async with serving(cert_dir, slow) as (server, peer), client_of(cert_dir) as client:
            assert_hits(await pull_all(client, peer, inner.addresses), inner, inner.addresses)
            assert server.slow_until > asyncio.get_running_loop().time()
        loop_thread = threading.get_ident()  # the server's event loop runs on this thread
        on_loop = [t == loop_thread for t in slow.threads]
        # the first SLOW_STREAK slow reads blocked the loop; every later one ran in the pool
        assert on_loop == [True] * SLOW_STREAK + [False] * (len(inner.addresses) - SLOW_STREAK)

    run(main())


def test_a_get_from_ram_is_answered_in_the_read_that_brought_its_pull(
        cert_dir: Path, memory_source: MemorySourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A PULL whose blocks fit one batch is answered by the read callback that received it, with no
    pump task (a loop turn later); a longer one starts the pump for what is left after its first
    batch. Every answer is whole either way."""
    source = memory_source(num_blocks=6, num_layers=1, payload_size=512 * 1024)
    pumps: list[int] = []
    pump = tls_server.ServerConnection._pump

    async def counted(conn: tls_server.ServerConnection) -> None:
        pumps.append(len(conn.session.active))
        await pump(conn)

    monkeypatch.setattr(tls_server.ServerConnection, "_pump", counted)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            one = source.addresses[:1]
            for _ in range(3):
                assert_hits(await pull_all(client, peer, one), source, one)
            assert pumps == [], "a one-batch get from RAM went through the pump"
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert len(pumps) == 1, "the rest of a six-block pull (3 MiB) is the pump's"

    run(main())


def test_a_read_of_many_pulls_answers_one_of_them_per_loop_turn(
        cert_dir: Path, memory_source: MemorySourceFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """PULLs read together (ten callers at once on one connection, each PULL a record of its own and
    answered in one batch): at most one batch per loop turn is answered from the read callback, so a
    burst of PULLs cannot hold the event loop; the pump answers the rest, and every caller gets its
    blocks."""
    source = memory_source(num_blocks=200, num_layers=1, payload_size=1024)
    turns = [0]
    inline_turns: list[int] = []
    answer_turn = tls_server.ServerConnection._answer_turn

    def counted(conn: tls_server.ServerConnection) -> None:
        inline_turns.append(turns[0])
        answer_turn(conn)

    monkeypatch.setattr(tls_server.ServerConnection, "_answer_turn", counted)

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def tick() -> None:   # counts loop turns
            turns[0] += 1
            loop.call_soon(tick)

        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            assert_hits(await pull_all(client, peer, source.addresses[:1]), source, source.addresses[:1])  # connect
            inline_turns.clear()
            loop.call_soon(tick)
            results = await asyncio.gather(*(pull_all(client, peer, source.addresses) for _ in range(10)))
            for got in results:
                assert_hits(got, source, source.addresses)
        assert inline_turns, "no PULL was answered from the read callback"
        assert len(inline_turns) == len(set(inline_turns)), f"answers from the read path in turns {inline_turns}"

    run(main())


def test_slow_consumer_bounds_client_memory(cert_dir: Path, memory_source: MemorySourceFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tls_client, "RESULTS_HIGH", 1 << 20)
    source = memory_source(num_blocks=48, num_layers=1, payload_size=256 * 1024)

    async def main() -> None:
        async with serving(cert_dir, source) as (_, peer), client_of(cert_dir) as client:
            results = []
            async for r in client.pull(peer, source.addresses):
                results.append(r)
                if len(results) == 1:
                    await asyncio.sleep(0.3)  # the caller is busy; the connection must stop reading
                    (conn,) = client._pool
                    assert conn.session.buffered <= (1 << 20) + READ_BUDGET + 256 * 1024
            assert_hits(results, source, source.addresses)

    run(main())


def test_pull_on_a_connection_the_server_just_dropped_is_retried(
        cert_dir: Path, memory_source: MemorySourceFactory) -> None:
    source = memory_source(num_blocks=3, num_layers=1)

    async def main() -> None:
        async with serving(cert_dir, source) as (server, peer), client_of(cert_dir) as client:
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            for conn in list(server._connections):  # the server drops it without a word …
                conn.link.close(MissReason.PEER_GONE, "test: dropped")
            # … and the client pulls before its loop noticed: the PULL goes out on a dead connection
            assert_hits(await pull_all(client, peer, source.addresses), source, source.addresses)
            assert client.num_connects == 2

    run(main())


def test_a_revoked_certificate_is_refused_on_both_sides_once_the_revocation_list_appears(
        pki: Pki, memory_source: MemorySourceFactory) -> None:
    d = pki.dir
    for node in ("client-2", "node-r"):
        pki.node(node)
    source = memory_source(num_blocks=2, num_layers=1)

    async def main() -> None:
        async with serving(d, source) as (server, peer):
            async with client_of(d, "client-1") as before:
                assert_hits(await pull_all(before, peer, source.addresses), source, source.addresses)
            pki.revoke("client-1", "node-r")       # the server notices crl.pem appear
            async with client_of(d, "client-1") as revoked:
                results = await pull_all(revoked, peer, source.addresses)
                assert all(isinstance(r, Miss) and r.reason is MissReason.PEER_ERROR for r in results)
                await wait_until(lambda: auth_failures(server.metrics, "revoked") == 1)
            async with client_of(d, "client-2") as good:
                assert_hits(await pull_all(good, peer, source.addresses), source, source.addresses)
        async with serving(d, source, node="node-r") as (_, peer_r), client_of(d, "client-2") as client:
            results = await pull_all(client, peer_r, source.addresses)
            assert all(isinstance(r, Miss) for r in results)
            assert auth_failures(client.metrics, "server_revoked") == 1

    run(main())


def test_signed_blocks_arrive_with_their_producers_record(cert_dir: Path, tmp_path: Path) -> None:
    """The producer's record travels with every layer, and a puller that has never met the producer
    verifies it from the certificate the frames carry."""
    check_signed_pull(cert_dir, tmp_path, serving, client_of)


def test_a_pull_under_another_namespace_gets_misses(cert_dir: Path, tmp_path: Path) -> None:
    """A puller that knows a block's address but asks under another namespace root gets no bytes."""
    check_namespaced_pull(cert_dir, tmp_path, serving, client_of)


def test_a_node_restricted_to_tenants_reads_only_their_roots(cert_dir: Path, tmp_path: Path) -> None:
    check_tenant_restricted_pull(cert_dir, tmp_path, serving, client_of)
