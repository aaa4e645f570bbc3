"""What the connector's scheduler side tells its workers for one engine step.

    KVFabricMetadata
      loads: LoadSpec per request with a fabric hit this step: read blocks
             first_block .. first_block + len(block_ids) of `tokens` into vLLM pages `block_ids`,
             during the step's forward, or in the background (the request waits for it)
      saves: SaveSpec per request whose prompt completed new full blocks this step: store
             blocks first_block .. first_block + len(block_ids) from pages `block_ids`
      audits: AuditSpec per request whose sampled load (see below) vLLM has now recomputed:
             gather pages `block_ids` (blocks 0 ..) after the forward and hand them to `Fabric.audit`
      prefill_tokens: tokens this step computes without any load (the node's prefill rate)

    KVFabricWorkerMetadata (worker -> scheduler, after each step)
      sampled: request -> blocks its load was sampled for (the node's `audit_blocks`): the worker
             loaded nothing of it, reported its blocks as failed, and audits them once recomputed

Specs carry the request's namespace and the token ids that key its blocks (int64, only up to the
last block named), so a worker needs nothing but its own TP rank to act on them. The metadata
crosses to worker processes pickled by vLLM, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from cluster.api import EventKeys
from fabric.keys import Namespace


@dataclass(frozen=True, slots=True)
class LoadSpec:
    req_id: str
    ns: Namespace
    tokens: np.ndarray           # int64, the prompt up to the end of the last block to load
    first_block: int             # blocks before it are already in vLLM's pages (its own prefix cache)
    block_ids: tuple[int, ...]   # vLLM pages of blocks first_block, first_block + 1, ...
    background: bool = False     # vLLM's asynchronous load: the request waits outside the batch

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class SaveSpec:
    req_id: str
    ns: Namespace
    tokens: np.ndarray           # int64, the prompt up to the end of the last block to store
    first_block: int
    block_ids: tuple[int, ...]
    event_keys: EventKeys | None = None   # vLLM's extra keys of these blocks, for KV events

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True)
class AuditSpec:
    req_id: str
    ns: Namespace
    tokens: np.ndarray           # int64, the prompt up to the end of the last sampled block
    block_ids: tuple[int, ...]   # vLLM pages of blocks 0, 1, ... (its prefix cache's included)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class KVFabricMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    audits: list[AuditSpec] = field(default_factory=list)
    prefill_tokens: int = 0


@dataclass
class KVFabricWorkerMetadata(KVConnectorWorkerMetadata):
    sampled: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Every TP rank's samples (each rank's load is drawn on its own): the most blocks per request."""
        assert isinstance(other, KVFabricWorkerMetadata), f"unexpected worker metadata {type(other).__name__}"
        merged = dict(self.sampled)
        for req_id, num_blocks in other.sampled.items():
            merged[req_id] = max(num_blocks, merged.get(req_id, 0))
        return KVFabricWorkerMetadata(merged)
