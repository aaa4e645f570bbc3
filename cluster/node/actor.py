"""NodeActor: one per Ray node, named by node id. Its life cycle and its `NodeApi` (cluster/api.py).

    engine ──FabricClient──► NodeActor ──► NodeLoader (node/reads.py): local tiers, directory,
                                           pull plans, deadline cuts, pulls, mirrors, estimates
    Store events ──► DirectoryUpkeep (directory/upkeep.py) ──► DirectoryActor.report (signed Reports)
                 └─► KvEventPublisher (when [events] enabled) ──► ZMQ PUB, vLLM's KV event format

What the node holds while it serves (certificates, Store, transport server and client, /metrics,
KV events) is a `NodeRuntime` (node/runtime.py); `stats()` is assembled by node/stats.py. Every
public method starts the node if needed, then hands over: each reads like a call to the part that
does the work.

Provenance (docs/provenance.md): `store` signs what it stores as one run (a record per block, one
signature) with this node's certificate key (`NodeSigner`); a pull accepts only payloads whose
producer's record verifies against the cluster CA and its revocation list (`TrustAnchor`, reread
when crl.pem changes); a mirror keeps the producer's records; `purge_producer` deletes what a
producer's records name.

Tenants (docs/tenants.md): every public call that takes a namespace rebinds it first to the salt of
the tenant its `tenant_token` proves (cluster/tenancy.py); the caller's salt is never used.

An async Ray actor: every method runs on one event loop, Store calls that touch files run on a
thread pool. It starts on its first call (the supervisor pings it right after creation and again
after Ray restarts it), so a restarted actor reopens its folders under a new incarnation. Payloads
leave and enter as numpy arrays, so Ray moves them through the object store without a copy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import ray

from cluster.api import (
    AuditReport,
    EngineLoad,
    EventKeys,
    LoadReply,
    LookupReply,
    StoreReply,
    Tokens,
    check_block_payloads,
    check_payloads,
)
from cluster.directory.client import DirectoryClient
from cluster.directory.types import derived_node_name
from cluster.directory.upkeep import DirectoryUpkeep
from cluster.node.audit import NodeAuditor
from cluster.node.reads import NodeLoader
from cluster.node.runtime import NodeRuntime
from cluster.node.stats import node_stats
from fabric.block_ids import BlockId, block_id_hashes
from fabric.config import Config, Environment
from fabric.events import EventKind
from fabric.keys import BlockHash, Namespace, block_hashes

if TYPE_CHECKING:
    from cluster.api import NodeApi

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def _no_retries(method: F) -> F:
    """`ray.method(max_task_retries=0)`, keeping the method's type for mypy (ray.method is untyped)."""
    marked: F = ray.method(max_task_retries=0)(method)
    return marked


def node_actor_name(node_id: str) -> str:
    return f"kvfabric-node-{node_id}"


def node_name_for(node_id: str) -> str:
    """The certificate / transport name and folder of a Ray node: `$KVFABRIC_NODE_NAME` when the
    node's environment sets it (e.g. the Kubernetes node name, so a restarted pod finds its SSD
    blocks again under a new Ray node id), else derived from the Ray node id (stable across restarts
    of the actor on that node)."""
    return Environment.read().node_name or derived_node_name(node_id)


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

    # ---- life cycle --------------------------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        await self._ensure_started()
        return {"node_id": self.node_id, "incarnation": self.incarnation, "address": self.rt.address}

    async def _ensure_started(self) -> None:
        if self._started:
            return
        async with self._start_lock:
            if not self._started:
                await self._start()
                self._started = True

    async def _start(self) -> None:
        rt = self.rt = NodeRuntime(self.config, node_id=self.node_id, node_name=self.node_name,
                                   incarnation=self.incarnation)
        await rt.start()
        c = self.config.cluster
        self.directory = DirectoryClient(c)
        rt.metrics.watch_breakers(self.directory.breakers)
        self.upkeep = DirectoryUpkeep(self.directory, c, address=rt.address, reports=rt.reports,
                                      held=rt.held_versions, metrics=rt.metrics, clock=time.monotonic)
        self.loader = NodeLoader(self.config, node_id=self.node_id, transport=rt.address.transport, local=rt.local,
                                 directory=self.directory, client=rt.client, verifier=rt.verifier,
                                 metrics=rt.metrics, kv_events=rt.kv_events, spawn=self._spawn,
                                 tenants_of=rt.tenancy.tenants_of)
        self.auditor = NodeAuditor(self.config, node_id=self.node_id, node_name=self.node_name,
                                   ray_namespace=c.namespace, signer=rt.signer, trust=lambda: rt.trust,
                                   loader=self.loader, local=rt.local, store=rt.kv_store, metrics=rt.metrics,
                                   book_path=rt.quarantine_path, spawn=self._spawn)
        self._spawn(self.upkeep.run_forever(self._feed_events, rt.reload_revocations))
        self._spawn(self.auditor.catch_up())
        logger.info("node %s (incarnation %d) serving %s on %s:%d, metrics on :%d, %d blocks held",
                    self.node_id, self.incarnation, rt.address.transport, rt.address.host, rt.address.port,
                    rt.metrics_port, len(rt.kv_store.held_addresses()))

    def _feed_events(self) -> None:
        """The store's new events, to the directory (with the stored blocks' versions) and to KV event
        subscribers; the directory upkeep calls this at the start of each of its passes."""
        store = self.rt.kv_store
        events = store.take_events()
        stored = [a for kind, a in events.events if kind is EventKind.STORED]
        versions = dict(zip((bytes(a.hash) for a in stored), store.versions_of(stored), strict=True)) \
            if stored else None
        self.upkeep.record([(a.hash, kind is EventKind.STORED) for kind, a in events.events], events.overflowed,
                           versions)
        if self.rt.kv_events is not None:
            self.rt.kv_events.drain(events, store.held_addresses)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def shutdown(self) -> None:
        """Stop serving and close the store (the actor is then killed by the caller)."""
        if not self._started:
            return
        for task in list(self._tasks):
            task.cancel()
        await self.rt.close_serving()
        await self.loader.close()   # a mirror in progress ends first
        await self.rt.close_store()
        self._started = False

    async def _held_hashes(self) -> set[bytes]:
        return await self.rt.held_hashes()

    # ---- the Fabric API ----------------------------------------------------------------------------

    async def lookup(self, ns: Namespace, tokens: Tokens, *, tenant_token: bytes | None = None) -> LookupReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        return await self.loader.lookup(ns, block_hashes(ns, tokens))

    async def set_send_rate(self, mb_s: float, *, token: bytes | None = None) -> None:
        """Cap (or, with 0, uncap) what this node's TLS-TCP server sends, MB/s, at run time: an
        operator's throttle, e.g. while the node's NIC serves inference traffic."""
        await self._ensure_started()
        self.rt.tenancy.operator(token, "set_send_rate")
        self.rt.set_send_rate(mb_s)

    async def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float, *,
                             tenant_token: bytes | None = None) -> None:
        """An engine on this node computed `num_tokens` of prefill in `seconds` (see `Fabric`)."""
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        self.loader.report_prefill(ns, num_tokens, seconds)

    async def report_load(self, load: EngineLoad, *, tenant_token: bytes | None = None) -> None:
        """The load an engine on this node reports; every lookup returns it (for routers). Any caller
        this node serves may report (engines run as tenants); others are refused."""
        await self._ensure_started()
        self.rt.tenancy.admit(tenant_token)
        self.loader.report_load(load)

    async def load(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                   pulls: bool = True, deadline_s: float | None = None, *,
                   tenant_token: bytes | None = None, audit: bool = False) -> LoadReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        return await self.loader.load(ns, block_hashes(ns, tokens)[:max_blocks], pulls, tokens=tokens,
                                      deadline_s=deadline_s, sample=audit)

    # A layer stream is never stitched from two runs (the plans may differ): a restart ends it.
    @_no_retries
    async def load_layers(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                          deadline_s: float | None = None, *, tenant_token: bytes | None = None,
                          audit: bool = False) -> AsyncIterator[Any]:
        """A Ray streaming generator: first `(num_blocks, sources)`, then each layer's array, in order.
        `deadline_s` plans the pulls as `load` does (never cuts: the stream has promised its blocks)."""
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        async for item in self.loader.load_layers(ns, block_hashes(ns, tokens)[:max_blocks], tokens, deadline_s,
                                                  sample=audit):
            yield item

    async def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, first_block: int = 0, *,
                    tenant_token: bytes | None = None, event_keys: EventKeys | None = None) -> StoreReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        num_blocks = check_payloads(ns, tokens, payloads, first_block)
        if event_keys is not None and event_keys.extra_keys and len(event_keys.extra_keys) != num_blocks:
            raise ValueError(f"event_keys names {len(event_keys.extra_keys)} blocks' extra keys for a store of "
                             f"{num_blocks} blocks")
        return await self._write(ns, block_hashes(ns, tokens)[:first_block + num_blocks], payloads, first_block,
                                 tokens, event_keys)

    async def _write(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: np.ndarray, first_block: int,
                     tokens: Tokens | None, event_keys: EventKeys | None = None) -> StoreReply:
        """Store `payloads` as `hashes[first_block:]`, signed by this node (their producer)."""
        self.loader.note_chain(ns, hashes, first_block, len(hashes), tokens,
                               extra_keys=event_keys.extra_keys or None if event_keys else None,
                               lora_name=event_keys.lora_name if event_keys else None)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self.rt.local.write_blocks(ns, hashes[first_block:], payloads, signer=self.rt.signer))

    async def audit(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *,
                    tenant_token: bytes | None = None) -> AuditReport:
        """Compare the engine's own KV of the prompt's first blocks with what their producers signed
        (see `Fabric.audit`); a producer found lying is quarantined cluster-wide."""
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        num_blocks = check_payloads(ns, tokens, payloads, 0)
        return await self.auditor.audit(ns, block_hashes(ns, tokens)[:num_blocks], payloads)

    async def quarantine_notice(self, entry: dict[str, Any]) -> bool:
        """A peer's quarantine entry (believed only with a valid checker's signature; cluster/node/quarantine.py)."""
        await self._ensure_started()
        return bool(await self.auditor.learn([entry], releases=False))

    async def quarantine_entries(self) -> list[dict[str, Any]]:
        await self._ensure_started()
        return self.auditor.entries()

    async def set_audit_rate(self, rate: float, *, token: bytes | None = None) -> None:
        """This node's base sampling rate from now until it restarts (e.g. raised while a producer is
        suspected, or paired runs of a benchmark). Operator only."""
        await self._ensure_started()
        self.rt.tenancy.operator(token, "set_audit_rate")
        self.auditor.set_rate(rate)

    async def release_producer(self, producer: str, *, token: bytes | None = None) -> bool:
        """Lift `producer`'s quarantine on this node (the client calls every node). Operator only."""
        await self._ensure_started()
        self.rt.tenancy.operator(token, "release_producer")
        return await self.auditor.release(producer)

    # ---- the Fabric API by block ids (fabric/block_ids.py): the same paths from the block hashes on ----

    async def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None, *,
                            tenant_token: bytes | None = None) -> LookupReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        return await self.loader.lookup(ns, block_id_hashes(ns, block_ids, parent))

    async def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                          max_blocks: int | None = None, pulls: bool = True, *,
                          tenant_token: bytes | None = None, audit: bool = False) -> LoadReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        return await self.loader.load(ns, block_id_hashes(ns, block_ids[:max_blocks], parent), pulls, sample=audit)

    @_no_retries
    async def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                                 max_blocks: int | None = None, *, tenant_token: bytes | None = None,
                                 audit: bool = False) -> AsyncIterator[Any]:
        """`load_layers` for a chain of block ids."""
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        async for item in self.loader.load_layers(ns, block_id_hashes(ns, block_ids[:max_blocks], parent), None,
                                                  sample=audit):
            yield item

    async def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray,
                           parent: BlockId | None = None, first_block: int = 0, *,
                           tenant_token: bytes | None = None) -> StoreReply:
        await self._ensure_started()
        ns = self.rt.tenancy.bind(ns, tenant_token)
        num_blocks = check_block_payloads(ns, len(block_ids), payloads, first_block)
        return await self._write(ns, block_id_hashes(ns, block_ids[:first_block + num_blocks], parent), payloads,
                                 first_block, None)

    # ---- operations --------------------------------------------------------------------------------

    async def held_block_hashes(self, *, token: bytes | None = None) -> list[bytes]:
        """Every block hash this node holds in any tier (any layer of it): what its KV events announce.
        A tenant's `token`: only the blocks of its own namespaces."""
        await self._ensure_started()
        return sorted(await self._visible_hashes(token, "held_block_hashes"))

    async def purge_producer(self, producer: str, *, token: bytes | None = None) -> int:
        """Delete every block held here whose provenance names `producer`; returns how many
        (block, layer) payloads. The directory forgets them through the usual removal events.
        An operator call (docs/tenants.md)."""
        await self._ensure_started()
        self.rt.tenancy.operator(token, "purge_producer")
        removed = await asyncio.get_running_loop().run_in_executor(None, self.rt.kv_store.purge_producer,
                                                                   producer)
        self.rt.metrics.purged.inc(removed)
        logger.warning("purged %d payloads produced by %s", removed, producer)
        return removed

    async def stats(self, *, token: bytes | None = None) -> dict[str, Any]:
        """The node's statistics (the operator's); a tenant's `token`: its own blocks held here."""
        await self._ensure_started()
        tenants = self.rt.tenancy.scope(token, "stats")
        if tenants is None:
            return {**node_stats(self.rt, self.loader, self.upkeep, self.directory),
                    "quarantined": sorted(self.auditor.book.quarantined())}
        return {"node_id": self.node_id, "node_name": self.node_name, "tenants": sorted(tenants),
                "held_blocks": len(await self._visible_hashes(token, "stats"))}

    async def _visible_hashes(self, token: bytes | None, call: str) -> set[bytes]:
        """The block hashes held here that the caller of `call` may list (see `TenantGate.scope`)."""
        gate = self.rt.tenancy
        tenants = gate.scope(token, call)
        if tenants is None:
            return await self._held_hashes()
        held = await asyncio.get_running_loop().run_in_executor(
            None, self.rt.kv_store.held_addresses_where,
            lambda prov: prov is not None and gate.in_scope(prov.namespace, tenants))
        return {a.hash for a in held}


if TYPE_CHECKING:
    # mypy sees the class itself here (it ignores what a class decorator returns; at run time the
    # name is Ray's actor class): every NodeApi call must exist on it with a compatible signature.
    _node_api: type[NodeApi] = NodeActor
