"""The fabric across hosts: a bed of three network namespaces on a private bridge, links shaped
(rate with tbf, loss with nftables; this kernel has no netem, so profile delays are not applied),
Ray started per host on the host's own address, a NodeActor per host. One bed for the module; the
partition test runs last.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from testkit import PkiFactory, Wait

from cluster.api import payload_shape
from cluster.client import FabricClient
from cluster.directory.client import DirectoryClient
from cluster.netbed.bed import NetBed, missing_capability
from cluster.netbed.plan import Profile
from cluster.netbed.ray_cluster import driver, node_hosts, start_bed_fabric, start_ray
from cluster.node.actor import node_actor_name, node_name_for
from fabric.config import ClusterConfig, Config, KVConfig, TransportConfig, TransportKind
from fabric.keys import BlockAddress, Namespace, block_hashes
from fabric.layout import KVLayout
from fabric.store import Store
from transports.core.base import Hit, Peer
from transports.factory import create_client, create_server

_missing = missing_capability()
pytestmark = pytest.mark.skipif(_missing is not None, reason=f"network test bed needs {_missing}")

LAYOUT = KVLayout.mha(4, 8, 128, "f16")      # 64 KiB per (block, layer) at 16 tokens
NS = Namespace("netbed-model", LAYOUT, block_size=16, weights_fingerprint="netbed")
PULL_TIMEOUT_S = 4.0
LEASE_S = 2.0
SLOW = Profile("slow", 40_000_000, 0.0, 0.0)   # 5 MB/s: a 16 MB pull lasts long enough to be cut


@pytest.fixture(scope="module")
def bed() -> Iterator[NetBed]:
    bed = NetBed.create(3, profile="dc")
    try:
        yield bed
    finally:
        bed.teardown()


@pytest.fixture(scope="module")
def fabric(bed: NetBed) -> Iterator[tuple[Config, list[str]]]:
    """Ray and the fabric on the bed; node ids in host order."""
    base = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, write_through=True, o_direct=False),
                  cluster=ClusterConfig(heartbeat_s=0.4, lease_s=LEASE_S, pull_timeout_s=PULL_TIMEOUT_S,
                                        directory_shards=1, resync_jitter_s=0.2))
    bed_ray = start_ray(bed)
    with driver(bed, bed_ray):
        cfg, _ = start_bed_fabric(bed, base)
        hosts = node_hosts()
        yield cfg, sorted(hosts, key=lambda n: hosts[n])


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, num_blocks * NS.block_size)]


def kv_for(seed: int, num_blocks: int) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).integers(0, 256, payload_shape(NS, num_blocks), dtype=np.uint8)


def owners(cfg: Config, hashes: list[bytes]) -> list[set[str]]:
    async def ask() -> list[set[str]]:
        return [set(o) for o in (await DirectoryClient(cfg.cluster).locate(hashes, exclude=())).owners]
    return asyncio.run(ask())


def in_host(bed: NetBed, i: int, fn: Callable[[], Any]) -> Any:
    """Run `fn` on a thread inside host i (its sockets are that host's)."""
    def inside() -> Any:
        with bed.inside(i):
            return fn()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(inside).result(timeout=120)


def pull_from(bed: NetBed, i: int, cert_dir: Path, node: str, peer: Peer,
              wanted: list[BlockAddress], kind: TransportKind = "tls-tcp") -> list[object]:
    """From inside host i, pull `wanted` from `peer` as `node`: the results, or the error raised."""
    async def pull() -> list[object]:
        client = create_client(TransportConfig(kind=kind, cert_dir=str(cert_dir), node_name=node,
                                               connect_timeout_s=5))
        got: list[object] = []
        try:
            async for result in client.pull(peer, wanted):
                got.append(result)
        except Exception as e:   # the refusal is the outcome under test
            got.append(e)
        finally:
            await client.close()
        return got
    return in_host(bed, i, lambda: asyncio.run(pull()))


class ServerInHost:
    """A transport server over `store`, listening inside host i on its own event loop thread."""

    def __init__(self, bed: NetBed, i: int, kind: TransportKind, cert_dir: Path, store: Store) -> None:
        self.port = 0
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        ready = threading.Event()

        async def serve() -> None:
            server = create_server(TransportConfig(kind=kind, host="0.0.0.0", tcp_port=0, quic_port=0,
                                                   cert_dir=str(cert_dir), node_name="server"), store)
            _, self.port = await server.start()
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            ready.set()
            try:
                await self._stop.wait()
            finally:
                await server.close()

        def run() -> None:
            with bed.inside(i):
                asyncio.run(serve())
        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert ready.wait(30), "transport server did not start"

    def close(self) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


@pytest.mark.parametrize("profile", ["dc", "lossy"])
@pytest.mark.parametrize("kind", ["tls-tcp", "quic"])
def test_a_pull_between_two_hosts_is_byte_identical(bed: NetBed, tmp_path: Path, make_pki: PkiFactory,
                                                    kind: TransportKind,
                                                    profile: str) -> None:
    certs = make_pki(tmp_path / "certs", "server", "client").dir
    rng = np.random.default_rng(7)
    wanted = [BlockAddress(bytes(rng.integers(0, 256, 32, dtype=np.uint8)), layer) for layer in range(24)]
    sent = {a: rng.integers(0, 256, 64 << 10, dtype=np.uint8).tobytes() for a in wanted}
    store = Store.open(KVConfig(ssd_dir=str(tmp_path / "ssd"), index_dir=str(tmp_path / "index"), ram_gib=0.1,
                                write_through=False, o_direct=False))
    for address, payload in sent.items():
        store.put(address, payload)
    for i in (1, 2):
        bed.shape(i, profile)
    server = ServerInHost(bed, 1, kind, certs, store)
    try:
        results = pull_from(bed, 2, certs, "client", Peer("server", bed.plan.address(1), server.port), wanted, kind)
    finally:
        server.close()
        store.close()
        for i in (1, 2):
            bed.shape(i, "dc")
    hits = [r for r in results if isinstance(r, Hit)]
    assert len(hits) == len(wanted), results[-1:]
    assert all(bytes(h.payload) == sent[h.address] for h in hits)


def test_a_prefix_stored_on_one_host_loads_byte_identical_on_another(fabric: tuple[Config, list[str]],
                                                                     wait_until: Wait) -> None:
    _, (_, a, b) = fabric
    tokens, kv = prompt(1, 8), kv_for(1, 8)
    FabricClient.connect(node_id=a).store(NS, tokens, kv)
    reader = FabricClient.connect(node_id=b)
    # The owner tells the directory within a flush interval, asynchronously: wait until it lists them.
    wait_until(lambda: reader.lookup(NS, tokens).num_blocks >= 8, "the directory listing the owner's blocks", 15)
    reply = reader.load(NS, tokens)
    assert reply.num_blocks == 8 and set(reply.sources) == {f"peer:{a}"}
    assert np.array_equal(reply.payloads, kv)


def test_a_certificate_from_a_foreign_ca_gets_nothing_from_another_host(
        bed: NetBed, fabric: tuple[Config, list[str]], tmp_path: Path, make_pki: PkiFactory) -> None:
    _, (_, a, _) = fabric
    tokens, kv = prompt(2, 2), kv_for(2, 2)
    FabricClient.connect(node_id=a).store(NS, tokens, kv)
    host, port = FabricClient.connect(node_id=a).stats()["address"].rsplit(":", 1)
    assert host == bed.plan.address(1)
    foreign = make_pki(tmp_path / "foreign", "intruder").dir
    wanted = [BlockAddress(block_hashes(NS, tokens)[0], 0)]
    results = pull_from(bed, 2, foreign, "intruder", Peer(node_name_for(a), host, int(port)), wanted)
    assert results and not any(isinstance(r, Hit) for r in results)


def test_a_partition_mid_pull_returns_the_verified_run_then_the_node_leaves_and_comes_back(
        bed: NetBed, fabric: tuple[Config, list[str]], wait_until: Wait) -> None:
    cfg, (c, a, b) = fabric
    blocks = 64                                      # 16 MiB: about 3 s at the slow rate
    tokens, kv = prompt(3, blocks), kv_for(3, blocks)
    hashes = block_hashes(NS, tokens)
    FabricClient.connect(node_id=a).store(NS, tokens, kv)
    wait_until(lambda: all(a in o for o in owners(cfg, hashes)), "the directory listing host 1's blocks", 10)
    bed.shape(1, SLOW)
    tx = Path(f"/sys/class/net/{bed.plan.veth(2)}/statistics/tx_bytes")
    before = int(tx.read_text())
    puller = ray.get_actor(node_actor_name(b), namespace=cfg.cluster.namespace)
    ref = puller.load.remote(NS, np.asarray(tokens, dtype=np.uint32), None, True)
    try:
        wait_until(lambda: int(tx.read_text()) - before > 2 << 20, "the pull under way", 30)
        bed.partition(1, 2)
        bed.partition(1, 0)
        # No hang: the pull is abandoned after pull_timeout_s; the margin covers Ray's call overhead.
        reply = ray.get(ref, timeout=PULL_TIMEOUT_S + 10)
        assert 0 < reply.num_blocks < blocks
        assert np.array_equal(reply.payloads, kv[:reply.num_blocks])
        wait_until(lambda: a not in owners(cfg, hashes[-1:])[0], "the directory dropping host 1", LEASE_S + 10)
    finally:
        bed.heal(1, 2)
        bed.heal(1, 0)
        bed.shape(1, "dc")
    wait_until(lambda: a in owners(cfg, hashes[-1:])[0], "host 1 resynced into the directory", 30)
    again = FabricClient.connect(node_id=c).load(NS, tokens)
    assert again.num_blocks == blocks and f"peer:{a}" in again.sources
    assert np.array_equal(again.payloads, kv)
