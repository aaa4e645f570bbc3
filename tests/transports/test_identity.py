"""Node identities: which certificates count (CA, validity, revocation, node-ness) and node signatures."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography import x509

from transports.trust.certs import CertificateError, init_ca, issue_node, revoke
from transports.trust.identity import IdentityError, NodeSigner, TrustAnchor


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


def test_an_rsa_node_key_signs_and_verifies(tmp_path: Path) -> None:
    """Some issuers (a cert-manager csi-driver set up that way) hand nodes RSA keys: they must work too."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    init_ca(tmp_path)
    ca_cert = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "ca.key").read_bytes(), password=None)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "r")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("rsa-node")]), critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    (tmp_path / "rsa-node.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "rsa-node.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    signer = NodeSigner(tmp_path / "rsa-node.pem", tmp_path / "rsa-node.key")
    ident = TrustAnchor.from_files(tmp_path / "ca.pem").identity(signer.cert_der)
    sig = signer.sign(b"report")
    assert ident.node == "rsa-node" and ident.verify(sig, b"report") and not ident.verify(sig, b"other")
