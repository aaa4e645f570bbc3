"""Provenance checked against the cluster CA: only the named producer's signature over these bytes counts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from testkit import PkiFactory

from fabric.provenance import Provenance, Rejection, sign_block, sign_run
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

NS, BLOCK = b"n" * 32, b"h" * 32
DIGESTS = [bytes([i]) * 32 for i in range(3)]


def _record(cert_dir: Path, node: str, producer: str | None = None, digests: list[bytes] = DIGESTS) -> Provenance:
    signer = NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    return sign_block(NS, BLOCK, digests, producer or signer.node, signer.cert_der, signer.sign)


def test_the_producers_record_verifies_for_every_layer(cert_dir: Path) -> None:
    verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
    record = _record(cert_dir, "node-a")
    assert [verifier.check(record, NS, BLOCK, i, d) for i, d in enumerate(DIGESTS)] == [None] * 3


def test_each_way_of_lying_gets_its_reason(cert_dir: Path, openssl_foreign) -> None:
    verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
    honest = _record(cert_dir, "node-a")
    liar_bytes = b"\xff" * 32
    # a record listing the liar's digest but keeping the honest signature
    tampered = dataclasses.replace(honest, layer_digests=liar_bytes + honest.layer_digests[32:])
    # signed by node-b, naming node-a as producer, with node-b's certificate or node-a's
    claims_a = _record(cert_dir, "node-b", producer="node-a")
    claims_a_with_a_cert = dataclasses.replace(claims_a, cert_der=honest.cert_der)
    foreign_cert = x509.load_pem_x509_certificate(openssl_foreign.server_cert.read_bytes())
    foreign = dataclasses.replace(honest, cert_der=foreign_cert.public_bytes(Encoding.DER))
    expired = _record(cert_dir, "expired-1")
    cases = [
        (None, 0, DIGESTS[0], Rejection.UNSIGNED),
        (honest, 0, liar_bytes, Rejection.WRONG_DIGEST),
        (honest, 7, DIGESTS[0], Rejection.WRONG_BLOCK),
        (tampered, 0, liar_bytes, Rejection.BAD_SIGNATURE),
        (claims_a, 0, DIGESTS[0], Rejection.PRODUCER_MISMATCH),
        (claims_a_with_a_cert, 0, DIGESTS[0], Rejection.BAD_SIGNATURE),
        (foreign, 0, DIGESTS[0], Rejection.UNTRUSTED),
        (expired, 0, DIGESTS[0], Rejection.EXPIRED),
        (dataclasses.replace(honest, cert_der=b"\x30\x03junk"), 0, DIGESTS[0], Rejection.MALFORMED),
    ]
    assert [verifier.check(r, NS, BLOCK, layer, d) for r, layer, d, _ in cases] == [c[3] for c in cases]
    assert verifier.check(honest, b"m" * 32, BLOCK, 0, DIGESTS[0]) is Rejection.WRONG_BLOCK


def test_a_revoked_producer_is_refused_even_after_its_record_verified(tmp_path: Path, make_pki: PkiFactory) -> None:
    pki = make_pki(tmp_path, "node-r")
    record = _record(tmp_path, "node-r")
    verifier = ProvenanceVerifier(TrustAnchor.from_files(pki.ca))
    assert verifier.check(record, NS, BLOCK, 0, DIGESTS[0]) is None
    pki.revoke("node-r")
    verifier.trust = TrustAnchor.from_files(pki.ca)
    assert verifier.check(record, NS, BLOCK, 1, DIGESTS[1]) is Rejection.REVOKED


@pytest.mark.parametrize("node", ["node-a", "node-b"])
def test_records_survive_their_encoding(cert_dir: Path, node: str) -> None:
    verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
    record = _record(cert_dir, node)
    again = Provenance.decode(record.encode(), record.cert_der)
    assert verifier.check(again, NS, BLOCK, 2, DIGESTS[2]) is None


def test_a_producer_restricted_to_other_tenants_is_not_authorised_for_this_namespace(
        tmp_path: Path, make_pki: PkiFactory) -> None:
    make_pki(tmp_path, "node-open").node("node-acme", tenants=("acme",))
    verifier = ProvenanceVerifier(TrustAnchor.from_files(tmp_path / "ca.pem"))
    acme_only, open_node = _record(tmp_path, "node-acme"), _record(tmp_path, "node-open")
    assert verifier.check(acme_only, NS, BLOCK, 0, DIGESTS[0], tenants=frozenset({"acme"})) is None
    assert verifier.check(acme_only, NS, BLOCK, 0, DIGESTS[0], tenants=frozenset({"acme", "globex"})) is None
    # the same record object right after it was accepted: the shortcut must not skip the tenant check
    assert verifier.check(acme_only, NS, BLOCK, 1, DIGESTS[1],
                          tenants=frozenset({"globex"})) is Rejection.UNAUTHORISED
    assert verifier.check(acme_only, NS, BLOCK, 0, DIGESTS[0], tenants=frozenset()) is Rejection.UNAUTHORISED
    assert verifier.check(open_node, NS, BLOCK, 0, DIGESTS[0], tenants=frozenset({"globex"})) is None
    assert verifier.check(acme_only, NS, BLOCK, 0, DIGESTS[0]) is None   # no tenant named: not checked


def _run_records(cert_dir: Path, node: str, num_blocks: int) -> list[Provenance]:
    signer = NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    blocks = [(bytes([i]) * 32, DIGESTS) for i in range(num_blocks)]
    return sign_run(NS, blocks, signer.node, signer.cert_der, signer.sign)


def test_every_block_of_a_signed_run_verifies_on_its_own(cert_dir: Path) -> None:
    records = _run_records(cert_dir, "node-a", 5)
    for i in (4, 0, 2):   # a fresh puller per block: each record proves its block without the others
        verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
        again = Provenance.decode(records[i].encode(), records[i].cert_der)
        assert [verifier.check(again, NS, bytes([i]) * 32, layer, d) for layer, d in enumerate(DIGESTS)] == [None] * 3


def test_a_tampered_inclusion_path_is_refused_even_after_the_run_verified(cert_dir: Path) -> None:
    verifier = ProvenanceVerifier(TrustAnchor.from_files(cert_dir / "ca.pem"))
    records = _run_records(cert_dir, "node-a", 6)
    assert verifier.check(records[1], NS, b"\1" * 32, 0, DIGESTS[0]) is None   # the run's root is now cached
    liar_digests = [b"\xff" * 32, *DIGESTS[1:]]
    r = records[2]
    forged = [
        dataclasses.replace(r, path=bytes([r.path[0] ^ 1]) + r.path[1:]),
        dataclasses.replace(r, leaf_index=3),
        dataclasses.replace(r, num_leaves=7),
        dataclasses.replace(r, path=r.path[:-32]),
    ]
    assert [verifier.check(f, NS, b"\2" * 32, 1, DIGESTS[1]) for f in forged] == [Rejection.BAD_SIGNATURE] * 4
    # another block's record, its digests replaced by a liar's, under the run's signature and path
    swapped = dataclasses.replace(records[3], layer_digests=b"".join(liar_digests))
    assert verifier.check(swapped, NS, b"\3" * 32, 0, b"\xff" * 32) is Rejection.BAD_SIGNATURE
    assert verifier.check(records[2], NS, b"\2" * 32, 1, DIGESTS[1]) is None
