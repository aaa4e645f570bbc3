"""Helpers the transport test modules share (plain functions; fixtures live in conftest.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import blake3
from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic.configuration import QuicConfiguration

from fabric.config import KVConfig
from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block
from fabric.store import Store
from transports.core.base import Hit, Peer, PullResult
from transports.core.codec import Frame, FrameDecoder
from transports.quic.base import ALPN
from transports.trust.certs import CredentialFiles, NodeCredentials, issue_node
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

SIGNED_NAMESPACE = b"s" * 32   # the namespace root of `signed_store` blocks
TIMEOUT_S = 30.0  # no test may hang: every event-loop run is bounded by this
NODE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lib" / "soak_node.py"


class Puller(Protocol):
    def pull(self, peer: Peer, addresses: Sequence[BlockAddress]) -> AsyncIterator[PullResult]: ...


class Server(Protocol):
    async def start(self) -> tuple[str, int]: ...
    async def close(self) -> None: ...


class Closable(Protocol):
    async def close(self) -> None: ...


S = TypeVar("S", bound=Server)
C = TypeVar("C", bound=Closable)


@asynccontextmanager
async def started(server: S, node: str) -> AsyncIterator[tuple[S, Peer]]:
    """`server` (of node `node`) listening, and the peer that dials it; closed on the way out."""
    host, port = await server.start()
    try:
        yield server, Peer(node, host, port)
    finally:
        await server.close()


@asynccontextmanager
async def closing(client: C) -> AsyncIterator[C]:
    """`client`, closed on the way out (its pooled connections with it)."""
    try:
        yield client
    finally:
        await client.close()


def receive_buffered(decoder: FrameDecoder, wire: bytes, chunk: int) -> list[Frame]:
    """Decode `wire` through the buffered-protocol path a socket reader uses (get_buffer /
    buffer_updated), at most `chunk` bytes a read."""
    frames: list[Frame] = []
    pos = 0
    while pos < len(wire):
        buf = decoder.get_buffer()
        n = min(len(buf), chunk, len(wire) - pos)
        buf[:n] = wire[pos:pos + n]
        pos += n
        frames += decoder.buffer_updated(n)
    return frames


def creds(cert_dir: Path, node: str) -> NodeCredentials:
    return NodeCredentials(CredentialFiles.for_node(cert_dir, node))


def run(coro: Awaitable[Any]) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, TIMEOUT_S)
    return asyncio.run(bounded())


async def pull_all(client: Puller, peer: Peer, addresses: Sequence[BlockAddress]) -> list[PullResult]:
    return [r async for r in client.pull(peer, addresses)]


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


@contextmanager
def filled_store(root: Path, num_layers: int = 6,
                 size: int = 100_000) -> Iterator[tuple[Store, dict[BlockAddress, bytes]]]:
    """A real Store under `root` (RAM and SSD tiers, persistent index) holding `num_layers` random
    payloads of one block, and those payloads by address (in layer order)."""
    kv = KVConfig(ram_gib=0.05, ssd_dir=str(root / "ssd"), index_dir=str(root / "index"),
                  ssd_gib=0.1, write_through=True, durable=False, o_direct=False)
    block = BlockHash(os.urandom(32))
    payloads = {BlockAddress(block, layer): os.urandom(size) for layer in range(num_layers)}
    with Store.open(kv, background=False) as store:
        for address, payload in payloads.items():
            assert store.put(address, payload).ok
        yield store, payloads


@asynccontextmanager
async def raw_peer(cert_dir: Path, port: int, node: str = "client-1") -> AsyncIterator[QuicConnectionProtocol]:
    """A stock aioquic connection to the QUIC server "node-a" with `node`'s certificate: the
    streams carry whatever bytes a test writes."""
    config = QuicConfiguration(is_client=True, alpn_protocols=[ALPN], server_name="node-a")
    config.load_verify_locations(cadata=(cert_dir / "ca.pem").read_bytes())
    config.load_cert_chain(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    async with connect("127.0.0.1", port, configuration=config) as protocol:
        yield protocol


class NodeProcess:
    """`benchmarks/lib/soak_node.py` serving node-a's blocks on both transports in its own process."""

    def __init__(self, cert_dir: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(NODE_SCRIPT), "--cert-dir", str(cert_dir), *args],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"node process did not start (said {line!r})")
        _, quic_port, tcp_port = line.split()
        self.quic = Peer("node-a", "127.0.0.1", int(quic_port))
        self.tls = Peer("node-a", "127.0.0.1", int(tcp_port))

    def terminate(self, timeout_s: float = 10.0) -> tuple[int | None, str]:
        """SIGTERM; (exit status, or None if it had not exited after `timeout_s`; what it printed)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, ""
        return self.proc.returncode, out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


@contextmanager
def node_process(cert_dir: Path, *args: str) -> Iterator[NodeProcess]:
    node = NodeProcess(cert_dir, *args)
    try:
        yield node
    finally:
        node.stop()
@contextmanager
def signed_store(root: Path, cert_dir: Path, producer: str, num_layers: int = 4,
                 size: int = 50_000) -> Iterator[tuple[Store, dict[BlockAddress, bytes], Provenance]]:
    """A real Store holding one block of `num_layers` random layers, signed by `producer`'s node key
    (as a NodeActor signs what its engine stores); the payloads by address and the block's record."""
    kv = KVConfig(ram_gib=0.05, ssd_dir=str(root / "ssd"), index_dir=str(root / "index"),
                  ssd_gib=0.1, write_through=True, durable=False, o_direct=False)
    block = BlockHash(os.urandom(32))
    payloads = {BlockAddress(block, layer): os.urandom(size) for layer in range(num_layers)}
    signer = NodeSigner(cert_dir / f"{producer}.pem", cert_dir / f"{producer}.key")
    record = sign_block(SIGNED_NAMESPACE, block, [blake3.blake3(p).digest() for p in payloads.values()],
                        signer.node, signer.cert_der, signer.sign)
    with Store.open(kv, background=False) as store:
        assert all(r.ok for r in store.put_many(list(payloads.items()), provenance=[record] * num_layers))
        yield store, payloads, record


def check_signed_pull(cert_dir: Path, root: Path, serving: Callable[..., Any], client_of: Callable[..., Any]) -> None:
    """Pull a block signed by "node-b" from a "node-a" server of one transport (`serving(cert_dir,
    source)` / `client_of(cert_dir)`): every layer arrives with the record, and the record verifies."""
    async def main() -> tuple[list[PullResult], dict[BlockAddress, bytes]]:
        with signed_store(root, cert_dir, "node-b") as (store, payloads, _):
            async with serving(cert_dir, store) as (_, peer), client_of(cert_dir) as client:
                return await pull_all(client, peer, list(payloads)), payloads

    results, payloads = run(main())
    verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
    assert [r.address for r in results] == list(payloads)
    for r in results:
        assert isinstance(r, Hit) and bytes(r.payload) == payloads[r.address]
        assert r.provenance is not None and r.provenance.producer == "node-b"
        assert verifier.check(r.provenance, SIGNED_NAMESPACE, r.address.hash, r.address.layer, r.digest) is None


def check_namespaced_pull(cert_dir: Path, root: Path, serving: Callable[..., Any],
                          client_of: Callable[..., Any]) -> None:
    """Pull a block signed under SIGNED_NAMESPACE from a "node-a" server of one transport: asked
    under that namespace every layer is a hit, asked under another every layer is a miss (the
    server never hands one namespace's bytes to a pull for another, even at the right address);
    a PULL that names none is served, until the server requires a namespace."""
    other = b"o" * 32
    async def main() -> dict[str, list[PullResult] | dict[BlockAddress, bytes]]:
        with signed_store(root, cert_dir, "node-b") as (store, payloads, _):
            async with serving(cert_dir, store) as (server, peer):
                async with client_of(cert_dir) as client:
                    own = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
                    foreign = [r async for r in client.pull(peer, list(payloads), namespace=other)]
                    unnamed = [r async for r in client.pull(peer, list(payloads))]
                server.require_pull_namespace = True   # seen by connections (and streams) opened from now on
                async with client_of(cert_dir) as client:
                    refused = [r async for r in client.pull(peer, list(payloads))]
                    still = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
                return {"own": own, "foreign": foreign, "unnamed": unnamed, "refused": refused, "still": still,
                        "payloads": payloads}

    got = run(main())
    expected = list(got["payloads"].values())   # type: ignore[union-attr]
    for hits in ("own", "unnamed", "still"):
        assert [bytes(r.payload) for r in got[hits] if isinstance(r, Hit)] == expected, hits
    for misses in ("foreign", "refused"):
        assert [r.address for r in got[misses]] == list(got["payloads"]), misses
        assert not any(isinstance(r, Hit) for r in got[misses]), misses


def check_tenant_restricted_pull(cert_dir: Path, root: Path, serving: Callable[..., Any],
                                 client_of: Callable[..., Any]) -> None:
    """A node certificate restricted to tenants reads only its tenants' roots: the server knows
    SIGNED_NAMESPACE as tenant acme's, so a puller restricted to acme gets every layer, one
    restricted to globex gets misses at the very addresses, an unrestricted node gets every layer,
    and a server that does not know its roots refuses restricted pullers (never another tenant's
    bytes for want of knowing)."""
    issue_node(cert_dir, "puller-acme", tenants=("acme",))
    issue_node(cert_dir, "puller-globex", tenants=("globex",))

    async def main() -> dict[str, list[PullResult] | dict[BlockAddress, bytes]]:
        got: dict[str, list[PullResult] | dict[BlockAddress, bytes]] = {}
        with signed_store(root, cert_dir, "node-b") as (store, payloads, _):
            got["payloads"] = payloads
            async with serving(cert_dir, store) as (server, peer):
                server.tenant_roots = {SIGNED_NAMESPACE: frozenset({"acme"})}.get
                for name in ("puller-acme", "puller-globex", "client-1"):
                    async with client_of(cert_dir, name) as client:
                        got[name] = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
                await wait_until(lambda: server.metrics.registry.get_sample_value(
                    "kvfabric_unauthorised_pulls_total",
                    {"transport": server.transport, "peer": "puller-globex"}) is not None)
                server.tenant_roots = None
                async with client_of(cert_dir, "puller-acme") as client:
                    got["unknown"] = [r async for r in client.pull(peer, list(payloads), namespace=SIGNED_NAMESPACE)]
        return got

    got = run(main())
    expected = list(got["payloads"].values())   # type: ignore[union-attr]
    for hits in ("puller-acme", "client-1"):
        assert [bytes(r.payload) for r in got[hits] if isinstance(r, Hit)] == expected, hits
    for misses in ("puller-globex", "unknown"):
        assert [r.address for r in got[misses]] == list(got["payloads"]), misses
        assert not any(isinstance(r, Hit) for r in got[misses]), misses
