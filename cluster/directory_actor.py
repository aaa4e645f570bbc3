"""The directory as Ray actors: one named, detached `DirectoryActor` per shard, and the client side.

Each shard actor wraps one pure `DirectoryShard` behind a `DirectoryGate` (directory_auth.py: every
report must be signed by the node it names) and supplies `now` (its own monotonic clock). It is given
the cluster CA certificate and revocation list as content (never a key), and re-reads `crl.pem` from
the cert folder when its host has one and it changes, so a revocation reaches it without a restart.
Ray restarts a dead shard (`max_restarts=-1`); the restarted actor is empty and draws a new
**epoch**, which every answer carries. A node that sees a shard's epoch change resyncs everything
it holds for that shard, so the directory is rebuilt from the nodes, the source of truth.

    shard k  =  actor f"{directory_name}-{k}" in Ray namespace `[cluster] namespace`

`DirectoryClient` is what a NodeActor holds: it routes hashes to shards (`shard_of`), merges their
answers, and turns a dead, restarting or stalled shard into "no owners" (a hint that is missing is a
miss, never an error for the engine). A lookup waits at most `[cluster] directory_lookup_timeout_s`
for a shard; after a timeout that shard's `CircuitBreaker` opens and lookups answer local-only at
once, while one probe at a time checks whether the shard answers again.

The shards are placed by the Ray resource `[cluster] directory_resource`, the head node by default:
the directory's latency then does not depend on which worker node Ray happened to pick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from cryptography import x509

from cluster.breaker import BreakerState, CircuitBreaker
from cluster.directory import DirectoryShard
from cluster.directory_auth import DirectoryGate, Proof
from cluster.directory_types import ApplyOutcome, LocateReply, NodeAddress, NodeInfo, shard_of
from cluster.directory_upkeep import ShardUnavailable
from cluster.tenancy import TenantRefusedError
from fabric.config import ClusterConfig
from transports.core.certs import CA_CERT, CRL, CertificateError, revoked_serials
from transports.core.identity import TrustAnchor
from transports.core.revocation import RevocationFile
from transports.core.tenant_tokens import TenantError, TenantVerifier

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

    def heartbeat(self, node_id: str, incarnation: int, address: NodeAddress, acked_seq: int | None = None,
                  proof: object = None) -> tuple[str, ApplyOutcome]:
        return self.epoch, self.gate.heartbeat(node_id, incarnation, address, self._now(), proof,
                                               acked_seq=acked_seq)

    def apply(self, node_id: str, incarnation: int, seq: int, stored: Sequence[bytes], removed: Sequence[bytes],
              address: NodeAddress | None = None, proof: object = None, versions: Sequence[bytes] = ()
              ) -> tuple[str, ApplyOutcome]:
        return self.epoch, self.gate.apply(node_id, incarnation, seq, stored, removed, self._now(), address, proof,
                                           versions)

    def begin_resync(self, node_id: str, incarnation: int, address: NodeAddress,
                     proof: object = None) -> tuple[str, int]:
        return self.epoch, self.gate.begin_resync(node_id, incarnation, address, self._now(), proof)

    def resync_batch(self, node_id: str, incarnation: int, resync_id: int, hashes: Sequence[bytes],
                     proof: object = None, versions: Sequence[bytes] = ()) -> tuple[str, bool]:
        return self.epoch, self.gate.resync_batch(node_id, incarnation, resync_id, hashes, self._now(), proof,
                                                  versions)

    def end_resync(self, node_id: str, incarnation: int, resync_id: int, seq: int,
                   proof: object = None) -> tuple[str, bool]:
        return self.epoch, self.gate.end_resync(node_id, incarnation, resync_id, seq, self._now(), proof)

    def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> tuple[str, LocateReply,
                                                                                  dict[str, NodeAddress]]:
        reply = self.shard.locate(hashes, time.monotonic(), exclude)
        return self.epoch, reply, {str(n): a for n, a in reply.addresses.items()}

    def nodes(self) -> tuple[str, list[NodeInfo]]:
        now = time.monotonic()
        self.shard.expire(now)
        return self.epoch, self.shard.nodes(now)

    def unbind(self, node_id: str, token: bytes | None) -> tuple[str, str | None]:
        """The operator clears which certificate `node_id` is bound to (directory_auth.py), dropping the
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


@dataclass(frozen=True, slots=True)
class Located:
    """The merged answer of every shard for one run of hashes."""

    owners: tuple[tuple[str, ...], ...]
    addresses: dict[str, NodeAddress]
    versions: tuple[tuple[bytes, ...], ...] = ()   # per hash, each owner's block version (LocateReply)
    firsts: tuple[bytes, ...] = ()                 # per hash, the first-reported version still held


class DirectoryClient:
    """A node's view of the sharded directory: routing, merging, and epoch tracking."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.num_shards = config.directory_shards
        self.call_timeout_s = config.directory_call_timeout_s
        self.lookup_timeout_s = config.directory_lookup_timeout_s
        self._handles: dict[int, ray.actor.ActorHandle] = {}
        self.epochs: dict[int, str] = {}
        self.breakers = [CircuitBreaker(config.directory_probe_s) for _ in range(self.num_shards)]
        self.num_skipped = 0     # lookups of a shard answered local-only because its breaker was open
        self._probes: set[asyncio.Task[None]] = set()

    def handle(self, shard: int) -> ray.actor.ActorHandle:
        h = self._handles.get(shard)
        if h is None:
            h = ray.get_actor(shard_actor_name(self.config, shard), namespace=self.config.namespace)
            self._handles[shard] = h
        return h

    def split(self, hashes: Sequence[bytes]) -> dict[int, list[int]]:
        """Positions of `hashes` per shard."""
        out: dict[int, list[int]] = {}
        for i, h in enumerate(hashes):
            out.setdefault(shard_of(h, self.num_shards), []).append(i)
        return out

    async def _invoke(self, shard: int, what: str, remote: Callable[[Any], Any], timeout_s: float | None = None
                      ) -> Any:
        breaker = self.breakers[shard]
        try:
            handle = self.handle(shard)
        except ValueError:  # get_actor: the shard has not been created (yet)
            breaker.failure(time.monotonic())
            raise ray.exceptions.RayActorError() from None
        try:
            epoch, *answer = await asyncio.wait_for(remote(handle), timeout_s or self.call_timeout_s)
        except SHARD_DOWN:
            self._handles.pop(shard, None)
            if breaker.state is BreakerState.CLOSED:
                logger.warning("directory shard %d did not answer %s in time: lookups answer local-only "
                               "until it does", shard, what)
            breaker.failure(time.monotonic())
            raise
        if breaker.state is not BreakerState.CLOSED:
            logger.info("directory shard %d answers again", shard)
        breaker.success()
        self.epochs[shard] = epoch
        return answer[0] if len(answer) == 1 else tuple(answer)

    async def _report(self, shard: int, what: str, remote: Callable[[Any], Any]) -> Any:
        try:
            return await self._invoke(shard, what, remote)
        except SHARD_DOWN as e:
            raise ShardUnavailable(f"directory shard {shard} did not answer {what}: {type(e).__name__}") from None

    # ---- the calls a node's DirectoryUpkeep makes (DirectoryApi), one typed method each ----------------

    def epoch(self, shard: int) -> str | None:
        return self.epochs.get(shard)

    async def heartbeat(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                        acked_seq: int | None, proof: Proof) -> ApplyOutcome:
        outcome: ApplyOutcome = await self._report(shard, "heartbeat", lambda h: h.heartbeat.remote(
            node_id, incarnation, address, acked_seq, proof))
        return outcome

    async def apply(self, shard: int, node_id: str, incarnation: int, seq: int, stored: Sequence[bytes],
                    removed: Sequence[bytes], address: NodeAddress, proof: Proof,
                    versions: Sequence[bytes] = ()) -> ApplyOutcome:
        outcome: ApplyOutcome = await self._report(shard, "apply", lambda h: h.apply.remote(
            node_id, incarnation, seq, stored, removed, address, proof, versions))
        return outcome

    async def begin_resync(self, shard: int, node_id: str, incarnation: int, address: NodeAddress,
                           proof: Proof) -> int:
        rid: int = await self._report(shard, "begin_resync", lambda h: h.begin_resync.remote(
            node_id, incarnation, address, proof))
        return rid

    async def resync_batch(self, shard: int, node_id: str, incarnation: int, resync_id: int,
                           hashes: Sequence[bytes], proof: Proof, versions: Sequence[bytes] = ()) -> bool:
        ok: bool = await self._report(shard, "resync_batch", lambda h: h.resync_batch.remote(
            node_id, incarnation, resync_id, hashes, proof, versions))
        return ok

    async def end_resync(self, shard: int, node_id: str, incarnation: int, resync_id: int, seq: int,
                         proof: Proof) -> bool:
        ok: bool = await self._report(shard, "end_resync", lambda h: h.end_resync.remote(
            node_id, incarnation, resync_id, seq, proof))
        return ok

    def _probe_if_due(self, shard: int) -> None:
        """Send the one probe of an open breaker, off the request path."""
        if not self.breakers[shard].take_probe(time.monotonic()):
            return

        async def probe() -> None:
            # On failure call() re-opens the breaker; the next lookup after probe_s probes again.
            with contextlib.suppress(*SHARD_DOWN):
                await self._invoke(shard, "probe", lambda h: h.probe.remote())

        task = asyncio.get_running_loop().create_task(probe())
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> Located:
        """Live owners per hash; a shard that does not answer contributes no owners."""
        owners: list[tuple[str, ...]] = [()] * len(hashes)
        versions: list[tuple[bytes, ...]] = [()] * len(hashes)
        firsts: list[bytes] = [b""] * len(hashes)
        addresses: dict[str, NodeAddress] = {}
        parts = self.split(hashes)

        async def one(shard: int, positions: list[int]) -> None:
            if not self.breakers[shard].allow():
                self.num_skipped += 1
                self._probe_if_due(shard)
                return
            try:
                asked = [hashes[i] for i in positions]
                reply, addrs = await self._invoke(shard, "locate", lambda h: h.locate.remote(asked, list(exclude)),
                                                  self.lookup_timeout_s)
            except SHARD_DOWN as e:
                logger.info("directory shard %d did not answer a lookup (%s): treating as no owners",
                            shard, type(e).__name__)
                return
            for i, per_hash in zip(positions, reply.owners, strict=True):
                owners[i] = tuple(per_hash)
            for i, per_owner, first in zip(positions, reply.versions, reply.firsts, strict=False):
                versions[i], firsts[i] = per_owner, first
            addresses.update(addrs)

        await asyncio.gather(*(one(s, pos) for s, pos in parts.items()))
        known = any(firsts)
        return Located(tuple(owners), addresses, tuple(versions) if known else (), tuple(firsts) if known else ())

    def breaker_stats(self) -> dict[str, Any]:
        return {"breaker_states": [b.state.name.lower() for b in self.breakers],
                "breaker_opened": sum(b.num_opened for b in self.breakers),
                "lookups_answered_local_only": self.num_skipped}

    async def unbind(self, node_id: str, token: bytes | None) -> dict[int, str | None]:
        """The operator's call on every shard: per shard, the certificate name `node_id` was bound to.
        Raises TenantRefusedError without an operator's `token`; a shard that does not answer raises too."""
        out: dict[int, str | None] = {}
        for k in range(self.num_shards):
            out[k] = await self._invoke(k, "unbind", lambda h: h.unbind.remote(node_id, token))
        return out

    async def stats(self) -> list[dict[str, Any]]:
        out = []
        for k in range(self.num_shards):
            try:
                out.append(await self._invoke(k, "stats", lambda h: h.stats.remote()))
            except SHARD_DOWN as e:
                out.append({"shard": k, "error": type(e).__name__})
        return out
