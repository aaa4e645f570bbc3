"""The fabric on a real local Ray cluster: several Ray nodes on 127.0.0.1, one NodeActor each,
real stores on disk, real TLS between nodes. One cluster for the whole module; tests that change
it (restarts, node loss) run last and add their own nodes.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import ray
from cryptography import x509
from testkit import PkiFactory, wait_until

from cluster.api import Where, payload_shape
from cluster.client import FabricClient, FabricUnavailableError
from cluster.directory.actor import shard_actor_name
from cluster.directory.client import DirectoryClient
from cluster.directory.report import Apply, Heartbeat, Report, ReportSigner
from cluster.directory.types import ApplyOutcome, NodeAddress, shard_of
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node.actor import NodeActor, node_actor_name, node_name_for
from fabric.config import NODE_NAME_ENV, ClusterConfig, Config, KVConfig, TransportConfig
from fabric.keys import BlockAddress, Namespace, block_hashes
from fabric.layout import KVLayout
from transports.core.base import Hit, Peer
from transports.factory import create_client
from transports.trust.certs import CertificateError, issue_node, issue_tenant, revoke
from transports.trust.identity import NodeSigner

LAYOUT = KVLayout.mha(4, 2, 64, "f16")      # 8 KiB per (block, layer) at 16 tokens
NS = Namespace("itest-model", LAYOUT, block_size=16, weights_fingerprint="itest")
LEASE_S = 2.0
HEARTBEAT_S = 0.4
RESYNC_BOUND_S = 8.0   # kill a shard -> full answers again: Ray restart + a heartbeat + jitter + resync


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    root = tmp_path_factory.mktemp("fabric")
    config = Config(kv=KVConfig(ram_gib=0.25, ssd_gib=1.0, write_through=True, o_direct=False),
                    cluster=ClusterConfig(heartbeat_s=HEARTBEAT_S, lease_s=LEASE_S, directory_shards=2,
                                          resync_jitter_s=0.2))
    local = start_local_cluster(3, root, config)
    try:
        yield local
    finally:
        local.shutdown()
    assert local.ray_dir is not None and not local.ray_dir.exists(), "Ray's files outlived the cluster"


def prompt(seed: int, num_blocks: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, 50_000, num_blocks * NS.block_size)]


def kv_for(seed: int, num_blocks: int, ns: Namespace = NS) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).integers(0, 256, payload_shape(ns, num_blocks), dtype=np.uint8)


def owners(config: Config, hashes: list[bytes]) -> list[set[str]]:
    async def ask() -> list[set[str]]:
        located = await DirectoryClient(config.cluster).locate(hashes, exclude=())
        return [set(o) for o in located.owners]
    return asyncio.run(ask())


def records_of(config: Config, node_id: str) -> list[tuple[int, str] | None]:
    """Each directory shard's record of `node_id`: (incarnation, "host:port" pulls go to), None if it has none."""
    out: list[tuple[int, str] | None] = []
    for k in range(config.cluster.directory_shards):
        _, infos = ray.get(ray.get_actor(shard_actor_name(config.cluster, k), namespace="kvfabric").nodes.remote())
        out.append(next(((n.incarnation, f"{n.address.host}:{n.address.port}") for n in infos
                         if n.node_id == node_id), None))
    return out


def nodes(fabric: LocalCluster) -> list[str]:
    head = ray.get_runtime_context().get_node_id()
    return [head] + [n for n in fabric.node_ids() if n != head]


def test_a_prefix_stored_on_one_node_is_pulled_byte_identical_by_another(fabric: LocalCluster) -> None:
    _head, a, b = nodes(fabric)[:3]
    client_a, client_b = FabricClient.connect(node_id=a), FabricClient.connect(node_id=b)
    tokens, data = prompt(1, 24), kv_for(1, 24)
    assert client_a.store(NS, tokens, data).num_stored == 24
    hashes = block_hashes(NS, tokens)
    wait_until(lambda: all(o == {a} for o in owners(fabric.config, hashes)), "the directory lists A", 5)
    found = client_b.lookup(NS, tokens)
    assert found.num_blocks == 24 and {loc.where for loc in found.locations} == {Where.PEER}
    assert {loc.node_id for loc in found.locations} == {a}
    before = client_b.stats()["pulled_bytes"]
    reply = client_b.load(NS, [*tokens, 7, 7, 7])
    assert reply.num_blocks == 24 and np.array_equal(reply.payloads, data)
    assert set(reply.sources) == {f"peer:{a}"}
    assert client_b.stats()["pulled_bytes"] - before == data.nbytes
    wait_until(lambda: all(o == {a, b} for o in owners(fabric.config, hashes)), "the directory lists A and B", 5)
    again = client_b.load(NS, tokens)
    assert set(again.sources) == {"ram"} and np.array_equal(again.payloads, data)


def test_layer_wise_load_from_a_peer_delivers_every_layer_in_order(fabric: LocalCluster) -> None:
    head, a, _ = nodes(fabric)[:3]
    tokens, data = prompt(6, 20), kv_for(6, 20)
    FabricClient.connect(node_id=a).store(NS, tokens, data)
    client = FabricClient.connect(node_id=head)
    wait_until(lambda: client.lookup(NS, tokens).num_blocks == 20, "A's blocks visible", 5)
    stream = client.load_layers(NS, tokens)
    assert stream.num_blocks == 20 and set(stream.sources) == {f"peer:{a}"}
    layers = list(stream)
    assert [layer for layer, _ in layers] == list(range(LAYOUT.num_layers))
    assert all(np.array_equal(arr, data[:, layer]) for layer, arr in layers)


def test_two_tenants_never_share_blocks(fabric: LocalCluster, tmp_path: Path) -> None:
    _, a, b = nodes(fabric)[:3]
    alice, bob = (issue_tenant(fabric.config.transport.cert_dir, name, out_dir=tmp_path)[0]
                  for name in ("alice", "bob"))
    ns = Namespace("itest-model", LAYOUT, 16, weights_fingerprint="itest")
    tokens = prompt(2, 8)
    FabricClient.connect(node_id=a, credential=alice).store(ns, tokens, kv_for(2, 8, ns))
    alice_b, bob_b = (FabricClient.connect(node_id=b, credential=c) for c in (alice, bob))
    wait_until(lambda: alice_b.lookup(ns, tokens).num_blocks == 8, "alice's blocks visible", 5)
    assert bob_b.lookup(ns, tokens).num_blocks == 0
    assert bob_b.load(ns, tokens).num_blocks == 0


def test_metrics_endpoint_shows_the_pulls(fabric: LocalCluster) -> None:
    _, _a, b = nodes(fabric)[:3]
    stats = FabricClient.connect(node_id=b).stats()
    with urllib.request.urlopen(f"http://127.0.0.1:{stats['metrics_port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    hits = [line for line in text.splitlines()
            if line.startswith("kvfabric_pulls_total") and 'outcome="hit"' in line]
    assert hits and float(hits[0].split()[-1]) > 0
    assert "kvfabric_hit_blocks_total" in text and "kvfabric_prefix_lookup_seconds_bucket" in text


def test_a_certificate_from_a_foreign_ca_cannot_pull(fabric: LocalCluster, tmp_path: Path,
                                                    make_pki: PkiFactory) -> None:
    _, a, _ = nodes(fabric)[:3]
    stats = FabricClient.connect(node_id=a).stats()
    host, port = stats["address"].rsplit(":", 1)
    foreign = make_pki(tmp_path / "foreign", "intruder").dir
    hashes = block_hashes(NS, prompt(1, 24))

    results = pull_as(foreign, "intruder", Peer(node_name_for(a), host, int(port)), BlockAddress(hashes[0], 0))
    assert results and not any(isinstance(r, Hit) for r in results)


def pull_as(cert_dir: Path, node: str, peer: Peer, address: BlockAddress) -> list[object]:
    """Pull one (block, layer) from `peer` with `node`'s certificate: results, or the error raised."""
    async def pull() -> list[object]:
        client = create_client(TransportConfig(cert_dir=str(cert_dir), node_name=node, connect_timeout_s=3))
        got: list[object] = []
        try:
            async for result in client.pull(peer, [address]):
                got.append(result)
        except Exception as e:
            got.append(e)
        finally:
            await client.close()
        return got
    return asyncio.run(pull())


def shard_handle(fabric: LocalCluster, k: int) -> ray.actor.ActorHandle:
    return ray.get_actor(shard_actor_name(fabric.config.cluster, k), namespace="kvfabric")


def report_signer(fabric: LocalCluster, name: str, node_id: str, incarnation: int) -> ReportSigner:
    d = Path(fabric.config.transport.cert_dir)
    return ReportSigner(NodeSigner(d / f"{name}.pem", d / f"{name}.key"), node_id, incarnation)


def test_reports_forged_from_a_ray_driver_are_refused_and_counted(fabric: LocalCluster) -> None:
    _, a, b = nodes(fabric)[:3]
    client_a = FabricClient.connect(node_id=a)
    tokens = prompt(11, 16)
    client_a.store(NS, tokens, kv_for(11, 16))
    hashes = block_hashes(NS, tokens)
    wait_until(lambda: all(o == {a} for o in owners(fabric.config, hashes)), "the directory lists A", 5)
    inc = client_a.stats()["incarnation"]
    host, port = client_a.stats()["address"].rsplit(":", 1)
    addr_a = NodeAddress(host, int(port), "tls-tcp", node_name_for(a))
    k = shard_of(hashes[0], fabric.config.cluster.directory_shards)
    mine = [h for h in hashes if shard_of(h, fabric.config.cluster.directory_shards) == k]
    shard = shard_handle(fabric, k)
    before = ray.get(shard.stats.remote())[1]
    as_a = report_signer(fabric, node_name_for(b), a, inc)          # B's key, A's id
    as_a_later = report_signer(fabric, node_name_for(b), a, inc + 10**12)
    as_ghost = report_signer(fabric, node_name_for(b), "ghost-node", inc)
    as_b = report_signer(fabric, node_name_for(b), b, inc)
    hijack = NodeAddress("10.66.0.1", int(port), "tls-tcp", node_name_for(b))
    answers = [
        shard.report.remote(Report(k, a, inc, Apply(10**6, [], mine, addr_a))),                # no key at all
        shard.report.remote(as_a.sign(k, Apply(10**6, [], mine, addr_a))),
        shard.report.remote(as_a_later.sign(k, Heartbeat(addr_a))),
        shard.report.remote(as_ghost.sign(k, Heartbeat(addr_a))),
        shard.report.remote(as_b.sign(k, Heartbeat(hijack))),
    ]
    assert [outcome for _epoch, outcome in ray.get(answers)] == [ApplyOutcome.REFUSED] * 5
    after = ray.get(shard.stats.remote())[1]
    assert {r: after.get(f"refused_{r}", 0) - before.get(f"refused_{r}", 0)
            for r in ("unsigned", "wrong_node", "address")} == {"unsigned": 1, "wrong_node": 3, "address": 1}
    assert all(o == {a} for o in owners(fabric.config, hashes))          # A's blocks are still listed, as A's
    located = asyncio.run(DirectoryClient(fabric.config.cluster).locate(hashes[:1], exclude=()))
    assert located.addresses[a] == addr_a


def test_a_node_without_its_certificate_refuses_to_start_with_a_one_line_error(fabric: LocalCluster) -> None:
    head = nodes(fabric)[0]
    actor = NodeActor.options(  # type: ignore[attr-defined]
        name="kvfabric-node-without-certificate", namespace="kvfabric",
        runtime_env={"env_vars": {NODE_NAME_ENV: "node-uncertified"}}).remote(fabric.config, head)
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as raised:
            ray.get(actor.ping.remote(), timeout=60)
    finally:
        ray.kill(actor, no_restart=True)
    cause = raised.value.cause
    assert isinstance(cause, CertificateError)
    message = str(cause)
    assert "\n" not in message and "node-uncertified.pem is missing" in message
    assert "kvfabric certs issue" in message and "--node node-uncertified" in message
    assert not (Path(fabric.config.transport.cert_dir) / "node-uncertified.pem").exists()


def test_a_revoked_certificate_is_refused_by_the_transport_and_the_directory(fabric: LocalCluster) -> None:
    _, a, _ = nodes(fabric)[:3]
    cert_dir = Path(fabric.config.transport.cert_dir)
    issue_node(cert_dir, "node-revoked", extra_sans=("127.0.0.1",))   # the operator issued it once
    stats = FabricClient.connect(node_id=a).stats()
    host, port = stats["address"].rsplit(":", 1)
    tokens = prompt(12, 4)
    FabricClient.connect(node_id=a).store(NS, tokens, kv_for(12, 4))
    peer, first = Peer(node_name_for(a), host, int(port)), BlockAddress(block_hashes(NS, tokens)[0], 0)
    addr = NodeAddress("127.0.0.1", 1, "tls-tcp", "node-revoked")
    shard = shard_handle(fabric, 0)
    signer = report_signer(fabric, "node-revoked", "revoked-node", 1)
    assert any(isinstance(r, Hit) for r in pull_as(cert_dir, "node-revoked", peer, first))
    assert ray.get(shard.report.remote(signer.sign(0, Heartbeat(addr))))[1] is ApplyOutcome.ACCEPTED
    serial = x509.load_pem_x509_certificate((cert_dir / "node-revoked.pem").read_bytes()).serial_number
    revoke(cert_dir, {serial})
    wait_until(lambda: ray.get(shard.report.remote(signer.sign(0, Heartbeat(addr))))[1] is ApplyOutcome.REFUSED,
               "the directory refuses the revoked certificate", 10)
    assert ray.get(shard.stats.remote())[1]["refused_revoked"] >= 1
    assert not any(isinstance(r, Hit) for r in pull_as(cert_dir, "node-revoked", peer, first))

    def counted() -> bool:   # the server counts once its side of the handshake ends, maybe after the client's
        with urllib.request.urlopen(f"http://127.0.0.1:{stats['metrics_port']}/metrics", timeout=5) as resp:
            return 'kvfabric_auth_failures_total{reason="revoked",transport="tls-tcp"}' in resp.read().decode()
    wait_until(counted, "A counts the revoked handshake", 10)


def test_a_restarted_node_reregisters_its_ssd_blocks_under_a_new_incarnation(fabric: LocalCluster) -> None:
    head, a, _b = nodes(fabric)[:3]
    client_a = FabricClient.connect(node_id=a)
    tokens, data = prompt(3, 12), kv_for(3, 12)
    client_a.store(NS, tokens, data)            # write-through: on A's SSD when acknowledged
    old = client_a.stats()["incarnation"]
    hashes = block_hashes(NS, tokens)
    wait_until(lambda: all(o == {a} for o in owners(fabric.config, hashes)), "A listed", 5)
    ray.kill(ray.get_actor(node_actor_name(a), namespace="kvfabric"), no_restart=False)
    client_a = FabricClient.connect(node_id=a, timeout_s=60)
    wait_until(lambda: client_a.stats()["incarnation"] > old, "A restarted", 60)   # the kill is asynchronous
    # Each shard keeps the old incarnation's record (and entries) until the new one's resync ends there:
    # A has re-registered once every shard's record of it is the new incarnation's, at its new port.
    new = client_a.stats()
    wait_until(lambda: set(records_of(fabric.config, a)) == {(new["incarnation"], new["address"])},
               "A re-registered", 10)
    assert all(o == {a} for o in owners(fabric.config, hashes))
    reply = FabricClient.connect(node_id=head).load(NS, tokens)
    assert reply.num_blocks == 12 and np.array_equal(reply.payloads, data)
    assert set(reply.sources) == {f"peer:{a}"}


def test_calls_in_flight_while_a_node_actor_restarts_are_answered_by_the_restarted_actor(fabric: LocalCluster) -> None:
    b = nodes(fabric)[2]
    client = FabricClient.connect(node_id=b)
    old = client.stats()["incarnation"]
    tokens, data = prompt(6, 8), kv_for(6, 8)
    with ThreadPoolExecutor(8) as pool:
        calls = [pool.submit(client.store, NS, tokens, data) for _ in range(200)]
        ray.kill(ray.get_actor(node_actor_name(b), namespace="kvfabric"), no_restart=False)
        calls += [pool.submit(client.stats) for _ in range(50)]
        replies = [c.result(timeout=120) for c in calls]      # raises if a call was lost to the restart
    assert all(r.num_stored == 8 for r in replies[:200])
    wait_until(lambda: client.stats()["incarnation"] > old, "B restarted", 60)
    reply = client.load(NS, tokens)
    assert reply.num_blocks == 8 and np.array_equal(reply.payloads, data)


def test_a_killed_directory_shard_answers_in_full_again_within_the_bound(fabric: LocalCluster) -> None:
    tokens = prompt(1, 24)
    hashes = block_hashes(NS, tokens)
    before = owners(fabric.config, hashes)
    assert all(before)
    for k in range(fabric.config.cluster.directory_shards):
        ray.kill(ray.get_actor(shard_actor_name(fabric.config.cluster, k), namespace="kvfabric"), no_restart=False)
    took = wait_until(lambda: owners(fabric.config, hashes) == before, "full state after restart", RESYNC_BOUND_S)
    print(f"directory rebuilt from the nodes in {took:.2f} s")


def test_a_node_added_later_gets_a_node_actor_and_serves_pulls(fabric: LocalCluster) -> None:
    head = nodes(fabric)[0]
    new = fabric.add_node()
    tokens, data = prompt(4, 10), kv_for(4, 10)
    FabricClient.connect(node_id=new).store(NS, tokens, data)
    client = FabricClient.connect(node_id=head)
    wait_until(lambda: client.lookup(NS, tokens).num_blocks == 10, "new node's blocks visible", 5)
    reply = client.load(NS, tokens)
    assert np.array_equal(reply.payloads, data) and set(reply.sources) == {f"peer:{new}"}


def test_every_ray_node_keeps_its_files_in_the_clusters_own_directory(fabric: LocalCluster) -> None:
    """Session files and sockets of every Ray node (the one added later too) are under the cluster's
    own directory, not the shared /tmp/ray that other clusters on the machine use."""
    assert fabric.ray_dir is not None
    session_dirs = [Path(node.get_session_dir_path()) for node in fabric.cluster.list_all_nodes()]
    assert len(session_dirs) >= 3
    assert all(d.parent == fabric.ray_dir for d in session_dirs), session_dirs
    assert (fabric.ray_dir / "ray" / "ray_current_cluster").read_text() == fabric.cluster.address


def test_a_dead_owner_means_fallback_or_miss_never_wrong_data(fabric: LocalCluster) -> None:
    head, _a, b = nodes(fabric)[:3]
    doomed = fabric.add_node()
    tokens, data = prompt(5, 32), kv_for(5, 32)
    FabricClient.connect(node_id=doomed).store(NS, tokens, data)
    client_b = FabricClient.connect(node_id=b)
    wait_until(lambda: client_b.lookup(NS, tokens).num_blocks == 32, "doomed node's blocks visible", 5)
    half = client_b.load(NS, tokens, max_blocks=16)             # B now owns the first half too
    assert np.array_equal(half.payloads, data[:16])
    hashes = block_hashes(NS, tokens)
    wait_until(lambda: all(b in o for o in owners(fabric.config, hashes[:16])), "B listed for the first half", 5)
    pending = FabricClient.connect(node_id=head).actor.load.remote(NS, tokens, None, True)
    fabric.remove_node(doomed)               # the machine dies during (or just before) the pull; its lease runs on
    reply = ray.get(pending)
    assert reply.num_blocks <= 32 and np.array_equal(reply.payloads, data[:reply.num_blocks])
    assert reply.num_blocks >= 16                                # B's copy served the first half
    wait_until(lambda: all(doomed not in o for o in owners(fabric.config, hashes)),
               "the dead node leaves the directory after its lease", LEASE_S + 3)


def test_kvfabric_start_on_the_running_cluster_finds_every_node_and_is_idempotent(fabric: LocalCluster) -> None:
    import os
    import subprocess
    import sys
    kvfabric = str(Path(sys.executable).parent / "kvfabric")
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([kvfabric, "start", "--address", fabric.address], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    def serves(node_id: str) -> bool:
        try:
            return bool(FabricClient.connect(node_id=node_id, timeout_s=5).stats())
        except FabricUnavailableError:
            return False
    serving = [n for n in fabric.node_ids() if serves(n)]
    assert len(serving) >= 4                     # 3 at the start + 1 added (the removed one may still be listed)
    assert f"kvfabric started on {len(serving)} Ray nodes" in proc.stdout
    assert all(node_id[:12] in proc.stdout for node_id in serving)
