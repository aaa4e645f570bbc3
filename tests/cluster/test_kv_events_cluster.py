"""KV events from a live 2-node Ray cluster, followed by the example subscriber: after a store, a
pull (mirrored), blocks named by ids, an eviction and a restart, its view of each node equals the
node's own `held` set. One cluster for the module; the restart runs last."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import ray

from cluster.api import Where, payload_shape
from cluster.client import FabricClient
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node_actor import node_actor_name, node_name_for
from examples.kv_events_subscriber import Subscriber, main
from fabric.config import ClusterConfig, Config, EventsConfig, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(2, 2, 64, "f16")       # 16 KiB per block at 16 tokens
NS = Namespace("events-itest", LAYOUT, block_size=16, weights_fingerprint="itest")
BLOCK = LAYOUT.bytes_per_block(16)


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Subscriber]]:
    root = tmp_path_factory.mktemp("kvev")
    config = Config(kv=KVConfig(ram_gib=40 * BLOCK / 2**30, ssd_gib=40 * BLOCK / 2**30,
                                o_direct=False, mirror_delay_s=0.1, eviction_interval_s=0.2),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0),
                    events=EventsConfig(enabled=True, endpoint=f"ipc://{root}/{{node}}.pub",
                                        replay_endpoint=f"ipc://{root}/{{node}}.replay", topic="kv"))
    local = start_local_cluster(2, root / "fabric", config)
    sub = None
    try:
        endpoints = {}
        for node_id in local.node_ids():
            events = FabricClient.connect(node_id=node_id).stats()["kv_events"]
            endpoints[node_id] = (events["endpoint"], events["replay_endpoint"])
            assert events["endpoint"] == f"ipc://{root}/{node_name_for(node_id)}.pub"
        sub = Subscriber(endpoints, topic="kv", idle_check_s=0.5)
        yield local, sub
    finally:
        if sub is not None:
            sub.close()
        local.shutdown()


def u64s(hashes: list[bytes]) -> set[int]:
    return {int.from_bytes(h[-8:], "big") for h in hashes}


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, num_blocks * 16)]


def kv_for(seed: int, num_blocks: int) -> np.ndarray:
    return np.random.default_rng(seed + 1000).integers(0, 256, payload_shape(NS, num_blocks), dtype=np.uint8)


def views_match(local: LocalCluster, sub: Subscriber, timeout_s: float = 30.0) -> dict[str, set[int]]:
    """Follow the events until the subscriber's view of every node equals its held set."""
    deadline = time.monotonic() + timeout_s
    while True:
        sub.poll(0.2)
        held = {n: u64s(FabricClient.connect(node_id=n).held_block_hashes()) for n in local.node_ids()}
        if all(sub.views[n].held == held[n] for n in held):
            return held
        if time.monotonic() > deadline:
            diff = {n: (len(sub.views[n].held), len(held[n])) for n in held}
            raise AssertionError(f"views (announced, held) per node never matched: {diff}")


def test_a_store_and_a_mirrored_pull_are_announced_with_their_tokens(
        fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, b = local.node_ids()
    tokens = prompt(1, 8)
    assert FabricClient.connect(node_id=a).store(NS, tokens, kv_for(1, 8)).num_stored == 8
    held = views_match(local, sub)
    assert u64s(block_hashes(NS, tokens)) <= held[a] and not held[b]
    assert sub.hit_estimates([*tokens, 1, 2, 3], 16) == {a: 8, b: 0}
    reader = FabricClient.connect(node_id=b)
    deadline = time.monotonic() + 15
    while reader.lookup(NS, tokens).num_blocks < 8:   # the directory learns of A's blocks asynchronously
        assert time.monotonic() < deadline, "the directory never listed A's blocks"
        time.sleep(0.05)
    reply = reader.load(NS, tokens)
    assert reply.num_pulled_blocks == 8 and np.array_equal(reply.payloads, kv_for(1, 8))
    deadline = time.monotonic() + 30
    while not u64s(block_hashes(NS, tokens)) <= views_match(local, sub)[b]:   # the mirror lands later
        assert time.monotonic() < deadline, "B's mirror never showed"
    assert sub.hit_estimates(tokens, 16) == {a: 8, b: 8}


def test_the_example_prints_what_each_node_would_hit_of_a_prompt(
        fabric: tuple[LocalCluster, Subscriber], capsys: pytest.CaptureFixture[str]) -> None:
    local, _ = fabric
    tokens = prompt(1, 8)          # stored on A and mirrored to B by the test before
    other = prompt(99, 8)
    assert main(["--tokens", ",".join(map(str, tokens + other[:16])), "--seconds", "1.5"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    for node_id in local.node_ids():
        assert f"{node_name_for(node_id)}: 128 of 144 tokens" in last


def test_blocks_named_by_ids_round_trip_through_the_cluster(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, b = local.node_ids()
    ids: list[bytes | int] = [7001, b"\x07" * 32, 7003, 7004]
    data = kv_for(2, 4)
    assert FabricClient.connect(node_id=a).store_blocks(NS, ids, data, parent=7000).num_stored == 4
    client_b = FabricClient.connect(node_id=b)
    deadline = time.monotonic() + 10
    while client_b.lookup_blocks(NS, ids, parent=7000).num_blocks < 4:
        assert time.monotonic() < deadline, "A's blocks never became visible to B"
        time.sleep(0.05)
    assert {loc.where for loc in client_b.lookup_blocks(NS, ids, parent=7000).locations} == {Where.PEER}
    tail = client_b.load_blocks(NS, ids[1:], parent=ids[0])
    assert tail.num_pulled_blocks == 3 and np.array_equal(tail.payloads, data[1:])
    stream = client_b.load_blocks_layers(NS, ids, parent=7000)
    assert [layer for layer, _ in stream] == [0, 1]
    assert client_b.lookup_blocks(NS, ids).num_blocks == 0                # another parent: other blocks
    views_match(local, sub)


def test_evicted_blocks_leave_the_view(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, _ = local.node_ids()
    first = u64s(block_hashes(NS, prompt(1, 8)))
    client = FabricClient.connect(node_id=a)
    for seed in range(10, 16):           # 6 x 16 blocks through tiers of about 40 blocks each
        client.store(NS, prompt(seed, 16), kv_for(seed, 16))
        time.sleep(0.3)                  # lets the background eviction make room between prompts
    deadline = time.monotonic() + 30
    while first & views_match(local, sub)[a]:
        assert time.monotonic() < deadline, "the first prompt was never evicted from A"


def test_a_restarted_node_clears_first_then_announces_its_ssd_blocks(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, _ = local.node_ids()
    client = FabricClient.connect(node_id=a)
    old, resets = client.stats()["incarnation"], sub.views[a].num_resets
    ray.kill(ray.get_actor(node_actor_name(a), namespace="kvfabric"), no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        try:
            if client.stats()["incarnation"] > old:
                break
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() < deadline, "A never restarted"
        time.sleep(0.2)
    held = views_match(local, sub)
    assert held[a], "the restarted node holds its SSD blocks"
    assert sub.views[a].num_resets > resets
    assert sub.views[a].first_events[0] == "AllBlocksCleared"
    assert set(sub.views[a].first_events[1:]) == {"BlockStored"}
