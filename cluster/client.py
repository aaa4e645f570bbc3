"""FabricClient: the `Fabric` protocol from any Ray driver, task or actor, via its node's NodeActor.

    client = FabricClient.connect()            # inside ray.init(...) / a Ray task or actor
    hit = client.lookup(ns, tokens)            # how much of the prompt is cached, and where
    kv = client.load(ns, tokens)               # kv.payloads: uint8 (blocks, layers, bytes), zero-copy
    client.store(ns, tokens, payloads, first_block=kv.num_blocks)
    client.load_blocks(ns, block_ids, parent=parent_id)   # the same, for blocks named by the engine's ids
    client.audit(ns, tokens, own)              # kv.audit_blocks: sampled; the node compares `own` (engine KV)
    client.purge_producer("node-7")            # every node drops the blocks node-7 produced (an operator call)
    client.release_producer("node-7")          # lift a quarantine on every node (an operator call)
    FabricClient.connect(credential="acme.tenant.pem")   # calls as tenant acme (docs/tenants.md)
    FabricClient.connect(credential="ops.operator.pem")  # calls as the operator: purge, node-wide stats

Each call is one Ray actor call to the NodeActor on the caller's own Ray node, so payloads move
through that node's shared-memory object store. Calls name the `NodeApi` method they make
(cluster/api.py), so mypy checks their arguments and answers against what the actor implements.
`a*` methods are the same calls for asyncio code.
Every call waits at most `call_timeout_s` for the NodeActor and then raises `FabricTimeoutError`:
a NodeActor that is stalled never blocks its engine for longer (the engine recomputes instead).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import numpy as np
import ray

from cluster.api import (
    AuditReport,
    EngineLoad,
    EventKeys,
    IncompleteLoadError,
    LoadReply,
    LookupReply,
    NodeApi,
    StoreReply,
    Tokens,
)
from cluster.errors import ClusterError
from cluster.node.actor import node_actor_name
from cluster.tenancy import TenantRefusedError
from fabric.block_ids import BlockId
from fabric.config import ClusterConfig, TenancyConfig
from fabric.keys import Namespace
from transports.trust.tenant_tokens import TenantMinter

DEFAULT_NAMESPACE = "kvfabric"
DEFAULT_CALL_TIMEOUT_S = ClusterConfig().client_timeout_s

P = ParamSpec("P")
R = TypeVar("R")


class FabricUnavailableError(ClusterError, RuntimeError):
    """No NodeActor serves this Ray node (the fabric is not started here, or not yet)."""


class FabricTimeoutError(ClusterError, TimeoutError):
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
        key beside it (`.key`); every call then carries a token of that tenant (docs/tenants.md). An
        operator certificate `<name>.operator.pem` instead makes the node-wide calls (purge, stats)."""
        tenancy = tenancy or TenancyConfig()
        credential = credential or tenancy.credential or None
        tenant = None if credential is None else minter(credential, tenancy.token_ttl_s)
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
        return self._call(NodeApi.lookup, ns, _tokens(tokens), tenant_token=self._token())

    def load(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
             pulls: bool = True, deadline_s: float | None = None, audit: bool = False) -> LoadReply:
        return self._call(NodeApi.load, ns, _tokens(tokens), max_blocks, pulls, deadline_s,
                          tenant_token=self._token(), audit=audit)

    def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        """Sent without waiting for an answer: a report never delays the engine."""
        self._remote(NodeApi.report_prefill, ns, num_tokens, seconds, tenant_token=self._token())

    def report_load(self, load: EngineLoad) -> None:
        """Sent without waiting for an answer: a report never delays the engine."""
        self._remote(NodeApi.report_load, load, tenant_token=self._token())

    def load_layers(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    deadline_s: float | None = None, audit: bool = False) -> RayLayerStream:
        return RayLayerStream(self._remote(NodeApi.load_layers, ns, _tokens(tokens), max_blocks, deadline_s,
                                           tenant_token=self._token(), audit=audit), self)

    def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *, first_block: int = 0,
              event_keys: EventKeys | None = None) -> StoreReply:
        """`Fabric.store`; `event_keys`: how an engine that hashes blocks its own way names them in KV events."""
        return self._call(NodeApi.store, ns, _tokens(tokens), payloads, first_block, tenant_token=self._token(),
                          event_keys=event_keys)

    def audit(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray) -> AuditReport:
        return self._call(NodeApi.audit, ns, _tokens(tokens), payloads, tenant_token=self._token())

    def store_later(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *, first_block: int = 0,
                    event_keys: EventKeys | None = None) -> PendingStore:
        """`store` without waiting for the node: `payloads` are copied into the object store before this
        returns (the caller may reuse them at once); the answer comes through the `PendingStore`."""
        # ray.put copies the payloads into the object store before it returns. Passing the array itself
        # would not: Ray may read it after this call returns, from memory the caller has freed by then.
        stored: Any = ray.put(payloads)
        return PendingStore(self._remote(NodeApi.store, ns, _tokens(tokens), stored, first_block,
                                         tenant_token=self._token(), event_keys=event_keys), self)

    def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *,
                      parent: BlockId | None = None) -> LookupReply:
        return self._call(NodeApi.lookup_blocks, ns, list(block_ids), parent, tenant_token=self._token())

    def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                    max_blocks: int | None = None, pulls: bool = True, audit: bool = False) -> LoadReply:
        return self._call(NodeApi.load_blocks, ns, list(block_ids), parent, max_blocks, pulls,
                          tenant_token=self._token(), audit=audit)

    def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                           max_blocks: int | None = None, audit: bool = False) -> RayLayerStream:
        return RayLayerStream(self._remote(NodeApi.load_blocks_layers, ns, list(block_ids), parent, max_blocks,
                                           tenant_token=self._token(), audit=audit),
                              self)

    def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray, *,
                     parent: BlockId | None = None, first_block: int = 0) -> StoreReply:
        return self._call(NodeApi.store_blocks, ns, list(block_ids), payloads, parent, first_block,
                          tenant_token=self._token())

    def held_block_hashes(self) -> list[bytes]:
        """Every block hash this client's node holds (any layer, any tier); a tenant's client: those
        of its own namespaces."""
        return self._call(NodeApi.held_block_hashes, token=self._token())

    def stats(self) -> dict[str, Any]:
        """The node's statistics (an operator's client, or anyone where tenancy is off); a tenant's
        client: how many of its blocks the node holds."""
        return self._call(NodeApi.stats, token=self._token())

    # ---- calls to the node's actor, typed by NodeApi ------------------------------------------------

    def _remote(self, method: Callable[Concatenate[NodeApi, P], object], *args: P.args, **kwargs: P.kwargs) -> Any:
        """Start `method` on the node's actor (its ObjectRef, or its generator for a layer stream)."""
        return getattr(self.actor, method.__name__).remote(*args, **kwargs)

    def _call(self, method: Callable[Concatenate[NodeApi, P], Awaitable[R]], *args: P.args, **kwargs: P.kwargs
              ) -> R:
        """`method`'s answer from the node's actor, waited for at most `call_timeout_s`."""
        reply: R = self._get(method.__name__, self._remote(method, *args, **kwargs))
        return reply

    async def _acall(self, method: Callable[Concatenate[NodeApi, P], Awaitable[R]], *args: P.args,
                     **kwargs: P.kwargs) -> R:
        """`_call` for asyncio code."""
        reply: R = await self._aget(method.__name__, self._remote(method, *args, **kwargs))
        return reply

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
        that kept it from answering (run it again once that node is back). An operator call: this
        client's credential must be the operator's where anonymous callers are not served."""
        return purge_producer(producer, namespace=namespace, timeout_s=timeout_s, operator=self.tenant)

    def release_producer(self, producer: str, *, namespace: str = DEFAULT_NAMESPACE,
                         timeout_s: float = 60.0) -> dict[str, bool | str]:
        """On every alive node, lift `producer`'s quarantine (docs/security.md). Per node id: whether
        it was quarantined there, or the error that kept the node from answering. An operator call."""
        return release_producer(producer, namespace=namespace, timeout_s=timeout_s, operator=self.tenant)

    def unbind_node(self, node_id: str, *, cluster: ClusterConfig | None = None) -> dict[int, str | None]:
        """`unbind_node` with this client's (operator's) credential."""
        if self.tenant is None:
            raise TenantRefusedError("unbind_node is an operator call: connect with an operator credential")
        return unbind_node(node_id, operator=self.tenant, cluster=cluster)

    # ---- asyncio -----------------------------------------------------------------------------------

    async def alookup(self, ns: Namespace, tokens: Tokens) -> LookupReply:
        return await self._acall(NodeApi.lookup, ns, _tokens(tokens), tenant_token=self._token())

    async def aload(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    pulls: bool = True, deadline_s: float | None = None) -> LoadReply:
        return await self._acall(NodeApi.load, ns, _tokens(tokens), max_blocks, pulls, deadline_s,
                                 tenant_token=self._token())

    async def astore(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *,
                     first_block: int = 0) -> StoreReply:
        return await self._acall(NodeApi.store, ns, _tokens(tokens), payloads, first_block,
                                 tenant_token=self._token())

    async def _aget(self, call: str, ref: Any) -> Any:
        try:
            return await asyncio.wait_for(ref, self.call_timeout_s)
        except TimeoutError:
            raise self._timeout(call) from None


class PendingStore:
    """A store sent to the node and not yet answered (`FabricClient.store_later`)."""

    def __init__(self, ref: Any, client: FabricClient) -> None:
        self._ref = ref
        self._client = client
        self._sent = time.monotonic()
        self.reply: StoreReply | None = None
        self.error: BaseException | None = None
        self._settled = False

    def settled(self, *, wait: bool = False) -> bool:
        """Whether the node answered, failed, or let the client's `call_timeout_s` pass (then `error`
        says which); with `wait`, waits for that first."""
        if self._settled:
            return True
        left = self._client.call_timeout_s - (time.monotonic() - self._sent)
        ready, _ = ray.wait([self._ref], timeout=max(0.0, left) if wait else 0)
        if ready:
            try:
                self.reply = ray.get(self._ref)
            except ray.exceptions.RayError as e:
                self.error = e
        elif left <= 0:
            self.error = self._client._timeout("store")
        else:
            return False
        self._settled = True
        return True


class RayLayerStream:
    """`LayerStream` over the NodeActor's streaming generator: the plan first, then layer by layer."""

    def __init__(self, gen: Any, client: FabricClient) -> None:
        self._gen = gen
        self._client = client
        try:
            plan = client._get("load_layers", next(gen))
            self.num_blocks, self.sources = plan[0], plan[1]
            self.audit_blocks = int(plan[2]) if len(plan) > 2 else 0
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


def minter(credential: str | os.PathLike[str], ttl_s: float = TenancyConfig().token_ttl_s) -> TenantMinter:
    """The token maker of a tenant or operator certificate, its key beside it (`.key`)."""
    return TenantMinter(credential, Path(credential).with_suffix(".key"), ttl_s=ttl_s)


def purge_producer(producer: str, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 60.0,
                   operator: TenantMinter | None = None) -> dict[str, int | str]:
    """`FabricClient.purge_producer` for a driver that has no node of its own (the CLI), calling
    with `operator`'s tokens (None: anonymously, which only nodes without required tenancy admit)."""
    if not producer:
        raise ValueError("purge needs a producer node name")
    return _on_every_node("purge_producer", producer, int, namespace=namespace, timeout_s=timeout_s,
                          operator=operator)


def release_producer(producer: str, *, namespace: str = DEFAULT_NAMESPACE, timeout_s: float = 60.0,
                     operator: TenantMinter | None = None) -> dict[str, bool | str]:
    """`FabricClient.release_producer` for a driver that has no node of its own (the CLI)."""
    if not producer:
        raise ValueError("release needs a producer node name")
    return _on_every_node("release_producer", producer, bool, namespace=namespace, timeout_s=timeout_s,
                          operator=operator)


def _on_every_node(call: str, producer: str, kind: Callable[[Any], R], *, namespace: str, timeout_s: float,
                   operator: TenantMinter | None) -> dict[str, R | str]:
    """Make the operator call `call(producer)` on every alive node's actor; per node id its answer or error."""
    calls: dict[str, Any] = {}
    out: dict[str, R | str] = {}
    token = None if operator is None else operator.token(time.time())
    for node_id in sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive")):
        try:
            actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
            calls[node_id] = getattr(actor, call).remote(producer, token=token)
        except ValueError:
            out[node_id] = "no NodeActor"
    for node_id, ref in calls.items():
        try:
            out[node_id] = kind(ray.get(ref, timeout=timeout_s))
        except TenantRefusedError as e:
            out[node_id] = f"refused: {getattr(e, 'cause', e)}"   # Ray's wrapper keeps the node's error
        except ray.exceptions.RayError as e:
            out[node_id] = type(e).__name__
    return out


def unbind_node(node_id: str, *, operator: TenantMinter, cluster: ClusterConfig | None = None) -> dict[int, str | None]:
    """Clear which certificate the directory binds Ray node `node_id` to, on every shard, and drop what
    it listed under that id (a squatter's reports): the next certificate to report the id binds it.
    An operator call (raises TenantRefusedError otherwise). Per shard: the certificate name it was bound to."""
    from cluster.directory.client import DirectoryClient

    return asyncio.run(DirectoryClient(cluster or ClusterConfig()).unbind(node_id, operator.token(time.time())))


def _tokens(tokens: Tokens) -> np.ndarray:
    """Token ids as a compact array (a Python list of ints pickles several times larger)."""
    return np.asarray(tokens, dtype=np.int64)


if TYPE_CHECKING:
    from cluster.api import Fabric

    # mypy checks that FabricClient offers every Fabric call with a compatible signature.
    _fabric: type[Fabric] = FabricClient
