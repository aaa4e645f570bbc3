"""The connector's worker side: fabric payloads in and out of vLLM's paged KV cache, layer by layer.

    start_load_kv        for each LoadSpec: open the node's layer stream (its plan comes first:
                         how many leading blocks it will deliver; fewer than owed -> the rest fail)
    wait_for_layer_load  before layer i's attention: take layer i off every stream, scatter it
                         into the request's pages (the node sends later layers meanwhile)
    save_kv_layer        after layer i's attention: gather the pages of blocks that became full
                         into a host buffer [blocks, layers, bytes]
    wait_for_save        hand each complete buffer to the node (one copy into the object store,
                         not waited for); the request's pages are released once it is acknowledged
    get_finished         requests whose stores were all acknowledged (or failed: a future miss)

Background loads (vLLM's asynchronous loads; the scheduler side asks for them where a hit needs
pulls from peers): the request waits outside the batch while a thread here takes its whole stream
and scatters every layer into its pages; `get_finished` then reports it received (failed blocks
first, through `failed_block_ids`), and vLLM schedules it. The batch runs on meanwhile.

Sampled recompute: a load the node samples for audit (its plan names `audit_blocks`) loads nothing;
its blocks are reported as failed, so vLLM recomputes them, and the scheduler side learns of it
(`build_connector_worker_meta`). Once vLLM has recomputed them it sends an AuditSpec: after that
step's forward, before the pages can be freed, they are gathered and handed to `Fabric.audit` (on a
thread of its own, not waited for), which compares them with what the producers signed and
quarantines a producer that lied.

A load that breaks (peer gone mid-pull, a payload that failed its digest, a timeout) leaves the
pages of its undelivered blocks reported by `failed_block_ids`; vLLM then recomputes from the first
of them, so the answer never depends on what the fabric could deliver, only how fast it comes. The
step's stores of that request are dropped (they were computed over pages that were not loaded);
the scheduler side sends them again from the recompute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import ray
import torch

from cluster.api import AuditReport, IncompleteLoadError
from cluster.client import FabricClient, FabricTimeoutError, PendingStore
from cluster.engines.vllm.metadata import AuditSpec, KVFabricMetadata, KVFabricWorkerMetadata, LoadSpec, SaveSpec
from cluster.engines.vllm.namespace import shard_namespace
from cluster.engines.vllm.paged import PagedLayer, layer_order
from cluster.tenancy import TenantRefusedError
from fabric.keys import Namespace

logger = logging.getLogger(__name__)

LOAD_ERRORS = (IncompleteLoadError, FabricTimeoutError, TenantRefusedError, ray.exceptions.RayError, ValueError)
BACKGROUND_THREADS = 4  # background loads taken at once (each mostly waits on its pull)
MIN_RATE_TOKENS = 128    # a shorter step says little about the prefill rate (cluster/node/estimates.py)


@dataclass(slots=True)
class _Load:
    spec: LoadSpec
    layers: Iterator[tuple[int, np.ndarray]] | None
    num_usable: int            # leading blocks of spec the node's plan covers
    next_layer: int = 0
    failed: bool = False


class WorkerSide:
    def __init__(self, client: FabricClient, *, num_blocks: int, rank: int, deadline_s: float | None,
                 audit: bool = True) -> None:
        """`audit`: loads may be sampled for recompute (the node decides which; see the module doc)."""
        self.client = client
        self.num_blocks = num_blocks
        self.rank = rank
        self.deadline_s = deadline_s
        self.audit = audit
        self.layers: list[PagedLayer] = []
        self.index: dict[str, int] = {}
        self._loads: list[_Load] = []
        self._saves: list[tuple[SaveSpec, np.ndarray]] = []
        self._owed: list[LoadSpec] = []
        self._pending: dict[str, list[PendingStore]] = {}
        self._finishing: set[str] = set()
        self._failed: set[int] = set()
        self._failed_reqs: set[str] = set()          # requests with blocks failed this step
        self._sampled: dict[str, int] = {}           # request -> blocks its load was sampled for
        self._new_samples: dict[str, int] = {}       # of those, sampled this step (for the scheduler)
        self._audits: list[AuditSpec] = []
        self._auditor: ThreadPoolExecutor | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._background: dict[str, Future[None]] = {}   # request -> its background load
        self._lock = threading.Lock()                     # failures and samples, also set by loader threads
        self.audit_reports: list[Future[AuditReport]] = []
        self._step_start = 0.0
        self._rate_ns: Namespace | None = None
        self._prefill_tokens = 0
        self.num_loaded_blocks = self.num_failed_blocks = self.num_stored_blocks = self.num_sampled_loads = 0

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = layer_order(list(kv_caches))
        self.layers = [PagedLayer.of(kv_caches[name], self.num_blocks) for name in names]
        self.index = {name: i for i, name in enumerate(names)}

    # ---- loads ---------------------------------------------------------------------------------

    def begin_step(self, meta: KVFabricMetadata) -> None:
        """The step's metadata is bound (before its forward): set up its saves' buffers."""
        self._step_start = time.perf_counter()
        self._prefill_tokens = meta.prefill_tokens if not meta.loads else 0
        self._rate_ns = meta.saves[0].ns if meta.saves else None
        self._owed = [spec for spec in meta.loads if not spec.background]
        self._audits = list(meta.audits)
        self._failed_reqs = set()
        for spec in meta.loads:
            if spec.background:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(BACKGROUND_THREADS, thread_name_prefix="kvfabric-load")
                self._background[spec.req_id] = self._loader.submit(self._load_whole, spec)
        self._saves = [(spec, np.empty((spec.num_blocks, len(self.layers), self.layers[0].page_bytes), np.uint8))
                       for spec in meta.saves]
        for save in meta.saves:    # from now on the scheduler holds the request's pages for this worker
            self._pending.setdefault(save.req_id, [])

    def start(self) -> None:
        """Open the step's loads (vLLM calls this before the forward when a step has loads)."""
        owed, self._owed = self._owed, []
        self._loads.extend(self._open(spec) for spec in owed)

    def _open(self, spec: LoadSpec) -> _Load:
        ns = shard_namespace(spec.ns, self.rank)
        try:
            stream = self.client.load_layers(ns, spec.tokens, max_blocks=spec.first_block + spec.num_blocks,
                                             deadline_s=self.deadline_s, audit=self.audit)
        except LOAD_ERRORS as e:
            logger.warning("fabric load of request %s failed to start (%s); vLLM recomputes it", spec.req_id, e)
            self._fail(spec.req_id, spec.block_ids)
            return _Load(spec, None, 0, failed=True)
        if stream.audit_blocks:
            # Sampled: vLLM computes these blocks, and the audit compares them with what was signed.
            self._fail(spec.req_id, spec.block_ids)
            with self._lock:
                self._sampled[spec.req_id] = self._new_samples[spec.req_id] = stream.audit_blocks
                self.num_sampled_loads += 1
            return _Load(spec, None, 0, failed=True)
        usable = max(0, min(stream.num_blocks - spec.first_block, spec.num_blocks))
        self._fail(spec.req_id, spec.block_ids[usable:])
        return _Load(spec, iter(stream) if usable else None, usable, failed=not usable)

    def wait_layer(self, layer_name: str) -> None:
        layer = self.index.get(layer_name)
        if layer is None:
            return
        if self._owed:
            self.start()
        for load in self._loads:
            self._advance(load, layer)

    def _advance(self, load: _Load, layer: int) -> None:
        """Scatter `load`'s layers up to `layer` (streams deliver layers in order)."""
        while not load.failed and load.layers is not None and load.next_layer <= layer:
            spec = load.spec
            try:
                got, payloads = next(load.layers)
            except (StopIteration, *LOAD_ERRORS) as e:
                logger.warning("fabric load of request %s broke at layer %d (%r); vLLM recomputes its %d blocks",
                               spec.req_id, load.next_layer, e, load.num_usable)
                load.failed = True
                self._fail(spec.req_id, spec.block_ids[:load.num_usable])
                return
            if got != load.next_layer:
                raise RuntimeError(f"the fabric's layer stream sent layer {got}, expected {load.next_layer}")
            rows = payloads[spec.first_block:spec.first_block + load.num_usable]
            self.layers[got].scatter(spec.block_ids[:load.num_usable], rows)
            load.next_layer += 1

    def _load_whole(self, spec: LoadSpec) -> None:
        """A background load (a loader thread): every layer into the request's pages, or its blocks failed."""
        load = self._open(spec)
        self._advance(load, len(self.layers) - 1)
        if load.failed:
            return
        if load.next_layer < len(self.layers):
            logger.warning("fabric load of request %s sent %d of %d layers; vLLM recomputes its %d blocks",
                           spec.req_id, load.next_layer, len(self.layers), load.num_usable)
            self._fail(spec.req_id, spec.block_ids[:load.num_usable])
        else:
            with self._lock:
                self.num_loaded_blocks += load.num_usable

    def _fail(self, req_id: str, block_ids: tuple[int, ...]) -> None:
        if block_ids:
            with self._lock:
                self._failed.update(block_ids)
                self._failed_reqs.add(req_id)
                self.num_failed_blocks += len(block_ids)

    def take_failed(self) -> set[int]:
        with self._lock:
            failed, self._failed = self._failed, set()
        return failed

    # ---- saves ---------------------------------------------------------------------------------

    def save_layer(self, layer_name: str) -> None:
        layer = self.index.get(layer_name)
        if layer is None:
            return
        for spec, buffer in self._saves:
            self.layers[layer].gather(spec.block_ids, buffer[:, layer])

    def end_step(self) -> None:
        """The step's forward is done: settle its loads, send its stores, report the prefill rate."""
        for owed in self._owed:     # never opened: no layer of the forward waited for it
            self._fail(owed.req_id, owed.block_ids)
        self._owed = []
        for load in self._loads:
            if not load.failed and load.next_layer < len(self.layers):
                # The forward ran some layer without waiting for it: those pages were not loaded.
                self._fail(load.spec.req_id, load.spec.block_ids[:load.num_usable])
            elif not load.failed:
                self.num_loaded_blocks += load.num_usable
        self._loads = []
        for audit in self._audits:
            self._hand_in(audit)
        self._audits = []
        for spec, buffer in self._saves:
            if spec.req_id in self._failed_reqs:   # computed over pages that were not loaded
                continue
            ns = shard_namespace(spec.ns, self.rank)
            try:
                pending = self.client.store_later(ns, spec.tokens, buffer, first_block=spec.first_block,
                                                  event_keys=spec.event_keys)
            except LOAD_ERRORS as e:
                logger.warning("fabric store of request %s failed (%s); those blocks stay uncached", spec.req_id, e)
                continue
            self._pending.setdefault(spec.req_id, []).append(pending)
            self.num_stored_blocks += spec.num_blocks
        self._saves = []
        seconds = time.perf_counter() - self._step_start
        if self._rate_ns is not None and self._prefill_tokens >= MIN_RATE_TOKENS:
            self.client.report_prefill(shard_namespace(self._rate_ns, self.rank), self._prefill_tokens, seconds)

    def _hand_in(self, spec: AuditSpec) -> None:
        """Gather a sampled load's recomputed pages (this step's forward is done) and audit them."""
        with self._lock:
            num_blocks = min(self._sampled.pop(spec.req_id, 0), spec.num_blocks)
        if not num_blocks:     # this rank's own load was not sampled (each TP rank's is drawn apart)
            return
        buffer = np.empty((num_blocks, len(self.layers), self.layers[0].page_bytes), np.uint8)
        for i, layer in enumerate(self.layers):
            layer.gather(spec.block_ids[:num_blocks], buffer[:, i])
        ns = shard_namespace(spec.ns, self.rank)
        tokens = spec.tokens[:num_blocks * ns.block_size]
        if self._auditor is None:
            self._auditor = ThreadPoolExecutor(1, thread_name_prefix="kvfabric-audit")
        future = self._auditor.submit(self._audit, spec.req_id, ns, tokens, buffer)
        self.audit_reports = [f for f in self.audit_reports if not f.done()] + [future]

    def _audit(self, req_id: str, ns: Namespace, tokens: np.ndarray, payloads: np.ndarray) -> AuditReport:
        try:
            report = self.client.audit(ns, tokens, payloads)
        except Exception as e:
            logger.warning("audit of request %s's sampled load failed (%r)", req_id, e)
            raise
        if report.quarantined:
            logger.warning("audit of request %s: producers %s signed KV that differs from vLLM's; quarantined",
                           req_id, ", ".join(report.quarantined))
        return report

    def worker_meta(self) -> KVFabricWorkerMetadata | None:
        """This step's report to the scheduler side: loads sampled for audit."""
        with self._lock:
            if not self._new_samples:
                return None
            sampled, self._new_samples = self._new_samples, {}
        return KVFabricWorkerMetadata(sampled)

    def received(self) -> set[str]:
        """Requests whose background loads are over (loaded, or their blocks reported failed)."""
        done = {req_id for req_id, future in self._background.items() if future.done()}
        for req_id in done:
            error = self._background.pop(req_id).exception()
            if error is not None:     # not a fabric error (those fail the blocks): the load's own bug
                raise error
        return done

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests the scheduler holds for their stores whose stores are all settled."""
        with self._lock:
            for req_id in finished_req_ids:   # finished before a sampled load's blocks were recomputed
                self._sampled.pop(req_id, None)
        self._finishing |= finished_req_ids
        done: set[str] = set()
        for req_id in list(self._finishing):
            pending = self._pending.get(req_id, [])
            if all(p.settled() for p in pending):
                self._finishing.discard(req_id)
                if self._pending.pop(req_id, None) is not None:
                    done.add(req_id)
        return done

    @property
    def num_requests(self) -> int:
        """Requests with state here: stores in flight or finishing, sampled loads not yet audited."""
        return len(self._pending.keys() | self._finishing | self._sampled.keys() | self._background.keys())

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        if self._auditor is not None:
            self._auditor.shutdown(wait=True)
        for pending in self._pending.values():
            for p in pending:
                p.settled(wait=True)
        self._pending.clear()
