"""KV events from a live 2-node Ray cluster on CURVE endpoints, followed by the example subscriber
(an allowed consumer): after a store, a pull (mirrored), blocks named by ids, an eviction and a
restart, its view of each node equals the node's own `held` set, with each block's parent and tokens.
A subscriber without an allowed key gets nothing; a replay flood leaves the node's lookups as fast
as idle. One cluster for the module; the restart runs last."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import zmq
import zmq.auth
from testkit import wait_until

from cluster.api import EventKeys, Where, payload_shape
from cluster.client import FabricClient
from cluster.launch import LocalCluster, start_local_cluster
from cluster.node.actor import node_actor_name, node_name_for
from examples.kv_events_subscriber import Subscriber, main
from fabric.block_ids import block_id_hashes
from fabric.config import ClusterConfig, Config, EventsConfig, KVConfig
from fabric.keys import Namespace, block_hashes
from fabric.layout import KVLayout

LAYOUT = KVLayout.mha(2, 2, 64, "f16")       # 16 KiB per block at 16 tokens
NS = Namespace("events-itest", LAYOUT, block_size=16, weights_fingerprint="itest")
BLOCK = LAYOUT.bytes_per_block(16)
TINY = Namespace("events-flood", KVLayout.mha(1, 1, 4, "f16"), block_size=16)   # 256 B blocks
IDS: list[bytes | int] = [7001, b"\x07" * 32, 7003, 7004]
KEYS: dict[str, Path] = {}


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Subscriber]]:
    root = tmp_path_factory.mktemp("kvev")
    keys, allowed = root / "keys", root / "allowed"
    keys.mkdir()
    allowed.mkdir()
    for name in ("node", "router", "stranger"):
        zmq.auth.create_certificates(keys, name)
        KEYS[name] = keys / f"{name}.key_secret"
    (allowed / "router.key").write_bytes((keys / "router.key").read_bytes())
    config = Config(kv=KVConfig(ram_gib=40 * BLOCK / 2**30, ssd_gib=40 * BLOCK / 2**30,
                                o_direct=False, mirror_delay_s=0.1, eviction_interval_s=0.2),
                    cluster=ClusterConfig(heartbeat_s=0.4, lease_s=2.0, flush_ms=1.0),
                    events=EventsConfig(enabled=True, endpoint=f"ipc://{root}/{{node}}.pub",
                                        replay_endpoint=f"ipc://{root}/{{node}}.replay", topic="kv",
                                        curve_secret_key=str(KEYS["node"]), curve_allow_dir=str(allowed)))
    local = start_local_cluster(2, root / "fabric", config)
    sub = None
    try:
        endpoints, server_keys = {}, {}
        for node_id in local.node_ids():
            events = FabricClient.connect(node_id=node_id).stats()["kv_events"]
            endpoints[node_id] = (events["endpoint"], events["replay_endpoint"])
            server_keys[node_id] = events["curve_public_key"].encode()
            assert events["endpoint"] == f"ipc://{root}/{node_name_for(node_id)}.pub"   # the same after a restart
        sub = Subscriber(endpoints, topic="kv", idle_check_s=0.5, curve_keys=key_pair("router"),
                         server_keys=server_keys)
        yield local, sub
    finally:
        if sub is not None:
            sub.close()
        local.shutdown()


def key_pair(name: str) -> tuple[bytes, bytes]:
    public, secret = zmq.auth.load_certificate(KEYS[name])
    assert secret is not None
    return public, secret


def u64(h: bytes) -> int:
    return int.from_bytes(h[-8:], "big")


def u64s(hashes: Iterable[bytes]) -> set[int]:
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
    # the directory learns of A's blocks asynchronously
    wait_until(lambda: reader.lookup(NS, tokens).num_blocks >= 8, "the directory listing A's blocks", 15)
    reply = reader.load(NS, tokens)
    assert reply.num_pulled_blocks == 8 and np.array_equal(reply.payloads, kv_for(1, 8))
    # the mirror lands later
    wait_until(lambda: u64s(block_hashes(NS, tokens)) <= views_match(local, sub)[b], "B's mirror in the view", 30)
    assert sub.hit_estimates(tokens, 16) == {a: 8, b: 8}


def test_an_engines_extra_keys_and_lora_name_name_its_stored_blocks(fabric: tuple[LocalCluster, Subscriber]) -> None:
    """A router that hashes tokens as vLLM does (cache_salt on a prompt's first block, a LoRA's name on
    each) maps the blocks the vLLM connector stores by the keys they are announced with."""
    local, sub = fabric
    a, _ = local.node_ids()
    tokens = prompt(7, 3)
    extra = (("lora-a", "salt-1"), ("lora-a",), ("lora-a",))
    client = FabricClient.connect(node_id=a)
    assert client.store(NS, tokens, kv_for(7, 3), event_keys=EventKeys(extra, "lora-a")).num_stored == 3
    views_match(local, sub)
    hashes = [u64(h) for h in block_hashes(NS, tokens)]
    assert [sub.views[a].keys_of.get(h) for h in hashes] == [(list(e), "lora-a") for e in extra]
    with pytest.raises(ValueError, match="extra keys"):   # one entry per stored block, or none
        client.store(NS, prompt(8, 2), kv_for(8, 2), event_keys=EventKeys(extra, None))


def test_a_subscriber_without_an_allowed_key_gets_nothing(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, _ = local.node_ids()
    events = FabricClient.connect(node_id=a).stats()["kv_events"]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    outsiders = []
    for name in (None, "stranger"):
        sock = ctx.socket(zmq.SUB)
        if name is not None:
            sock.curve_publickey, sock.curve_secretkey = key_pair(name)
            sock.curve_serverkey = events["curve_public_key"].encode()
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(events["endpoint"])
        outsiders.append(sock)
    try:
        tokens = prompt(3, 4)
        assert FabricClient.connect(node_id=a).store(NS, tokens, kv_for(3, 4)).num_stored == 4
        assert u64s(block_hashes(NS, tokens)) <= views_match(local, sub)[a]    # the allowed consumer saw it ...
        assert not any(sock.poll(0) for sock in outsiders)                      # ... the others got nothing
    finally:
        for sock in outsiders:
            sock.close(linger=0)


def test_the_example_prints_what_each_node_would_hit_of_a_prompt(
        fabric: tuple[LocalCluster, Subscriber], capsys: pytest.CaptureFixture[str]) -> None:
    local, _ = fabric
    tokens = prompt(1, 8)          # stored on A and mirrored to B by the test before
    other = prompt(99, 8)
    assert main(["--tokens", ",".join(map(str, tokens + other[:16])), "--seconds", "1.5",
                 "--curve-key", str(KEYS["router"])]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    for node_id in local.node_ids():
        assert f"{node_name_for(node_id)}: 128 of 144 tokens" in last


def test_blocks_named_by_ids_round_trip_through_the_cluster(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, b = local.node_ids()
    ids = IDS
    data = kv_for(2, 4)
    assert FabricClient.connect(node_id=a).store_blocks(NS, ids, data, parent=7000).num_stored == 4
    client_b = FabricClient.connect(node_id=b)
    wait_until(lambda: client_b.lookup_blocks(NS, ids, parent=7000).num_blocks >= 4, "A's blocks visible to B", 10)
    assert {loc.where for loc in client_b.lookup_blocks(NS, ids, parent=7000).locations} == {Where.PEER}
    tail = client_b.load_blocks(NS, ids[1:], parent=ids[0])
    assert tail.num_pulled_blocks == 3 and np.array_equal(tail.payloads, data[1:])
    stream = client_b.load_blocks_layers(NS, ids, parent=7000)
    assert [layer for layer, _ in stream] == [0, 1]
    assert client_b.lookup_blocks(NS, ids).num_blocks == 0                # another parent: other blocks
    views_match(local, sub)


def _incarnation(client: FabricClient) -> int:
    try:
        return int(client.stats()["incarnation"])
    except ray.exceptions.RayError:   # the actor is restarting
        return -1


def _room(store: dict[str, Any]) -> bool:
    return bool(store["ram"]["bytes"] <= store["ram"]["capacity_bytes"] and store["pending_writes"] == 0)


def test_evicted_blocks_leave_the_view(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, _ = local.node_ids()
    first = u64s(block_hashes(NS, prompt(1, 8)))
    client = FabricClient.connect(node_id=a)
    for seed in range(10, 16):           # 6 x 16 blocks through tiers of about 40 blocks each
        client.store(NS, prompt(seed, 16), kv_for(seed, 16))
        # the background eviction makes room between prompts: RAM back within its capacity, nothing pending
        wait_until(lambda: _room(client.stats()["store"]), "A's RAM back within its capacity", 10)
    wait_until(lambda: not first & views_match(local, sub)[a], "the first prompt evicted from A", 30)


FLOODER = """
import sys, time, zmq
endpoint, public, secret, server = sys.argv[1:5]
ctx = zmq.Context()
socks = []
for _ in range(8):
    s = ctx.socket(zmq.DEALER)
    s.rcvhwm = 16
    s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public.encode(), secret.encode(), server.encode()
    s.connect(endpoint)
    socks.append(s)
print("flooding", flush=True)
while True:       # every socket asks for everything from 0, 200 times a second; one reads what comes, 7 never do
    for s in socks:
        try:
            s.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            pass
    while socks[0].poll(0):
        socks[0].recv_multipart()
    time.sleep(0.005)
"""


def lookup_p99(client: FabricClient, tokens: list[int], n: int) -> float:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.lookup(TINY, tokens)
        samples.append(time.perf_counter() - t0)
    return sorted(samples)[int(0.99 * n) - 1]


def test_a_replay_flood_leaves_the_nodes_lookups_as_fast_as_idle(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, _ = fabric
    a, _ = local.node_ids()
    client = FabricClient.connect(node_id=a)
    tiny = np.zeros(payload_shape(TINY, 1), dtype=np.uint8)
    for seed in range(1500):                  # ~1500 kept batches: what a flood of replays asks for
        client.store(TINY, prompt(10_000 + seed, 1), tiny)
    events = client.stats()["kv_events"]
    assert int(events["next_seq"]) > 500
    tokens = prompt(10_000, 1)
    public, secret = key_pair("router")       # an allowed consumer that misbehaves: the worst case
    idle, flooded = [], []
    for _ in range(2):                        # alternate, so both see the same background load
        idle.append(lookup_p99(client, tokens, 150))
        flood = subprocess.Popen([sys.executable, "-c", FLOODER, events["replay_endpoint"], public.decode(),
                                  secret.decode(), events["curve_public_key"]], stdout=subprocess.PIPE, text=True)
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "flooding"
            wait_until(lambda: int(client.stats()["kv_events"].get("replay_requests", "0")) >= 50,
                       "the flood reaching the node", 30, poll_s=0.0)
            start = int(client.stats()["kv_events"]["replay_requests"])
            flooded.append(lookup_p99(client, tokens, 150))
            served = int(client.stats()["kv_events"]["replay_requests"]) - start
        finally:
            flood.kill()
            flood.wait()
        assert served >= 10, "the flood stopped reaching the node"
    print(f"lookup p99 idle {idle}, under a replay flood {flooded}")
    # Before replays left the event loop, each request stalled it for the whole buffer's sends (and
    # a flood for seconds); now the flood costs the loop nothing. The slack absorbs a shared host's
    # scheduling noise, far below one stall.
    assert max(flooded) < 2 * max(idle) + 0.05, (idle, flooded)


def test_a_restarted_node_clears_first_then_announces_its_ssd_blocks(fabric: tuple[LocalCluster, Subscriber]) -> None:
    local, sub = fabric
    a, _ = local.node_ids()
    client = FabricClient.connect(node_id=a)
    old, resets = client.stats()["incarnation"], sub.views[a].num_resets
    ray.kill(ray.get_actor(node_actor_name(a), namespace="kvfabric"), no_restart=False)
    wait_until(lambda: _incarnation(client) > old, "A restarted", 60, poll_s=0.2)
    held = views_match(local, sub)
    assert held[a], "the restarted node holds its SSD blocks"
    assert sub.views[a].num_resets > resets
    assert sub.views[a].first_events[0] == "AllBlocksCleared"
    assert set(sub.views[a].first_events[1:]) == {"BlockStored"}
    # From the events alone, every block A re-announced has its parent and tokens, as first stored;
    # blocks named by ids carry none (their tokens were never given).
    known: dict[int, tuple[int | None, tuple[int, ...]]] = {}
    for ns, tokens in [(NS, prompt(seed, n)) for seed, n in [(1, 8), (3, 4), *((s, 16) for s in range(10, 16))]] + [
            (TINY, prompt(10_000 + seed, 1)) for seed in range(1500)]:
        hashes = block_hashes(ns, tokens)
        for i, h in enumerate(hashes):
            known[u64(h)] = (u64(hashes[i - 1]) if i else None, tuple(tokens[i * 16:(i + 1) * 16]))
    by_id = u64s(block_id_hashes(NS, IDS, parent=7000))
    view = sub.views[a]
    assert held[a] - by_id and set(view.chain_of) == held[a] - by_id
    assert {h: view.chain_of[h] for h in held[a] - by_id} == {h: known[h] for h in held[a] - by_id}
