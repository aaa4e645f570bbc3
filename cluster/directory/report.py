"""A directory report: what one node tells one shard, as one type (operation, shard, body), signed once.

    Report(shard, node_id, incarnation, body, proof)
      body: Heartbeat | Apply | BeginResync | ResyncBatch | EndResync     (the operation is the body's kind)

A node builds every report with `ReportSigner.sign(shard, body)`, which signs it with the node's
certificate key, and hands it down one call per layer: `DirectoryClient.report` → `DirectoryActor.report`
→ `DirectoryGate.submit` (checks the proof, directory/auth.py) → `DirectoryShard.submit` (applies it,
directory/shard.py). Each answer is an `ApplyOutcome`.

The operations (the shard's rules for each are in directory/shard.py):

* `Heartbeat(address, acked_seq)`: renew the node's lease; GAP when the shard holds less than
  `acked_seq`, the highest seq the node saw ACCEPTED or DUPLICATE (None: do not check).
* `Apply(seq, stored, removed, address, versions)`: one numbered batch of register/unregister;
  `versions` per stored hash its block version (b"": unknown), or () for none.
* `BeginResync(resync_id, address)`, `ResyncBatch(resync_id, hashes, versions)`*, `EndResync(resync_id,
  seq)`: replace the node's entries atomically at the end. The node names the resync (an id of its
  own, unique within its incarnation: the seq the resync ends at).

The signed bytes (`signed_message`), over every field of the report but the proof:

    DOMAIN ‖ msgpack([operation, shard, node_id, incarnation, nonce, [body field, ...]])

with the body's fields in their declared order, an address as [host, port, transport, name] (or nil),
hash and version sequences as arrays of bin. `DOMAIN` names this encoding, so a report signature can
never pass for any other signed message, nor for a report of another encoding.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import msgpack

from cluster.directory.types import NodeAddress

__all__ = ["DOMAIN", "Apply", "BeginResync", "Body", "EndResync", "Heartbeat", "Op", "Proof", "Report",
           "ReportSigner", "ResyncBatch", "Signer", "signed_message"]

DOMAIN = b"kvfabric directory report v2\0"


class Op(enum.StrEnum):
    HEARTBEAT = "heartbeat"
    APPLY = "apply"
    BEGIN_RESYNC = "begin_resync"
    RESYNC_BATCH = "resync_batch"
    END_RESYNC = "end_resync"


@dataclass(frozen=True, slots=True)
class Heartbeat:
    op: ClassVar[Op] = Op.HEARTBEAT
    address: NodeAddress
    acked_seq: int | None = None


@dataclass(frozen=True, slots=True)
class Apply:
    op: ClassVar[Op] = Op.APPLY
    seq: int
    stored: Sequence[bytes]
    removed: Sequence[bytes] = ()
    address: NodeAddress | None = None
    versions: Sequence[bytes] = ()


@dataclass(frozen=True, slots=True)
class BeginResync:
    op: ClassVar[Op] = Op.BEGIN_RESYNC
    resync_id: int
    address: NodeAddress


@dataclass(frozen=True, slots=True)
class ResyncBatch:
    op: ClassVar[Op] = Op.RESYNC_BATCH
    resync_id: int
    hashes: Sequence[bytes]
    versions: Sequence[bytes] = ()


@dataclass(frozen=True, slots=True)
class EndResync:
    op: ClassVar[Op] = Op.END_RESYNC
    resync_id: int
    seq: int


Body = Heartbeat | Apply | BeginResync | ResyncBatch | EndResync
BODIES: tuple[type, ...] = (Heartbeat, Apply, BeginResync, ResyncBatch, EndResync)


@dataclass(frozen=True, slots=True)
class Proof:
    """What a node attaches to a report: its certificate (DER), a fresh nonce and its signature."""

    cert: bytes
    nonce: int
    signature: bytes


@dataclass(frozen=True, slots=True)
class Report:
    """One node's report to one shard; `proof` is None until signed (a pure shard ignores it)."""

    shard: int
    node_id: str
    incarnation: int
    body: Body
    proof: Proof | None = None

    @property
    def op(self) -> Op:
        return self.body.op


def _field(value: Any) -> Any:
    if isinstance(value, NodeAddress):
        return [value.host, value.port, value.transport, value.name]
    if isinstance(value, (tuple, list)):
        return list(value)
    return value


def signed_message(report: Report, nonce: int) -> bytes:
    """The canonical bytes a report's signature covers (the module docstring); raises TypeError,
    ValueError or OverflowError for fields msgpack cannot encode."""
    body = report.body
    fields = [_field(getattr(body, f.name)) for f in dataclasses.fields(body)]
    return DOMAIN + msgpack.packb([body.op.value, report.shard, report.node_id, report.incarnation, nonce, fields],
                                  use_bin_type=True)


class Signer(Protocol):
    cert_der: bytes

    def sign(self, message: bytes) -> bytes: ...


class ReportSigner:
    """The node side: builds each report of this node incarnation and signs it with the node's
    certificate key and a fresh nonce (nonces start at the incarnation and count up, so they also grow
    across restarts of the node)."""

    def __init__(self, signer: Signer, node_id: str, incarnation: int) -> None:
        self.signer = signer
        self.node_id = node_id
        self.incarnation = incarnation
        self._nonce = incarnation

    def sign(self, shard: int, body: Body) -> Report:
        self._nonce += 1
        report = Report(shard, self.node_id, self.incarnation, body)
        signature = self.signer.sign(signed_message(report, self._nonce))
        return dataclasses.replace(report, proof=Proof(self.signer.cert_der, self._nonce, signature))
