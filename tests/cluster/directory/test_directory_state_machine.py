"""DirectoryShard against a plain reference model (dicts of sets), driven by a hypothesis state machine.

The model spells the consistency rules out the slow, obvious way: every node's entries are a set,
a lease check happens on every touch, locate scans every node. Steps mix heartbeats, batches with
random sequence numbers and incarnations, resyncs interleaved with batches and newer incarnations,
time advancing past leases, expire(), and locate with exclusions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster.directory.report import Apply, BeginResync, Body, EndResync, Heartbeat, Report, ResyncBatch
from cluster.directory.shard import DIGESTS_KEPT, DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, batch_digest

LEASE = 5.0
NODES = ["n0", "n1", "n2"]
HASHES = [bytes([i]) * 32 for i in range(8)]
ADDRS = [NodeAddress("127.0.0.1", 7000 + i, "tls-tcp") for i in range(2)]

nodes = st.sampled_from(NODES)
incarnations = st.integers(1, 3)
hash_sets = st.lists(st.sampled_from(HASHES), max_size=4)
resync_ids = st.integers(1, 3)   # the node names its resyncs: few ids, so one is reused across resyncs


@dataclass
class MNode:
    incarnation: int
    address: NodeAddress | None
    lease_expiry: float
    last_seq: int = 0
    entries: set[bytes] = field(default_factory=set)
    digests: dict[int, bytes] = field(default_factory=dict)   # seq -> content of the batch applied


@dataclass
class MResync:
    resync_id: int
    incarnation: int
    staged: set[bytes] = field(default_factory=set)


class Model:
    def __init__(self) -> None:
        self.nodes: dict[str, MNode] = {}
        self.resyncs: dict[str, MResync] = {}

    def live(self, node_id: str, now: float) -> MNode | None:
        n = self.nodes.get(node_id)
        if n is not None and now >= n.lease_expiry:
            del self.nodes[node_id]
            self.resyncs.pop(node_id, None)
            return None
        return n

    def known(self, node_id: str, n: MNode) -> int:
        r = self.resyncs.get(node_id)
        return max(n.incarnation, r.incarnation) if r else n.incarnation

    def renew(self, node_id: str, incarnation: int) -> None:
        """A newer incarnation replaces everything; an older resync of the node is cancelled."""
        n = self.nodes[node_id]
        n.incarnation, n.last_seq, n.entries, n.digests = incarnation, 0, set(), {}
        r = self.resyncs.get(node_id)
        if r is not None and r.incarnation < incarnation:
            del self.resyncs[node_id]

    def heartbeat(self, node_id: str, inc: int, addr: NodeAddress, now: float, acked: int | None) -> ApplyOutcome:
        n = self.live(node_id, now)
        if n is not None and inc < self.known(node_id, n):
            return ApplyOutcome.STALE
        if n is None:
            n = self.nodes[node_id] = MNode(inc, addr, now + LEASE)
        elif inc > n.incarnation:
            r = self.resyncs.get(node_id)
            if r is None or r.incarnation != inc:
                self.renew(node_id, inc)
        n.address, n.lease_expiry = addr, now + LEASE
        if acked is not None and inc == n.incarnation and n.last_seq < acked:
            return ApplyOutcome.GAP
        return ApplyOutcome.ACCEPTED

    def apply(self, node_id: str, inc: int, seq: int, stored: list[bytes], removed: list[bytes], now: float,
              addr: NodeAddress | None) -> ApplyOutcome:
        n = self.live(node_id, now)
        if n is not None and inc < self.known(node_id, n):
            return ApplyOutcome.STALE
        if n is None or inc > n.incarnation:
            if seq != 1:
                return ApplyOutcome.GAP
            if n is None:
                n = self.nodes[node_id] = MNode(inc, None, now + LEASE)
            else:
                self.renew(node_id, inc)
        elif seq <= n.last_seq:
            same = seq > n.last_seq - DIGESTS_KEPT and n.digests.get(seq) == batch_digest(stored, removed)
            return ApplyOutcome.DUPLICATE if same else ApplyOutcome.CONFLICT
        elif seq != n.last_seq + 1:
            return ApplyOutcome.GAP
        n.entries = (n.entries - set(removed)) | set(stored)
        n.last_seq, n.lease_expiry = seq, now + LEASE
        n.digests[seq] = batch_digest(stored, removed)
        if addr is not None:
            n.address = addr
        return ApplyOutcome.ACCEPTED

    def begin_resync(self, node_id: str, inc: int, rid: int, addr: NodeAddress, now: float) -> ApplyOutcome:
        n = self.live(node_id, now)
        if n is not None and inc < self.known(node_id, n):
            return ApplyOutcome.STALE
        if n is None:
            n = self.nodes[node_id] = MNode(inc, None, now)
        n.address, n.lease_expiry = addr, now + LEASE
        self.resyncs[node_id] = MResync(rid, inc)
        return ApplyOutcome.ACCEPTED

    def current(self, node_id: str, inc: int, rid: int, now: float) -> MResync | None:
        n = self.live(node_id, now)
        r = self.resyncs.get(node_id)
        if n is None or r is None or r.resync_id != rid or r.incarnation != inc:
            return None
        n.lease_expiry = now + LEASE
        return r

    def resync_batch(self, node_id: str, inc: int, rid: int, hashes: list[bytes], now: float) -> ApplyOutcome:
        r = self.current(node_id, inc, rid, now)
        if r is None:
            return ApplyOutcome.GAP
        r.staged |= set(hashes)
        return ApplyOutcome.ACCEPTED

    def end_resync(self, node_id: str, inc: int, rid: int, seq: int, now: float) -> ApplyOutcome:
        r = self.current(node_id, inc, rid, now)
        if r is None:
            return ApplyOutcome.GAP
        del self.resyncs[node_id]
        n = self.nodes[node_id]
        if inc == n.incarnation and n.last_seq > seq:
            return ApplyOutcome.STALE
        n.entries, n.incarnation, n.last_seq, n.digests = set(r.staged), inc, seq, {}
        return ApplyOutcome.ACCEPTED

    def locate(self, hashes: list[bytes], now: float,
               exclude: set[str]) -> tuple[list[tuple[str, ...]], dict[str, int]]:
        ok = {k: n for k, n in self.nodes.items()
              if now < n.lease_expiry and n.address is not None and k not in exclude}
        owners = [tuple(sorted(k for k, n in ok.items() if h in n.entries)) for h in hashes]
        runs = {}
        for k in (owners[0] if owners else ()):
            run = 0
            while run < len(owners) and k in owners[run]:
                run += 1
            runs[k] = run
        return owners, runs


class DirectoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.shard = DirectoryShard(lease_s=LEASE)
        self.model = Model()
        self.now = 0.0

    def submit(self, node: str, inc: int, body: Body) -> ApplyOutcome:
        return self.shard.submit(Report(self.shard.shard, node, inc, body), self.now)

    @rule(node=nodes, inc=incarnations, addr=st.sampled_from(ADDRS), acked=st.none() | st.integers(0, 4))
    def heartbeat(self, node: str, inc: int, addr: NodeAddress, acked: int | None) -> None:
        got = self.submit(node, inc, Heartbeat(addr, acked))
        assert got is self.model.heartbeat(node, inc, addr, self.now, acked)

    @rule(node=nodes, inc=incarnations, data=st.data(), stored=hash_sets, removed=hash_sets,
          addr=st.none() | st.sampled_from(ADDRS))
    def apply(self, node: str, inc: int, data: st.DataObject, stored: list[bytes], removed: list[bytes],
              addr: NodeAddress | None) -> None:
        m = self.model.nodes.get(node)
        near = m.last_seq if m is not None else 0
        # mostly the next batch, sometimes a retry, a gap, or an incarnation's first batch
        seq = data.draw(st.sampled_from([near + 1, near + 1, near + 1, max(1, near), near + 2, 1]))
        got = self.submit(node, inc, Apply(seq, stored, removed, addr))
        assert got is self.model.apply(node, inc, seq, stored, removed, self.now, addr)

    @rule(node=nodes, inc=incarnations, rid=resync_ids, addr=st.sampled_from(ADDRS))
    def begin_resync(self, node: str, inc: int, rid: int, addr: NodeAddress) -> None:
        got = self.submit(node, inc, BeginResync(rid, addr))
        assert got is self.model.begin_resync(node, inc, rid, addr, self.now)

    def resync_call(self, node: str, data: st.DataObject) -> tuple[int, int]:
        """Mostly the node's current resync; sometimes a superseded id or another incarnation."""
        r = self.model.resyncs.get(node)
        current = [(r.incarnation, r.resync_id)] * 4 if r is not None else []
        others = [(inc, rid) for inc in (1, 2, 3) for rid in (1, 2, 3)]
        return data.draw(st.sampled_from(current + others))

    @rule(node=nodes, data=st.data(), hashes=hash_sets)
    def resync_batch(self, node: str, data: st.DataObject, hashes: list[bytes]) -> None:
        inc, rid = self.resync_call(node, data)
        got = self.submit(node, inc, ResyncBatch(rid, hashes))
        assert got is self.model.resync_batch(node, inc, rid, hashes, self.now)

    @rule(node=nodes, data=st.data())
    def end_resync(self, node: str, data: st.DataObject) -> None:
        inc, rid = self.resync_call(node, data)
        m = self.model.nodes.get(node)
        near = m.last_seq if m is not None else 0
        seq = data.draw(st.sampled_from([near, near + 1, max(0, near - 1)]))   # snapshots behind the shard too
        got = self.submit(node, inc, EndResync(rid, seq))
        assert got is self.model.end_resync(node, inc, rid, seq, self.now)

    @rule(dt=st.sampled_from([0.0, 0.5, 2.0, 4.0, 5.0, 7.0]))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule()
    def expire(self) -> None:
        gone = self.shard.expire(self.now)
        expected = sorted(k for k, n in self.model.nodes.items() if self.now >= n.lease_expiry)
        assert gone == expected
        for k in gone:
            self.model.live(k, self.now)

    @rule(hashes=st.lists(st.sampled_from(HASHES), max_size=8), exclude=st.sets(nodes, max_size=2))
    def locate(self, hashes: list[bytes], exclude: set[str]) -> None:
        reply = self.shard.locate(hashes, self.now, exclude)
        owners, runs = self.model.locate(hashes, self.now, exclude)
        assert list(reply.owners) == owners
        assert reply.runs == runs
        assert reply.addresses == {k: self.model.nodes[k].address for t in owners for k in t}

    @invariant()
    def same_map(self) -> None:
        reply = self.shard.locate(HASHES, self.now)
        assert list(reply.owners) == self.model.locate(HASHES, self.now, set())[0]
        live = {k: n for k, n in self.model.nodes.items() if self.now < n.lease_expiry and n.address is not None}
        infos = self.shard.nodes(self.now)
        assert [i.node_id for i in infos] == sorted(live)
        for i in infos:
            n = live[i.node_id]
            assert (i.incarnation, i.last_seq, i.lease_expiry, i.address, i.num_blocks) == \
                   (n.incarnation, n.last_seq, n.lease_expiry, n.address, len(n.entries))


DirectoryMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestDirectoryMachine = DirectoryMachine.TestCase
