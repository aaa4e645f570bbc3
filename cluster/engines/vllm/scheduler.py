"""The connector's scheduler side: how much of a prompt the fabric can give, and what each step
must load and store.

    new request ──get_num_new_matched_tokens──► node lookup (own tiers, then the directory's peers)
                                                 hit = leading cached blocks, never the last token;
                                                 one that needs pulls from peers loads in the background
                ──update_state_after_alloc────► a load is owed: blocks [local hit, hit) into its pages
    each step   ──build_connector_meta────────► LoadSpecs owed + SaveSpecs for prompt blocks that
                                                 become full this step (chunked prefill: as they do)
    each output ──update_connector_output─────► loads the node sampled for audit (the workers loaded
                                                 nothing of them; vLLM recomputes them): once recomputed,
                                                 an AuditSpec has the workers hand their pages to the audit
    finish      ──request_finished────────────► blocks kept until the workers' stores are acknowledged

Per request it keeps the prompt, its namespace (cache_salt / LoRA as an extra key), its vLLM pages
and how many leading prompt blocks the fabric has (or is being sent). A hit on this node's own
tiers loads synchronously: the worker streams it layer by layer during the step's forward pass
(layer 0 first). A hit that needs pulls from peers loads in the background (vLLM's asynchronous
load, `get_num_new_matched_tokens` -> (n, True)): vLLM allocates the request's pages and parks it in
WAITING_FOR_REMOTE_KVS, the LoadSpec goes out with the next step's metadata, and the workers report
it received when every layer is in its pages; the batch runs on meanwhile. A lookup is a
hint: whatever the workers cannot load is reported back to vLLM as failed blocks and recomputed;
vLLM then rewinds the request to the first of them, and the blocks the failed step stored nothing
of (worker.py) are stored again from the recompute.

`kv_transfer_params={"kvfabric": {"load": false, "store": false}}` on a request's sampling params
turns either direction off for that request (a recompute baseline on the same engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from cluster.api import EventKeys
from cluster.client import FabricClient, FabricTimeoutError
from cluster.engines.vllm.metadata import AuditSpec, KVFabricMetadata, KVFabricWorkerMetadata, LoadSpec, SaveSpec
from cluster.engines.vllm.namespace import request_namespace
from cluster.tenancy import TenantRefusedError
from fabric.keys import Namespace

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    ns: Namespace
    prompt: np.ndarray                 # int64 prompt token ids
    load: bool
    store: bool
    block_ids: list[int] = field(default_factory=list)
    num_saved_blocks: int = 0          # leading prompt blocks the fabric has, or has been sent
    has_saves: bool = False            # a worker holds or held a store of this request
    hit_tokens: int = 0                # the last lookup's answer
    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()   # vLLM's extra hash keys per full prompt block
    lora_name: str | None = None
    owed_load: tuple[int, int] | None = None   # (first block, tokens to load up to) for the next step
    load_first: int = 0                # the last load sent to the workers: blocks load_first ..
    loaded_blocks: int = 0             # .. loaded_blocks
    audit: tuple[int, int] | None = None       # a sampled load: (its first block, blocks to audit)
    recomputed: bool = False           # vLLM rewound to the sampled load's first block since
    background: bool = False           # the last lookup's hit is loaded in the background
    received: bool = False             # a background load is over and the request not yet scheduled


def event_extra_keys(request: Request, block_size: int) -> tuple[tuple[Any, ...] | None, ...]:
    """Per full prompt block, the extra keys vLLM hashes it with and names it by in its own KV events
    (LoRA, cache_salt on the first block, multimodal and prompt-embeds keys): a router that hashes
    tokens as vLLM does maps the fabric's events with them (docs/kv-events.md)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

    keys: list[tuple[Any, ...] | None] = []
    mm_index = 0
    for start in range(0, len(request.prompt_token_ids or ()) // block_size * block_size, block_size):
        extra, mm_index = generate_block_hash_extra_keys(request, start, start + block_size, mm_index)
        keys.append(extra)
    return tuple(to_event_extra_keys(keys) or ())


class SchedulerSide:
    """One engine's scheduler-side state (see the module docstring)."""

    def __init__(self, client: FabricClient, base: Namespace, *, pulls: bool = True, background: bool = True) -> None:
        self.client = client
        self.base = base
        self.block_size = base.block_size
        self.pulls = pulls
        self.background = background
        self._requests: dict[str, _Request] = {}
        self._background: list[str] = []      # requests whose background load goes out with the next step
        self.num_lookups = self.num_hit_tokens = self.num_lookup_errors = 0

    # ---- per request ---------------------------------------------------------------------------

    def _state(self, request: Request) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is None and request.prompt_token_ids is not None:
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            params = (request.kv_transfer_params or {}).get("kvfabric") or {}
            state = _Request(request_namespace(self.base, cache_salt=request.cache_salt, lora_name=lora),
                             np.asarray(request.prompt_token_ids, dtype=np.int64),
                             load=bool(params.get("load", True)), store=bool(params.get("store", True)),
                             extra_keys=event_extra_keys(request, self.block_size), lora_name=lora)
            self._requests[request.request_id] = state
        return state

    def matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens beyond `num_computed_tokens` the fabric can load, whether they load in the background)."""
        state = self._state(request)
        if state is None or not state.load or state.received:
            # Asked again right after a background load: it failed (or was sampled) whole, so compute.
            return 0, False
        # The last prompt token is always computed: its logits are the point of the prefill.
        max_blocks = (len(state.prompt) - 1) // self.block_size
        if max_blocks * self.block_size <= num_computed_tokens:
            return 0, False
        self.num_lookups += 1
        try:
            reply = self.client.lookup(state.ns, state.prompt[:max_blocks * self.block_size])
        except (FabricTimeoutError, TenantRefusedError, ray.exceptions.RayError) as e:
            self.num_lookup_errors += 1
            logger.warning("fabric lookup failed for request %s (%s); computing it", request.request_id, e)
            return 0, False
        num_blocks = reply.num_blocks if self.pulls else reply.num_local_blocks
        state.hit_tokens = min(num_blocks, max_blocks) * self.block_size
        num_tokens = max(0, state.hit_tokens - num_computed_tokens)
        state.background = self.background and num_tokens > 0 and min(num_blocks, max_blocks) > reply.num_local_blocks
        return num_tokens, state.background

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self._requests.get(request.request_id)
        if state is None or num_external_tokens <= 0:
            return
        if state.background:     # not scheduled this step: its pages are only known from here
            state.block_ids = list(blocks.get_block_ids()[0])
            self._background.append(request.request_id)
        local = state.hit_tokens - num_external_tokens
        if local < 0 or local % self.block_size:
            raise RuntimeError(f"vLLM allocated {num_external_tokens} external tokens of a {state.hit_tokens}-token "
                               f"hit for request {request.request_id}: not a block-aligned tail of it")
        state.owed_load = (local // self.block_size, state.hit_tokens)
        self.num_hit_tokens += num_external_tokens

    def finished(self, request: Request) -> bool:
        """Whether the request's blocks must stay until the workers report its stores done."""
        state = self._requests.pop(request.request_id, None)
        return state is not None and state.has_saves

    # ---- per step ------------------------------------------------------------------------------

    def build(self, out: SchedulerOutput) -> KVFabricMetadata:
        meta = KVFabricMetadata()
        for req_id in self._background:
            state = self._requests.get(req_id)
            if state is not None and state.owed_load is not None:
                self._load(req_id, state, meta, background=True)
        self._background = []
        for new in out.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is None:
                continue
            state.block_ids = list(new.block_ids[0])
            state.received = False
            # After a background load: its blocks are the fabric's, failed or sampled ones included.
            state.num_saved_blocks = max(new.num_computed_tokens // self.block_size, state.loaded_blocks)
            self._step(new.req_id, state, new.num_computed_tokens, out.num_scheduled_tokens[new.req_id], meta)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            blocks = cached.new_block_ids[i]
            resumed = req_id in cached.resumed_req_ids
            if resumed:     # preempted and back: a fresh set of pages (a sampled load's are gone)
                state.block_ids = list(blocks[0]) if blocks is not None else []
                state.audit = None
            elif blocks is not None:
                state.block_ids.extend(blocks[0])
            num_computed = cached.num_computed_tokens[i]
            if not resumed and num_computed < state.num_saved_blocks * self.block_size:
                # vLLM rewound the request to recompute blocks a load did not deliver (failed or sampled);
                # the step that tried stored nothing of it (worker.py): store its new blocks again.
                state.num_saved_blocks = max(num_computed // self.block_size, state.loaded_blocks)
            self._step(req_id, state, num_computed, out.num_scheduled_tokens[req_id], meta)
        return meta

    def update_output(self, output: KVConnectorOutput) -> None:
        """The workers' report of a step: background loads over, loads the node sampled for audit."""
        for req_id in output.finished_recving or ():
            state = self._requests.get(req_id)
            if state is not None:
                state.received = True
        worker = output.kv_connector_worker_meta
        if not isinstance(worker, KVFabricWorkerMetadata):
            return
        for req_id, num_blocks in worker.sampled.items():
            state = self._requests.get(req_id)
            if state is not None:
                state.audit, state.recomputed = (state.load_first, num_blocks), False

    def _step(self, req_id: str, state: _Request, num_computed: int, num_scheduled: int,
              meta: KVFabricMetadata) -> None:
        bs = self.block_size
        if state.owed_load is not None:
            self._load(req_id, state, meta, background=False)
        if state.audit is not None:
            self._audit(req_id, state, num_computed, num_scheduled, meta)
        num_prompt = len(state.prompt)
        meta.prefill_tokens += max(0, min(num_computed + num_scheduled, num_prompt) - num_computed)
        full = min(num_computed + num_scheduled, num_prompt) // bs
        first = state.num_saved_blocks
        if state.store and full > first and len(state.block_ids) >= full:
            keys = EventKeys(state.extra_keys[first:full], state.lora_name) \
                if state.lora_name or any(state.extra_keys[first:full]) else None
            meta.saves.append(SaveSpec(req_id, state.ns, state.prompt[:full * bs], first,
                                       tuple(state.block_ids[first:full]), keys))
            state.has_saves = True
        state.num_saved_blocks = max(state.num_saved_blocks, full)

    def _load(self, req_id: str, state: _Request, meta: KVFabricMetadata, *, background: bool) -> None:
        assert state.owed_load is not None
        first, end = state.owed_load
        state.owed_load = None
        state.load_first, state.loaded_blocks = first, end // self.block_size
        meta.loads.append(LoadSpec(req_id, state.ns, state.prompt[:end], first,
                                   tuple(state.block_ids[first:end // self.block_size]), background))

    def _audit(self, req_id: str, state: _Request, num_computed: int, num_scheduled: int,
               meta: KVFabricMetadata) -> None:
        """Once vLLM has recomputed a sampled load's blocks (rewound to its first block, then computed
        past the last), the workers hand those pages to the audit after this step's forward, before
        the scheduler can free or reuse them. Blocks before the load's first are vLLM's prefix cache."""
        assert state.audit is not None
        first, num_blocks = state.audit
        bs = self.block_size
        if num_computed <= first * bs:
            state.recomputed = True
        if state.recomputed and num_computed + num_scheduled >= num_blocks * bs and \
                len(state.block_ids) >= num_blocks:
            meta.audits.append(AuditSpec(req_id, state.ns, state.prompt[:num_blocks * bs],
                                         tuple(state.block_ids[:num_blocks])))
            state.audit = None

    @property
    def num_requests(self) -> int:
        """Requests tracked (vLLM has not finished them)."""
        return len(self._requests)

    def stats(self) -> dict[str, Any]:
        return {"lookups": self.num_lookups, "hit_tokens": self.num_hit_tokens,
                "lookup_errors": self.num_lookup_errors, "requests": len(self._requests)}
