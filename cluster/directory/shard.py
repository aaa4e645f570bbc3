"""One shard of the cluster directory: block hash -> live owner nodes. Pure: no I/O, no clock, no Ray.
Its wire types (addresses, outcomes, replies) are `cluster.directory.types`'. Every report of a node
comes in through `submit` (a `Report` of directory/report.py; its body says which operation) and is
answered with an `ApplyOutcome`.

The directory is a *hint*: an owner checks again before it sends, so a wrong "yes" costs one failed
pull and a wrong "no" a recompute; neither serves wrong KV. The rules below keep it from going stale:

* **Incarnation.** Every node process has an incarnation (it grows on each restart). A report from an
  older incarnation than the shard knows is STALE and dropped. A newer one replaces all of that node's
  entries (its RAM tier died with the old process; SSD blocks come back when it re-advertises them).
* **Sequence.** Batches are numbered per (node, shard) from 1 in each incarnation. `last_seq + 1` is
  ACCEPTED, anything at or below `last_seq` a DUPLICATE (a retry) when its content digest equals the
  batch applied under that seq (the last `DIGESTS_KEPT` are kept), else a CONFLICT: refused, and the
  node must resync; anything beyond it a GAP: nothing is applied and the node must resync.
  A node the shard does not know (new, expired, or the directory
  restarted) is a GAP unless the batch is seq 1.
* **Lease.** A node that is not heard from for `lease_s` is gone: its entries are never returned, and
  every operation treats the record as absent (`expire` only reclaims the memory).
* **Resync.** `BeginResync` / `ResyncBatch`* / `EndResync(seq)` replace all of a node's entries
  atomically at the end; until then lookups see the old ones. The node's snapshot must cover every
  batch up to `seq` and it must not send batch `seq + 1` before `EndResync` was answered; if the shard
  already accepted a batch beyond `seq`, `EndResync` is refused as STALE (the snapshot is older than
  what the shard holds) and the node starts over, as it does on a GAP (a resync unknown or superseded).

Layout (each node keeps the set of its hashes, so a new incarnation, a resync or an expiry touches
only that node's entries; these sets add to the per-entry bytes of the owner map):

    _map    : OwnerMap                             hash -> owner indexes and block versions (directory/owners.py)
    _nodes  : list[_Node | None]                   per node index: incarnation, address, seq, lease, entries
    _index  : dict[str, int]                       node id -> index; interned for the shard's lifetime

Complexity: apply O(entries in the batch); locate O(hashes x owners); dropping or resyncing a node
O(its entries); the set of dead nodes is recomputed only when a lease may have passed (O(nodes)).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cluster.directory.owners import MAX_VERSION_BYTES, OwnerMap
from cluster.directory.report import Apply, BeginResync, EndResync, Heartbeat, Report, ResyncBatch
from cluster.directory.types import (
    ApplyOutcome,
    LocateReply,
    NodeAddress,
    NodeId,
    NodeInfo,
    batch_digest,
    leading_runs,
    shard_of,
)
from fabric import config as defaults

DIGESTS_KEPT = 16   # per node: content digests of its last applied batches, to tell a retry from a conflict


class _Node:
    __slots__ = ("address", "digests", "entries", "idx", "incarnation", "last_seq", "lease_expiry", "node_id")

    def __init__(self, node_id: NodeId, idx: int, incarnation: int, address: NodeAddress | None) -> None:
        self.node_id = node_id
        self.idx = idx
        self.incarnation = incarnation
        self.address = address
        self.last_seq = 0
        self.lease_expiry = -math.inf
        self.entries: set[bytes] = set()
        self.digests: dict[int, bytes] = {}   # seq -> batch_digest, the last DIGESTS_KEPT applied


@dataclass(slots=True)
class _Resync:
    resync_id: int     # named by the node
    incarnation: int
    staged: set[bytes] = field(default_factory=set)
    versions: dict[bytes, bytes] = field(default_factory=dict)


class DirectoryShard:
    """Owner map of the block hashes with `shard_of(hash, num_shards) == shard`."""

    def __init__(self, shard: int = 0, num_shards: int = 1, *, lease_s: float = defaults.LEASE_S) -> None:
        if not 0 <= shard < num_shards:
            raise ValueError(f"shard {shard} is not in 0..{num_shards - 1}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.shard, self.num_shards, self.lease_s = shard, num_shards, lease_s
        self._nodes: list[_Node | None] = []
        self._ids: list[NodeId] = []
        self._map = OwnerMap(self._ids)
        self._index: dict[str, int] = {}
        self._resyncs: dict[int, _Resync] = {}
        self._dead: frozenset[int] = frozenset()
        self._dead_valid: tuple[float, float] | None = None   # [from, until) where _dead is exact
        self._counters = {"applied": 0, "duplicate": 0, "stale": 0, "gap": 0, "conflict": 0, "heartbeats": 0,
                          "stale_heartbeats": 0, "resyncs_completed": 0, "resyncs_refused": 0, "expired": 0}

    # ------------------------------------------------------------------ reports from nodes
    def owns(self, block_hash: bytes) -> bool:
        return shard_of(block_hash, self.num_shards) == self.shard

    def submit(self, report: Report, now: float) -> ApplyOutcome:
        """Apply one node's report (the one entry for every operation; directory/report.py).
        Raises ValueError for a report no node sends: another shard's, hashes of another shard,
        block versions that do not pair with its hashes, a seq below 1."""
        if report.shard != self.shard:
            raise ValueError(f"a report for shard {report.shard} sent to shard {self.shard}")
        node_id, incarnation, body = report.node_id, report.incarnation, report.body
        match body:   # one handler per operation; each answers by the module's rules
            case Apply():
                return self._apply(node_id, incarnation, body, now)
            case Heartbeat():
                return self._heartbeat(node_id, incarnation, body, now)
            case BeginResync():
                return self._begin_resync(node_id, incarnation, body, now)
            case ResyncBatch():
                return self._resync_batch(node_id, incarnation, body, now)
            case EndResync():
                return self._end_resync(node_id, incarnation, body, now)
        raise ValueError(f"not a directory report: {type(body).__name__}")

    def _heartbeat(self, node_id: str, incarnation: int, body: Heartbeat, now: float) -> ApplyOutcome:
        """Renew the node's lease (creating its record if new); a newer incarnation drops its entries.

        STALE: an older incarnation than known, ignored. GAP (only with `acked_seq`, the highest seq the
        node saw ACCEPTED or DUPLICATE): the lease is renewed but the shard holds less than the node
        knows it sent (the record lapsed or the directory restarted), so the node must resync.
        A newer incarnation that has a resync under way keeps the old entries until its `EndResync`.
        """
        node = self._live(node_id, now)
        if node is not None and incarnation < self._known_incarnation(node):
            self._counters["stale_heartbeats"] += 1
            return ApplyOutcome.STALE
        self._counters["heartbeats"] += 1
        if node is None:
            node = self._create(node_id, incarnation, body.address)
        elif incarnation > node.incarnation and not self._resyncing(node, incarnation):
            self._new_incarnation(node, incarnation)
        self._set_address(node, body.address)
        node.lease_expiry = now + self.lease_s
        acked_seq = body.acked_seq
        if acked_seq is not None and incarnation == node.incarnation and node.last_seq < acked_seq:
            return ApplyOutcome.GAP
        return ApplyOutcome.ACCEPTED

    def _apply(self, node_id: str, incarnation: int, body: Apply, now: float) -> ApplyOutcome:
        """Apply one register/unregister batch (removals first, then stores); see the module rules."""
        seq, stored, removed, versions = body.seq, body.stored, body.removed, body.versions
        if versions and len(versions) != len(stored):
            raise ValueError(f"{len(versions)} block versions for {len(stored)} stored hashes")
        if seq < 1:
            raise ValueError(f"sequence numbers start at 1, got {seq}")
        self._check_owned(stored)
        self._check_owned(removed)
        node = self._live(node_id, now)
        if node is not None and incarnation < self._known_incarnation(node):
            return self._count(ApplyOutcome.STALE)
        if node is None or incarnation > node.incarnation:
            if seq != 1:
                return self._count(ApplyOutcome.GAP)
            if node is None:
                node = self._create(node_id, incarnation, body.address)
            else:
                self._new_incarnation(node, incarnation)
        elif seq <= node.last_seq:
            same = node.digests.get(seq) == batch_digest(stored, removed)
            return self._count(ApplyOutcome.DUPLICATE if same else ApplyOutcome.CONFLICT)
        elif seq > node.last_seq + 1:
            return self._count(ApplyOutcome.GAP)
        entries, idx, owners = node.entries, node.idx, self._map
        for h in removed:
            if h in entries:
                entries.remove(h)
                owners.remove(h, idx)
        for h in stored:
            if h not in entries:
                entries.add(h)
                owners.add(h, idx)
        for h, version in zip(stored, versions, strict=False):
            owners.set_version(h, idx, version)
        node.last_seq = seq
        node.digests[seq] = batch_digest(stored, removed)
        node.digests.pop(seq - DIGESTS_KEPT, None)
        node.lease_expiry = now + self.lease_s
        if body.address is not None:
            self._set_address(node, body.address)
        return self._count(ApplyOutcome.ACCEPTED)

    def live_incarnation(self, node_id: str, now: float) -> int | None:
        """The incarnation of the node's live record, None when it has none."""
        node = self._live(node_id, now)
        return None if node is None else node.incarnation

    def _begin_resync(self, node_id: str, incarnation: int, body: BeginResync, now: float) -> ApplyOutcome:
        """Start the node's full resync `body.resync_id`: ACCEPTED, or STALE (an older incarnation).

        A new resync supersedes any unfinished one of the node. The address and lease are renewed now;
        the entries (of a newer incarnation too) are replaced only by `EndResync`.
        """
        node = self._live(node_id, now)
        if node is not None and incarnation < self._known_incarnation(node):
            self._counters["resyncs_refused"] += 1
            return ApplyOutcome.STALE
        if node is None:
            node = self._create(node_id, incarnation, body.address)
        self._set_address(node, body.address)
        node.lease_expiry = now + self.lease_s
        self._resyncs[node.idx] = _Resync(body.resync_id, incarnation)
        return ApplyOutcome.ACCEPTED

    def _resync_batch(self, node_id: str, incarnation: int, body: ResyncBatch, now: float) -> ApplyOutcome:
        """Stage hashes of a resync (with their block versions, if given): ACCEPTED, or GAP when the
        resync is unknown or superseded (the node starts over)."""
        hashes, versions = body.hashes, body.versions
        if versions and len(versions) != len(hashes):
            raise ValueError(f"{len(versions)} block versions for {len(hashes)} hashes")
        self._check_owned(hashes)
        found = self._resync_of(node_id, incarnation, body.resync_id, now)
        if found is None:
            return ApplyOutcome.GAP
        resync = found[1]
        resync.staged.update(hashes)
        resync.versions.update((h, v) for h, v in zip(hashes, versions, strict=False)
                               if type(v) is bytes and 0 < len(v) <= MAX_VERSION_BYTES)
        return ApplyOutcome.ACCEPTED

    def _end_resync(self, node_id: str, incarnation: int, body: EndResync, now: float) -> ApplyOutcome:
        """Replace the node's entries with the staged hashes and set `last_seq = seq`, atomically: ACCEPTED.

        The node starts over on GAP (the resync is unknown or superseded) or STALE (the shard already
        accepted a batch of this incarnation numbered beyond `seq`: the snapshot is older than that).
        """
        found = self._resync_of(node_id, incarnation, body.resync_id, now)
        if found is None:
            return ApplyOutcome.GAP
        node, resync = found
        del self._resyncs[node.idx]
        seq = body.seq
        if incarnation == node.incarnation and node.last_seq > seq:
            self._counters["resyncs_refused"] += 1
            return ApplyOutcome.STALE
        old = node.entries
        staged = resync.staged
        for h in old - staged:
            self._map.remove(h, node.idx)
        for h in staged - old:
            self._map.add(h, node.idx)
        for h, version in resync.versions.items():
            self._map.set_version(h, node.idx, version)
        node.entries = staged
        node.digests.clear()   # the snapshot supersedes every earlier batch; the node retries none of them
        node.incarnation = incarnation
        node.last_seq = seq
        self._counters["resyncs_completed"] += 1
        return ApplyOutcome.ACCEPTED

    # ------------------------------------------------------------------ queries
    def locate(self, hashes: Sequence[bytes], now: float, exclude: Collection[str] = ()) -> LocateReply:
        """Live owners of each hash (expired, address-less and excluded nodes removed) and leading runs."""
        dead = self._dead_at(now)
        if exclude:
            excluded = {self._index[n] for n in exclude if n in self._index}
            if excluded:
                dead = dead | excluded
        owners = self._map.owners(hashes, dead)
        addresses: dict[NodeId, NodeAddress] = {}
        for n in {n for t in owners for n in t}:
            node = self._nodes[self._index[n]]
            assert node is not None and node.address is not None, f"locate named node {n} without an address"
            addresses[n] = node.address
        versions, firsts = self._map.versions(hashes, owners, dead, self._index)
        return LocateReply(tuple(owners), leading_runs(owners), addresses, versions, firsts)

    def nodes(self, now: float) -> list[NodeInfo]:
        """Live nodes that have an address, by node id."""
        out = [NodeInfo(n.node_id, n.incarnation, n.address, n.last_seq, n.lease_expiry, len(n.entries))
               for n in self._nodes if n is not None and n.address is not None and now < n.lease_expiry]
        return sorted(out, key=lambda i: i.node_id)

    def forget_node(self, node_id: str) -> bool:
        """Drop `node_id`'s record and entries now (its id was bound to another certificate); whether it had one."""
        idx = self._index.get(node_id)
        node = None if idx is None else self._nodes[idx]
        if node is None:
            return False
        self._drop(node)
        return True

    def expire(self, now: float) -> list[NodeId]:
        """Drop the records (and entries) of nodes whose lease has passed; returns their ids."""
        gone = [n for n in self._nodes if n is not None and now >= n.lease_expiry]
        for n in gone:
            self._drop(n)
        self._counters["expired"] += len(gone)
        return sorted(n.node_id for n in gone)

    def stats(self, now: float) -> dict[str, int | float]:
        """Sizes and counters; `bytes_per_entry` estimates the memory held per (hash, node) entry."""
        self.expire(now)
        return {"shard": self.shard, "num_shards": self.num_shards,
                "num_nodes": sum(1 for n in self._nodes if n is not None),
                "num_entries": self._map.num_entries, "num_hashes": self._map.num_hashes,
                "num_resyncs_open": len(self._resyncs),
                "bytes_per_entry": self._map.bytes_per_entry(n.entries for n in self._nodes if n is not None),
                **self._counters}

    # ------------------------------------------------------------------ internals
    def _count(self, outcome: ApplyOutcome) -> ApplyOutcome:
        self._counters["applied" if outcome is ApplyOutcome.ACCEPTED else outcome.value] += 1
        return outcome

    def _check_owned(self, hashes: Sequence[bytes]) -> None:
        if self.num_shards > 1:
            for h in hashes:
                if shard_of(h, self.num_shards) != self.shard:
                    raise ValueError(f"hash {h.hex()} belongs to shard {shard_of(h, self.num_shards)}, "
                                     f"not {self.shard}")

    def _live(self, node_id: str, now: float) -> _Node | None:
        """The node's record, or None if absent; a record whose lease passed is dropped here."""
        idx = self._index.get(node_id)
        node = None if idx is None else self._nodes[idx]
        if node is not None and now >= node.lease_expiry:
            self._drop(node)
            self._counters["expired"] += 1
            return None
        return node

    def _known_incarnation(self, node: _Node) -> int:
        resync = self._resyncs.get(node.idx)
        return node.incarnation if resync is None else max(node.incarnation, resync.incarnation)

    def _create(self, node_id: str, incarnation: int, address: NodeAddress | None) -> _Node:
        idx = self._index.get(node_id)
        if idx is None:
            idx = len(self._nodes)
            self._index[node_id] = idx
            self._ids.append(NodeId(node_id))
            self._nodes.append(None)
        node = _Node(self._ids[idx], idx, incarnation, address)
        self._nodes[idx] = node
        self._dead_valid = None
        return node

    def _resyncing(self, node: _Node, incarnation: int) -> bool:
        resync = self._resyncs.get(node.idx)
        return resync is not None and resync.incarnation == incarnation

    def _new_incarnation(self, node: _Node, incarnation: int) -> None:
        self._clear_entries(node)
        node.incarnation = incarnation
        node.last_seq = 0
        node.digests.clear()
        resync = self._resyncs.get(node.idx)
        if resync is not None and resync.incarnation < incarnation:
            del self._resyncs[node.idx]

    def _set_address(self, node: _Node, address: NodeAddress) -> None:
        if node.address is None:
            self._dead_valid = None
        node.address = address

    def _drop(self, node: _Node) -> None:
        self._clear_entries(node)
        self._nodes[node.idx] = None
        self._resyncs.pop(node.idx, None)
        self._dead_valid = None

    def _clear_entries(self, node: _Node) -> None:
        for h in node.entries:
            self._map.remove(h, node.idx)
        node.entries = set()

    def _resync_of(self, node_id: str, incarnation: int, resync_id: int, now: float) -> tuple[_Node, _Resync] | None:
        node = self._live(node_id, now)
        resync = None if node is None else self._resyncs.get(node.idx)
        if node is None or resync is None or resync.resync_id != resync_id or resync.incarnation != incarnation:
            return None
        node.lease_expiry = now + self.lease_s   # a call of the node's current resync renews its lease
        return node, resync

    def _dead_at(self, now: float) -> frozenset[int]:
        """Indexes of records locate must skip: lease passed or no address yet. Cached while exact."""
        valid = self._dead_valid
        if valid is not None and valid[0] <= now < valid[1]:
            return self._dead
        dead = set()
        until = math.inf
        for n in self._nodes:
            if n is None:
                continue
            if n.address is None or now >= n.lease_expiry:
                dead.add(n.idx)
            else:
                until = min(until, n.lease_expiry)   # leases only grow, so this bound stays safe
        self._dead = frozenset(dead)
        self._dead_valid = (now, until)
        return self._dead
