"""FabricClient: the `Fabric` protocol from any Ray driver, task or actor, via its node's NodeActor.

    client = FabricClient.connect()            # inside ray.init(...) / a Ray task or actor
    hit = client.lookup(ns, tokens)            # how much of the prompt is cached, and where
    kv = client.load(ns, tokens)               # kv.payloads: uint8 (blocks, layers, bytes), zero-copy
    client.store(ns, tokens, payloads, first_block=kv.num_blocks)
    client.load_blocks(ns, block_ids, parent=parent_id)   # the same, for blocks named by the engine's ids
    client.purge_producer("node-7")            # every node drops the blocks node-7 produced
    FabricClient.connect(credential="acme.tenant.pem")   # calls as tenant acme (docs/tenants.md)

Each call is one Ray actor call to the NodeActor on the caller's own Ray node, so payloads move
through that node's shared-memory object store. `a*` methods are the same calls for asyncio code.
Every call waits at most `call_timeout_s` for the NodeActor and then raises `FabricTimeoutError`:
a NodeActor that is stalled never blocks its engine for longer (the engine recomputes instead).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from cluster.api import EngineLoad, IncompleteLoadError, LoadReply, LookupReply, StoreReply, Tokens
from cluster.node_actor import node_actor_name
from fabric.block_ids import BlockId
from fabric.config import ClusterConfig, TenancyConfig
from fabric.keys import Namespace
from transports.tenant_tokens import TenantMinter

DEFAULT_NAMESPACE = "kvfabric"
DEFAULT_CALL_TIMEOUT_S = ClusterConfig().client_timeout_s


class FabricUnavailableError(RuntimeError):
    """No NodeActor serves this Ray node (the fabric is not started here, or not yet)."""


class FabricTimeoutError(TimeoutError):
    """The node's NodeActor did not answer a call within the client's `call_timeout_s`."""


class FabricClient:
    def __init__(self, actor: ray.actor.ActorHandle, node_id: str, *,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, tenant: TenantMinter | None = None) -> None:
        self.actor = actor
        self.node_id = node_id
        self.call_timeout_s = call_timeout_s
        self.tenant = tenant

    def _token(self) -> bytes | None:
        """This client's tenant token (None: it calls as the anonymous tenant)."""
        return None if self.tenant is None else self.tenant.token(time.time())

    @classmethod
    def connect(cls, *, node_id: str | None = None, namespace: str = DEFAULT_NAMESPACE,
                timeout_s: float = 30.0, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                credential: str | os.PathLike[str] | None = None, tenancy: TenancyConfig | None = None
                ) -> FabricClient:
        """The client of this process's Ray node (or of `node_id`); waits up to `timeout_s` for the
        supervisor to start its NodeActor. Each later call waits at most `call_timeout_s`.

        `credential` (else `tenancy.credential`): a tenant certificate `<name>.tenant.pem` with its
        key beside it (`.key`); every call then carries a token of that tenant (docs/tenants.md)."""
        tenancy = tenancy or TenancyConfig()
        credential = credential or tenancy.credential or None
        tenant = None if credential is None else TenantMinter(
            credential, Path(credential).with_suffix(".key"), ttl_s=tenancy.token_ttl_s)
        if not ray.is_initialized():
            raise FabricUnavailableError("Ray is not initialised: call ray.init(address=...) first")
        node_id = node_id or ray.get_runtime_context().get_node_id()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
                ray.get(actor.ping.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return cls(actor, node_id, call_timeout_s=call_timeout_s, tenant=tenant)
            except (ValueError, ray.exceptions.RayError) as e:
                if time.monotonic() >= deadline:
                    raise FabricUnavailableError(
                        f"no kvfabric NodeActor answers on Ray node {node_id} in namespace {namespace!r} "
                        f"after {timeout_s:.0f} s; start the fabric with `kvfabric start` ({e})") from None
                time.sleep(0.2)

    # ---- synchronous -------------------------------------------------------------------------------

    def lookup(self, ns: Namespace, tokens: Tokens) -> LookupReply:
        reply: LookupReply = self._get("lookup", self.actor.lookup.remote(ns, _tokens(tokens),
                                                                           tenant_token=self._token()))
        return reply

    def load(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
             pulls: bool = True, deadline_s: float | None = None) -> LoadReply:
        reply: LoadReply = self._get("load", self.actor.load.remote(ns, _tokens(tokens), max_blocks, pulls,
                                                                     deadline_s, tenant_token=self._token()))
        return reply

    def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        """Sent without waiting for an answer: a report never delays the engine."""
        self.actor.report_prefill.remote(ns, num_tokens, seconds, tenant_token=self._token())

    def report_load(self, load: EngineLoad) -> None:
        """Sent without waiting for an answer: a report never delays the engine."""
        self.actor.report_load.remote(load)

    def load_layers(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    deadline_s: float | None = None) -> RayLayerStream:
        return RayLayerStream(self.actor.load_layers.remote(ns, _tokens(tokens), max_blocks, deadline_s,
                                                            tenant_token=self._token()), self)

    def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *, first_block: int = 0) -> StoreReply:
        reply: StoreReply = self._get("store", self.actor.store.remote(ns, _tokens(tokens), payloads, first_block,
                                                                       tenant_token=self._token()))
        return reply

    def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *,
                      parent: BlockId | None = None) -> LookupReply:
        reply: LookupReply = self._get("lookup_blocks", self.actor.lookup_blocks.remote(
            ns, list(block_ids), parent, tenant_token=self._token()))
        return reply

    def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                    max_blocks: int | None = None, pulls: bool = True) -> LoadReply:
        reply: LoadReply = self._get("load_blocks",
                                     self.actor.load_blocks.remote(ns, list(block_ids), parent, max_blocks, pulls,
                                                                   tenant_token=self._token()))
        return reply

    def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                           max_blocks: int | None = None) -> RayLayerStream:
        return RayLayerStream(self.actor.load_blocks_layers.remote(ns, list(block_ids), parent, max_blocks,
                                                                   tenant_token=self._token()), self)

    def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray, *,
                     parent: BlockId | None = None, first_block: int = 0) -> StoreReply:
        reply: StoreReply = self._get("store_blocks", self.actor.store_blocks.remote(ns, list(block_ids), payloads,
                                                                                   parent, first_block,
                                                                                   tenant_token=self._token()))
        return reply

    def held_block_hashes(self) -> list[bytes]:
        """Every block hash this client's node holds (any layer, any tier)."""
        held: list[bytes] = self._get("held_block_hashes", self.actor.held_block_hashes.remote())
        return held

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = self._get("stats", self.actor.stats.remote())
        return out

    def _get(self, call: str, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=self.call_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._timeout(call) from None

    def _timeout(self, call: str) -> FabricTimeoutError:
        return FabricTimeoutError(f"kvfabric NodeActor of Ray node {self.node_id} did not answer {call} within "
                                  f"{self.call_timeout_s:g} s; recompute instead, or raise call_timeout_s")

    def purge_producer(self, producer: str, *, namespace: str = DEFAULT_NAMESPACE,
                       timeout_s: float = 60.0) -> dict[str, int | str]:
        """On every alive node, delete every block whose provenance names `producer` (a node's
        certificate name). Per node id: how many (block, layer) payloads it removed, or the error
        that kept it from answering (run it again once that node is back)."""
        return purge_producer(producer, namespace=namespace, timeout_s=timeout_s)

    # ---- asyncio -----------------------------------------------------------------------------------

    async def alookup(self, ns: Namespace, tokens: Tokens) -> LookupReply:
        reply: LookupReply = await self._aget("lookup", self.actor.lookup.remote(ns, _tokens(tokens),
                                                                                  tenant_token=self._token()))
        return reply

    async def aload(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    pulls: bool = True, deadline_s: float | None = None) -> LoadReply:
        reply: LoadReply = await self._aget("load", self.actor.load.remote(ns, _tokens(tokens), max_blocks, pulls,
                                                                            deadline_s, tenant_token=self._token()))
        return reply

    async def astore(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *,
                     first_block: int = 0) -> StoreReply:
        reply: StoreReply = await self._aget("store",
                                             self.actor.store.remote(ns, _tokens(tokens), payloads, first_block,
                                                                     tenant_token=self._token()))
        return reply

    async def _aget(self, call: str, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self.call_timeout_s)
        except TimeoutError:
            raise self._timeout(call) from None


class RayLayerStream:
    """`LayerStream` over the NodeActor's streaming generator: the plan first, then layer by layer."""

    def __init__(self, gen: Any, client: FabricClient) -> None:
        self._gen = gen
        self._client = client
        try:
            self.num_blocks, self.sources = client._get("load_layers", next(gen))
        except StopIteration:
            raise RuntimeError("load_layers ended before sending its plan") from None

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for layer, ref in enumerate(self._gen):
            try:
                yield layer, self._client._get("load_layers", ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, IncompleteLoadError):
                    raise e.cause from None
                raise


def purge_producer(producer: str, *, namespace: str = DEFAULT_NAMESPACE,
                   timeout_s: float = 60.0) -> dict[str, int | str]:
    """`FabricClient.purge_producer` for a driver that has no node of its own (the CLI)."""
    if not producer:
        raise ValueError("purge needs a producer node name")
    calls: dict[str, Any] = {}
    out: dict[str, int | str] = {}
    for node_id in sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive")):
        try:
            actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
            calls[node_id] = actor.purge_producer.remote(producer)
        except ValueError:
            out[node_id] = "no NodeActor"
    for node_id, ref in calls.items():
        try:
            out[node_id] = int(ray.get(ref, timeout=timeout_s))
        except ray.exceptions.RayError as e:
            out[node_id] = type(e).__name__
    return out


def _tokens(tokens: Tokens) -> np.ndarray:
    """Token ids as a compact array (a Python list of 4k ints pickles ~5x larger)."""
    return np.asarray(tokens, dtype=np.int64)
