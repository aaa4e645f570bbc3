"""Directory reports bound to their sender: signed by the node's key, checked before the shard sees them.
Pure: no Ray, no clock (the verifier checks certificate validity against the wall clock).

    node: ReportSigner.sign ── Report(..., Proof(cert, nonce, signature)) ──► DirectoryGate.submit ──► DirectoryShard

A `Report` (directory/report.py: heartbeat, batch, begin/end resync, resync batch) counts only if,
in this order:

1. it carries a `Proof` whose certificate the verifier (`TrustAnchor`: the cluster CA and its
   revocation list) accepts as a node certificate: else `unsigned`, `untrusted`, `expired`,
   `revoked`, `not_a_node`, `malformed`;
2. it is a well-formed report addressed to this shard (else `malformed`), and the signature is the
   certificate key's over the canonical encoding of every field of the report but the proof
   (`signed_message`: operation, shard, node id, incarnation, nonce and every field of the body,
   block versions included): else `bad_signature`;
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

A refused report changes nothing, is answered REFUSED and is counted by reason
(`stats()["refused_<reason>"]`). Nonces start at the node's incarnation (wall-clock nanoseconds at
its start) and count up, so they also grow across restarts of the node.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from cluster.directory.report import BODIES, Proof, Report, signed_message
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, derived_node_name, is_derived_node_name
from cluster.errors import ClusterError
from transports.trust.identity import IdentityError, NodeIdentity

logger = logging.getLogger(__name__)


class Verifier(Protocol):
    def identity(self, cert: bytes) -> NodeIdentity: ...


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

    def submit(self, report: object, now: float) -> ApplyOutcome:
        """The shard's answer to `report`, or REFUSED (and nothing changes) when it fails a check."""
        try:
            checked, ident = self._check(report, now)
        except _Refused as e:
            self.refused[e.reason] += 1
            op = report.op.value if isinstance(report, Report) and isinstance(report.body, BODIES) else "malformed"
            logger.warning("directory shard %d refused a %s report for node %r: %s", self.shard.shard, op,
                           getattr(report, "node_id", None), e.reason)
            return ApplyOutcome.REFUSED
        self._bind(checked, ident)
        return self.shard.submit(checked, now)

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

    def _bind(self, report: Report, ident: NodeIdentity) -> None:
        node_id = report.node_id
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
        assert report.proof is not None
        self._nonce[(node_id, ident.node)] = report.proof.nonce

    def _check(self, report: object, now: float) -> tuple[Report, NodeIdentity]:
        """Rules 1-5 of the module docstring, in order; raises `_Refused`."""
        if not isinstance(report, Report):
            raise _Refused("malformed")
        proof = report.proof
        if not (isinstance(proof, Proof) and isinstance(proof.cert, bytes) and isinstance(proof.nonce, int)
                and isinstance(proof.signature, bytes)):
            raise _Refused("unsigned")
        node_id = report.node_id
        if not (isinstance(node_id, str) and isinstance(report.incarnation, int) and report.shard == self.shard.shard
                and isinstance(report.body, BODIES)):
            raise _Refused("malformed")
        try:
            ident = self.verifier.identity(proof.cert)
        except IdentityError as e:
            raise _Refused(e.reason) from None
        try:
            message = signed_message(report, proof.nonce)
        except (TypeError, ValueError, OverflowError):   # fields msgpack cannot encode: not a node's report
            raise _Refused("malformed") from None
        if not ident.verify(proof.signature, message):
            raise _Refused("bad_signature")
        if not self._may_speak_for(node_id, ident.node, now):
            raise _Refused("wrong_node")
        address = getattr(report.body, "address", None)
        if address is not None and (not isinstance(address, NodeAddress) or address.name != ident.node
                                    or not ident.may_advertise(address.host)):
            raise _Refused("address")
        if proof.nonce <= self._nonce.get((node_id, ident.node), -1):
            raise _Refused("replay")
        return report, ident

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
