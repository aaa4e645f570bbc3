"""Provenance on a real 3-node Ray cluster: signed stores, verified pulls, purge and revocation.

One local cluster for the module (as in test_cluster_integration.py). The revocation test runs
last: it revokes a node's certificate for the rest of the module.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from cryptography import x509
from testkit import wait_until

from cluster.api import payload_shape
from cluster.client import FabricClient, purge_producer
from cluster.directory.client import DirectoryClient
from cluster.launch import LocalCluster, start_local_cluster
from fabric.config import ClusterConfig, Config, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout
from fabric.provenance import version_producer
from transports.trust.certs import revoke

LAYOUT = KVLayout.mha(4, 2, 64, "f16")
NS = Namespace("prov-model", LAYOUT, block_size=16, weights_fingerprint="prov")


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fabric")
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, write_through=True, o_direct=False, mirror_delay_s=0.0),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0, directory_shards=1, resync_jitter_s=0.2))
    local = start_local_cluster(3, root, config)
    try:
        yield local
    finally:
        local.shutdown()


def _prompt(seed: int, num_blocks: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 50_000, num_blocks * NS.block_size)]
    return tokens, rng.integers(0, 256, payload_shape(NS, num_blocks), dtype=np.uint8)


def _owners(fabric: LocalCluster, tokens: list[int]) -> list[set[str]]:
    async def ask() -> list[set[str]]:
        located = await DirectoryClient(fabric.config.cluster).locate(block_hashes(NS, tokens), exclude=())
        return [set(o) for o in located.owners]
    return asyncio.run(ask())


def _settled(stats: dict[str, Any]) -> bool:
    return bool(stats["pending_mirrors"] == 0 and stats["pending_directory_ops"] == 0)


def _nodes(fabric: LocalCluster) -> tuple[FabricClient, FabricClient, FabricClient]:
    head = ray.get_runtime_context().get_node_id()
    ids = [head] + [n for n in fabric.node_ids() if n != head]
    a, b, c = (FabricClient.connect(node_id=n) for n in ids[:3])
    return a, b, c


def test_a_block_pulled_from_its_producer_is_mirrored_and_purged_everywhere(fabric: LocalCluster) -> None:
    a, b, c = _nodes(fabric)
    tokens, data = _prompt(1, 8)
    assert a.store(NS, tokens, data).num_stored == 8
    wait_until(lambda: all(o == {a.node_id} for o in _owners(fabric, tokens)), "the directory lists A", 10)
    reply = b.load(NS, tokens)
    assert reply.num_blocks == 8 and np.array_equal(reply.payloads, data)
    assert not any(b.stats()["provenance_rejections"].values())
    wait_until(lambda: all(o == {a.node_id, b.node_id} for o in _owners(fabric, tokens)), "B mirrored", 10)
    # C may pull from the producer or from B's mirror: both verify as A's
    reply = c.load(NS, tokens)
    assert reply.num_blocks == 8 and np.array_equal(reply.payloads, data)
    assert not any(c.stats()["provenance_rejections"].values())
    everyone = {a.node_id, b.node_id, c.node_id}
    wait_until(lambda: all(o == everyone for o in _owners(fabric, tokens)), "C mirrored", 10)

    removed = purge_producer(a.stats()["node_name"])
    per_copy = 8 * LAYOUT.num_layers
    assert removed == {a.node_id: per_copy, b.node_id: per_copy, c.node_id: per_copy}
    wait_until(lambda: all(not o for o in _owners(fabric, tokens)), "the directory forgets every copy", 10)
    assert b.load(NS, tokens).num_blocks == 0


def test_producers_that_disagree_are_counted_by_name_and_their_tie_is_a_miss_until_resolved(
        fabric: LocalCluster) -> None:
    a, b, c = _nodes(fabric)
    tokens, data = _prompt(3, 4)
    other = np.bitwise_xor(data, 0x5A)   # another engine's bytes at the same addresses
    assert a.store(NS, tokens, data).num_stored == 4
    wait_until(lambda: all(o == {a.node_id} for o in _owners(fabric, tokens)), "the directory lists A", 10)
    assert b.store(NS, tokens, other).num_stored == 4
    wait_until(lambda: all(o == {a.node_id, b.node_id} for o in _owners(fabric, tokens)), "the directory lists B", 10)
    names = {client.node_id: client.stats()["node_name"] for client in (a, b)}

    async def versions() -> tuple[list[set[str]], list[str]]:
        located = await DirectoryClient(fabric.config.cluster).locate(block_hashes(NS, tokens), exclude=())
        producers = [{version_producer(v) for v in per_hash} for per_hash in located.versions]
        return producers, [version_producer(v) for v in located.firsts]
    producers, firsts = asyncio.run(versions())   # the directory groups the owners by version
    assert producers == [{names[a.node_id], names[b.node_id]}] * 4 and firsts == [names[a.node_id]] * 4
    assert c.load(NS, tokens).num_blocks == 0   # one producer against one: in dispute, a miss
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{c.stats()['metrics_port']}/metrics", timeout=10).read()
    pair = f'first_producer="{names[a.node_id]}",other_producer="{names[b.node_id]}"'.encode()
    assert b"kvfabric_producer_disagreements_total{" + pair + b"} 4.0" in metrics
    assert b"kvfabric_disputed_blocks_total 4.0" in metrics
    purge_producer(names[b.node_id])   # the operator's call settles it
    wait_until(lambda: all(o == {a.node_id} for o in _owners(fabric, tokens)), "the directory forgets B's", 10)
    reply = c.load(NS, tokens)
    assert reply.num_blocks == 4 and np.array_equal(reply.payloads, data)


def test_a_revoked_producers_blocks_are_refused_by_pullers(fabric: LocalCluster) -> None:
    a, b, _ = _nodes(fabric)
    tokens, data = _prompt(2, 6)
    assert a.store(NS, tokens, data).num_stored == 6
    wait_until(lambda: all(o == {a.node_id} for o in _owners(fabric, tokens)), "the directory lists A", 10)
    cert_dir = Path(fabric.config.transport.cert_dir)
    (cert_dir / "crl.pem").write_text("not a revocation list")   # a node keeps what it has
    def scrape() -> bytes:
        return urllib.request.urlopen(f"http://127.0.0.1:{b.stats()['metrics_port']}/metrics", timeout=10).read()
    wait_until(lambda: b'kvfabric_crl_reloads_total{outcome="refused"} 1.0' in scrape(), "B reads the bad list", 10)
    assert b.stats()["revoked_certificates"] == 0
    metrics = scrape()
    assert b'reason="sync_error"' not in metrics   # the directory upkeep was not disturbed by it
    assert b"kvfabric_crl_seconds_to_next_update +Inf" in metrics   # no list yet: nothing to expire
    (cert_dir / "crl.pem").unlink()
    name = a.stats()["node_name"]
    serial = x509.load_pem_x509_certificate((cert_dir / f"{name}.pem").read_bytes()).serial_number
    revoke(cert_dir, {serial})
    wait_until(lambda: b.stats()["revoked_certificates"] == 1, "B reads the new revocation list", 10)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{b.stats()['metrics_port']}/metrics", timeout=10).read()
    left = float(metrics.split(b"\nkvfabric_crl_seconds_to_next_update ")[1].split()[0])
    assert 29 * 86400 < left <= 30 * 86400   # `revoke` signs the list for 30 days by default
    assert b.load(NS, tokens).num_blocks == 0
    assert b.stats()["provenance_rejections"]["revoked"] == 6 * LAYOUT.num_layers
    # a mirror would have been written and advertised once B has neither a mirror nor a report pending
    wait_until(lambda: _settled(b.stats()), "B has no mirror or directory report pending", 10)
    assert all(o == {a.node_id} for o in _owners(fabric, tokens)), "B never mirrors nor advertises them"
