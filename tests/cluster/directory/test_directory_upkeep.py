"""DirectoryUpkeep without Ray: a node's upkeep against real, signature-checking directory shards
(`DirectoryGate` over `DirectoryShard`) behind an in-memory `DirectoryApi`, on a clock the test moves.
Shards can stall (every call fails as a timed-out call would) and restart empty (a new epoch)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Collection
from pathlib import Path

import pytest
from testkit import PkiFactory

from cluster.directory.auth import DirectoryGate
from cluster.directory.report import Report, ReportSigner
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, shard_of
from cluster.directory.upkeep import DirectoryUpkeep, ShardUnavailable
from cluster.node.metrics import ClusterMetrics
from fabric.config import ClusterConfig
from transports.trust.identity import NodeSigner, TrustAnchor

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
        self.after_report: list[Callable[[], None]] = []   # run after each answered report

    def _gate(self, k: int) -> DirectoryGate:
        return DirectoryGate(DirectoryShard(k, SHARDS, lease_s=30.0), TrustAnchor.from_files(self.certs / "ca.pem"))

    def restart(self, k: int) -> None:
        self.gates[k] = self._gate(k)
        self.epochs[k] = f"e{int(self.epochs[k][1:]) + 1}"

    def epoch(self, shard: int) -> str | None:
        return self.epochs[shard]

    async def report(self, report: Report) -> ApplyOutcome:
        self.num_calls += 1
        if report.shard in self.stalled:
            raise ShardUnavailable(f"shard {report.shard} stalled")
        outcome = self.gates[report.shard].submit(report, self.clock())
        for watch in self.after_report:
            watch()
        return outcome


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("certs"), "node-a", extra_sans=("127.0.0.1",)).dir


def make(certs: Path, held: set[bytes], clock: Clock, directory: MemoryDirectory,
         incarnation: int = 5) -> DirectoryUpkeep:
    async def held_now() -> Collection[bytes]:
        return set(held)

    config = ClusterConfig(directory_shards=SHARDS, heartbeat_s=1.0, flush_ms=5.0, resync_jitter_s=0.5)
    reports = ReportSigner(NodeSigner(certs / "node-a.pem", certs / "node-a.key"), NODE, incarnation)
    return DirectoryUpkeep(directory, config, address=ADDR, reports=reports, held=held_now,
                           metrics=ClusterMetrics(None), clock=clock, rng=random.Random(1))


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


def test_a_restarted_node_keeps_its_blocks_listed_until_its_resync_replaces_them(certs: Path) -> None:
    clock = Clock()
    directory = MemoryDirectory(certs, clock)
    held = {h(i) for i in range(40)}
    run_ticks(make(certs, held, clock, directory), clock, 0.1)
    assert listed(directory, held) == held
    restarted = make(certs, held, clock, directory, incarnation=10**6)   # the same blocks, kept on its SSD
    seen: list[int] = []
    directory.after_report.append(lambda: seen.append(len(listed(directory, held))))
    run_ticks(restarted, clock, 0.1)
    assert seen and set(seen) == {len(held)}   # no report of the new incarnation unlisted them, even briefly
    assert {i.incarnation for g in directory.gates for i in g.shard.nodes(clock.now)} == {10**6}


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


def test_the_background_pass_feeds_the_directory_and_outlives_a_failing_pass(
        certs: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    directory = MemoryDirectory(certs, clock)
    held = {h(i) for i in range(20)}
    upkeep = make(certs, held, clock, directory)
    beats: list[float] = []
    passes = 0

    def feed() -> None:   # what a node's store hands over at the start of each pass
        nonlocal passes
        passes += 1
        clock.now += 0.3
        if passes == 2:
            raise RuntimeError("a bug in one pass")
        if passes == 3:
            upkeep.record([(h(50), True)])
            held.add(h(50))

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(upkeep.run_forever(feed, lambda: beats.append(clock.now)))
        while not (passes > 3 and listed(directory, held) == held and len(beats) >= 3):
            await asyncio.sleep(0.005)
        task.cancel()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert "directory sync pass failed" in caplog.text
    assert max(beats) > 0.6                   # heartbeats went on after the failing (second) pass
