"""Unit tests of cluster/directory/auth.py: the directory believes a report only from the node it names.

Real certificates of one cluster CA (and of a second CA), real signatures; no Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit import PkiFactory

from cluster.directory.auth import DirectoryGate, Proof, ReportSigner
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, NodeAddress, derived_node_name
from transports.core.identity import NodeSigner, TrustAnchor

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
    assert g.heartbeat(A, 5, ADDR_A, 0.0, a.heartbeat(0, ADDR_A, None)) is ApplyOutcome.ACCEPTED
    assert g.apply(A, 5, 1, [H[0]], [], 0.0, ADDR_A, a.apply(0, 1, [H[0]], [], ADDR_A)) is ApplyOutcome.ACCEPTED
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)
    assert g.stats(0.0)["refused"] == 0


def test_a_report_without_a_valid_signature_is_refused_and_counted(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    g.apply(A, 5, 1, [H[0]], [], 0.0, ADDR_A, a.apply(0, 1, [H[0]], [], ADDR_A))
    good = a.apply(0, 2, [], [H[0]], ADDR_A)
    forged = Proof(good.cert, good.nonce + 1, good.signature)          # signature of another message
    assert g.apply(A, 5, 2, [], [H[0]], 0.0, ADDR_A, forged) is ApplyOutcome.REFUSED
    assert g.apply(A, 5, 2, [], [H[0]], 0.0, ADDR_A, None) is ApplyOutcome.REFUSED
    assert g.heartbeat(A, 9, ADDR_A, 0.0, None) is ApplyOutcome.REFUSED      # a forged newer incarnation
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)                 # the removal was not applied
    assert g.shard.live_incarnation(A, 0.0) == 5
    s = g.stats(0.0)
    assert (s["refused_bad_signature"], s["refused_unsigned"], s["refused"]) == (1, 2, 3)


def test_another_nodes_key_cannot_speak_for_a_node_or_invent_ids(certs: Path) -> None:
    g, a, b = gate(certs), signer(certs, "node-a", A), signer(certs, "node-b", B)
    g.apply(A, 5, 1, [H[0]], [], 0.0, ADDR_A, a.apply(0, 1, [H[0]], [], ADDR_A))
    g.heartbeat(B, 5, ADDR_B, 0.0, b.heartbeat(0, ADDR_B, None))
    as_a = signer(certs, "node-b", A)                       # B's key, A's id: removals, incarnations
    assert g.apply(A, 5, 2, [], [H[0]], 0.0, ADDR_A, as_a.apply(0, 2, [], [H[0]], ADDR_A)) is ApplyOutcome.REFUSED
    assert g.heartbeat(A, 9, ADDR_B, 0.0, signer(certs, "node-b", A, 9).heartbeat(0, ADDR_B, None)) \
        is ApplyOutcome.REFUSED
    ghost = signer(certs, "node-b", "ghost")                # B's key, an id no node has
    assert g.heartbeat("ghost", 5, ADDR_B, 0.0, ghost.heartbeat(0, ADDR_B, None)) is ApplyOutcome.REFUSED
    assert g.shard.locate([H[0]], 0.0).owners == ((A,),)
    assert [n.node_id for n in g.shard.nodes(0.0)] == [A, B]
    assert g.stats(0.0)["refused_wrong_node"] == 3


def test_an_address_outside_the_certificate_is_refused(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    hijack = NodeAddress("10.9.9.9", 7000, "tls-tcp", "node-a")
    assert g.heartbeat(A, 5, hijack, 0.0, a.heartbeat(0, hijack, None)) is ApplyOutcome.REFUSED
    as_b = NodeAddress("127.0.0.1", 7000, "tls-tcp", "node-b")       # A advertising B's TLS name
    assert g.begin_resync(A, 5, as_b, 0.0, a.begin_resync(0, as_b)) == 0
    c = signer(certs, "node-c", "ray-id-c")
    addr_c = NodeAddress("127.0.0.1", 7002, "tls-tcp", "node-c")
    assert g.heartbeat("ray-id-c", 5, addr_c, 0.0, c.heartbeat(0, addr_c, None)) is ApplyOutcome.REFUSED
    assert g.shard.nodes(0.0) == []
    assert g.stats(0.0)["refused_address"] == 3


def test_a_replayed_report_is_refused(certs: Path) -> None:
    g, a = gate(certs), signer(certs, "node-a", A)
    first = a.apply(0, 1, [H[0]], [], ADDR_A)
    g.apply(A, 5, 1, [H[0]], [], 0.0, ADDR_A, first)
    removal = a.apply(0, 2, [], [H[0]], ADDR_A)
    g.apply(A, 5, 2, [], [H[0]], 0.0, ADDR_A, removal)
    g.end_resync(A, 5, 0, 3, 0.0, a.end_resync(0, 0, 3))     # any later report of A
    assert g.apply(A, 5, 1, [H[0]], [], 0.0, ADDR_A, first) is ApplyOutcome.REFUSED
    assert g.stats(0.0)["refused_replay"] == 1


def test_foreign_and_revoked_certificates_are_refused(certs: Path) -> None:
    g = gate(certs)
    foreign = signer(certs / "other", "node-a", A)
    assert g.heartbeat(A, 5, ADDR_A, 0.0, foreign.heartbeat(0, ADDR_A, None)) is ApplyOutcome.REFUSED
    a = signer(certs, "node-a", A)
    assert g.heartbeat(A, 5, ADDR_A, 0.0, a.heartbeat(0, ADDR_A, None)) is ApplyOutcome.ACCEPTED
    serial = TrustAnchor.from_files(certs / "ca.pem").identity((certs / "node-a.pem").read_bytes()).serial
    g.verifier = g.verifier.with_revoked(frozenset({serial}))
    assert g.apply(A, 5, 1, [H[1]], [], 0.0, ADDR_A, a.apply(0, 1, [H[1]], [], ADDR_A)) is ApplyOutcome.REFUSED
    s = g.stats(0.0)
    assert (s["refused_untrusted"], s["refused_revoked"]) == (1, 1)
    assert g.shard.locate([H[1]], 0.0).owners == ((),)


def test_a_resync_is_signed_end_to_end(certs: Path) -> None:
    g, a, b = gate(certs), signer(certs, "node-a", A), signer(certs, "node-b", A)
    rid = g.begin_resync(A, 5, ADDR_A, 0.0, a.begin_resync(0, ADDR_A))
    assert rid > 0
    assert not g.resync_batch(A, 5, rid, [H[2]], 0.0, b.resync_batch(0, rid, [H[2]]))   # B cannot stage for A
    assert g.resync_batch(A, 5, rid, [H[3]], 0.0, a.resync_batch(0, rid, [H[3]]))
    assert g.end_resync(A, 5, rid, 1, 0.0, a.end_resync(0, rid, 1))
    assert g.shard.locate([H[2], H[3]], 0.0).owners == ((), (A,))


def _address(name: str) -> NodeAddress:
    return NodeAddress("127.0.0.1", 7100, "tls-tcp", name)


def test_a_squatter_cannot_keep_a_joining_node_out_of_its_own_id(certs: Path) -> None:
    g = gate(certs)
    squat, real = signer(certs, "spare-1", JOINING, incarnation=2**62), signer(certs, derived_node_name(JOINING),
                                                                             JOINING)
    # a valid certificate bound to no live node reports first under the joining node's Ray id,
    # with an incarnation and nonces far above any the real node will use
    assert g.heartbeat(JOINING, 2**62, _address("spare-1"), 0.0, squat.heartbeat(0, _address("spare-1"), None)) \
        is ApplyOutcome.ACCEPTED
    assert g.apply(JOINING, 2**62, 1, [H[0]], [], 0.0, _address("spare-1"),
                   squat.apply(0, 1, [H[0]], [], _address("spare-1"))) is ApplyOutcome.ACCEPTED
    # the node whose id it is (its certificate's name derives from the id) takes its id back at once
    addr = _address(derived_node_name(JOINING))
    assert g.heartbeat(JOINING, 5, addr, 1.0, real.heartbeat(0, addr, None)) is ApplyOutcome.ACCEPTED
    assert g.apply(JOINING, 5, 1, [H[1]], [], 1.0, addr, real.apply(0, 1, [H[1]], [], addr)) is ApplyOutcome.ACCEPTED
    assert g.shard.locate([H[0], H[1]], 1.0).owners == ((), (JOINING,))   # the squatter's entries are gone
    assert [n.address for n in g.shard.nodes(1.0)] == [addr]
    # and the squatter, still reporting, is refused from then on
    assert g.heartbeat(JOINING, 2**62, _address("spare-1"), 2.0, squat.heartbeat(0, _address("spare-1"), None)) \
        is ApplyOutcome.REFUSED
    # a name derived from another id never speaks for this one, first or not
    other = signer(certs, derived_node_name(OTHER), JOINING)
    assert g.heartbeat(JOINING, 5, _address(derived_node_name(OTHER)), 2.0,
                       other.heartbeat(0, _address(derived_node_name(OTHER)), None)) is ApplyOutcome.REFUSED
    assert g.stats(2.0)["refused_wrong_node"] == 2


def test_a_binding_of_other_names_lasts_one_lease_and_the_operator_can_clear_it(certs: Path) -> None:
    # nodes named by $KVFABRIC_NODE_NAME: no name says which id is whose
    g, squat, real = gate(certs), signer(certs, "spare-1", A), signer(certs, "node-a", A)
    assert g.heartbeat(A, 5, _address("spare-1"), 0.0, squat.heartbeat(0, _address("spare-1"), None)) \
        is ApplyOutcome.ACCEPTED
    assert g.heartbeat(A, 5, ADDR_A, 9.9, real.heartbeat(0, ADDR_A, None)) is ApplyOutcome.REFUSED   # still live
    assert g.heartbeat(A, 5, ADDR_A, 10.0, real.heartbeat(0, ADDR_A, None)) is ApplyOutcome.ACCEPTED  # one lease on
    assert g.bindings() == {A: "node-a"}
    # a squatter that keeps reporting holds the id only until the operator clears it
    assert g.heartbeat(B, 5, _address("spare-1"), 20.0, signer(certs, "spare-1", B).heartbeat(
        0, _address("spare-1"), None)) is ApplyOutcome.ACCEPTED
    real_b = signer(certs, "node-b", B)
    assert g.heartbeat(B, 5, ADDR_B, 21.0, real_b.heartbeat(0, ADDR_B, None)) is ApplyOutcome.REFUSED
    assert g.unbind(B) == "spare-1" and g.shard.live_incarnation(B, 21.0) is None
    assert g.heartbeat(B, 5, ADDR_B, 21.0, real_b.heartbeat(0, ADDR_B, None)) is ApplyOutcome.ACCEPTED
    assert g.bindings() == {A: "node-a", B: "node-b"}
