"""The revocation-list watcher every reader shares (transports/trust/revocation.py), on real files."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from cryptography import x509

from transports.trust.certs import CertificateError, init_ca, issue_node, revoke
from transports.trust.revocation import RevocationFile


def _serial(d: Path, node: str) -> int:
    return x509.load_pem_x509_certificate((d / f"{node}.pem").read_bytes()).serial_number


def _watcher(d: Path) -> RevocationFile:
    return RevocationFile(d / "crl.pem", x509.load_pem_x509_certificate((d / "ca.pem").read_bytes()),
                          check_every_s=0.0)


def test_a_loaded_list_is_reported_again_only_after_it_changes(tmp_path: Path) -> None:
    init_ca(tmp_path)
    issue_node(tmp_path, "node-a")
    issue_node(tmp_path, "node-b")
    revoke(tmp_path, {_serial(tmp_path, "node-a")}, days=3)
    watcher = _watcher(tmp_path)
    assert watcher.load() == {_serial(tmp_path, "node-a")}
    assert watcher.next_update is not None and watcher.next_update > time.time() + 2 * 86400
    assert watcher.poll(time.monotonic()) is None                      # unchanged since load
    revoke(tmp_path, {_serial(tmp_path, "node-b")})
    assert watcher.poll(time.monotonic()) == {_serial(tmp_path, "node-a"), _serial(tmp_path, "node-b")}
    assert watcher.poll(time.monotonic()) is None


def test_a_forged_or_vanished_list_never_un_revokes(tmp_path: Path) -> None:
    init_ca(tmp_path / "ours")
    init_ca(tmp_path / "other")
    issue_node(tmp_path / "ours", "node-a")
    revoke(tmp_path / "ours", {_serial(tmp_path / "ours", "node-a")})
    watcher = _watcher(tmp_path / "ours")
    assert watcher.load() == {_serial(tmp_path / "ours", "node-a")}
    (tmp_path / "ours" / "crl.pem").write_bytes(revoke(tmp_path / "other", {1}).read_bytes())   # another CA's
    with pytest.raises(CertificateError, match="not signed by the cluster CA"):
        watcher.poll(time.monotonic())
    (tmp_path / "ours" / "crl.pem").unlink()
    assert watcher.poll(time.monotonic()) is None                      # the reader keeps what it had


def test_without_a_list_nothing_is_revoked(tmp_path: Path) -> None:
    init_ca(tmp_path)
    watcher = _watcher(tmp_path)
    assert watcher.load() == frozenset() and watcher.next_update is None
