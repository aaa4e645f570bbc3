"""The revocation-list watcher every reader shares (transports/trust/revocation.py), on real files."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import pytest
from cryptography import x509

from transports.trust.certs import CertificateError, CredentialFiles, NodeCredentials, init_ca, issue_node, revoke
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


def _handshake(client: ssl.SSLContext, server: ssl.SSLContext, server_name: str) -> None:
    """A TLS 1.3 handshake between the two contexts over memory BIOs; raises what either end raises."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=server_name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {c: False, s: False}
    for _ in range(10):
        for end in (c, s):
            if not done[end]:
                try:
                    end.do_handshake()
                    done[end] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


def test_node_credentials_keep_a_list_that_disappears(tmp_path: Path) -> None:
    """Deleting crl.pem (a mistaken rm, a secret remounted without it) must not let a revoked node
    back in: the TLS contexts keep refusing it, as every other reader of the list does."""
    init_ca(tmp_path)
    for node in ("node-a", "node-b"):
        issue_node(tmp_path, node)
    revoke(tmp_path, {_serial(tmp_path, "node-b")})
    server = NodeCredentials(CredentialFiles.for_node(tmp_path, "node-a"))
    client = NodeCredentials(CredentialFiles.for_node(tmp_path, "node-b"))
    with pytest.raises(ssl.SSLError):
        _handshake(client.ssl_context(server=False), server.ssl_context(server=True), "node-a")
    (tmp_path / "crl.pem").unlink()
    issue_node(tmp_path, "node-a")   # and a rotation of the server's own certificate meanwhile
    server.refresh()
    assert server.revoked == {_serial(tmp_path, "node-b")}
    with pytest.raises(ssl.SSLError):
        _handshake(client.ssl_context(server=False), server.ssl_context(server=True), "node-a")
