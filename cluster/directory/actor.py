"""The directory as Ray actors: one named, detached `DirectoryActor` per shard, and `start_directory`.

Each shard actor wraps one pure `DirectoryShard` behind a `DirectoryGate` (directory/auth.py: every
report must be signed by the node it names) and supplies `now` (its own monotonic clock). A node's
reports of every kind come in through one call, `report` (directory/report.py). It is given
the cluster CA certificate and revocation list as content (never a key), and re-reads `crl.pem` from
the cert folder when its host has one and it changes, so a revocation reaches it without a restart.
Ray restarts a dead shard (`max_restarts=-1`); the restarted actor is empty and draws a new
**epoch**, which every answer carries. A node that sees a shard's epoch change resyncs everything
it holds for that shard, so the directory is rebuilt from the nodes, the source of truth.

    shard k  =  actor f"{directory_name}-{k}" in Ray namespace `[cluster] namespace`

The node's side is `DirectoryClient` (directory/client.py).

The shards are placed by the Ray resource `[cluster] directory_resource`, the head node by default:
the directory's latency then does not depend on which worker node Ray happened to pick.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import ray
from cryptography import x509

from cluster.directory.auth import DirectoryGate
from cluster.directory.shard import DirectoryShard
from cluster.directory.types import ApplyOutcome, LocateReply, NodeAddress, NodeInfo
from cluster.tenancy import TenantRefusedError
from fabric.config import ClusterConfig
from transports.trust.certs import CA_CERT, CRL, CertificateError, revoked_serials
from transports.trust.identity import TrustAnchor
from transports.trust.revocation import RevocationFile
from transports.trust.tenant_tokens import TenantError, TenantVerifier

logger = logging.getLogger(__name__)

# Errors that mean "the shard is not answering right now" (dead, restarting, unreachable).
SHARD_DOWN = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, asyncio.TimeoutError)


def shard_actor_name(config: ClusterConfig, shard: int) -> str:
    return f"{config.directory_name}-{shard}"


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=1)
class DirectoryActor:
    """One shard. Every method returns `(epoch, answer)`; calls are served one at a time."""

    def __init__(self, shard: int, num_shards: int, lease_s: float, ca_pem: bytes, crl_pem: bytes | None = None,
                 cert_dir: str | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.epoch = os.urandom(8).hex()
        self._ca = x509.load_pem_x509_certificate(ca_pem)
        self._given = revoked_serials(crl_pem, self._ca) if crl_pem else frozenset()
        self._crl = RevocationFile(Path(cert_dir) / CRL, self._ca) if cert_dir else None
        self.trust = TrustAnchor(self._ca, self._given)
        self.gate = DirectoryGate(DirectoryShard(shard, num_shards, lease_s=lease_s), self.trust)
        self.shard = self.gate.shard
        logger.info("directory shard %d/%d up with epoch %s", shard, num_shards, self.epoch)

    def _now(self) -> float:
        """The shard's clock; also where a changed revocation list is picked up."""
        now = time.monotonic()
        if self._crl is not None:
            try:
                revoked = self._crl.poll(now)
            except CertificateError as e:
                logger.error("keeping the previous revocation list: %s", e)
                revoked = None
            if revoked is not None:
                self.trust = self.gate.verifier = TrustAnchor(self._ca, self._given | revoked)
                logger.info("revocation list reloaded: %d certificate(s) revoked", len(self._given | revoked))
        return now

    def ping(self) -> str:
        return self.epoch

    def probe(self) -> tuple[str, bool]:
        """A breaker's probe: answers (epoch, True) as soon as the shard serves calls."""
        return self.epoch, True

    def report(self, report: object) -> tuple[str, ApplyOutcome]:
        """A node's signed report (directory/report.py), checked by the gate and applied by the shard."""
        return self.epoch, self.gate.submit(report, self._now())

    def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> tuple[str, LocateReply,
                                                                                  dict[str, NodeAddress]]:
        reply = self.shard.locate(hashes, time.monotonic(), exclude)
        return self.epoch, reply, {str(n): a for n, a in reply.addresses.items()}

    def nodes(self) -> tuple[str, list[NodeInfo]]:
        now = time.monotonic()
        self.shard.expire(now)
        return self.epoch, self.shard.nodes(now)

    def unbind(self, node_id: str, token: bytes | None) -> tuple[str, str | None]:
        """The operator clears which certificate `node_id` is bound to (directory/auth.py), dropping the
        id's record; the certificate name it was bound to. Raises TenantRefusedError unless `token`
        is an operator's."""
        self._now()   # a revocation of the operator's credential counts at once
        try:
            principal = TenantVerifier(self.trust).verify_principal(token, time.time()) if token else None
        except TenantError as e:
            raise TenantRefusedError(f"unbind: token refused: {e}") from None
        if principal is None or not principal.operator:
            raise TenantRefusedError("unbind is an operator call: connect with an operator credential "
                                     "(kvfabric certs issue-operator)")
        return self.epoch, self.gate.unbind(node_id)

    def stats(self) -> tuple[str, dict[str, Any]]:
        now = self._now()
        self.shard.expire(now)
        return self.epoch, dict(self.gate.stats(now))


def start_directory(config: ClusterConfig, cert_dir: str) -> list[ray.actor.ActorHandle]:
    """Create (or find) every shard actor; idempotent, so `kvfabric start` may run twice.

    New shards get `cert_dir`'s `ca.pem` and `crl.pem` (if any) as content: the directory checks node
    certificates, it never holds a key."""
    material: tuple[bytes, bytes | None] | None = None
    handles = []
    placement = {"resources": {config.directory_resource: 0.001}} if config.directory_resource else {}
    for k in range(config.directory_shards):
        try:
            handles.append(ray.get_actor(shard_actor_name(config, k), namespace=config.namespace))
            continue
        except ValueError:   # not created yet
            pass
        material = material or _trust_material(Path(cert_dir))
        handles.append(DirectoryActor.options(  # type: ignore[attr-defined]
            name=shard_actor_name(config, k), namespace=config.namespace, lifetime="detached",
            get_if_exists=True, **placement).remote(k, config.directory_shards, config.lease_s, *material, cert_dir))
    ray.get([h.ping.remote() for h in handles])
    return handles


def _trust_material(d: Path) -> tuple[bytes, bytes | None]:
    try:
        ca_pem = (d / CA_CERT).read_bytes()
    except OSError as e:
        raise CertificateError(f"the directory needs the cluster CA certificate {d / CA_CERT}: {e}") from None
    return ca_pem, (d / CRL).read_bytes() if (d / CRL).is_file() else None
