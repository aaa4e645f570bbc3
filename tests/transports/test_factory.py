"""Transport selection from the config: the right classes, lazy imports, working pulls."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fabric.config import Config, TransportConfig
from transports.core.base import Hit, Peer
from transports.factory import create_client, create_server, load_credentials, server_port
from transports.tls.client import TlsTcpClient
from transports.tls.server import TlsTcpServer
from transports.trust.certs import CertificateError


def transport_config(cert_dir: Path, kind: str, node: str = "node-a") -> TransportConfig:
    cfg = Config.from_dict({"transport": {"kind": kind, "cert_dir": str(cert_dir), "node_name": node,
                                          "frame_timeout_s": 3.0}})
    return cfg.transport


@pytest.mark.parametrize("kind", ["tls-tcp", "quic"])
def test_config_kind_picks_a_working_transport(cert_dir: Path, memory_source: Any, kind: str) -> None:
    source = memory_source(num_blocks=3, num_layers=2, payload_size=20_000)

    async def main() -> None:
        server = create_server(transport_config(cert_dir, kind), source)
        host, port = await server.start()
        client = create_client(transport_config(cert_dir, kind, node="client-1"))
        try:
            results = [r async for r in client.pull(Peer("node-a", host, port), source.addresses)]
        finally:
            await client.close()
            await server.close()
        assert [r.address for r in results] == source.addresses
        assert all(isinstance(r, Hit) and bytes(r.payload) == source.blocks[r.address].payload for r in results)

    asyncio.run(asyncio.wait_for(main(), 30))


def test_tls_tcp_is_the_default_and_takes_its_settings(cert_dir: Path, memory_source: Any) -> None:
    config = TransportConfig(cert_dir=str(cert_dir), node_name="node-a", tcp_port=0, quic_port=4433,
                             max_inflight=3, frame_timeout_s=1.5)
    server = create_server(config, memory_source())
    client = create_client(TransportConfig(cert_dir=str(cert_dir), node_name="client-1", connect_timeout_s=0.7))
    assert isinstance(server, TlsTcpServer) and isinstance(client, TlsTcpClient)
    assert server.max_inflight == 3 and server.frame_timeout_s == 1.5 and server.node == "node-a"
    assert client.connect_timeout_s == 0.7 and client.node == "client-1"
    assert server_port(config) == 0 and server_port(TransportConfig(kind="quic", quic_port=4433)) == 4433


def test_choosing_tls_tcp_never_imports_aioquic_or_pyverbs(cert_dir: Path) -> None:
    code = ("import sys\n"
            "from fabric.config import TransportConfig\n"
            "from transports.factory import create_client\n"
            f"create_client(TransportConfig(cert_dir={str(cert_dir)!r}, node_name='client-1'))\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aioquic', 'pyverbs')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_certificates_are_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CertificateError, match="missing certificate file"):
        load_credentials(TransportConfig(cert_dir=str(tmp_path), node_name="node-a"))


def test_unknown_kind_is_refused(cert_dir: Path) -> None:
    config = TransportConfig(cert_dir=str(cert_dir), node_name="node-a")
    config.kind = "carrier-pigeon"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="carrier-pigeon"):
        create_client(config)
