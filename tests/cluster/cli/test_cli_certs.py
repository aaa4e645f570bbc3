"""`kvfabric certs init|issue|revoke` as a user runs it: exit codes, messages, files, and usable certificates."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import blake3
import pytest
from cryptography import x509

from cluster.cli.main import main
from fabric.keys import BlockAddress, BlockHash
from transports.core.base import Hit, Peer
from transports.quic import QuicTransportClient, QuicTransportServer
from transports.trust.certs import CredentialFiles, NodeCredentials, node_name_of
from transports.trust.identity import IdentityError, TrustAnchor
from transports.trust.tenant_tokens import TenantMinter, tenants_of_node


@dataclass(frozen=True)
class StoredBlock:
    payload: bytes
    digest: bytes


def san(path: Path) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_init_then_issue_writes_a_ca_and_node_certificates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert main(["certs", "issue", "--dir", str(d), "--node", "gpu-node-7", "--san", "10.0.0.5",
                 "--san", "gpu-node-7.cluster.node.local"]) == 0
    out = capsys.readouterr().out
    assert "cluster CA" in out and "node gpu-node-7" in out
    names = san(d / "gpu-node-7.pem")
    assert node_name_of(x509.load_pem_x509_certificate((d / "gpu-node-7.pem").read_bytes())) == "gpu-node-7"
    assert names.get_values_for_type(x509.DNSName) == ["gpu-node-7", "gpu-node-7.cluster.node.local"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.5")]
    for key in (d / "ca.key", d / "gpu-node-7.key"):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600


def test_mistakes_are_one_line_errors_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "issue", "--dir", str(d), "--node", "n1"]) == 2
    assert "kvfabric certs init" in capsys.readouterr().err  # tells the user what to run first
    assert main(["certs", "init", "--dir", str(d)]) == 0
    ca_before = (d / "ca.pem").read_bytes()
    assert main(["certs", "init", "--dir", str(d)]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and len(err.strip().splitlines()) == 1
    assert (d / "ca.pem").read_bytes() == ca_before  # the CA every node trusts was not replaced
    assert main(["certs", "issue", "--dir", str(d), "--node", "../evil"]) == 2
    assert "invalid node name" in capsys.readouterr().err
    assert main(["certs", "init", "--dir", str(d), "--force"]) == 0
    assert (d / "ca.pem").read_bytes() != ca_before


def test_the_installed_command_works_in_a_subprocess(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    cmd = [sys.executable, "-m", "cluster.cli.main", "certs"]
    done = subprocess.run([*cmd, "init", "--dir", str(d)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([*cmd, "issue", "--dir", str(d), "--node", "n1"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (d / "n1.pem").is_file() and (d / "n1.key").is_file()


def test_cli_made_certificates_carry_a_mutual_tls_quic_pull(tmp_path: Path) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    for node in ("server-node", "client-node"):
        assert main(["certs", "issue", "--dir", str(d), "--node", node]) == 0
    address = BlockAddress(BlockHash(b"\x01" * 32), 0)
    payload = os.urandom(4096)
    block = StoredBlock(payload, blake3.blake3(payload).digest())

    class OneBlock:
        def get_block(self, a: BlockAddress) -> StoredBlock | None:
            return block if a == address else None

    async def pull() -> list[object]:
        server = QuicTransportServer(NodeCredentials(CredentialFiles.for_node(d, "server-node")), OneBlock())
        host, port = await server.start()
        client = QuicTransportClient(NodeCredentials(CredentialFiles.for_node(d, "client-node")))
        try:
            return [r async for r in client.pull(Peer("server-node", host, port), [address])]
        finally:
            await client.close()
            await server.close()

    results = asyncio.run(asyncio.wait_for(pull(), 30))
    assert len(results) == 1 and isinstance(results[0], Hit)


def test_revoke_lists_the_nodes_certificate_in_the_cas_revocation_list(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "certs"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    for node in ("node-1", "node-2"):
        assert main(["certs", "issue", "--dir", str(d), "--node", node]) == 0
    assert main(["certs", "revoke", "--dir", str(d), "node-1"]) == 0
    serial = x509.load_pem_x509_certificate((d / "node-1.pem").read_bytes()).serial_number
    anchor = TrustAnchor.from_files(d / "ca.pem")
    with pytest.raises(IdentityError) as refused:
        anchor.identity((d / "node-1.pem").read_bytes())
    assert refused.value.reason == "revoked"
    assert anchor.identity((d / "node-2.pem").read_bytes()).node == "node-2"
    assert f"{serial:x}" in capsys.readouterr().out
    assert main(["certs", "revoke", "--dir", str(d), "node-9"]) == 2     # no such certificate: nothing written
    assert "node-9.pem" in capsys.readouterr().err
    assert TrustAnchor.from_files(d / "ca.pem").revoked == frozenset({serial})
    assert main(["certs", "revoke", "--dir", str(d), "--serial", "0x1f:2a"]) == 0   # a certificate not in --dir
    assert TrustAnchor.from_files(d / "ca.pem").revoked == frozenset({serial, 0x1F2A})


def test_issue_tenant_writes_a_tenant_credential_and_issue_can_restrict_a_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d, out = tmp_path / "certs", tmp_path / "tenants"
    assert main(["certs", "init", "--dir", str(d)]) == 0
    assert main(["certs", "issue-tenant", "acme", "--dir", str(d), "--out", str(out)]) == 0
    assert "tenant acme" in capsys.readouterr().out
    assert san(out / "acme.tenant.pem").get_values_for_type(x509.UniformResourceIdentifier) == [
        "kvfabric-tenant:acme"]
    assert stat.S_IMODE(os.stat(out / "acme.tenant.key").st_mode) == 0o600
    assert TenantMinter(out / "acme.tenant.pem", out / "acme.tenant.key").tenant == "acme"
    assert main(["certs", "issue", "--dir", str(d), "--node", "n1", "--tenant", "acme", "--tenant", "globex"]) == 0
    assert tenants_of_node((d / "n1.pem").read_bytes()) == {"acme", "globex"}
    assert main(["certs", "issue-tenant", "no/slash", "--dir", str(d)]) != 0
    assert "invalid tenant name" in capsys.readouterr().err
