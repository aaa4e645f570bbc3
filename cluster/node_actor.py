"""NodeActor: one per Ray node. Owns the node's Store and transport server, keeps the directory told.

    engine ──FabricClient──► NodeActor.load ──► LocalFabric (RAM / SSD, digest-checked)
                                       └──────► DirectoryClient.locate ──► plan_pulls ──► pull_prefix
                                                                        (TLS-TCP / QUIC, verified)
    Store events ──► DirectoryUpkeep (ordered, bounded, signed) ──► DirectoryActor.apply / resync
                 └─► KvEventPublisher (when [events] enabled) ──► ZMQ PUB, vLLM's KV event format

Provenance (docs/provenance.md): `store` signs what it stores as one run (a record per block, one
signature) with this node's certificate key (`NodeSigner`); a pull accepts only payloads whose
producer's record verifies against the cluster CA and its revocation list (`TrustAnchor`, reread
when crl.pem changes); a mirror keeps the producer's records; `purge_producer` deletes what a
producer's records name.

It is an async Ray actor: every method runs on one event loop, Store calls that touch files run on
a thread pool. It starts itself on its first call (the supervisor pings it right after creation
and again after Ray restarts it), so a restarted actor reopens its folders under a new incarnation.
Payloads leave and enter as numpy arrays inside the reply / argument, so Ray moves them through
the object store and the engine reads them without a copy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import ray
from prometheus_client import CollectorRegistry, start_http_server

from cluster.api import (
    BlockLocation,
    EngineLoad,
    IncompleteLoadError,
    LoadReply,
    LookupReply,
    StoreReply,
    Tokens,
    Where,
    check_block_payloads,
    check_payloads,
    payload_shape,
)
from cluster.breaker import CircuitBreaker
from cluster.directory import NodeAddress
from cluster.directory_actor import DirectoryClient
from cluster.directory_auth import ReportSigner
from cluster.directory_upkeep import DirectoryUpkeep
from cluster.estimates import PeerEstimates, RunCost, plan_by_deadline
from cluster.kv_events_zmq import KvEventPublisher
from cluster.local import WHERE_OF_TIER, LocalFabric
from cluster.metrics import ClusterMetrics
from cluster.node_load import LayerProgress, PullOutcome, pull_prefix
from cluster.planner import PullRun, plan_pulls
from cluster.reply_buffers import ReplyBuffers
from fabric.block_ids import BlockId, block_id_hashes
from fabric.config import Config
from fabric.events import EventKind
from fabric.keys import BlockHash, Namespace, block_hashes
from fabric.priority import lower_thread_priority
from fabric.provenance import Provenance, Rejection
from fabric.store import Store
from fabric.tiers.base import Tier
from transports.base import Peer
from transports.buffers import tune_allocator
from transports.certs import CA_CERT, CRL, CertificateError
from transports.codec import MissReason
from transports.factory import create_client, create_server
from transports.identity import NodeSigner, TrustAnchor
from transports.metrics import TransportMetrics
from transports.provenance_check import ProvenanceVerifier
from transports.serving import EgressPacer

logger = logging.getLogger(__name__)

GC_THRESHOLD = 50_000   # young-generation allocations between cycle-collector passes (CPython: 700)

def _breaker_value(breaker: CircuitBreaker) -> float:
    return float(breaker.state.value)


def node_actor_name(node_id: str) -> str:
    return f"kvfabric-node-{node_id}"


NODE_NAME_ENV = "KVFABRIC_NODE_NAME"
# The host a node advertises when it listens on every interface: a DNS name its certificate names
# (the chart sets the pod's), else the Ray node's IP address (which the certificate must then name).
ADVERTISE_HOST_ENV = "KVFABRIC_ADVERTISE_HOST"


def node_name_for(node_id: str) -> str:
    """The certificate / transport name and folder of a Ray node: `$KVFABRIC_NODE_NAME` when the
    node's environment sets it (e.g. the Kubernetes node name, so a restarted pod finds its SSD
    blocks again under a new Ray node id), else derived from the Ray node id (stable across restarts
    of the actor on that node)."""
    return os.environ.get(NODE_NAME_ENV) or f"node-{node_id[:16]}"


# Every method may run twice: reads are reads, and a store of the same tokens writes the same
# content-addressed blocks. So a call caught by a restart is made again on the restarted actor
# instead of failing with ActorUnavailableError.
NODE_ACTOR_CALL_RETRIES = 3


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=NODE_ACTOR_CALL_RETRIES)
class NodeActor:
    def __init__(self, config: Config, node_id: str) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.config = config
        self.node_id = node_id
        self.node_name = node_name_for(node_id)
        self.incarnation = time.time_ns()
        self._start_lock = asyncio.Lock()
        self._started = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replies = ReplyBuffers(int(config.kv.reply_pool_gib * (1 << 30)))

    # ---- life cycle --------------------------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        await self._ensure_started()
        return {"node_id": self.node_id, "incarnation": self.incarnation, "address": self.address}

    async def _ensure_started(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if not self._started:
                await self._start()
                self._started = True

    async def _start(self) -> None:
        cfg = self.config
        kv = dataclasses.replace(cfg.kv, ssd_dir=str(Path(cfg.kv.ssd_dir) / self.node_name),
                                 index_dir=str(Path(cfg.kv.index_dir) / self.node_name))
        transport = dataclasses.replace(cfg.transport, node_name=self.node_name)
        cert_dir = Path(transport.cert_dir)
        # The operator issues node certificates before nodes start; no node holds the CA key.
        missing = [p for p in (cert_dir / f"{self.node_name}.pem", cert_dir / f"{self.node_name}.key",
                               cert_dir / CA_CERT) if not p.is_file()]
        if missing:
            message = (f"node {self.node_name} has no certificate: {missing[0]} is missing; issue it on the CA "
                       f"machine with `kvfabric certs issue --dir <ca folder> --node {self.node_name} --san <node IP>` "
                       f"and copy {self.node_name}.pem, {self.node_name}.key and {CA_CERT} to {cert_dir}")
            logger.error("%s", message)
            raise CertificateError(message)
        self.signer = NodeSigner(cert_dir / f"{self.node_name}.pem", cert_dir / f"{self.node_name}.key")
        self.trust = TrustAnchor.from_files(cert_dir / CA_CERT)
        self.reports = ReportSigner(self.signer, self.node_id, self.incarnation)
        self.verifier = ProvenanceVerifier(self.trust)
        self._crl_path = cert_dir / CRL
        self._crl_mtime = self._crl_path.stat().st_mtime_ns if self._crl_path.exists() else 0
        # This Ray worker process runs only this actor: keep freed payload buffers in the heap, or
        # every pull page-faults them back in, tens of MB per long prefix (buffers.tune_allocator).
        tune_allocator()
        # Likewise for the cycle collector: a 4k-token pull makes ~100k short-lived objects (results,
        # views, addresses), and at the default threshold (700) its young-generation passes kept
        # re-scanning the load's live plan, a visible share of the puller's CPU in perf. Cycles are rare here
        # (reference counting frees the rest), so collect less often, and never re-scan start-up state.
        gc.freeze()
        gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
        self.registry = CollectorRegistry()
        self.metrics = ClusterMetrics(self.registry)
        self.kv_store = Store.open(kv, registry=self.registry)
        self.local = LocalFabric(self.kv_store, self.node_id)
        # Mirroring pulled blocks is background work: one thread, at the store's lower priority.
        self._mirror_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-mirror",
                                               initializer=lower_thread_priority, initargs=(kv.background_nice,))
        tmetrics = TransportMetrics(self.registry)
        self.server = create_server(transport, self.kv_store, metrics=tmetrics)
        host, port = await self.server.start()
        if host in ("0.0.0.0", "::"):
            host = os.environ.get(ADVERTISE_HOST_ENV) or ray.util.get_node_ip_address()
        self.client = create_client(transport, metrics=tmetrics)
        self.address = NodeAddress(host, port, transport.kind, self.node_name)
        bind = "127.0.0.1" if transport.host.startswith("127.") else "0.0.0.0"
        self.http, _ = start_http_server(cfg.cluster.metrics_port, addr=bind, registry=self.registry)
        self.metrics_port = int(self.http.server_port)
        c = cfg.cluster
        self.directory = DirectoryClient(c)
        for k, breaker in enumerate(self.directory.breakers):
            self.metrics.breaker_state.labels(str(k)).set_function(partial(_breaker_value, breaker))
        self.upkeep = DirectoryUpkeep(self.directory, c, node_id=self.node_id, incarnation=self.incarnation,
                                      address=self.address, reports=self.reports, held=self._held_hashes,
                                      metrics=self.metrics, clock=time.monotonic)
        self._pending_mirrors = 0
        self.peer_estimates = PeerEstimates()
        self.kv_events: KvEventPublisher | None = None
        if cfg.events.enabled:
            self.kv_events = KvEventPublisher(cfg.events, self.node_name, block_size=kv.block_size)
            self.kv_events.start(self.kv_store.held_addresses())
        self._spawn(self._sync_loop())
        logger.info("node %s (incarnation %d) serving %s on %s:%d, metrics on :%d, %d blocks held",
                    self.node_id, self.incarnation, transport.kind, host, port, self.metrics_port,
                    len(self.kv_store.held_addresses()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        """Stop serving and close the store (the actor is then killed by the caller)."""
        if not self._started:
            return
        for task in list(self._tasks):
            task.cancel()
        await self.client.close()
        await self.server.close()
        self.http.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._mirror_pool.shutdown)   # a mirror in progress ends first
        await loop.run_in_executor(None, self.kv_store.close)
        self._started = False

    # ---- directory upkeep --------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        c = self.config.cluster
        tick = min(c.flush_ms / 1000, c.heartbeat_s / 4)
        while True:
            try:
                events = self.kv_store.take_events()
                self.upkeep.record([(a.hash, kind is EventKind.STORED) for kind, a in events.events],
                                   events.overflowed)
                if self.kv_events is not None:
                    self.kv_events.drain(events, self.kv_store.held_addresses)
                if await self.upkeep.tick():
                    self._reload_revocations()
            except Exception:
                # This loop is the node's liveness: a bug in one pass must not silence its heartbeats.
                logger.exception("directory sync pass failed; resyncing every shard")
                self.upkeep.reset()
            await asyncio.sleep(tick)

    async def _held_hashes(self) -> set[bytes]:
        held = await asyncio.get_running_loop().run_in_executor(None, self.kv_store.held_addresses)
        return {a.hash for a in held}

    def _reload_revocations(self) -> None:
        """Pick up a new revocation list (crl.pem beside ca.pem) without a restart."""
        mtime = self._crl_path.stat().st_mtime_ns if self._crl_path.exists() else 0
        if mtime == self._crl_mtime:
            return
        self._crl_mtime = mtime
        try:
            self.trust = TrustAnchor.from_files(self._crl_path.with_name(CA_CERT))
        except CertificateError as e:   # keep the list we have: an unreadable one revokes nothing new
            logger.error("new revocation list not used: %s", e)
            return
        self.verifier.trust = self.trust
        logger.info("revocation list reloaded: %d certificates revoked", len(self.trust.revoked))

    # ---- the Fabric API ----------------------------------------------------------------------------

    async def _plan(self, ns: Namespace, hashes: list[BlockHash], *, pulls: bool = True, peek: bool = False
                    ) -> tuple[list[BlockHash], list[Tier], list[Sequence[str]], list[PullRun], dict[str, Peer]]:
        loop = asyncio.get_running_loop()
        tiers = await loop.run_in_executor(None, partial(self.local.local_tiers, hashes, ns.layout.num_layers,
                                                         peek=peek))
        if not pulls or len(tiers) == len(hashes):
            return hashes, tiers, [], [], {}
        located = await self.directory.locate(hashes[len(tiers):], exclude=[self.node_id])
        owners: list[Sequence[str]] = [()] * len(tiers) + [list(o) for o in located.owners]
        peers = {n: Peer(a.name or f"node-{n[:16]}", a.host, a.port) for n, a in located.addresses.items()
                 if a.transport == self.address.transport}
        owners = [[o for o in per_block if o in peers] for per_block in owners]
        return hashes, tiers, owners, plan_pulls(owners, len(tiers), hashes=hashes), peers

    async def lookup(self, ns: Namespace, tokens: Tokens) -> LookupReply:
        await self._ensure_started()
        return await self._lookup(ns, block_hashes(ns, tokens))

    async def _lookup(self, ns: Namespace, hashes: list[BlockHash]) -> LookupReply:
        start = time.perf_counter()
        # A lookup is a peek: routers ask every node, and asking must not reorder eviction on the nodes
        # that do not serve the request. The load that follows is the access.
        _, tiers, _, runs, _ = await self._plan(ns, hashes, peek=True)
        locs = [BlockLocation(WHERE_OF_TIER[t], self.node_id) for t in tiers]
        for run in runs:
            locs += [BlockLocation(Where.PEER, run.node_id)] * (run.end - run.start)
        self.metrics.lookups.inc()
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        return LookupReply(ns.block_size, tuple(locs), self.local.engine_load)

    async def _read_local(self, hashes: Sequence[BlockHash], out: np.ndarray, sources: list[str]) -> int:
        def read() -> int:
            for i, h in enumerate(hashes):
                tier = self.local.read_block(h, out[i])
                if tier is None:
                    return i
                sources[i] = tier.value
            return len(hashes)
        return await asyncio.get_running_loop().run_in_executor(None, read)

    async def _load(self, ns: Namespace, hashes: list[BlockHash], pulls: bool,
                    started: asyncio.Future[tuple[int, LayerProgress, np.ndarray, list[str]]] | None = None,
                    tokens: Tokens | None = None, deadline_s: float | None = None) -> LoadReply:
        t0 = time.perf_counter()
        hashes, tiers, owners, runs, peers = await self._plan(ns, hashes, pulls=pulls)
        deadline = None
        if runs:   # pull only the runs expected to land before the engine could compute them
            take, deadline = plan_by_deadline(
                [RunCost(r.node_id, r.num_blocks, r.num_blocks * ns.layout.bytes_per_block(ns.block_size),
                         r.num_blocks * ns.block_size) for r in runs],
                self.peer_estimates, self.local.prefill.of(ns.root), time.monotonic(), deadline_s)
            self.metrics.skipped_blocks.inc(sum(r.num_blocks for r in runs[take:]))
            runs = runs[:take]
        planned = len(tiers) + sum(r.end - r.start for r in runs)
        out = self._replies.take(payload_shape(ns, planned))
        sources = [""] * planned
        num_local = await self._read_local(hashes[:len(tiers)], out, sources)
        if num_local < len(tiers):
            runs, planned = [], num_local   # a local block failed its check: stop there
        progress = LayerProgress(planned, ns.layout.num_layers)
        for b in range(min(num_local, planned)):
            for layer in range(ns.layout.num_layers):
                progress.fill(b, layer)
        for run in runs:   # the plan; a fallback may replace the node
            sources[run.start:run.end] = [f"peer:{run.node_id}"] * (run.end - run.start)
        if started is not None:
            started.set_result((planned, progress, out, sources))
        digests = [[b""] * ns.layout.num_layers for _ in range(planned)]
        provenance: list[Provenance | None] = [None] * planned
        outcome = PullOutcome() if runs else None
        if outcome is not None:
            pull = pull_prefix(self.client, peers, hashes, owners, num_local, out, digests, progress, sources,
                               verifier=self.verifier, namespace=ns.root, provenance=provenance,
                               timeout_s=self.config.cluster.pull_timeout_s, layer_major=started is not None,
                               outcome=outcome)
            # A layer stream has promised its blocks: it is planned by the same rule but never cut.
            if deadline is None or started is not None:
                await pull
            else:
                try:
                    await asyncio.wait_for(pull, deadline)
                except TimeoutError:
                    self.metrics.deadline_cuts.inc()
                    logger.info("load cut at its %.3f s deadline after %d of %d blocks", deadline,
                                progress.complete_blocks(), planned)
            self._learn(outcome)
        complete = progress.complete_blocks()
        if outcome is not None:
            self.metrics.said_yes_owner_no.inc(outcome.said_yes_owner_no)
            self.metrics.pull_failures.inc(outcome.num_failures)
            self.metrics.fallbacks.inc(outcome.num_fallbacks)
            for reason, count in outcome.rejections.items():
                self.metrics.provenance_rejections.labels(reason.value).inc(count)
            if self.config.kv.mirror_pulls and complete > num_local:
                self._pending_mirrors += 1
                self._note_chain(ns, hashes, num_local, complete, tokens)
                self._spawn(self._mirror(ns, hashes[num_local:complete], out[num_local:complete],
                                         digests[num_local:complete], provenance[num_local:complete]))
        self.metrics.lookups.inc()
        self.metrics.requested_blocks.inc(len(hashes))
        self.metrics.hit_blocks.labels("local").inc(min(num_local, complete))
        self.metrics.hit_blocks.labels("peer").inc(max(0, complete - num_local))
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        payloads = out[:complete]
        pulled = max(0, complete - num_local) * ns.layout.bytes_per_block(ns.block_size)
        return LoadReply(ns.block_size, payloads, tuple(sources[:complete]), pulled_bytes=pulled)

    def _learn(self, outcome: PullOutcome) -> None:
        """Feed each peer's estimate with this load's attempts on it."""
        now = time.monotonic()
        for sample in outcome.samples:
            if sample.failed or (sample.cut and not sample.num_bytes):
                self.peer_estimates.record_failure(sample.node_id, now)
            else:
                self.peer_estimates.record_pull(sample.node_id, sample.num_bytes, sample.seconds, sample.first_s,
                                                now, cut=sample.cut)
        for peer, est in self.peer_estimates.snapshot(now).items():
            self.metrics.peer_bandwidth.labels(peer).set(est["bandwidth_mb_s"] * 1e6)
            self.metrics.peer_rtt.labels(peer).set(est["rtt_ms"] / 1e3)

    async def set_send_rate(self, mb_s: float) -> None:
        """Cap (or, with 0, uncap) what this node's TLS-TCP server sends, MB/s, at run time: an
        operator's throttle, e.g. while the node's NIC serves inference traffic."""
        await self._ensure_started()
        if mb_s < 0:
            raise ValueError(f"send rate must be >= 0 MB/s, got {mb_s}")
        if not hasattr(self.server, "pacer"):
            raise ValueError(f"the {self.address.transport} server has no send-rate cap (TLS-TCP has)")
        self.server.pacer = EgressPacer(mb_s * 1e6) if mb_s > 0 else None
        logger.info("send rate %s", f"capped at {mb_s:g} MB/s" if mb_s > 0 else "uncapped")

    async def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        """An engine on this node computed `num_tokens` of prefill in `seconds` (see `Fabric`)."""
        await self._ensure_started()
        self.local.report_prefill(ns, num_tokens, seconds)
        rate = self.local.prefill.of(ns.root).tokens_per_s
        if rate:
            self.metrics.prefill_rate.labels(ns.root[:8].hex()).set(rate)

    async def report_load(self, load: EngineLoad) -> None:
        """The load an engine on this node reports; every lookup returns it (for routers)."""
        await self._ensure_started()
        self.local.report_load(load)
        self.metrics.engine_load.labels("running_requests").set(load.running_requests)
        self.metrics.engine_load.labels("queued_requests").set(load.queued_requests)
        self.metrics.engine_load.labels("queued_prefill_tokens").set(load.queued_prefill_tokens)

    async def _mirror(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: np.ndarray,
                      digests: Sequence[Sequence[bytes]], provenance: Sequence[Provenance | None]) -> None:
        # Off the critical path of the request that pulled: its engine is computing on this node's
        # cores right now, and a mirror (verify, copy, write-behind flush, disk writeback) would
        # compete with it. A copy is an optimisation; a node that dies first just has none.
        try:
            await asyncio.sleep(self.config.kv.mirror_delay_s)
            await asyncio.get_running_loop().run_in_executor(
                self._mirror_pool,   # the producer's records, verbatim: a mirror never signs
                lambda: self.local.write_blocks(ns, hashes, payloads, digests=digests, provenance=provenance))
        finally:
            self._pending_mirrors -= 1

    async def load(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                   pulls: bool = True, deadline_s: float | None = None) -> LoadReply:
        await self._ensure_started()
        return await self._load(ns, block_hashes(ns, tokens)[:max_blocks], pulls, tokens=tokens,
                                deadline_s=deadline_s)

    # A layer stream is never stitched from two runs (the plans may differ): a restart ends it.
    @ray.method(max_task_retries=0)  # type: ignore[untyped-decorator]  # ray.method is untyped
    async def load_layers(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                          deadline_s: float | None = None) -> AsyncIterator[Any]:
        """A Ray streaming generator: first `(num_blocks, sources)`, then each layer's array, in order.
        `deadline_s` plans the pulls as `load` does (never cuts: the stream has promised its blocks)."""
        await self._ensure_started()
        async for item in self._load_layers(ns, block_hashes(ns, tokens)[:max_blocks], tokens, deadline_s):
            yield item

    async def _load_layers(self, ns: Namespace, hashes: list[BlockHash], tokens: Tokens | None,
                           deadline_s: float | None = None) -> AsyncIterator[Any]:
        started: asyncio.Future[tuple[int, LayerProgress, np.ndarray, list[str]]] = \
            asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self._load(ns, hashes, True, started, tokens, deadline_s))
        planned, progress, out, sources = await started
        yield planned, tuple(sources)
        for layer in range(ns.layout.num_layers):
            ready = asyncio.ensure_future(progress.layer_ready[layer].wait())
            await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
            if not progress.layer_ready[layer].is_set() and planned > 0:
                ready.cancel()
                task.cancel()
                raise IncompleteLoadError(f"layer {layer} could not be loaded for all {planned} blocks")
            ready.cancel()
            yield out[:planned, layer].copy()
        await task

    async def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, first_block: int = 0) -> StoreReply:
        await self._ensure_started()
        num_blocks = check_payloads(ns, tokens, payloads, first_block)
        hashes = block_hashes(ns, tokens)[:first_block + num_blocks]
        self._note_chain(ns, hashes, first_block, len(hashes), tokens)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.local.write_blocks(ns, hashes[first_block:], payloads, signer=self.signer))

    def _note_chain(self, ns: Namespace, hashes: Sequence[BlockHash], start: int, end: int,
                    tokens: Tokens | None) -> None:
        """Tell the KV event stream how `hashes[start:end]`, about to be stored, chain (and their tokens)."""
        if self.kv_events is None:
            return
        span = None if tokens is None else np.asarray(tokens)[start * ns.block_size:end * ns.block_size].tolist()
        self.kv_events.note_chain(hashes[start:end], hashes[start - 1] if start else None, span, ns.block_size)

    # ---- the Fabric API by block ids (fabric/block_ids.py): the same paths from the block hashes on ----

    async def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None
                            ) -> LookupReply:
        await self._ensure_started()
        return await self._lookup(ns, block_id_hashes(ns, block_ids, parent))

    async def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                          max_blocks: int | None = None, pulls: bool = True) -> LoadReply:
        await self._ensure_started()
        return await self._load(ns, block_id_hashes(ns, block_ids[:max_blocks], parent), pulls)

    @ray.method(max_task_retries=0)  # type: ignore[untyped-decorator]  # ray.method is untyped
    async def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                                 max_blocks: int | None = None) -> AsyncIterator[Any]:
        """`load_layers` for a chain of block ids."""
        await self._ensure_started()
        async for item in self._load_layers(ns, block_id_hashes(ns, block_ids[:max_blocks], parent), None):
            yield item

    async def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray,
                           parent: BlockId | None = None, first_block: int = 0) -> StoreReply:
        await self._ensure_started()
        num_blocks = check_block_payloads(ns, len(block_ids), payloads, first_block)
        hashes = block_id_hashes(ns, block_ids[:first_block + num_blocks], parent)
        self._note_chain(ns, hashes, first_block, len(hashes), None)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.local.write_blocks(ns, hashes[first_block:], payloads, signer=self.signer))

    async def held_block_hashes(self) -> list[bytes]:
        """Every block hash this node holds in any tier (any layer of it): what its KV events announce."""
        await self._ensure_started()
        held = await asyncio.get_running_loop().run_in_executor(None, self.kv_store.held_addresses)
        return sorted({a.hash for a in held})

    async def purge_producer(self, producer: str) -> int:
        """Delete every block held here whose provenance names `producer`; returns how many
        (block, layer) payloads. The directory forgets them through the usual removal events."""
        await self._ensure_started()
        removed = await asyncio.get_running_loop().run_in_executor(None, self.kv_store.purge_producer, producer)
        self.metrics.purged.inc(removed)
        logger.warning("purged %d payloads produced by %s", removed, producer)
        return removed

    async def stats(self) -> dict[str, Any]:
        await self._ensure_started()
        def count(metric: str, **labels: str) -> float:
            value = self.registry.get_sample_value(metric, labels or None)
            return float(value or 0.0)
        requested = count("kvfabric_requested_blocks_total")
        local, peer = count("kvfabric_hit_blocks_total", source="local"), count("kvfabric_hit_blocks_total",
                                                                                 source="peer")
        pulls = {o: count("kvfabric_pulls_total", transport=self.address.transport, outcome=o)
                 for o in ("hit", *(reason.value for reason in MissReason))}
        return {"node_id": self.node_id, "node_name": self.node_name, "incarnation": self.incarnation,
                "pid": os.getpid(), "address": f"{self.address.host}:{self.address.port}",
                "transport": self.address.transport, "metrics_port": self.metrics_port,
                "store": self.kv_store.stats(), "requested_blocks": requested, "hit_blocks_local": local,
                "hit_blocks_peer": peer, "hit_ratio": (local + peer) / requested if requested else 0.0,
                "pulls": pulls, "pulled_bytes": count("kvfabric_pull_bytes_total", transport=self.address.transport),
                "said_yes_owner_no": count("kvfabric_directory_said_yes_owner_said_no_total"),
                "provenance_rejections": {r.value: count("kvfabric_provenance_rejections_total", reason=r.value)
                                          for r in Rejection},
                "revoked_certificates": len(self.trust.revoked),
                "pending_directory_ops": self.upkeep.pending(), "overflows": self.upkeep.sync.num_overflows,
                "pending_mirrors": self._pending_mirrors,
                "estimates": {"peers": self.peer_estimates.snapshot(time.monotonic()),
                              "prefill_tokens_per_s": self.local.prefill.snapshot()},
                "engine_load": dataclasses.asdict(self.local.engine_load), "directory": self.directory.breaker_stats(),
                "kv_events": None if self.kv_events is None else self.kv_events.endpoints()}
