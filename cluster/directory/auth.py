"""Directory reports bound to their sender: signed by the node's key, checked before the shard sees them.
Pure: no Ray, no clock (the verifier checks certificate validity against the wall clock).

    node: ReportSigner ── Proof(cert, nonce, signature over report_message(...)) ──► DirectoryGate ──► DirectoryShard

A report (heartbeat, batch, begin/end resync, resync batch) counts only if, in this order:

1. it carries a `Proof` whose certificate the verifier (`TrustAnchor`: the cluster CA and its
   revocation list) accepts as a node certificate: else `unsigned`, `untrusted`, `expired`,
   `revoked`, `not_a_node`, `malformed`;
2. the signature is the certificate key's over the canonical encoding of every field of the call
   (operation, shard, node id, incarnation, nonce, and the operation's own fields, block versions
   included when the report carries any): else `bad_signature`;
3. the node id belongs to that certificate: else `wrong_node`. A node id is bound to one certificate
   name (its DNS SAN), one id per name, for as long as the id's record is live:
   - a name of the form a Ray node id derives (`node-<16 hex>`, `derived_node_name`) speaks only
     for the ids it is derived from, and takes such an id over from any other name at once (the
     other name's record under that id is dropped);
   - otherwise the first name to report an id holds it until the id's record lease passes (its
     holder stopped reporting, or was revoked), then the next name may bind it;
   - a name whose id still has a live record cannot speak for another id (after that lease passed,
     a restarted node may bind a new id);
   - the operator may clear a binding at once (`unbind`), dropping the id's record.
4. an advertised address names the certificate's node and a host among its SANs: else `address`;
5. the nonce is above every nonce the gate saw from that node id under that name (so a recorded
   report cannot be replayed, and a squatter's nonces never block the id's rightful name): else `replay`.

A refused report changes nothing and is counted by reason (`stats()["refused_<reason>"]`). Nonces
start at the node's incarnation (wall-clock nanoseconds at its start) and count up, so they also
grow across restarts of the node.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack

from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, derived_node_name, is_derived_node_name
from cluster.errors import ClusterError
from transports.trust.identity import IdentityError, NodeIdentity

logger = logging.getLogger(__name__)

DOMAIN = b"kvfabric directory report v1\0"   # a report signature can never pass for any other signed message


class Op(enum.StrEnum):
    HEARTBEAT = "heartbeat"
    APPLY = "apply"
    BEGIN_RESYNC = "begin_resync"
    RESYNC_BATCH = "resync_batch"
    END_RESYNC = "end_resync"


@dataclass(frozen=True, slots=True)
class Proof:
    """What a node attaches to a report: its certificate (DER), a fresh nonce and its signature."""

    cert: bytes
    nonce: int
    signature: bytes


class Verifier(Protocol):
    def identity(self, cert: bytes) -> NodeIdentity: ...


class Signer(Protocol):
    cert_der: bytes

    def sign(self, message: bytes) -> bytes: ...


def _address(a: NodeAddress | None) -> list[Any] | None:
    return None if a is None else [a.host, a.port, a.transport, a.name]


def report_message(op: Op, shard: int, node_id: str, incarnation: int, nonce: int, body: list[Any]) -> bytes:
    """The canonical bytes a report's signature covers."""
    return DOMAIN + msgpack.packb([op.value, shard, node_id, incarnation, nonce, body], use_bin_type=True)


def apply_body(seq: int, stored: Sequence[bytes], removed: Sequence[bytes], address: NodeAddress | None,
               versions: Sequence[bytes] = ()) -> list[Any]:
    body = [seq, list(stored), list(removed), _address(address)]
    return [*body, list(versions)] if versions else body   # a report without versions signs as before


def resync_body(resync_id: int, hashes: Sequence[bytes], versions: Sequence[bytes] = ()) -> list[Any]:
    body = [resync_id, list(hashes)]
    return [*body, list(versions)] if versions else body


def heartbeat_body(address: NodeAddress, acked_seq: int | None) -> list[Any]:
    return [_address(address), acked_seq]


class ReportSigner:
    """The node side: signs each report with the node's certificate key and a fresh nonce."""

    def __init__(self, signer: Signer, node_id: str, incarnation: int) -> None:
        self.signer = signer
        self.node_id = node_id
        self.incarnation = incarnation
        self._nonce = incarnation

    def _proof(self, op: Op, shard: int, body: list[Any]) -> Proof:
        self._nonce += 1
        message = report_message(op, shard, self.node_id, self.incarnation, self._nonce, body)
        return Proof(self.signer.cert_der, self._nonce, self.signer.sign(message))

    def heartbeat(self, shard: int, address: NodeAddress, acked_seq: int | None) -> Proof:
        return self._proof(Op.HEARTBEAT, shard, heartbeat_body(address, acked_seq))

    def apply(self, shard: int, seq: int, stored: Sequence[bytes], removed: Sequence[bytes],
              address: NodeAddress | None, versions: Sequence[bytes] = ()) -> Proof:
        return self._proof(Op.APPLY, shard, apply_body(seq, stored, removed, address, versions))

    def begin_resync(self, shard: int, address: NodeAddress) -> Proof:
        return self._proof(Op.BEGIN_RESYNC, shard, [_address(address)])

    def resync_batch(self, shard: int, resync_id: int, hashes: Sequence[bytes], versions: Sequence[bytes] = ()
                     ) -> Proof:
        return self._proof(Op.RESYNC_BATCH, shard, resync_body(resync_id, hashes, versions))

    def end_resync(self, shard: int, resync_id: int, seq: int) -> Proof:
        return self._proof(Op.END_RESYNC, shard, [resync_id, seq])


class _Refused(ClusterError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DirectoryGate:
    """A `DirectoryShard` that takes only reports proven to come from the node they name."""

    def __init__(self, shard: DirectoryShard, verifier: Verifier) -> None:
        self.shard = shard
        self.verifier = verifier          # replaced when the revocation list changes
        self._name_of: dict[str, str] = {}    # node id -> certificate name it is bound to
        self._id_of: dict[str, str] = {}      # certificate name -> node id bound to it
        self._nonce: dict[tuple[str, str], int] = {}   # (node id, name) -> highest nonce accepted
        self.refused: Counter[str] = Counter()

    # ---- reports -----------------------------------------------------------------------------------

    def heartbeat(self, node_id: str, incarnation: int, address: NodeAddress, now: float, proof: object,
                  *, acked_seq: int | None = None) -> ApplyOutcome:
        if not self._admit(Op.HEARTBEAT, node_id, incarnation, proof, heartbeat_body(address, acked_seq),
                           address, now):
            return ApplyOutcome.REFUSED
        return self.shard.heartbeat(node_id, incarnation, address, now, acked_seq=acked_seq)

    def apply(self, node_id: str, incarnation: int, seq: int, stored: Sequence[bytes], removed: Sequence[bytes],
              now: float, address: NodeAddress | None, proof: object, versions: Sequence[bytes] = ()
              ) -> ApplyOutcome:
        if not self._admit(Op.APPLY, node_id, incarnation, proof,
                           apply_body(seq, stored, removed, address, versions), address, now):
            return ApplyOutcome.REFUSED
        return self.shard.apply(node_id, incarnation, seq, stored, removed, now, address, versions)

    def begin_resync(self, node_id: str, incarnation: int, address: NodeAddress, now: float, proof: object) -> int:
        if not self._admit(Op.BEGIN_RESYNC, node_id, incarnation, proof, [_address(address)], address, now):
            return 0
        return self.shard.begin_resync(node_id, incarnation, address, now)

    def resync_batch(self, node_id: str, incarnation: int, resync_id: int, hashes: Sequence[bytes], now: float,
                     proof: object, versions: Sequence[bytes] = ()) -> bool:
        if not self._admit(Op.RESYNC_BATCH, node_id, incarnation, proof, resync_body(resync_id, hashes, versions),
                           None, now):
            return False
        return self.shard.resync_batch(node_id, incarnation, resync_id, hashes, now, versions)

    def end_resync(self, node_id: str, incarnation: int, resync_id: int, seq: int, now: float,
                   proof: object) -> bool:
        if not self._admit(Op.END_RESYNC, node_id, incarnation, proof, [resync_id, seq], None, now):
            return False
        return self.shard.end_resync(node_id, incarnation, resync_id, seq, now)

    def unbind(self, node_id: str) -> str | None:
        """The operator's call: forget which certificate name `node_id` is bound to, and drop the id's
        record and entries, so the next name to report the id binds it. Returns the name it was bound to."""
        name = self._release(node_id)
        logger.warning("directory shard %d: node id %r unbound from %s by the operator", self.shard.shard, node_id,
                       name)
        return name

    def _release(self, node_id: str) -> str | None:
        name = self._name_of.pop(node_id, None)
        if name is not None:
            del self._id_of[name]
        self.shard.forget_node(node_id)
        return name

    def bindings(self) -> dict[str, str]:
        """Node id -> the certificate name it is bound to."""
        return dict(self._name_of)

    def stats(self, now: float) -> dict[str, int | float]:
        out = dict(self.shard.stats(now))
        out["refused"] = sum(self.refused.values())
        out.update({f"refused_{reason}": n for reason, n in self.refused.items()})
        return out

    # ---- the checks --------------------------------------------------------------------------------

    def _admit(self, op: Op, node_id: str, incarnation: int, proof: object, body: list[Any],
               address: NodeAddress | None, now: float) -> bool:
        try:
            ident = self._check(op, node_id, incarnation, proof, body, address, now)
        except _Refused as e:
            self.refused[e.reason] += 1
            logger.warning("directory shard %d refused a %s report for node %r: %s", self.shard.shard, op.value,
                           node_id, e.reason)
            return False
        assert isinstance(proof, Proof)
        bound = self._name_of.get(node_id)
        if bound is not None and bound != ident.node:   # the id changes hands: the old name's record goes
            logger.warning("directory shard %d: node id %r moves from %s to %s", self.shard.shard, node_id, bound,
                           ident.node)
            self._release(node_id)
        holder = self._id_of.get(ident.node)
        if holder != node_id:
            if holder is not None:
                del self._name_of[holder]
            self._id_of[ident.node] = node_id
            self._name_of[node_id] = ident.node
        self._nonce[(node_id, ident.node)] = proof.nonce
        return True

    def _check(self, op: Op, node_id: str, incarnation: int, proof: object, body: list[Any],
               address: NodeAddress | None, now: float) -> NodeIdentity:
        if not (isinstance(proof, Proof) and isinstance(proof.cert, bytes) and isinstance(proof.nonce, int)
                and isinstance(proof.signature, bytes)):
            raise _Refused("unsigned")
        if not (isinstance(node_id, str) and isinstance(incarnation, int)):
            raise _Refused("malformed")
        try:
            ident = self.verifier.identity(proof.cert)
        except IdentityError as e:
            raise _Refused(e.reason) from None
        try:
            message = report_message(op, self.shard.shard, node_id, incarnation, proof.nonce, body)
        except (TypeError, ValueError, OverflowError):   # fields msgpack cannot encode: not a node's report
            raise _Refused("malformed") from None
        if not ident.verify(proof.signature, message):
            raise _Refused("bad_signature")
        if not self._may_speak_for(node_id, ident.node, now):
            raise _Refused("wrong_node")
        if address is not None and (address.name != ident.node or not ident.may_advertise(address.host)):
            raise _Refused("address")
        if proof.nonce <= self._nonce.get((node_id, ident.node), -1):
            raise _Refused("replay")
        return ident

    def _may_speak_for(self, node_id: str, name: str, now: float) -> bool:
        """Rule 3 of the module docstring."""
        derived = is_derived_node_name(name)
        if derived and derived_node_name(node_id) != name:
            return False
        holder = self._id_of.get(name)
        if holder is not None and holder != node_id and self.shard.live_incarnation(holder, now) is not None:
            return False
        bound = self._name_of.get(node_id)
        return bound is None or bound == name or derived or self.shard.live_incarnation(node_id, now) is None
