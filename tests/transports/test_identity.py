"""Node identities: which certificates count (CA, validity, revocation, node-ness) and node signatures."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from transports.certs import CertificateError, init_ca, issue_node, revoke
from transports.identity import IdentityError, NodeSigner, TrustAnchor


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_a_node_signature_verifies_only_for_its_message_and_its_node(cert_dir: Path) -> None:
    anchor = TrustAnchor.from_files(cert_dir / "ca.pem")
    signer_a = NodeSigner(cert_dir / "node-a.pem", cert_dir / "node-a.key")
    ident_a = anchor.identity(signer_a.cert_der)
    ident_b = anchor.identity((cert_dir / "node-b.pem").read_bytes())
    assert (ident_a.node, ident_b.node) == ("node-a", "node-b")
    sig = signer_a.sign(b"block 1")
    assert ident_a.verify(sig, b"block 1")
    assert not ident_a.verify(sig, b"block 2")
    assert not ident_b.verify(sig, b"block 1")
    assert not ident_a.verify(sig[:-1] + bytes([sig[-1] ^ 1]), b"block 1")


def test_foreign_expired_and_ca_certificates_prove_no_node(cert_dir: Path, odd_certs: Path, openssl_foreign) -> None:
    anchor = TrustAnchor.from_files(cert_dir / "ca.pem")
    cases = {"untrusted": openssl_foreign.server_cert, "expired": cert_dir / "expired-1.pem",
             "not_a_node": odd_certs / "rogue-ca.pem"}
    for reason, path in cases.items():
        with pytest.raises(IdentityError) as err:
            anchor.identity(path.read_bytes())
        assert err.value.reason == reason, path
    with pytest.raises(IdentityError) as err:
        anchor.identity(b"\x30\x03junk")
    assert err.value.reason == "malformed"


def test_a_revoked_certificate_is_refused_even_after_it_was_cached(tmp_path: Path) -> None:
    init_ca(tmp_path)
    cert_a, _ = issue_node(tmp_path, "a")
    issue_node(tmp_path, "b")
    anchor = TrustAnchor.from_files(tmp_path / "ca.pem")
    assert anchor.identity(cert_a.read_bytes()).node == "a"
    revoke(tmp_path, {_cert(cert_a).serial_number})
    reloaded = TrustAnchor.from_files(tmp_path / "ca.pem")
    with pytest.raises(IdentityError) as err:
        reloaded.identity(cert_a.read_bytes())
    assert err.value.reason == "revoked"
    assert reloaded.identity((tmp_path / "b.pem").read_bytes()).node == "b"
    cached = anchor.with_revoked(reloaded.revoked)
    with pytest.raises(IdentityError, match="revoked"):
        cached.identity(cert_a.read_bytes())


def test_a_revocation_list_not_signed_by_the_ca_is_refused(tmp_path: Path) -> None:
    init_ca(tmp_path / "one")
    init_ca(tmp_path / "other")
    revoke(tmp_path / "other", {12345})
    (tmp_path / "one" / "crl.pem").write_bytes((tmp_path / "other" / "crl.pem").read_bytes())
    with pytest.raises(CertificateError, match="not signed by the cluster CA"):
        TrustAnchor.from_files(tmp_path / "one" / "ca.pem")


def test_sans_bound_what_a_node_may_advertise(tmp_path: Path) -> None:
    init_ca(tmp_path)
    cert, _ = issue_node(tmp_path, "n1", extra_sans=("127.0.0.5", "n1.svc"))
    ident = TrustAnchor.from_files(tmp_path / "ca.pem").identity(cert.read_bytes())
    assert ident.may_advertise("127.0.0.5") and ident.may_advertise("N1.svc") and ident.may_advertise("n1")
    assert not ident.may_advertise("127.0.0.6") and not ident.may_advertise("n2")


def test_a_signer_refuses_a_key_that_is_not_its_certificates(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_node(tmp_path, "a")
    issue_node(tmp_path, "b")
    with pytest.raises(CertificateError, match="not the key of"):
        NodeSigner(tmp_path / "a.pem", tmp_path / "b.key")


def test_validity_is_checked_at_the_given_time(tmp_path: Path) -> None:
    init_ca(tmp_path)
    cert, _ = issue_node(tmp_path, "a", days=1)
    anchor = TrustAnchor.from_files(tmp_path / "ca.pem")
    assert anchor.identity(cert.read_bytes()).node == "a"
    with pytest.raises(IdentityError, match="not valid now"):
        anchor.identity(cert.read_bytes(), now=dt.datetime.now(dt.UTC) + dt.timedelta(days=3))
