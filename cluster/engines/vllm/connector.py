"""`KVFabricConnector`: kvfabric behind vLLM's KV connector API (`KVConnectorBase_V1`, vLLM 0.32).

vLLM makes one instance per role: the scheduler's (engine-core process) and one per worker
(each worker process, or the same process with `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Each joins
the Ray cluster and talks to its node's NodeActor (link.py); the instance then forwards vLLM's calls
to its role's half, `SchedulerSide` (scheduler.py) or `WorkerSide` (worker.py).

`kv_connector_extra_config` keys (besides link.py's): `model_id` (the name blocks are shared
under; default vLLM's model), `weights_fingerprint` (default: BLAKE3 of the local checkpoint's weight
files), `deadline_s` (how long a load may wait for pulls; default the node's own break-even), `pulls`
(false: only this node's own tiers count as hits), `audit` (false: loads are never sampled for
recompute; default true, at the rate the node's `[audit]` config sets), `background_pulls`
(default true: a hit that needs pulls from peers loads while the request waits outside the batch,
vLLM's asynchronous load; false: every load runs in the step's forward).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from cluster.engines.vllm.link import connect
from cluster.engines.vllm.metadata import KVFabricMetadata
from cluster.engines.vllm.namespace import base_namespace
from cluster.engines.vllm.scheduler import SchedulerSide
from cluster.engines.vllm.worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class KVFabricConnector(KVConnectorBase_V1):
    """KV blocks of every engine on a Ray cluster, found by token prefix, loaded layer by layer."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError('KVFabricConnector needs "kv_load_failure_policy": "recompute" in --kv-transfer-config: '
                             "a block the fabric fails to deliver (a peer gone mid-pull) is then recomputed, where "
                             '"fail" would fail the request')
        extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        client = connect(extra)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            ns = base_namespace(vllm_config, kv_cache_config, extra)
            self._scheduler = SchedulerSide(client, ns, pulls=bool(extra.get("pulls", True)),
                                            background=_flag(extra.get("background_pulls", True)))
            logger.info("kvfabric connector: scheduler side on Ray node %s, namespace %s (%s)",
                        client.node_id, ns.model_id, ns.layout.describe())
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            deadline = extra.get("deadline_s")
            self._worker = WorkerSide(client, num_blocks=int(kv_cache_config.num_blocks),
                                      rank=get_tensor_model_parallel_rank(),
                                      deadline_s=None if deadline is None else float(deadline),   # "inf" parses
                                      audit=_flag(extra.get("audit", True)))

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side call reached the worker-side connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker-side call reached the scheduler-side connector")
        return self._worker

    @property
    def num_requests(self) -> int:
        """Requests this side still tracks."""
        return self._scheduler.num_requests if self._scheduler is not None else self.worker_side.num_requests

    @property
    def requires_kv_delivery(self) -> bool:
        return False     # a store that never lands is a future miss, not a lost answer

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, KVFabricMetadata), \
            f"unexpected connector metadata {type(connector_metadata).__name__}"
        # Before the forward, always: vLLM calls start_load_kv after the forward in steps without loads.
        self.worker_side.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self.worker_side.save_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker_side.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done = self.worker_side.finished(finished_req_ids)
        received = self.worker_side.received()
        return (done or None), (received or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_failed()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.finished(request), None


def _flag(value: Any) -> bool:
    """A boolean `kv_connector_extra_config` value (JSON true/false, or a string from a CLI)."""
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    return bool(value)
