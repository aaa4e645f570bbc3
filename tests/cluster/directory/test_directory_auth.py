"""Unit tests of cluster/directory/auth.py: the directory believes a report only from the node it names.

Real certificates of one cluster CA (and of a second CA), real signatures; no Ray.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from testkit import PkiFactory

from cluster.directory.auth import DirectoryGate
from cluster.directory.report import (
    Apply,
    BeginResync,
    Body,
    EndResync,
    Heartbeat,
    Proof,
    Report,
    ReportSigner,
    ResyncBatch,
)
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, derived_node_name
from transports.trust.identity import NodeSigner, TrustAnchor

H = [bytes([i]) * 32 for i in range(6)]
A, B = "ray-id-a", "ray-id-b"            # Ray node ids; the certificates name "node-a" / "node-b"
ADDR_A = NodeAddress("127.0.0.1", 7000, "tls-tcp", "node-a")
ADDR_B = NodeAddress("127.0.0.1", 7001, "tls-tcp", "node-b")
JOINING, OTHER = "a1b2c3d4e5f60718" + "0" * 40, "ffeeddccbbaa9988" + "1" * 40   # Ray node ids (56 hex digits)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    # spare-1 and the derived names are named as kvfabric names them
    pki = make_pki(tmp_path_factory.mktemp("certs"), "node-a", "node-b", "spare-1", derived_node_name(JOINING),
                   derived_node_name(OTHER), extra_sans=("127.0.0.1",))
    pki.node("node-c")                     # no IP SAN: may not advertise 127.0.0.1
    make_pki(pki.dir / "other", "node-a", extra_sans=("127.0.0.1",))
    return pki.dir


def signer(d: Path, node: str, node_id: str, incarnation: int = 5) -> ReportSigner:
    return ReportSigner(NodeSigner(d / f"{node}.pem", d / f"{node}.key"), node_id, incarnation)


def gate(d: Path) -> DirectoryGate:
    return DirectoryGate(DirectoryShard(lease_s=10.0), TrustAnchor.from_files(d / "ca.pem"))


def test_signed_reports_of_a_node_are_applied(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    assert g.submit(a.sign(0, Heartbeat(ADDR_A)), 0.0) is ApplyOutcome.ACCEPTED
    assert g.submit(a.sign(0, Apply(1, [H[0]], [], ADDR_A)), 0.0) is ApplyOutcome.ACCEPTED
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)
    assert g.stats(0.0)["refused"] == 0


def test_a_report_without_a_valid_signature_is_refused_and_counted(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    g.submit(a.sign(0, Apply(1, [H[0]], [], ADDR_A)), 0.0)
    good = a.sign(0, Apply(2, [], [H[0]], ADDR_A))
    assert good.proof is not None
    forged = dataclasses.replace(good, proof=Proof(good.proof.cert, good.proof.nonce + 1, good.proof.signature))
    assert g.submit(forged, 0.0) is ApplyOutcome.REFUSED                 # a signature of another message
    assert g.submit(dataclasses.replace(good, proof=None), 0.0) is ApplyOutcome.REFUSED
    assert g.submit(Report(0, A, 9, Heartbeat(ADDR_A)), 0.0) is ApplyOutcome.REFUSED   # a forged newer incarnation
    s = g.stats(0.0)
    assert (s["refused_bad_signature"], s["refused_unsigned"], s["refused"]) == (1, 2, 3)
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)                 # the removal was not applied
    assert g.shard.live_incarnation(A, 0.0) == 5


def test_every_field_of_a_report_is_signed(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    g.submit(a.sign(0, Apply(1, [H[0]], [], ADDR_A, [b"v1"])), 0.0)
    good = a.sign(0, Apply(2, [H[1]], [H[0]], ADDR_A, [b"v2"]))
    changed: list[Body] = [Apply(3, [H[1]], [H[0]], ADDR_A, [b"v2"]), Apply(2, [H[2]], [H[0]], ADDR_A, [b"v2"]),
               Apply(2, [H[1]], [], ADDR_A, [b"v2"]), Apply(2, [H[1]], [H[0]], None, [b"v2"]),
               Apply(2, [H[1]], [H[0]], ADDR_A, [b"v3"]), Apply(2, [H[1]], [H[0]], ADDR_A),
               EndResync(2, 2)]
    for body in changed:
        assert g.submit(dataclasses.replace(good, body=body), 0.0) is ApplyOutcome.REFUSED, body
    assert g.submit(dataclasses.replace(good, incarnation=6), 0.0) is ApplyOutcome.REFUSED
    assert g.stats(0.0)["refused_bad_signature"] == len(changed) + 1
    assert g.submit(dataclasses.replace(good, shard=1), 0.0) is ApplyOutcome.REFUSED      # another shard's
    assert g.submit(("not", "a", "report"), 0.0) is ApplyOutcome.REFUSED
    assert g.stats(0.0)["refused_malformed"] == 2
    assert g.submit(good, 0.0) is ApplyOutcome.ACCEPTED                  # the report as signed still counts
    assert g.shard.locate([H[0], H[1]], 0.0).versions == ((), (b"v2",))


def test_another_nodes_key_cannot_speak_for_a_node_or_invent_ids(certs: Path) -> None:
    g, a, b = gate(certs), signer(certs, "node-a", A), signer(certs, "node-b", B)
    g.submit(a.sign(0, Apply(1, [H[0]], [], ADDR_A)), 0.0)
    g.submit(b.sign(0, Heartbeat(ADDR_B)), 0.0)
    as_a = signer(certs, "node-b", A)                       # B's key, A's id: removals, incarnations
    assert g.submit(as_a.sign(0, Apply(2, [], [H[0]], ADDR_A)), 0.0) is ApplyOutcome.REFUSED
    assert g.submit(signer(certs, "node-b", A, 9).sign(0, Heartbeat(ADDR_B)), 0.0) is ApplyOutcome.REFUSED
    ghost = signer(certs, "node-b", "ghost")                # B's key, an id no node has
    assert g.submit(ghost.sign(0, Heartbeat(ADDR_B)), 0.0) is ApplyOutcome.REFUSED
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)
    assert [n.node_id for n in g.shard.nodes(0.0)] == [A, B]
    assert g.stats(0.0)["refused_wrong_node"] == 3


def test_an_address_outside_the_certificate_is_refused(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    hijack = NodeAddress("10.9.9.9", 7000, "tls-tcp", "node-a")
    assert g.submit(a.sign(0, Heartbeat(hijack)), 0.0) is ApplyOutcome.REFUSED
    as_b = NodeAddress("127.0.0.1", 7000, "tls-tcp", "node-b")       # A advertising B's TLS name
    assert g.submit(a.sign(0, BeginResync(1, as_b)), 0.0) is ApplyOutcome.REFUSED
    c = signer(certs, "node-c", "ray-id-c")
    addr_c = NodeAddress("127.0.0.1", 7002, "tls-tcp", "node-c")
    assert g.submit(c.sign(0, Heartbeat(addr_c)), 0.0) is ApplyOutcome.REFUSED
    assert g.shard.nodes(0.0) == []
    assert g.stats(0.0)["refused_address"] == 3


def test_a_replayed_report_is_refused(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    first = a.sign(0, Apply(1, [H[0]], [], ADDR_A))
    g.submit(first, 0.0)
    g.submit(a.sign(0, Apply(2, [], [H[0]], ADDR_A)), 0.0)
    g.submit(a.sign(0, EndResync(1, 3)), 0.0)                # any later report of A
    assert g.submit(first, 0.0) is ApplyOutcome.REFUSED
    assert g.stats(0.0)["refused_replay"] == 1
    assert g.shard.locate([H[0]], 0.0).owners == ((),)


def test_foreign_and_revoked_certificates_are_refused(certs: Path) -> None:
    g = gate(certs)
    foreign = signer(certs / "other", "node-a", A)
    assert g.submit(foreign.sign(0, Heartbeat(ADDR_A)), 0.0) is ApplyOutcome.REFUSED
    a = signer(certs, "node-a", A)
    assert g.submit(a.sign(0, Heartbeat(ADDR_A)), 0.0) is ApplyOutcome.ACCEPTED
    serial = TrustAnchor.from_files(certs / "ca.pem").identity((certs / "node-a.pem").read_bytes()).serial
    g.verifier = g.verifier.with_revoked(frozenset({serial}))
    assert g.submit(a.sign(0, Apply(1, [H[1]], [], ADDR_A)), 0.0) is ApplyOutcome.REFUSED
    s = g.stats(0.0)
    assert (s["refused_untrusted"], s["refused_revoked"]) == (1, 1)
    assert g.shard.locate([H[1]], 0.0).owners == ((),)


def test_a_resync_is_signed_end_to_end(certs: Path) -> None:
    g, a, b = gate(certs), signer(certs, "node-a", A), signer(certs, "node-b", A)
    assert g.submit(a.sign(0, BeginResync(1, ADDR_A)), 0.0) is ApplyOutcome.ACCEPTED
    assert g.submit(b.sign(0, ResyncBatch(1, [H[2]])), 0.0) is ApplyOutcome.REFUSED   # B cannot stage for A
    assert g.submit(a.sign(0, ResyncBatch(1, [H[3]])), 0.0) is ApplyOutcome.ACCEPTED
    assert g.submit(a.sign(0, EndResync(1, 1)), 0.0) is ApplyOutcome.ACCEPTED
    assert g.shard.locate([H[2], H[3]], 0.0).owners == ((), (A,))


def _address(name: str) -> NodeAddress:
    return NodeAddress("127.0.0.1", 7100, "tls-tcp", name)


def test_a_squatter_cannot_keep_a_joining_node_out_of_its_own_id(certs: Path) -> None:
    g = gate(certs)
    squat, real = signer(certs, "spare-1", JOINING, incarnation=2**62), signer(certs, derived_node_name(JOINING),
                                                                             JOINING)
    # a valid certificate bound to no live node reports first under the joining node's Ray id,
    # with an incarnation and nonces far above any the real node will use
    assert g.submit(squat.sign(0, Heartbeat(_address("spare-1"))), 0.0) is ApplyOutcome.ACCEPTED
    assert g.submit(squat.sign(0, Apply(1, [H[0]], [], _address("spare-1"))), 0.0) is ApplyOutcome.ACCEPTED
    # the node whose id it is (its certificate's name derives from the id) takes its id back at once
    addr = _address(derived_node_name(JOINING))
    assert g.submit(real.sign(0, Heartbeat(addr)), 1.0) is ApplyOutcome.ACCEPTED
    assert g.submit(real.sign(0, Apply(1, [H[1]], [], addr)), 1.0) is ApplyOutcome.ACCEPTED
    assert g.shard.locate([H[0], H[1]], 1.0).owners == ((), (JOINING,))   # the squatter's entries are gone
    assert [n.address for n in g.shard.nodes(1.0)] == [addr]
    # and the squatter, still reporting, is refused from then on
    assert g.submit(squat.sign(0, Heartbeat(_address("spare-1"))), 2.0) is ApplyOutcome.REFUSED
    # a name derived from another id never speaks for this one, first or not
    other = signer(certs, derived_node_name(OTHER), JOINING)
    assert g.submit(other.sign(0, Heartbeat(_address(derived_node_name(OTHER)))), 2.0) is ApplyOutcome.REFUSED
    assert g.stats(2.0)["refused_wrong_node"] == 2


def test_a_binding_of_other_names_lasts_one_lease_and_the_operator_can_clear_it(certs: Path) -> None:
    # nodes named by $KVFABRIC_NODE_NAME: no name says which id is whose
    g, squat, real = gate(certs), signer(certs, "spare-1", A), signer(certs, "node-a", A)
    assert g.submit(squat.sign(0, Heartbeat(_address("spare-1"))), 0.0) is ApplyOutcome.ACCEPTED
    assert g.submit(real.sign(0, Heartbeat(ADDR_A)), 9.9) is ApplyOutcome.REFUSED    # still live
    assert g.submit(real.sign(0, Heartbeat(ADDR_A)), 10.0) is ApplyOutcome.ACCEPTED  # one lease on
    assert g.bindings() == {A: "node-a"}
    # a squatter that keeps reporting holds the id only until the operator clears it
    assert g.submit(signer(certs, "spare-1", B).sign(0, Heartbeat(_address("spare-1"))), 20.0) \
        is ApplyOutcome.ACCEPTED
    real_b = signer(certs, "node-b", B)
    assert g.submit(real_b.sign(0, Heartbeat(ADDR_B)), 21.0) is ApplyOutcome.REFUSED
    assert g.unbind(B) == "spare-1" and g.shard.live_incarnation(B, 21.0) is None
    assert g.submit(real_b.sign(0, Heartbeat(ADDR_B)), 21.0) is ApplyOutcome.ACCEPTED
    assert g.bindings() == {A: "node-a", B: "node-b"}
