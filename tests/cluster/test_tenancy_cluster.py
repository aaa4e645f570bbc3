"""Tenants on a real 2-node Ray cluster: a tenant's calls are bound to its own namespace, whatever salt it claims.

One local cluster for the module (as in test_provenance_cluster.py) that requires tenants, with
tenants c and d in a shared group. Tenant credentials are issued by the cluster's CA (the
operator's role), and so is the operator's credential, which node-wide calls need here. Anonymous
calls where tenants are optional are what every other cluster test makes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import ray
from cryptography import x509
from testkit import Pki, PkiFactory, wait_until

from cluster.api import payload_shape
from cluster.client import FabricClient, purge_producer
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node.actor import node_name_for
from cluster.tenancy import TenantRefusedError
from fabric.config import ClusterConfig, Config, KVConfig, TenancyConfig
from fabric.keys import BlockAddress, Namespace, block_hashes
from fabric.layout import KVLayout
from fabric.tenancy import TenancyPolicy
from transports.core.base import Hit, Peer
from transports.factory import create_client
from transports.trust.certs import revoke
from transports.trust.identity import NodeSigner
from transports.trust.tenant_tokens import TenantToken

LAYOUT = KVLayout.mha(2, 2, 32, "f16")
NS = Namespace("tenant-model", LAYOUT, block_size=16)


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fabric")
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, o_direct=False, mirror_delay_s=0.0),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0, directory_shards=1, resync_jitter_s=0.2),
                    tenancy=TenancyConfig(required=True, shared=[["c", "d"]]))
    local = start_local_cluster(2, root, config)
    try:
        yield local
    finally:
        local.shutdown()


@pytest.fixture(scope="module")
def wallet(fabric: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tenant credentials a, b, c, d, e and the operator's (ops) from the cluster's CA."""
    out, ca = tmp_path_factory.mktemp("tenants"), Pki(Path(fabric.config.transport.cert_dir))
    for name in "abcde":
        ca.tenant(name, out_dir=out)
    ca.operator("ops", out_dir=out)
    return out


def _operator(wallet: Path, node_id: str) -> FabricClient:
    return FabricClient.connect(node_id=node_id, credential=wallet / "ops.operator.pem")


def _nodes(fabric: LocalCluster) -> tuple[str, str]:
    head = ray.get_runtime_context().get_node_id()
    return head, next(n for n in fabric.node_ids() if n != head)


def _client(wallet: Path | None, tenant: str | None, node_id: str) -> FabricClient:
    credential = None if wallet is None or tenant is None else wallet / f"{tenant}.tenant.pem"
    return FabricClient.connect(node_id=node_id, credential=credential)


def _prompt(seed: int, num_blocks: int) -> tuple[list[int], np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, 50_000, num_blocks * NS.block_size)]
    return tokens, rng.integers(0, 256, payload_shape(NS, num_blocks), dtype=np.uint8)


def _with_salt_of(tenant: str) -> Namespace:
    return Namespace(NS.model_id, LAYOUT, NS.block_size, tenant_salt=TenancyPolicy().salt(tenant))


def test_tenant_b_with_tenant_as_salt_can_neither_read_nor_poison_a(fabric: LocalCluster, wallet: Path) -> None:
    here, there = _nodes(fabric)
    a_here, a_there = _client(wallet, "a", here), _client(wallet, "a", there)
    b_here, b_there = _client(wallet, "b", here), _client(wallet, "b", there)
    tokens, data = _prompt(1, 6)
    assert a_here.store(NS, tokens, data).num_stored == 6
    claimed = _with_salt_of("a")   # B knows A's salt and A's tokens, so every address of A's blocks
    ids = [1000 + i for i in range(6)]   # the same blocks stored by the engine's block ids
    assert a_here.store_blocks(NS, ids, data).num_stored == 6
    for b in (b_here, b_there):
        assert b.lookup(claimed, tokens).num_blocks == 0
        assert b.load(claimed, tokens).num_blocks == 0
        assert b.lookup_blocks(claimed, ids).num_blocks == 0
        assert b.load_blocks(claimed, ids).num_blocks == 0
    poison = np.full_like(data, 0xAB)
    assert b_there.store(claimed, tokens, poison).num_stored == 6   # lands in B's own namespace
    assert np.array_equal(b_there.load(NS, tokens, pulls=False).payloads, poison)
    assert b_there.store_blocks(claimed, ids, poison).num_stored == 6
    wait_until(lambda: a_there.lookup(NS, tokens).num_blocks == 6, "the directory lists A's blocks")
    # the credential may come from the config too
    a_by_config = FabricClient.connect(node_id=there, tenancy=TenancyConfig(credential=str(wallet / "a.tenant.pem")))
    for a in (a_here, a_there, a_by_config):   # A's own node, and a pull from it
        reply = a.load(NS, tokens)
        assert reply.num_blocks == 6 and np.array_equal(reply.payloads, data)
        reply = a.load_blocks(NS, ids)
        assert reply.num_blocks == 6 and np.array_equal(reply.payloads, data)


def test_a_shared_group_sees_each_others_blocks_and_no_one_else_does(fabric: LocalCluster, wallet: Path) -> None:
    here, there = _nodes(fabric)
    tokens, data = _prompt(2, 4)
    assert _client(wallet, "c", here).store(NS, tokens, data).num_stored == 4
    d = _client(wallet, "d", there)
    wait_until(lambda: d.lookup(NS, tokens).num_blocks == 4, "D sees C's blocks")
    reply = d.load(NS, tokens)
    assert reply.num_blocks == 4 and np.array_equal(reply.payloads, data)
    assert _client(wallet, "e", here).load(NS, tokens).num_blocks == 0


def test_anonymous_calls_are_refused_where_tenants_are_required(fabric: LocalCluster) -> None:
    here, _ = _nodes(fabric)
    anonymous = _client(None, None, here)
    tokens, data = _prompt(4, 2)
    for call in (lambda: anonymous.store(NS, tokens, data), lambda: anonymous.load(_with_salt_of("a"), tokens),
                 lambda: anonymous.lookup(NS, tokens)):
        with pytest.raises(TenantRefusedError, match="only calls with a tenant token"):
            call()

def test_a_pull_that_names_no_namespace_gets_misses_where_tenants_are_required(fabric: LocalCluster,
                                                                                 wallet: Path) -> None:
    here, there = _nodes(fabric)
    tokens, data = _prompt(5, 2)
    assert _client(wallet, "a", here).store(NS, tokens, data).num_stored == 2
    host, port = _operator(wallet, here).stats()["address"].rsplit(":", 1)
    peer = Peer(node_name_for(here), host, int(port))
    root = _with_salt_of("a").root
    addresses = [BlockAddress(h, layer) for h in block_hashes(_with_salt_of("a"), tokens)
                 for layer in range(LAYOUT.num_layers)]

    async def pull(namespace: bytes) -> list[bool]:   # as node `there` (a node certificate of the cluster)
        client = create_client(dataclasses.replace(fabric.config.transport, node_name=node_name_for(there)))
        try:
            return [isinstance(r, Hit) async for r in client.pull(peer, addresses, namespace=namespace)]
        finally:
            await client.close()
    assert asyncio.run(pull(b"")) == [False] * len(addresses)
    assert asyncio.run(pull(root)) == [True] * len(addresses)   # nodes are trusted for the tenants they serve


def test_foreign_node_and_revoked_credentials_are_refused_and_counted(fabric: LocalCluster, wallet: Path,
                                                                      tmp_path: Path, make_pki: PkiFactory) -> None:
    here, _ = _nodes(fabric)
    tokens, data = _prompt(3, 2)
    foreign = FabricClient.connect(node_id=here, credential=make_pki(tmp_path / "other").tenant("a")[0])
    with pytest.raises(TenantRefusedError, match="not issued by the cluster CA"):
        foreign.store(NS, tokens, data)
    cert_dir = Path(fabric.config.transport.cert_dir)
    # a node certificate made into a "tenant" token is refused (the client refuses to mint it, so forge one)
    node_cert, node_key = Pki(cert_dir).node("not-a-tenant")
    signer = NodeSigner(node_cert, node_key)
    now_ms = int(time.time() * 1000)
    unsigned = TenantToken(signer.cert_der, now_ms, now_ms + 60_000, b"")
    forged = TenantToken(signer.cert_der, now_ms, now_ms + 60_000, signer.sign(unsigned.message())).encode()
    actor = _client(None, None, here).actor
    with pytest.raises(TenantRefusedError, match="node certificate is not a tenant"):
        ray.get(actor.lookup.remote(NS, np.asarray(tokens), tenant_token=forged))
    e = _client(wallet, "e", here)
    assert e.store(NS, tokens, data).num_stored == 2
    revoke(cert_dir, {x509.load_pem_x509_certificate((wallet / "e.tenant.pem").read_bytes()).serial_number})
    operator = _operator(wallet, here)
    wait_until(lambda: operator.stats()["revoked_certificates"] == 1, "the node reads the new revocation list")
    with pytest.raises(TenantRefusedError, match="revoked"):
        e.load(NS, tokens)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{operator.stats()['metrics_port']}/metrics",
                                     timeout=10).read()
    for reason in (b"untrusted", b"not_a_tenant", b"revoked"):   # each refused once, on this node
        assert b'kvfabric_tenant_refusals_total{reason="' + reason + b'"} 1.0' in metrics


def test_a_tenant_can_neither_purge_nor_list_other_tenants_blocks_and_the_operator_can(fabric: LocalCluster,
                                                                                      wallet: Path) -> None:
    here, _ = _nodes(fabric)   # last in this module: the operator's purge empties node `here`
    alice, bob = _client(wallet, "a", here), _client(wallet, "b", here)
    tokens, data = _prompt(6, 5)
    assert alice.store(NS, tokens, data).num_stored == 5
    mine = set(block_hashes(_with_salt_of("a"), tokens))
    producer = node_name_for(here)
    for refused in (bob.purge_producer(producer), purge_producer(producer)):   # bob's token, then none at all
        assert set(refused) == set(fabric.node_ids())
        assert all(isinstance(v, str) and v.startswith("refused:") for v in refused.values()), refused
    with pytest.raises(TenantRefusedError, match="operator call"):
        ray.get(bob.actor.set_send_rate.remote(1.0, token=bob._token()))
    reply = alice.load(NS, tokens, pulls=False)   # nothing of alice's was removed
    assert reply.num_blocks == 5 and np.array_equal(reply.payloads, data)
    assert not mine & set(bob.held_block_hashes())   # bob lists only his own namespaces ...
    assert mine <= set(alice.held_block_hashes())
    assert bob.stats()["held_blocks"] < alice.stats()["held_blocks"]
    assert "store" not in bob.stats()   # ... and no node-wide figures
    with pytest.raises(TenantRefusedError, match="operator call"):
        _client(None, None, here).stats()
    operator = _operator(wallet, here)
    assert mine <= set(operator.held_block_hashes())
    removed = operator.purge_producer(producer)
    assert removed[here] >= 5 * LAYOUT.num_layers
    assert alice.load(NS, tokens, pulls=False).num_blocks == 0
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{operator.stats()['metrics_port']}/metrics",
                                     timeout=10).read()
    for reason in (b"not_operator", b"operator_required"):
        assert b'kvfabric_tenant_refusals_total{reason="' + reason + b'"}' in metrics
