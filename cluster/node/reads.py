"""A node's read path: lookup and load of a run of block hashes, local blocks first, then pulls.

    hashes ──LocalFabric.local_tiers──► leading local run ──Locator.locate──► owners of the rest
           ──plan_pulls──► runs per owner (a Placement) ──plan_by_deadline──► the runs expected to land
           in time ──read local run──► a LoadPlan (node/plan.py)
           ──pull_prefix (node/pulls.py)──► verified leading run ──► LoadReply
                                                        └──► mirror into this node's RAM (background)
                                                        └──► what each peer's pulls took ──► PeerEstimates

A lookup is the same plan made as a peek (no recency change, no pull). A load pulls only the runs
expected to arrive before the engine could compute their tokens and, unless it streams layers,
cuts the pull at that deadline: what arrived and verified in time is returned, the rest is a miss.
A layer stream is planned by the same rule but never cut (it has promised its blocks).

`NodeLoader` does the asyncio work of one node; the NodeActor builds it once it has started and
calls it from its public methods. It holds no Ray handle: the directory comes in as a `Locator`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Protocol

import numpy as np

from cluster.api import (
    BlockLocation,
    EngineLoad,
    IncompleteLoadError,
    LoadReply,
    LookupReply,
    Tokens,
    Where,
    payload_shape,
)
from cluster.directory.client import Located
from cluster.events.publisher import KvEventPublisher
from cluster.node.estimates import PeerEstimates, RunCost, plan_by_deadline
from cluster.node.local import WHERE_OF_TIER, LocalFabric
from cluster.node.metrics import ClusterMetrics
from cluster.node.plan import LoadPlan, Placement, new_plan
from cluster.node.pulls import PullOutcome, pull_prefix
from cluster.node.reply_buffers import ReplyBuffers
from cluster.planner import PullRun, agreeing_owners, plan_pulls
from fabric.config import Config
from fabric.keys import BlockHash, Namespace
from fabric.layout import LayoutKind
from fabric.priority import lower_thread_priority
from fabric.provenance import Provenance, version_producer
from transports.core.base import Peer, TransportClient
from transports.trust.provenance_check import ProvenanceVerifier

logger = logging.getLogger(__name__)

# What `load` hands a layer stream once its plan is made: the plan, whose progress it waits on.
Started = asyncio.Future[LoadPlan]


class Locator(Protocol):
    """Who owns which of a run of block hashes (the directory; `DirectoryClient` in a node)."""

    async def locate(self, hashes: Sequence[bytes], exclude: Collection[str]) -> Located: ...


class Sampler(Protocol):
    """Whether a load whose pulled blocks name `producers` is recomputed (cluster/node/audit.py)."""

    def sample(self, ns: Namespace, producers: Collection[str], hashes: Sequence[BlockHash]) -> bool: ...

    def disputed(self, producers: Collection[str]) -> None: ...

    def outvoted(self, ns: Namespace, block_hash: BlockHash, winner: bytes, loser: bytes) -> None: ...


class NodeLoader:
    """Lookup and load for one node: plans, local reads, pulls, deadline cuts, mirrors, estimates."""

    def __init__(self, config: Config, *, node_id: str, transport: str, local: LocalFabric, directory: Locator,
                 client: TransportClient, verifier: ProvenanceVerifier, metrics: ClusterMetrics,
                 kv_events: KvEventPublisher | None, spawn: Callable[[Coroutine[Any, Any, None]], None],
                 tenants_of: Callable[[Namespace], frozenset[str] | None] = lambda ns: None) -> None:
        """`tenants_of`: the tenants a bound namespace is for (a pulled block's producer must be
        authorised for one of them; see cluster/tenancy.py)."""
        self.config = config
        self.node_id = node_id
        self.transport = transport     # peers are reached over this node's own transport kind only
        self.local = local
        self.directory = directory
        self.client = client
        self.verifier = verifier
        self.metrics = metrics
        self.kv_events = kv_events
        self.spawn = spawn
        self.tenants_of = tenants_of
        self.peer_estimates = PeerEstimates()
        self.quarantined: frozenset[str] = frozenset()   # producers whose records pulls refuse (node/audit.py)
        self.sampler: Sampler | None = None              # sampled recompute of pulled loads (node/audit.py)
        self.pending_mirrors = 0
        self._logged_pairs: set[tuple[str, str]] = set()   # producer pairs whose disagreement was logged
        self._replies = ReplyBuffers(int(config.kv.reply_pool_gib * (1 << 30)))
        # Mirroring pulled blocks is background work: one thread, at the store's lower priority.
        self._mirror_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-mirror",
                                               initializer=lower_thread_priority,
                                               initargs=(config.kv.background_nice,))

    async def close(self) -> None:
        """Wait for a mirror in progress to end; mirrors not yet begun are the caller's tasks to cancel."""
        await asyncio.get_running_loop().run_in_executor(None, self._mirror_pool.shutdown)

    def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        """An engine here computed `num_tokens` of prefill in `seconds`: the rate loads are planned by."""
        self.local.report_prefill(ns, num_tokens, seconds)
        rate = self.local.prefill.of(ns.root).tokens_per_s
        if rate:
            self.metrics.prefill_rate.labels(ns.root[:8].hex()).set(rate)

    def report_load(self, load: EngineLoad) -> None:
        """The engines' load here, returned with every lookup (for routers)."""
        self.local.report_load(load)
        self.metrics.engine_load.labels("running_requests").set(load.running_requests)
        self.metrics.engine_load.labels("queued_requests").set(load.queued_requests)
        self.metrics.engine_load.labels("queued_prefill_tokens").set(load.queued_prefill_tokens)

    # ---- planning ----------------------------------------------------------------------------------

    async def _place(self, ns: Namespace, hashes: list[BlockHash], *, pulls: bool = True, peek: bool = False,
                     read_into: np.ndarray | None = None) -> Placement:
        """Where `hashes` are: the leading local run, then owners per block of the version most producers
        hold and the pull runs over them. Owners of an outvoted version are never asked, even when the
        winners cannot serve: the block is then a miss, as a disputed one is. With `read_into`, the
        local run is read into it in the same pass over the store that finds it (a load); a block that
        fails its check there ends the local run, and the rest is located like any other miss."""
        loop = asyncio.get_running_loop()
        if read_into is None:
            tiers = await loop.run_in_executor(None, partial(self.local.local_tiers, hashes, ns.layout.num_layers,
                                                             peek=peek))
        else:
            tiers = await loop.run_in_executor(None, self.local.read_blocks, hashes, read_into)
        if not pulls or len(tiers) == len(hashes):
            return Placement(hashes, tiers, [], [], {}, frozenset())
        located = self._without_quarantined(await self.directory.locate(hashes[len(tiers):], exclude=[self.node_id]))
        producers = {version_producer(v) for per_hash in located.versions for v in per_hash if v}
        vote = agreeing_owners(located.owners, located.versions, located.firsts)
        if not peek:
            self._count_disagreements(hashes, len(tiers), vote.disagreements)
            self.metrics.disputed_blocks.inc(len(vote.disputed))
            if self.sampler is not None:
                for b, winner, loser in vote.outvoted:
                    self.sampler.outvoted(ns, hashes[len(tiers) + b], winner, loser)
        owners: list[Sequence[str]] = [[] for _ in tiers]
        owners += vote.kept
        peers = {n: Peer(a.name or f"node-{n[:16]}", a.host, a.port) for n, a in located.addresses.items()
                 if a.transport == self.transport}
        owners = [[o for o in per_block if o in peers] for per_block in owners]
        return Placement(hashes, tiers, owners, plan_pulls(owners, len(tiers), hashes=hashes), peers,
                         frozenset(producers))

    def _without_quarantined(self, located: Located) -> Located:
        """`located` less the owners whose version of a block names a quarantined producer."""
        if not self.quarantined or not located.versions:
            return located
        bad = self.quarantined
        owners: list[tuple[str, ...]] = []
        versions: list[tuple[bytes, ...]] = []
        for per_block, per_version in zip(located.owners, located.versions, strict=True):
            keep = [i for i, v in enumerate(per_version) if version_producer(v) not in bad] \
                if len(per_version) == len(per_block) else range(len(per_block))
            owners.append(tuple(per_block[i] for i in keep))
            versions.append(tuple(per_version[i] for i in keep) if len(per_version) == len(per_block) else per_version)
        firsts = tuple(b"" if version_producer(v) in bad else v for v in located.firsts)
        return Located(tuple(owners), located.addresses, tuple(versions), firsts)

    async def lookup(self, ns: Namespace, hashes: list[BlockHash]) -> LookupReply:
        start = time.perf_counter()
        # A lookup is a peek: routers ask every node, and asking must not reorder eviction on the nodes
        # that do not serve the request. The load that follows is the access.
        placed = await self._place(ns, hashes, peek=True)
        fill = await asyncio.get_running_loop().run_in_executor(None, self.local.cache_fill, ns)
        locs = [BlockLocation(WHERE_OF_TIER[t], self.node_id) for t in placed.tiers]
        for run in placed.runs:
            locs += [BlockLocation(Where.PEER, run.node_id)] * (run.end - run.start)
        self.metrics.lookups.inc()
        self.metrics.lookup_seconds.observe(time.perf_counter() - start)
        return LookupReply(ns.block_size, tuple(locs), self.local.engine_load, fill)

    def _count_disagreements(self, hashes: Sequence[BlockHash], start: int,
                             disagreements: Sequence[tuple[int, bytes, bytes]]) -> None:
        """Count (and log, once per pair of producers) blocks whose owners hold different versions."""
        if self.sampler is not None and disagreements:
            self.sampler.disputed({version_producer(v) for _, first, other in disagreements for v in (first, other)})
        for b, first, other in disagreements:
            pair = (version_producer(first), version_producer(other))
            self.metrics.disagreements.labels(*pair).inc()
            if pair not in self._logged_pairs:
                self._logged_pairs.add(pair)
                logger.warning("producers %s and %s hold different bytes for block %s (and maybe more); the "
                               "version more producers hold is pulled, a tie is a miss", pair[0], pair[1],
                               bytes(hashes[start + b]).hex()[:16])

    # ---- loading -----------------------------------------------------------------------------------

    async def load(self, ns: Namespace, hashes: list[BlockHash], pulls: bool, started: Started | None = None,
                   tokens: Tokens | None = None, deadline_s: float | None = None, *, sample: bool = False,
                   mirror: bool = True, records: list[Provenance | None] | None = None) -> LoadReply:
        """The verified leading run of `hashes`; with `started`, also a layer stream's plan (`load_layers`).
        `sample`: this load may be picked for recompute (its engine audits; see `Fabric.load`); `mirror`:
        mirror what was pulled (an audit's own load does not); `records`: filled with the pulled
        blocks' provenance records (None for local ones)."""
        t0 = time.perf_counter()
        plan = await self._plan_load(ns, hashes, pulls, deadline_s, layer_major=started is not None, sample=sample)
        num_local, planned, out, sources = plan.num_local, plan.num_blocks, plan.out, plan.sources
        progress, digests, provenance = plan.progress, plan.digests, plan.provenance
        if started is not None:
            started.set_result(plan)
        outcome = PullOutcome() if plan.runs else None
        if outcome is not None:
            pull = pull_prefix(self.client, plan, timeout_s=self.config.cluster.pull_timeout_s, outcome=outcome)
            # A layer stream has promised its blocks: it is planned by the same rule but never cut.
            deadline = plan.pull_deadline_s
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
            if self.config.kv.mirror_pulls and complete > num_local and mirror:
                self.pending_mirrors += 1
                self.note_chain(ns, hashes, num_local, complete, tokens)
                self.spawn(self._mirror(ns, hashes[num_local:complete], out[num_local:complete],
                                        digests[num_local:complete], provenance[num_local:complete]))
        self.metrics.lookups.inc()
        self.metrics.requested_blocks.inc(len(hashes))
        self.metrics.hit_blocks.labels("local").inc(min(num_local, complete))
        self.metrics.hit_blocks.labels("peer").inc(max(0, complete - num_local))
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        payloads = out[:complete]
        pulled = max(0, complete - num_local) * ns.layout.bytes_per_block(ns.block_size)
        if records is not None:
            records[:] = provenance[:complete]
        return LoadReply(ns.block_size, payloads, tuple(sources[:complete]), pulled_bytes=pulled,
                         audit_blocks=plan.audit_blocks)

    async def _plan_load(self, ns: Namespace, hashes: list[BlockHash], pulls: bool, deadline_s: float | None, *,
                         layer_major: bool, sample: bool) -> LoadPlan:
        """The load's plan: the leading local run read into the reply buffer as it is found, the runs
        expected to land before the engine could compute their blocks, and nothing pulled when the
        load is sampled for audit."""
        out = self._replies.take(payload_shape(ns, len(hashes)))
        placed = await self._place(ns, hashes, pulls=pulls, read_into=out)
        num_local = placed.num_local
        runs, deadline = placed.runs, None
        if runs:   # pull only the runs expected to land before the engine could compute them
            take, deadline = plan_by_deadline(self._costs(ns, runs), self.peer_estimates,
                                              self.local.prefill.of(ns.root), time.monotonic(), deadline_s)
            self.metrics.skipped_blocks.inc(sum(r.num_blocks for r in runs[take:]))
            runs = runs[:take]
        planned = num_local + sum(r.num_blocks for r in runs)
        sources = [tier.value for tier in placed.tiers] + [""] * (planned - num_local)
        # Sampled: nothing is pulled; the engine computes the planned blocks and `audit` pulls them to compare.
        audit_blocks = planned if sample and runs and self.sampler is not None and \
            self.sampler.sample(ns, placed.producers, hashes[:planned]) else 0
        if audit_blocks:
            self.metrics.audit_samples.inc()
            runs, planned = [], num_local
        for run in runs:   # the plan; an alternate owner may replace the node
            sources[run.start:run.end] = [f"peer:{run.node_id}"] * run.num_blocks
        return new_plan(hashes, placed.owners, runs, placed.peers, out, num_blocks=planned, num_local=num_local,
                        sources=sources, verifier=self.verifier, namespace=ns.root, tenants=self.tenants_of(ns),
                        quarantined=self.quarantined, layer_major=layer_major, audit_blocks=audit_blocks,
                        pull_deadline_s=deadline)

    @staticmethod
    def _costs(ns: Namespace, runs: Sequence[PullRun]) -> list[RunCost]:
        return [RunCost(r.node_id, r.num_blocks, r.num_blocks * ns.layout.bytes_per_block(ns.block_size),
                        r.num_blocks * ns.block_size) for r in runs]

    async def load_layers(self, ns: Namespace, hashes: list[BlockHash], tokens: Tokens | None,
                          deadline_s: float | None = None, *, sample: bool = False) -> AsyncIterator[Any]:
        """First `(num_blocks, sources, audit_blocks)`, then each layer's array, in order (see
        `NodeActor.load_layers`)."""
        started: Started = asyncio.get_running_loop().create_future()
        task = asyncio.get_running_loop().create_task(self.load(ns, hashes, True, started, tokens, deadline_s,
                                                                sample=sample))
        plan = await started
        planned, progress, out = plan.num_blocks, plan.progress, plan.out
        yield planned, tuple(plan.sources[:planned]), plan.audit_blocks
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

    async def _mirror(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: np.ndarray,
                      digests: Sequence[Sequence[bytes]], provenance: Sequence[Provenance | None]) -> None:
        # Off the critical path of the request that pulled: its engine is computing on this node's
        # cores right now, and a mirror (verify, copy, write-behind flush, disk writeback) would
        # compete with it. A copy is an optimisation; a node that dies first just has none.
        # A mirror only of blocks one producer's record vouches for (every pulled block has one):
        # an unsigned copy would be found by no purge and checked by no revocation.
        try:
            await asyncio.sleep(self.config.kv.mirror_delay_s)
            # Up to the first unsigned block, or one whose producer was quarantined since the pull.
            signed = next((i for i, p in enumerate(provenance) if p is None or p.producer in self.quarantined),
                          len(provenance))
            await asyncio.get_running_loop().run_in_executor(
                self._mirror_pool,   # the producer's records, verbatim: a mirror never signs
                lambda: self.local.write_blocks(ns, hashes[:signed], payloads[:signed], digests=digests[:signed],
                                                provenance=provenance[:signed]))
        finally:
            self.pending_mirrors -= 1

    def note_chain(self, ns: Namespace, hashes: Sequence[BlockHash], start: int, end: int,
                   tokens: Tokens | None, *, extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
                   lora_name: str | None = None) -> None:
        """Tell the KV event stream how `hashes[start:end]`, about to be stored, chain (and their tokens,
        if events may show this tenant's; an engine's per-block `extra_keys` for `hashes[start:end]`)."""
        if self.kv_events is None:
            return
        shown = tokens is not None and self.kv_events.shows_tokens(self.tenants_of(ns))
        span = np.asarray(tokens)[start * ns.block_size:end * ns.block_size].tolist() if shown else None
        kind = "mla_attention" if ns.layout.kind is LayoutKind.MLA else "full_attention"
        # An engine's extra keys (a cache_salt among them) and LoRA name go with the tokens or not at all.
        self.kv_events.note_chain(hashes[start:end], hashes[start - 1] if start else None, span, ns.block_size,
                                  spec_kind=kind, extra_keys=extra_keys if shown else None,
                                  lora_name=lora_name if shown else None)
