"""What an engine sees of the fabric: `lookup / load / load_layers / store` over token prefixes,
and the same four over chains of the engine's own block ids (`*_blocks`, see fabric/block_ids.py).

Payloads cross this boundary as one uint8 array per request, never as Python bytes objects:

    payloads[block, layer, :]   uint8, shape (num_blocks, layout.num_layers, bytes_per_block_layer)

`bytes_per_block_layer = ns.layout.bytes_per_block_layer(ns.block_size)`; how an engine lays out
K and V inside those bytes is its own business (both ends of a reuse run the same engine, and the
namespace names the layout). Only full blocks are cached: a prompt of `n` tokens has
`n // block_size` addressable blocks, and a hit is always a leading run of them. A chain of block
ids has one block per id; its parent id (None for a sequence's first block) names what precedes it.
Both paths end in the same block hashes, tiers, pulls and digest checks.

`Fabric` is the protocol; `FabricClient` (cluster/client.py) implements it over the node's Ray
actor, `LocalFabric` (cluster/node/local.py) over one in-process `Store` with no Ray at all. `NodeApi`
is what that actor answers (cluster/node/actor.py implements it, `FabricClient` calls it); mypy
checks all three against these protocols.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cluster.errors import ClusterError
from fabric.block_ids import BlockId
from fabric.keys import Namespace

Tokens = Sequence[int] | np.ndarray


class Where(enum.StrEnum):
    """Where a leading block of a lookup is."""

    DEVICE = "device"
    RAM = "ram"
    SSD = "ssd"
    PEER = "peer"      # not on this node; the directory names a live owner


@dataclass(frozen=True, slots=True)
class BlockLocation:
    where: Where
    node_id: str       # the owner: this node for DEVICE/RAM/SSD, a peer for PEER


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the engines of a node report they have to do (`Fabric.report_load`)."""

    running_requests: int = 0
    queued_requests: int = 0
    queued_prefill_tokens: int = 0    # prompt tokens accepted but not yet computed

    @property
    def requests(self) -> int:
        return self.running_requests + self.queued_requests


@dataclass(frozen=True, slots=True)
class CacheFill:
    """How much of a node's cache is in use, in blocks of the namespace asked about: its larger tier's
    capacity, and what its fuller tier holds. A node with room stores new blocks without evicting."""

    held_blocks: int = 0
    capacity_blocks: int = 0     # 0: not known


@dataclass(frozen=True, slots=True)
class EventKeys:
    """How an engine that hashes blocks its own way names the blocks of a store, for KV events
    (docs/kv-events.md): per stored block its extra hash keys (vLLM's LoRA, cache_salt, ...; None for
    none), and the LoRA adapter's name. They travel only where events may show the tenant's tokens."""

    extra_keys: tuple[tuple[Any, ...] | None, ...] = ()
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class LookupReply:
    """The longest cached leading run of a prompt's blocks, local or on a live peer, the load the
    answering node's engines last reported and how full its cache is (what a router weighs against
    the cached prefix)."""

    block_size: int
    locations: tuple[BlockLocation, ...]   # one per leading cached block
    load: EngineLoad = EngineLoad()
    fill: CacheFill = CacheFill()

    @property
    def num_blocks(self) -> int:
        return len(self.locations)

    @property
    def num_tokens(self) -> int:
        return len(self.locations) * self.block_size

    @property
    def num_local_blocks(self) -> int:
        """Leading blocks held by this node (before the first one that needs a pull)."""
        n = 0
        for loc in self.locations:
            if loc.where is Where.PEER:
                break
            n += 1
        return n


@dataclass(frozen=True, slots=True)
class LoadReply:
    """KV of the longest prefix that was loaded and verified; every byte matched its digest."""

    block_size: int
    payloads: np.ndarray          # uint8 (num_blocks, num_layers, bytes_per_block_layer), read-only
    sources: tuple[str, ...]      # per block: "device" / "ram" / "ssd" / "peer:<node id>"
    pulled_bytes: int             # bytes that came over a transport for this request
    # Sampled for audit: nothing was pulled (only local blocks are here); the engine computes blocks
    # 0 .. audit_blocks itself and passes them to `Fabric.audit`. An engine that ignores it just misses.
    audit_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return int(self.payloads.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_pulled_blocks(self) -> int:
        return sum(1 for s in self.sources if s.startswith("peer:"))


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What `Fabric.audit` found: blocks compared with their producer's signed payload."""

    num_checked: int                       # blocks compared (another producer's, signed, found)
    num_mismatched: int                    # of those, beyond the tolerance (or not bitwise equal)
    producers: tuple[str, ...] = ()        # the producers whose blocks were compared
    quarantined: tuple[str, ...] = ()      # producers this audit caught (quarantined cluster-wide)


@dataclass(frozen=True, slots=True)
class StoreReply:
    num_stored: int      # blocks whose every layer was acknowledged (or already held)
    num_refused: int     # blocks with at least one layer refused (tier full, no space, ...)


class LayerStream(Protocol):
    """A load delivered layer by layer, layer 0 first, so compute can start before the rest arrives.

    `num_blocks` is known before the first layer (the plan is made first). Iterating yields
    `(layer, array)` with `array` uint8 `(num_blocks, bytes_per_block_layer)`. If a block fails
    verification after layers were delivered, the stream stays consistent by never shrinking:
    a layer that cannot be completed for all `num_blocks` raises `IncompleteLoadError`, and the
    caller recomputes (it has not run any token on wrong KV, only started on right KV).
    """

    num_blocks: int
    sources: tuple[str, ...]
    audit_blocks: int    # as LoadReply's: sampled, only local blocks come; compute and audit this many

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]: ...


class IncompleteLoadError(ClusterError):
    """A layer-wise load could not deliver a layer for every planned block (peer died, corrupt)."""


class Fabric(Protocol):
    """The engine-facing API. Every method is safe to call concurrently."""

    def lookup(self, ns: Namespace, tokens: Tokens) -> LookupReply: ...

    def load(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
             deadline_s: float | None = None, audit: bool = False) -> LoadReply:
        """The longest verified cached prefix. Pulls are made only where they are expected to land
        before the engine could compute the same tokens, and are cut at `deadline_s` (by default the
        node's own estimate of that break-even); what arrived in time is returned. `deadline_s=math.inf`
        pulls everything the owners hold and never cuts. `audit=True`: the caller (an engine) computes
        the blocks and calls `audit` when the reply names `audit_blocks`; only such loads are sampled."""
        ...

    def load_layers(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    deadline_s: float | None = None, audit: bool = False) -> LayerStream:
        """`load`, layer by layer; pulls are planned by `deadline_s` the same way but never cut."""
        ...

    def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        """An engine computed `num_tokens` of prefill in `seconds`: the rate loads are planned by."""
        ...

    def report_load(self, load: EngineLoad) -> None:
        """The engine's current load, returned with every lookup of its node (for routers)."""
        ...

    def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *, first_block: int = 0) -> StoreReply:
        """Store `payloads` for blocks `first_block .. first_block + len(payloads)` of `tokens`."""
        ...

    def audit(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray) -> AuditReport:
        """Compare KV the engine computed itself, `payloads` for blocks `0 .. len(payloads)` of `tokens`
        (as `store` takes them), with what those blocks' producers signed: the node reads its own
        copies or pulls them (verified as any pull), skips blocks it produced itself, and quarantines
        a producer whose signed KV differs beyond the `[audit]` tolerance (docs/security.md). Call it
        after computing the blocks of a load whose reply named `audit_blocks`; any engine may call it."""
        ...

    def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *,
                      parent: BlockId | None = None) -> LookupReply: ...

    def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                    max_blocks: int | None = None, audit: bool = False) -> LoadReply: ...

    def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                           max_blocks: int | None = None, audit: bool = False) -> LayerStream: ...

    def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray, *,
                     parent: BlockId | None = None, first_block: int = 0) -> StoreReply:
        """Store `payloads` for `block_ids[first_block:first_block + len(payloads)]`."""
        ...


class NodeApi(Protocol):
    """The calls a node's actor answers, as a caller passes them through Ray: positional arguments,
    each call a coroutine, the two layer streams async generators that yield `(num_blocks, sources,
    audit_blocks)` first and then one uint8 array `(num_blocks, bytes_per_block_layer)` per layer. The Fabric calls
    mean what they mean in `Fabric`; `pulls=False` answers from this node's own tiers only;
    `tenant_token` proves the caller's tenant (docs/tenants.md). `token` of the node-wide calls is a
    tenant's (who then sees only its own) or the operator's (who sees and may change everything)."""

    async def ping(self) -> dict[str, Any]:
        """Start the node if it has not started; its id, incarnation and transport address."""
        ...

    async def shutdown(self) -> None: ...

    async def lookup(self, ns: Namespace, tokens: Tokens, *, tenant_token: bytes | None = None) -> LookupReply: ...

    async def load(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                   pulls: bool = True, deadline_s: float | None = None, *,
                   tenant_token: bytes | None = None, audit: bool = False) -> LoadReply: ...

    def load_layers(self, ns: Namespace, tokens: Tokens, max_blocks: int | None = None,
                    deadline_s: float | None = None, *, tenant_token: bytes | None = None, audit: bool = False
                    ) -> AsyncIterator[Any]: ...

    async def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, first_block: int = 0, *,
                    tenant_token: bytes | None = None, event_keys: EventKeys | None = None) -> StoreReply: ...

    async def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None, *,
                            tenant_token: bytes | None = None) -> LookupReply: ...

    async def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                          max_blocks: int | None = None, pulls: bool = True, *,
                          tenant_token: bytes | None = None, audit: bool = False) -> LoadReply: ...

    def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], parent: BlockId | None = None,
                           max_blocks: int | None = None, *, tenant_token: bytes | None = None,
                           audit: bool = False) -> AsyncIterator[Any]: ...

    async def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray,
                           parent: BlockId | None = None, first_block: int = 0, *,
                           tenant_token: bytes | None = None) -> StoreReply: ...

    async def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float, *,
                             tenant_token: bytes | None = None) -> None: ...

    async def report_load(self, load: EngineLoad, *, tenant_token: bytes | None = None) -> None: ...

    async def audit(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *,
                    tenant_token: bytes | None = None) -> AuditReport: ...

    async def quarantine_notice(self, entry: dict[str, Any]) -> bool:
        """A peer's signed quarantine (or a release it learned): merged if newer; True if it changed anything."""
        ...

    async def quarantine_entries(self) -> list[dict[str, Any]]:
        """Every producer's latest quarantine or release this node knows (what a restarted peer merges)."""
        ...

    async def set_audit_rate(self, rate: float, *, token: bytes | None = None) -> None:
        """Set this node's base sampling rate (`[audit] rate`) until it restarts. Operator only."""
        ...

    async def release_producer(self, producer: str, *, token: bytes | None = None) -> bool:
        """Lift `producer`'s quarantine here (True if it was quarantined). Operator only."""
        ...

    async def held_block_hashes(self, *, token: bytes | None = None) -> list[bytes]:
        """Every block hash the node holds in any tier (any layer of it); a tenant's: those of its namespaces."""
        ...

    async def purge_producer(self, producer: str, *, token: bytes | None = None) -> int:
        """Delete every block whose provenance names `producer`; how many (block, layer) payloads. Operator only."""
        ...

    async def set_send_rate(self, mb_s: float, *, token: bytes | None = None) -> None:
        """Cap (0: uncap) what the node's TLS-TCP server sends, MB/s. Operator only."""
        ...

    async def stats(self, *, token: bytes | None = None) -> dict[str, Any]:
        """The node's statistics; a tenant's: its own blocks held here."""
        ...


def payload_shape(ns: Namespace, num_blocks: int) -> tuple[int, int, int]:
    return (num_blocks, ns.layout.num_layers, ns.layout.bytes_per_block_layer(ns.block_size))


def check_payloads(ns: Namespace, tokens: Tokens, payloads: np.ndarray, first_block: int) -> int:
    """Validate a store request; returns the number of blocks. Raises ValueError with what is wrong."""
    return check_block_payloads(ns, len(tokens) // ns.block_size, payloads, first_block, of="the prompt's")


def check_block_payloads(ns: Namespace, num_full: int, payloads: np.ndarray, first_block: int, *,
                         of: str = "the chain's") -> int:
    """`check_payloads` for a request that names `num_full` full blocks (a chain of ids by default)."""
    if payloads.dtype != np.uint8 or payloads.ndim != 3:
        raise ValueError(f"payloads must be a 3-d uint8 array (blocks, layers, bytes), got {payloads.dtype} "
                         f"with shape {payloads.shape}")
    num_blocks = int(payloads.shape[0])
    want = payload_shape(ns, num_blocks)
    if tuple(payloads.shape) != want:
        raise ValueError(f"payloads have shape {tuple(payloads.shape)}, the namespace's layout wants {want}")
    if first_block < 0 or first_block + num_blocks > num_full:
        raise ValueError(f"blocks {first_block}..{first_block + num_blocks} lie outside {of} "
                         f"{num_full} full blocks")
    return num_blocks
