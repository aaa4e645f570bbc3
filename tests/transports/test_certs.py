"""Certificates: CA and node issuance, identity from the SAN, reload on rotation."""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

import pytest
from cryptography import x509

from transports.trust.certs import (
    CertificateError,
    CredentialFiles,
    NodeCredentials,
    init_ca,
    issue_node,
    node_name_of,
)


def test_issue_node_cert_names_the_node(tmp_path: Path) -> None:
    init_ca(tmp_path)
    cert_path, key_path = issue_node(tmp_path, "node-7", extra_sans=("127.0.0.1", "node-7.svc"))
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert node_name_of(cert) == "node-7"
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)


def test_refuses_to_replace_a_ca_and_needs_one_to_issue(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="kvfabric certs init"):
        issue_node(tmp_path, "n")
    init_ca(tmp_path)
    with pytest.raises(CertificateError, match="already exists"):
        init_ca(tmp_path)
    with pytest.raises(CertificateError, match="invalid node name"):
        issue_node(tmp_path, "../evil")


def test_contexts_require_peer_certificates(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_node(tmp_path, "a")
    creds = NodeCredentials(CredentialFiles.for_node(tmp_path, "a"))
    assert creds.node == "a"
    for server in (True, False):
        ctx = creds.ssl_context(server)
        assert ctx.verify_mode is ssl.CERT_REQUIRED and ctx.minimum_version is ssl.TLSVersion.TLSv1_3
    assert creds.ssl_context(False).check_hostname


def test_rotation_is_noticed_and_a_broken_rotation_keeps_the_old_material(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_node(tmp_path, "a")
    creds = NodeCredentials(CredentialFiles.for_node(tmp_path, "a"))
    old = creds.ssl_context(True)
    assert not creds.refresh()
    issue_node(tmp_path, "a")  # rotate
    new = creds.ssl_context(True)
    assert new is not old and creds.generation == 2
    (tmp_path / "a.key").write_text("not a key")
    assert not creds.refresh()
    assert creds.ssl_context(True) is new
    (tmp_path / "a.key").unlink()  # a rotation tool that deletes before it writes
    assert creds.ssl_context(True) is new and creds.ssl_context(False) is not None
    issue_node(tmp_path, "a")
    assert creds.ssl_context(True) is not new and creds.generation == 3


def test_missing_files_are_named(tmp_path: Path) -> None:
    init_ca(tmp_path)
    with pytest.raises(CertificateError, match="missing certificate file"):
        NodeCredentials(CredentialFiles.for_node(tmp_path, "ghost"))
