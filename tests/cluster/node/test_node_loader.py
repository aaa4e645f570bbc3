"""A node's read path without Ray: `NodeLoader` over real Stores, a real TLS-TCP peer with
certificates of one cluster CA, and a real `DirectoryShard` as the directory.

Node B holds the first blocks of a prompt itself; node A, its producer, holds all of them and
is listed in the directory. What B's engine would see: where each block is, the KV itself (local
run first, the rest pulled and verified), a copy kept on B afterwards, and a peer that is gone
costing only the blocks it held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import AsyncIterator, Collection, Coroutine, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from testkit import PkiFactory

from cluster.api import LoadReply, Where, payload_shape
from cluster.directory.client import Located
from cluster.directory.report import Apply, Heartbeat, Report
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import NodeAddress
from cluster.node.local import LocalFabric
from cluster.node.metrics import ClusterMetrics
from cluster.node.reads import NodeLoader
from fabric.config import Config, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout
from fabric.store import Store
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer
from transports.trust.certs import CredentialFiles, NodeCredentials
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

LAYOUT = KVLayout.mha(3, 2, 32, "f16")
NS = Namespace("loader-model", LAYOUT, block_size=16, weights_fingerprint="loader")
TOKENS = list(range(16 * 6))
HASHES = block_hashes(NS, TOKENS)
NUM_BLOCKS, NUM_LOCAL = len(HASHES), 2
A_ID, B_ID = "a" * 32, "b" * 32
TRUTH = np.random.default_rng(7).integers(0, 256, payload_shape(NS, NUM_BLOCKS), dtype=np.uint8)


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("certs"), "node-a", "node-b").dir


class ShardLocator:
    """The directory as a node asks it, answered by one real `DirectoryShard`."""

    def __init__(self, shard: DirectoryShard) -> None:
        self.shard = shard

    async def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> Located:
        reply = self.shard.locate(hashes, 0.0, exclude)
        return Located(reply.owners, {str(n): a for n, a in reply.addresses.items()})


@dataclasses.dataclass
class Pair:
    loader: NodeLoader          # node B's
    b_local: LocalFabric
    a_server: TlsTcpServer
    registry: CollectorRegistry
    tasks: list[asyncio.Task[None]]


def _open(tmp_path: Path, name: str) -> Store:
    kv = KVConfig(ram_gib=0.05, ssd_dir=str(tmp_path / name / "ssd"), index_dir=str(tmp_path / name / "index"),
                  ssd_gib=0.1, write_through=True, durable=False, o_direct=False)
    return Store.open(kv, background=False)


def _signer(cert_dir: Path, node: str) -> NodeSigner:
    return NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")


def _run(cert_dir: Path, tmp_path: Path, body: Any) -> None:
    """Node A (all blocks, serving, listed) and node B (the first blocks); `body(pair)` runs on B."""
    a_store, b_store = _open(tmp_path, "node-a"), _open(tmp_path, "node-b")
    LocalFabric(a_store, A_ID).write_blocks(NS, HASHES, TRUTH, signer=_signer(cert_dir, "node-a"))
    b_local = LocalFabric(b_store, B_ID)
    b_local.write_blocks(NS, HASHES[:NUM_LOCAL], TRUTH[:NUM_LOCAL], signer=_signer(cert_dir, "node-b"))

    async def main() -> None:
        server = TlsTcpServer(NodeCredentials(CredentialFiles.for_node(cert_dir, "node-a")), a_store, "127.0.0.1", 0)
        host, port = await server.start()
        shard = DirectoryShard()
        shard.submit(Report(0, A_ID, 1, Heartbeat(NodeAddress(host, port, "tls-tcp", "node-a"))), 0.0)
        shard.submit(Report(0, A_ID, 1, Apply(1, HASHES)), 0.0)
        client = TlsTcpClient(NodeCredentials(CredentialFiles.for_node(cert_dir, "node-b")))
        registry = CollectorRegistry()
        tasks: list[asyncio.Task[None]] = []

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            tasks.append(asyncio.get_running_loop().create_task(coro))
        config = Config()
        config = dataclasses.replace(config, kv=dataclasses.replace(config.kv, mirror_delay_s=0.0))
        loader = NodeLoader(config, node_id=B_ID, transport="tls-tcp", local=b_local,
                            directory=ShardLocator(shard), client=client,
                            verifier=ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem")),
                            metrics=ClusterMetrics(registry), kv_events=None, spawn=spawn)
        try:
            await body(Pair(loader, b_local, server, registry, tasks))
        finally:
            await loader.close()
            await client.close()
            await server.close()
    try:
        asyncio.run(main())
    finally:
        a_store.close()
        b_store.close()


def test_lookup_names_the_local_run_and_the_peer_that_holds_the_rest(cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        reply = await p.loader.lookup(NS, HASHES)
        assert [loc.where for loc in reply.locations] == [Where.RAM] * NUM_LOCAL + [Where.PEER] * (
            NUM_BLOCKS - NUM_LOCAL)
        assert {loc.node_id for loc in reply.locations[NUM_LOCAL:]} == {A_ID}
    _run(cert_dir, tmp_path, body)


def test_a_load_returns_the_local_run_then_the_pulled_blocks_and_keeps_a_copy(cert_dir: Path,
                                                                             tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        reply = await p.loader.load(NS, HASHES, True, deadline_s=math.inf)
        assert reply.num_blocks == NUM_BLOCKS and np.array_equal(reply.payloads, TRUTH)
        assert reply.sources == ("ram",) * NUM_LOCAL + (f"peer:{A_ID}",) * (NUM_BLOCKS - NUM_LOCAL)
        assert reply.pulled_bytes == (NUM_BLOCKS - NUM_LOCAL) * LAYOUT.bytes_per_block(NS.block_size)
        assert A_ID in p.loader.peer_estimates.snapshot(0.0)
        await asyncio.gather(*p.tasks)   # the mirror
        assert p.loader.pending_mirrors == 0
        assert len(p.b_local.local_tiers(HASHES, LAYOUT.num_layers)) == NUM_BLOCKS
        await p.a_server.close()   # now B answers the whole prompt by itself
        again = await p.loader.load(NS, HASHES, True, deadline_s=math.inf)
        assert np.array_equal(again.payloads, TRUTH) and again.pulled_bytes == 0
    _run(cert_dir, tmp_path, body)


def test_without_pulls_a_load_answers_from_this_node_only(cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        reply = await p.loader.load(NS, HASHES, False)
        assert reply.sources == ("ram",) * NUM_LOCAL and np.array_equal(reply.payloads, TRUTH[:NUM_LOCAL])
    _run(cert_dir, tmp_path, body)


def test_a_layer_stream_delivers_each_layer_of_every_planned_block(cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        stream: AsyncIterator[Any] = p.loader.load_layers(NS, HASHES, TOKENS, math.inf)
        num_blocks, sources, audit_blocks = await anext(stream)
        assert audit_blocks == 0   # no sampler: never sampled for audit
        assert num_blocks == NUM_BLOCKS and sources[NUM_LOCAL:] == (f"peer:{A_ID}",) * (NUM_BLOCKS - NUM_LOCAL)
        layers = [layer async for layer in stream]
        assert len(layers) == LAYOUT.num_layers
        for layer, array in enumerate(layers):
            assert np.array_equal(array, TRUTH[:, layer])
    _run(cert_dir, tmp_path, body)


def test_a_peer_that_is_gone_costs_only_the_blocks_it_held(cert_dir: Path, tmp_path: Path) -> None:
    async def body(p: Pair) -> None:
        await p.a_server.close()   # the directory still lists A
        reply: LoadReply = await p.loader.load(NS, HASHES, True, deadline_s=math.inf)
        assert reply.sources == ("ram",) * NUM_LOCAL and np.array_equal(reply.payloads, TRUTH[:NUM_LOCAL])
        assert reply.pulled_bytes == 0
        assert p.loader.pending_mirrors == 0 and not p.tasks
    _run(cert_dir, tmp_path, body)
