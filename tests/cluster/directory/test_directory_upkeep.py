"""DirectoryUpkeep without Ray: a node's upkeep against real, signature-checking directory shards
(`DirectoryGate` over `DirectoryShard`) behind an in-memory `DirectoryApi`, on a clock the test moves.
Shards can stall (every call fails as a timed-out call would) and restart empty (a new epoch)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Collection, Sequence
from pathlib import Path

import pytest
from testkit import PkiFactory

from cluster.directory.auth import DirectoryGate, Proof, ReportSigner
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, shard_of
from cluster.directory.upkeep import DirectoryUpkeep, ShardUnavailable
from cluster.node.metrics import ClusterMetrics
from fabric.config import ClusterConfig
from transports.core.identity import NodeSigner, TrustAnchor

NODE = "a" * 56
ADDR = NodeAddress("127.0.0.1", 7000, "tls-tcp", "node-a")
SHARDS = 2


def h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class MemoryDirectory:
    """`DirectoryApi` over real gated shards, answering at once; `stalled` shards answer nothing."""

    def __init__(self, certs: Path, clock: Clock) -> None:
        self.certs, self.clock = certs, clock
        self.gates = [self._gate(k) for k in range(SHARDS)]
        self.epochs = ["e0"] * SHARDS
        self.stalled: set[int] = set()
        self.num_calls = 0

    def _gate(self, k: int) -> DirectoryGate:
        return DirectoryGate(DirectoryShard(k, SHARDS, lease_s=30.0), TrustAnchor.from_files(self.certs / "ca.pem"))

    def restart(self, k: int) -> None:
        self.gates[k] = self._gate(k)
        self.epochs[k] = f"e{int(self.epochs[k][1:]) + 1}"

    def _gate_of(self, shard: int) -> DirectoryGate:
        self.num_calls += 1
        if shard in self.stalled:
            raise ShardUnavailable(f"shard {shard} stalled")
        return self.gates[shard]

    def epoch(self, shard: int) -> str | None:
        return self.epochs[shard]

    async def heartbeat(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                        acked_seq: int | None, proof: Proof) -> ApplyOutcome:
        return self._gate_of(shard).heartbeat(node_id, incarnation, address, self.clock(), proof,
                                              acked_seq=acked_seq)

    async def apply(self, shard: int, node_id: str, incarnation: int, seq: int, stored: Sequence[bytes],
                    removed: Sequence[bytes], address: NodeAddress, proof: Proof,
                    versions: Sequence[bytes] = ()) -> ApplyOutcome:
        return self._gate_of(shard).apply(node_id, incarnation, seq, stored, removed, self.clock(), address, proof,
                                          versions)

    async def begin_resync(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                           proof: Proof) -> int:
        return self._gate_of(shard).begin_resync(node_id, incarnation, address, self.clock(), proof)

    async def resync_batch(self, shard: int, node_id: str, incarnation: int, resync_id: int,
                           hashes: Sequence[bytes], proof: Proof, versions: Sequence[bytes] = ()) -> bool:
        return self._gate_of(shard).resync_batch(node_id, incarnation, resync_id, hashes, self.clock(), proof,
                                                 versions)

    async def end_resync(self, shard: int, node_id: str, incarnation: int, resync_id: int, seq: int,
                         proof: Proof) -> bool:
        return self._gate_of(shard).end_resync(node_id, incarnation, resync_id, seq, self.clock(), proof)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("certs"), "node-a", extra_sans=("127.0.0.1",)).dir


def make(certs: Path, held: set[bytes], clock: Clock, directory: MemoryDirectory) -> DirectoryUpkeep:
    async def held_now() -> Collection[bytes]:
        return set(held)

    config = ClusterConfig(directory_shards=SHARDS, heartbeat_s=1.0, flush_ms=5.0, resync_jitter_s=0.5)
    reports = ReportSigner(NodeSigner(certs / "node-a.pem", certs / "node-a.key"), NODE, 5)
    return DirectoryUpkeep(directory, config, node_id=NODE, incarnation=5, address=ADDR, reports=reports,
                           held=held_now, metrics=ClusterMetrics(None), clock=clock, rng=random.Random(1))


def listed(directory: MemoryDirectory, hashes: Collection[bytes]) -> set[bytes]:
    out = set()
    for x in hashes:
        owners = directory.gates[shard_of(x, SHARDS)].shard.locate([x], directory.clock()).owners[0]
        if NODE in owners:
            out.add(x)
    return out


def run_ticks(upkeep: DirectoryUpkeep, clock: Clock, seconds: float, step: float = 0.01) -> None:
    async def main() -> None:
        end = clock.now + seconds
        while clock.now < end:
            await upkeep.tick()
            clock.now += step
    asyncio.run(main())


def test_the_directory_ends_listing_what_the_node_holds(certs: Path) -> None:
    clock = Clock()
    directory = MemoryDirectory(certs, clock)
    held = {h(i) for i in range(40)}
    upkeep = make(certs, held, clock, directory)
    run_ticks(upkeep, clock, 0.1)            # the first pass resyncs every shard from the held set
    assert listed(directory, held | {h(99)}) == held
    upkeep.record([(h(1), False), (h(50), True)])
    held.discard(h(1))
    held.add(h(50))
    run_ticks(upkeep, clock, 0.1)
    assert listed(directory, held | {h(1)}) == held
    assert upkeep.pending() == 0


def test_a_stalled_shard_loses_nothing_and_holds_up_nothing(certs: Path) -> None:
    clock = Clock()
    directory = MemoryDirectory(certs, clock)
    held = {h(i) for i in range(40)}
    upkeep = make(certs, held, clock, directory)
    run_ticks(upkeep, clock, 0.1)
    stalled = shard_of(h(100), SHARDS)
    directory.stalled.add(stalled)
    new = [h(i) for i in range(100, 140)]
    upkeep.record([(x, True) for x in new])
    held.update(new)
    run_ticks(upkeep, clock, 3.0)            # heartbeats and batches keep failing on one shard
    other = {x for x in new if shard_of(x, SHARDS) != stalled}
    assert listed(directory, new) == other   # the other shard was told at once
    directory.stalled.clear()
    run_ticks(upkeep, clock, 2.0)            # the failed batch became a resync, retried a heartbeat later
    assert listed(directory, held) == held


def test_a_restarted_shard_is_rebuilt_after_a_jittered_delay(certs: Path) -> None:
    clock = Clock()
    directory = MemoryDirectory(certs, clock)
    held = {h(i) for i in range(40)}
    upkeep = make(certs, held, clock, directory)
    run_ticks(upkeep, clock, 0.1)
    directory.restart(0)
    assert listed(directory, held) == {x for x in held if shard_of(x, SHARDS) == 1}
    run_ticks(upkeep, clock, 2.0)            # the next heartbeat sees the new epoch; resync within the jitter
    assert listed(directory, held) == held
