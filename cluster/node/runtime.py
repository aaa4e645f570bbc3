"""What a node holds while it serves, opened in order by `start` and released in reverse by `close`:

    identity   NodeSigner (its certificate and key), the cluster CA and its revocation list (crl.pem)
    storage    Store (RAM / SSD / index under folders named for the node) and LocalFabric over it
    serving    the transport server that answers peers' pulls, the client that pulls from them
    telemetry  a prometheus registry and its /metrics endpoint, the KV event publisher when enabled

A node refuses to start without its certificate: the operator issues node certificates before
nodes start, and no node holds the CA key. A new revocation list is picked up while it runs
(`reload_revocations`), keeping the old one if the new one cannot be read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import time
from pathlib import Path

import ray
from prometheus_client import CollectorRegistry, start_http_server

from cluster.directory.report import ReportSigner
from cluster.directory.types import NodeAddress
from cluster.events.publisher import KvEventPublisher
from cluster.node.local import LocalFabric
from cluster.node.metrics import ClusterMetrics
from cluster.tenancy import TenantGate
from fabric.config import Config, Environment
from fabric.store import Store
from transports.core.base import TransportClient, TransportServer
from transports.core.buffers import tune_allocator
from transports.core.metrics import TransportMetrics
from transports.core.serving import EgressPacer
from transports.factory import create_client, create_server
from transports.trust.certs import CA_CERT, CRL, CertificateError
from transports.trust.identity import NodeSigner, TrustAnchor, read_ca_cert
from transports.trust.provenance_check import ProvenanceVerifier
from transports.trust.revocation import RevocationFile

logger = logging.getLogger(__name__)

GC_THRESHOLD = 50_000   # young-generation allocations between cycle-collector passes (CPython: 700)


class NodeRuntime:
    """One node incarnation's certificates, store, transport ends, metrics and KV events."""

    def __init__(self, config: Config, *, node_id: str, node_name: str, incarnation: int) -> None:
        self.config = config
        self.node_id = node_id
        self.node_name = node_name
        self.incarnation = incarnation

    async def start(self) -> None:
        """Open everything; raises `CertificateError` (saying how to issue it) without a certificate."""
        cfg = self.config
        kv = dataclasses.replace(cfg.kv, ssd_dir=str(Path(cfg.kv.ssd_dir) / self.node_name),
                                 index_dir=str(Path(cfg.kv.index_dir) / self.node_name))
        transport = dataclasses.replace(cfg.transport, node_name=self.node_name)
        self.quarantine_path = f"{kv.index_dir}.quarantine.json"   # cluster/node/quarantine.py
        self._open_identity(Path(transport.cert_dir))
        # This Ray worker process runs only this actor: keep freed payload buffers in the heap, or
        # every pull page-faults them back in, the whole prefix each time (buffers.tune_allocator).
        tune_allocator()
        # Likewise for the cycle collector: a long pull makes many short-lived objects (results,
        # views, addresses), and at the default threshold its young-generation passes kept
        # re-scanning the load's live plan, a visible share of the puller's CPU in perf. Cycles are rare here
        # (reference counting frees the rest), so collect less often, and never re-scan start-up state.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        self.registry = CollectorRegistry()
        self.metrics = ClusterMetrics(self.registry)
        self.metrics.crl_seconds_left.set_function(
            lambda: math.inf if self.crl_next_update is None else self.crl_next_update - time.time())
        self.kv_store = Store.open(kv, registry=self.registry)
        self.local = LocalFabric(self.kv_store, self.node_id)
        self.local.revoked = self.trust.revoked
        self.tenancy = TenantGate(cfg.tenancy, self.trust,
                                  (Path(transport.cert_dir) / f"{self.node_name}.pem").read_bytes(), self.registry)
        self.transport_metrics = tmetrics = TransportMetrics(self.registry)
        self.server: TransportServer = create_server(transport, self.kv_store, metrics=tmetrics)
        self.server.require_pull_namespace = cfg.tenancy.required   # docs/tenants.md
        self.server.tenant_roots = self.tenancy.tenants_of_root
        host, port = await self.server.start()
        if host in ("0.0.0.0", "::"):
            host = Environment.read().advertise_host or ray.util.get_node_ip_address()
        self.client: TransportClient = create_client(transport, metrics=tmetrics)
        self.address = NodeAddress(host, port, transport.kind, self.node_name)
        bind = "127.0.0.1" if transport.host.startswith("127.") else "0.0.0.0"
        self.http, _ = start_http_server(cfg.cluster.metrics_port, addr=bind, registry=self.registry)
        self.metrics_port = int(self.http.server_port)
        self.kv_events: KvEventPublisher | None = None
        if cfg.events.enabled:
            self.kv_events = KvEventPublisher(cfg.events, self.node_name, block_size=kv.block_size,
                                              tenancy_required=cfg.tenancy.required,
                                              chains_path=f"{kv.index_dir}.event-chains")
            self.kv_events.start(self.kv_store.held_addresses())

    def _open_identity(self, cert_dir: Path) -> None:
        missing = [p for p in (cert_dir / f"{self.node_name}.pem", cert_dir / f"{self.node_name}.key",
                               cert_dir / CA_CERT) if not p.is_file()]
        if missing:
            message = (f"node {self.node_name} has no certificate: {missing[0]} is missing; issue it on the CA "
                       f"machine with `kvfabric certs issue --dir <ca folder> --node {self.node_name} --san <node IP>` "
                       f"and copy {self.node_name}.pem, {self.node_name}.key and {CA_CERT} to {cert_dir}")
            logger.error("%s", message)
            raise CertificateError(message)
        self.signer = NodeSigner(cert_dir / f"{self.node_name}.pem", cert_dir / f"{self.node_name}.key")
        self._crl = RevocationFile(cert_dir / CRL, read_ca_cert(cert_dir / CA_CERT), check_every_s=0.0)
        self.trust = TrustAnchor(self._crl.ca_cert, self._crl.load())
        self.reports = ReportSigner(self.signer, self.node_id, self.incarnation)
        self.verifier = ProvenanceVerifier(self.trust)
        self.crl_next_update = self._crl.next_update

    def reload_revocations(self) -> None:
        """Pick up a new revocation list (crl.pem beside ca.pem) without a restart."""
        try:
            revoked = self._crl.poll(time.monotonic())
        except CertificateError as e:   # keep the list we have: an unreadable one revokes nothing new
            logger.error("new revocation list not used: %s", e)
            self.metrics.crl_reloads.labels("refused").inc()
            return
        if revoked is None:
            return
        self.trust = TrustAnchor(self._crl.ca_cert, revoked)
        self.verifier.trust = self.trust
        self.tenancy.verifier.trust = self.trust
        self.local.revoked = self.trust.revoked
        self.crl_next_update = self._crl.next_update
        self.metrics.crl_reloads.labels("loaded").inc()
        logger.info("revocation list reloaded: %d certificates revoked", len(self.trust.revoked))

    def set_send_rate(self, mb_s: float) -> None:
        """Cap (or, with 0, uncap) what the TLS-TCP server sends, MB/s; ValueError for another transport."""
        if mb_s < 0:
            raise ValueError(f"send rate must be >= 0 MB/s, got {mb_s}")
        if not hasattr(self.server, "pacer"):
            raise ValueError(f"the {self.address.transport} server has no send-rate cap (TLS-TCP has)")
        self.server.pacer = EgressPacer(mb_s * 1e6) if mb_s > 0 else None
        logger.info("send rate %s", f"capped at {mb_s:g} MB/s" if mb_s > 0 else "uncapped")

    async def held_versions(self) -> dict[bytes, bytes]:
        """Every block hash the store holds (any tier, any layer), with its block version."""
        return await asyncio.get_running_loop().run_in_executor(None, self.kv_store.held_versions)

    async def held_hashes(self) -> set[bytes]:
        """Every block hash the store holds (any tier, any layer)."""
        held = await asyncio.get_running_loop().run_in_executor(None, self.kv_store.held_addresses)
        return {a.hash for a in held}

    async def close_serving(self) -> None:
        """Stop pulling, serving, the metrics endpoint and the KV events (the store stays open)."""
        await self.client.close()
        await self.server.close()
        self.http.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()

    async def close_store(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.kv_store.close)
