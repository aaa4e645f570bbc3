"""Transport selection: the `[transport] kind` of the config picks the server and client classes.

    kind = "tls-tcp"   TlsTcpServer / TlsTcpClient   (default: TCP works everywhere, fastest bulk path
                                                      without RDMA hardware)
    kind = "quic"      QuicTransportServer / QuicTransportClient   (UDP; per-stream flow control)
    kind = "rdma"      RdmaServer / RdmaClient       (needs pyverbs and an RDMA NIC; fails at
                                                      creation, with the reason, when either is missing)

Modules are imported only when their kind is chosen, so a node running TLS-TCP never imports
aioquic or pyverbs. Every kind uses the same certificates (`config.cert_dir`, node
`config.node_name`) and the same frame codec, so peers must agree on the kind only per port.
"""

from __future__ import annotations

from typing import get_args

from fabric.config import TransportConfig, TransportKind
from transports.core.base import BlockSource, TransportClient, TransportServer
from transports.core.errors import TransportError
from transports.core.metrics import TransportMetrics
from transports.trust.certs import CredentialFiles, NodeCredentials

KINDS: tuple[str, ...] = get_args(TransportKind)


class TransportUnavailableError(TransportError, RuntimeError):
    """The configured transport cannot run on this machine (e.g. RDMA without a device)."""


def load_credentials(config: TransportConfig) -> NodeCredentials:
    """This node's certificate, key and cluster CA from `cert_dir` (raises CertificateError if missing)."""
    return NodeCredentials(CredentialFiles.for_node(config.cert_dir, config.node_name))


def _check_kind(config: TransportConfig) -> None:
    if config.kind not in KINDS:
        raise ValueError(f"unknown transport kind {config.kind!r}; expected one of {', '.join(KINDS)}")


def create_server(config: TransportConfig, source: BlockSource, credentials: NodeCredentials | None = None,
                  metrics: TransportMetrics | None = None) -> TransportServer:
    """The server of `config.kind`, answering pulls from `source`; call `await server.start()`."""
    _check_kind(config)
    creds = credentials or load_credentials(config)
    if config.kind == "quic":
        from transports.quic import QuicTransportServer

        return QuicTransportServer.from_config(config, creds, source, metrics)
    if config.kind == "rdma":
        from transports.rdma.transport import RdmaServer, rdma_unavailable_reason

        reason = rdma_unavailable_reason()
        if reason is not None:
            raise TransportUnavailableError(f"transport kind 'rdma' is unavailable: {reason}")
        return RdmaServer.from_config(config, creds, source, metrics)
    from transports.tls.server import TlsTcpServer

    return TlsTcpServer.from_config(config, creds, source, metrics)


def create_client(config: TransportConfig, credentials: NodeCredentials | None = None,
                  metrics: TransportMetrics | None = None) -> TransportClient:
    """The client of `config.kind`; `pull(peer, addresses)` dials peers on demand."""
    _check_kind(config)
    creds = credentials or load_credentials(config)
    if config.kind == "quic":
        from transports.quic import QuicTransportClient

        return QuicTransportClient.from_config(config, creds, metrics)
    if config.kind == "rdma":
        from transports.rdma.transport import RdmaClient, rdma_unavailable_reason

        reason = rdma_unavailable_reason()
        if reason is not None:
            raise TransportUnavailableError(f"transport kind 'rdma' is unavailable: {reason}")
        return RdmaClient.from_config(config, creds, metrics)
    from transports.tls.client import TlsTcpClient

    return TlsTcpClient.from_config(config, creds, metrics)


def server_port(config: TransportConfig) -> int:
    """The configured port of `config.kind`: UDP `quic_port` for QUIC, TCP `tcp_port` otherwise
    (RDMA's control connection is TLS over TCP)."""
    _check_kind(config)
    return config.quic_port if config.kind == "quic" else config.tcp_port
