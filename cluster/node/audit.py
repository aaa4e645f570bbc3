"""A node's side of catching a lying producer: sampling, comparing, quarantining, releasing.

    NodeLoader.load (an engine that audits) ──sample(ns, producers)──► reply.audit_blocks: nothing is
        pulled, the engine computes those blocks itself
    engine ──Fabric.audit(ns, tokens, its KV)──► NodeAuditor.audit
        ──► the producers' signed payloads (own tiers, else pulled and verified as any pull)
        ──► fabric/audit.py compare_block, per block another producer signed
        ──► mismatch: signed quarantine entry (cluster/node/quarantine.py) ──► every NodeActor
    every node on an entry: verify the checker's signature, persist, purge the producer's blocks,
    refuse its records from then on (pulls: `quarantined` provenance rejections; local reads delete)

The sampling decision and its weighting are fabric/audit.py's; which tenant's rate applies is the
namespace's tenant (the first by name where a namespace is shared; "" for the anonymous tenant).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import ray

from cluster.api import AuditReport
from cluster.errors import ClusterError
from cluster.node.local import LocalFabric
from cluster.node.metrics import ClusterMetrics
from cluster.node.quarantine import QUARANTINED, QuarantineBook, entry_problem, released_entry, signed_entry
from cluster.node.reads import NodeLoader
from fabric.audit import AuditSampler, Outcome, compare_block, is_bitwise
from fabric.config import Config
from fabric.keys import BlockAddress, BlockHash, Namespace
from fabric.provenance import VERSION_TAG_SIZE, Provenance, version_producer
from fabric.store import Store
from transports.trust.identity import NodeSigner, TrustAnchor

logger = logging.getLogger(__name__)

PEER_CALL_TIMEOUT_S = 10.0
TICKET_TTL_S = 600.0      # an engine has this long to hand in the KV of a sampled load
MAX_TICKETS = 4096


class AuditRefusedError(ClusterError, ValueError):
    """An audit of blocks this node did not sample: nobody picks which producer to accuse."""


class NodeAuditor:
    """Sampled recompute and quarantine for one node (the NodeActor builds it once started)."""

    def __init__(self, config: Config, *, node_id: str, node_name: str, ray_namespace: str, signer: NodeSigner,
                 trust: Callable[[], TrustAnchor], loader: NodeLoader, local: LocalFabric, store: Store,
                 metrics: ClusterMetrics, book_path: str,
                 spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.config = config.audit
        self.node_id = node_id
        self.node_name = node_name
        self.ray_namespace = ray_namespace
        self.signer = signer
        self.trust = trust
        self.loader = loader
        self.local = local
        self.store = store
        self.metrics = metrics
        self.spawn = spawn
        seed = self.config.seed or int.from_bytes(os.urandom(8), "little")
        self.sampler = AuditSampler(self.config, random.Random(seed))
        self.book = QuarantineBook(book_path)
        self._outvoted: dict[str, set[bytes]] = {}   # producer -> blocks where others outvoted it
        # (namespace root, last block hash) of each sampled load -> until when its audit is taken
        self._tickets: dict[tuple[bytes, bytes], float] = {}
        loader.sampler = self
        self._apply()

    def set_rate(self, rate: float) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"an audit rate is a probability in [0, 1], got {rate}")
        self.config = self.sampler.config = dataclasses.replace(self.config, rate=rate)
        logger.info("audit rate set to %g", rate)

    # ---- what NodeLoader asks (its `Sampler`) ------------------------------------------------------

    def sample(self, ns: Namespace, producers: Collection[str], hashes: Sequence[BlockHash]) -> bool:
        """Draw for a load of `hashes`; a sampled one leaves a ticket its engine's audit hands in."""
        # Owners that report no version name no producer: drawn at the base rate ("" is nobody's name).
        others = [p for p in producers if p != self.node_name] if producers else [""]
        tenants = self.loader.tenants_of(ns)
        now = time.time()
        if not hashes or not self.sampler.sample(others, min(tenants) if tenants else "", now):
            return False
        if len(self._tickets) >= MAX_TICKETS:
            self._tickets = {k: t for k, t in self._tickets.items() if t > now}
            while len(self._tickets) >= MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]
        self._tickets[(ns.root, bytes(hashes[-1]))] = now + TICKET_TTL_S
        return True

    def disputed(self, producers: Collection[str]) -> None:
        now = time.time()
        for producer in producers:
            self.sampler.disputed(producer, now)

    def outvoted(self, ns: Namespace, block_hash: BlockHash, winner: bytes, loser: bytes) -> None:
        """Two or more independent producers hold another version than `loser`'s producer at this
        address. Where the namespace's engines are deterministic (compared bitwise) that is evidence:
        past `[audit] outvoted_blocks` distinct blocks the loser is quarantined. Elsewhere honest
        producers differ in their low bits, and only a recompute (sampled, boosted) decides."""
        producer = version_producer(loser)
        if not self.config.outvoted_blocks or not is_bitwise(self.config, ns.model_id) or \
                producer == self.node_name or producer in self.book.quarantined():
            return
        blocks = self._outvoted.setdefault(producer, set())
        blocks.add(bytes(block_hash))
        if len(blocks) < self.config.outvoted_blocks:
            return
        del self._outvoted[producer]
        evidence = {"namespace": ns.root.hex(), "block": bytes(block_hash).hex(), "layer": -1,
                    "engine_digest": winner[:VERSION_TAG_SIZE].hex(), "signed_digest": loser[:VERSION_TAG_SIZE].hex(),
                    "worst": -1.0, "checker": self.node_name,
                    "outvoted_by": version_producer(winner), "outvoted_blocks": len(blocks)}
        entry = signed_entry(self.signer, producer, time.time(), evidence)
        self.spawn(self._quarantine(entry))

    async def _quarantine(self, entry: dict[str, Any]) -> None:
        await self.learn([entry])
        await self._broadcast(entry)

    # ---- the audit ---------------------------------------------------------------------------------

    async def audit(self, ns: Namespace, hashes: list[BlockHash], payloads: np.ndarray) -> AuditReport:
        """Compare `payloads` (the engine's KV of `hashes`) with what their producers signed. Only
        for a load this node sampled (its ticket: the chain's last hash), so an engine cannot choose
        which producer's blocks to accuse; raises AuditRefusedError otherwise."""
        expiry = self._tickets.pop((ns.root, bytes(hashes[-1])), None) if hashes else None
        if expiry is None or expiry < time.time():
            raise AuditRefusedError(f"no load of these {len(hashes)} blocks was sampled for audit here (or its "
                                    f"ticket is over {TICKET_TTL_S:g} s old): compare only what the node asked for")
        records: list[Provenance | None] = []
        signed = await self.loader.load(ns, hashes, True, deadline_s=float("inf"), mirror=False,
                                         records=records)
        loop = asyncio.get_running_loop()
        records = [r if r is not None else await loop.run_in_executor(None, self._local_record, h)
                   for h, r in zip(hashes, records, strict=False)]
        bitwise = is_bitwise(self.config, ns.model_id)
        checked = mismatched = 0
        producers: set[str] = set()
        caught: dict[str, dict[str, Any]] = {}
        now = time.time()
        for b, record in enumerate(records):
            if record is None or record.producer == self.node_name or record.producer in self.book.quarantined():
                continue
            verdict = compare_block(ns.layout, np.ascontiguousarray(payloads[b]), signed.payloads[b],
                                    bitwise=bitwise, atol=self.config.atol, rtol=self.config.rtol)
            checked += 1
            producers.add(record.producer)
            self.metrics.audits.labels(verdict.outcome.value).inc()
            if verdict.outcome is Outcome.MISMATCH:
                mismatched += 1
                caught.setdefault(record.producer, {
                    "namespace": ns.root.hex(), "block": bytes(hashes[b]).hex(), "layer": verdict.layer,
                    "engine_digest": verdict.engine_digest.hex(), "signed_digest": verdict.signed_digest.hex(),
                    "worst": verdict.worst if verdict.worst != float("inf") else -1.0, "checker": self.node_name})
        for producer in producers:
            self.sampler.checked(producer, now)
        for producer, evidence in caught.items():
            entry = signed_entry(self.signer, producer, now, evidence)
            await self.learn([entry])
            self.spawn(self._broadcast(entry))
        return AuditReport(checked, mismatched, tuple(sorted(producers)), tuple(sorted(caught)))

    def _local_record(self, block_hash: BlockHash) -> Provenance | None:
        block = self.store.get_block(BlockAddress(block_hash, 0), promote=False)
        return None if block is None else block.provenance

    # ---- quarantine --------------------------------------------------------------------------------

    async def learn(self, entries: Iterable[Mapping[str, Any]], *, releases: bool = True) -> list[dict[str, Any]]:
        """Merge believed entries (see cluster/node/quarantine.py); purge what became quarantined.
        `releases=False`: only signed quarantines are taken (a notice pushed by any caller)."""
        trust = self.trust()
        believed = []
        for entry in entries:
            problem = entry_problem(entry, trust)
            if problem is None and not releases and entry.get("state") != QUARANTINED:
                problem = "a release comes only from the operator or a peer's list"
            if problem is None:
                believed.append(entry)
            else:
                logger.warning("quarantine entry for %s not believed: %s", entry.get("producer"), problem)
        kept = self.book.merge(believed)
        self._apply()
        for entry in kept:
            producer = entry["producer"]
            if entry["state"] != QUARANTINED:
                logger.warning("producer %s released from quarantine", producer)
                continue
            ev = entry["evidence"]
            self.metrics.quarantines.labels(producer, ev["checker"]).inc()
            logger.warning("producer %s QUARANTINED: %s recomputed block %s layer %s of namespace %s: engine digest "
                           "%s, producer's signed digest %s (%.3g x the tolerance; -1: bitwise)", producer,
                           ev["checker"], ev["block"], ev["layer"], ev["namespace"][:16], ev["engine_digest"],
                           ev["signed_digest"], ev["worst"])
            removed = await asyncio.get_running_loop().run_in_executor(None, self.store.purge_producer, producer)
            self.metrics.purged.inc(removed)
            logger.warning("purged %d payloads produced by quarantined %s", removed, producer)
        return kept

    async def release(self, producer: str) -> bool:
        """The operator's release, here (the caller calls every node)."""
        was = producer in self.book.quarantined()
        self.book.merge([released_entry(producer, time.time())])
        self._apply()
        if was:
            logger.warning("producer %s released from quarantine by the operator", producer)
        return was

    def entries(self) -> list[dict[str, Any]]:
        return list(self.book.entries.values())

    def _apply(self) -> None:
        quarantined = self.book.quarantined()
        self.loader.quarantined = quarantined
        self.local.quarantined = quarantined
        self.metrics.quarantined.set(len(quarantined))

    # ---- peers -------------------------------------------------------------------------------------

    async def _peers(self) -> list[Any]:
        from cluster.node.actor import node_actor_name

        def find() -> list[Any]:
            if not ray.is_initialized():   # a node outside Ray (tests of the read path): no peers to tell
                return []
            actors = []
            for node in ray.nodes():
                if not node.get("Alive") or node["NodeID"] == self.node_id:
                    continue
                try:
                    actors.append(ray.get_actor(node_actor_name(node["NodeID"]), namespace=self.ray_namespace))
                except ValueError:
                    continue
            return actors
        return await asyncio.get_running_loop().run_in_executor(None, find)

    async def _broadcast(self, entry: Mapping[str, Any]) -> None:
        async def tell(actor: Any) -> None:
            try:
                await asyncio.wait_for(actor.quarantine_notice.remote(dict(entry)), PEER_CALL_TIMEOUT_S)
            except (TimeoutError, ray.exceptions.RayError) as e:
                logger.warning("a peer did not take the quarantine of %s (%s); it merges it when it restarts",
                               entry["producer"], type(e).__name__)
        await asyncio.gather(*(tell(a) for a in await self._peers()))

    async def catch_up(self) -> None:
        """Merge every peer's entries (a restarted node learns what it slept through)."""
        async def ask(actor: Any) -> list[dict[str, Any]]:
            try:
                got: list[dict[str, Any]] = await asyncio.wait_for(actor.quarantine_entries.remote(),
                                                                   PEER_CALL_TIMEOUT_S)
                return got
            except (TimeoutError, ray.exceptions.RayError):
                return []
        answers = await asyncio.gather(*(ask(a) for a in await self._peers()))
        await self.learn([e for answer in answers for e in answer])
