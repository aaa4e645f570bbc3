"""What crosses the directory's boundary: node ids and addresses, the outcome of a report, a locate
reply (with its leading runs) and the node table, which shard a block belongs to and the digest that
tells a retried batch from a conflicting one. The shard state and its rules are `cluster.directory.shard`'s.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import blake3
import msgpack

__all__ = ["ApplyOutcome", "LocateReply", "NodeAddress", "NodeId", "NodeInfo", "batch_digest", "derived_node_name",
           "is_derived_node_name", "leading_runs", "shard_of"]

NodeId = NewType("NodeId", str)

_DERIVED = re.compile(r"node-[0-9a-f]{16}")


def derived_node_name(node_id: str) -> str:
    """The certificate name of a Ray node whose environment names none (`$KVFABRIC_NODE_NAME`):
    derived from its Ray node id, so the name says which id it may speak for."""
    return f"node-{node_id[:16]}"


def is_derived_node_name(name: str) -> bool:
    """Whether `name` has the form `derived_node_name` gives (then it speaks only for its own id)."""
    return _DERIVED.fullmatch(name) is not None


class ApplyOutcome(enum.StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "stale"
    GAP = "gap"
    CONFLICT = "conflict"   # a used seq with other content: refused, the node must resync
    REFUSED = "refused"     # the report did not prove it came from the node it names (directory/auth.py)


@dataclass(frozen=True, slots=True)
class NodeAddress:
    host: str
    port: int
    transport: str   # "tls-tcp" | "quic" | "rdma"
    name: str = ""   # the node's TLS identity (its certificate's DNS name); "" = derived from the node id


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: NodeId
    incarnation: int
    address: NodeAddress
    last_seq: int
    lease_expiry: float
    num_blocks: int


@dataclass(frozen=True, slots=True)
class LocateReply:
    owners: tuple[tuple[NodeId, ...], ...]   # per requested hash: live owners, sorted by node id
    runs: dict[NodeId, int]                   # node -> length of its leading run; nodes with none are absent
    addresses: dict[NodeId, NodeAddress] = field(default_factory=dict)   # of every node named in owners
    # Block versions (fabric.provenance.block_version), when owners reported them: per hash, each
    # listed owner's (b"": unknown), and the first-reported version a live owner still holds.
    versions: tuple[tuple[bytes, ...], ...] = ()
    firsts: tuple[bytes, ...] = ()


def shard_of(block_hash: bytes, num_shards: int) -> int:
    """The shard of a block: its first 8 bytes little-endian, modulo the shard count."""
    return int.from_bytes(block_hash[:8], "little") % num_shards


def batch_digest(stored: Sequence[bytes], removed: Sequence[bytes]) -> bytes:
    """What a DUPLICATE must repeat: BLAKE3 over the batch's stored and removed hashes, in order."""
    return blake3.blake3(msgpack.packb([list(stored), list(removed)], use_bin_type=True)).digest()


def leading_runs(owners: Sequence[tuple[NodeId, ...]]) -> dict[NodeId, int]:
    """For each node owning the first hash: how many leading hashes it owns in a row."""
    runs: dict[NodeId, int] = {}
    if not owners or not owners[0]:
        return runs
    running = set(owners[0])
    prev = owners[0]
    for i in range(1, len(owners)):
        t = owners[i]
        if t == prev:
            continue
        prev = t
        lost = running.difference(t)
        if lost:
            for n in lost:
                runs[n] = i
            running -= lost
            if not running:
                return runs
    for n in running:
        runs[n] = len(owners)
    return runs
