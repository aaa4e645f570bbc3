"""A node's tier changes as KV events in vLLM's wire format: pure, no sockets, no clock.

The Store reports (block, layer) addresses that became held or left their last tier; routers
outside kvfabric (vLLM's subscriber, llm-d's KV-cache indexer, Dynamo's KV router) learn what a
worker holds from msgpack batches encoded exactly as vLLM 0.32's msgspec structs encode them
(`KVEventBatch` is array-like; each event is a map tagged by its class name under "type"; a field
whose declared default is None is left out while it is None):

    KVEventBatch     = [ts: float64, events: [event, ...], data_parallel_rank: int]
    BlockStored      = {"type": "BlockStored", "block_hashes": [u64], "parent_block_hash": u64 | nil,
                        "token_ids": [int], "block_size": int, "lora_id": nil, "medium": str,
                        "lora_name": str | nil, ["extra_keys": [[...] | nil]], "group_idx": 0,
                        "kv_cache_spec_kind": str, "locality": "LOCAL"}
    BlockRemoved     = {"type": "BlockRemoved", "block_hashes": [u64], "medium": str, "group_idx": 0,
                        "locality": "LOCAL"}
    AllBlocksCleared = {"type": "AllBlocksCleared"}

A block hash goes out as vLLM's int form: the last 8 bytes of kvfabric's 32-byte hash, big-endian.
A block is held while any of its layers is (`held`): `BlockStored` when its first layer arrives,
`BlockRemoved` when its last layer leaves the node (an eviction from RAM that leaves the SSD copy
is no removal). `medium` names the tier it was announced in with vLLM's constants (`GPU`, `CPU`,
`STORAGE`), and its removal repeats it. Consecutive new blocks whose chain is known (`note_chain`:
parent, tokens and extra keys, from the request that stored them) share one `BlockStored`, as vLLM
sends them. A block whose tokens are unknown or withheld (named by id, or a tenant's tokens that
events may not show) goes alone with `token_ids` [] and `block_size` 0: vLLM's own shape for a block
it cannot describe.

Chains outlive the process through a `ChainRecords` store (the node keeps it beside its index), so
the blocks a restarted node re-announces carry their tokens and parents as when first stored.

`KvEventLog` numbers batches 0, 1, 2, ... for its whole life (sequence numbers never go back) and
keeps the last `buffer_batches` for replay. `reset(held)` starts over the view a subscriber holds:
`AllBlocksCleared`, then `BlockStored` for every held block (a restart, or a store event queue
that overflowed). Cost: O(1) per store event, O(held blocks) per reset.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from fabric.events import EventKind, StoreEvents
from fabric.keys import BlockAddress, BlockHash
from fabric.tiers.base import Tier

# vLLM's medium constants (vllm.distributed.kv_events.MEDIUM_*).
MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE = "GPU", "CPU", "STORAGE"
MEDIUM_OF_TIER = {Tier.DEVICE: MEDIUM_GPU, Tier.RAM: MEDIUM_CPU, Tier.SSD: MEDIUM_STORAGE}
STORE_MEDIUM = MEDIUM_OF_TIER[Tier.RAM]   # where an acknowledged put or a mirror lands first
LOCALITY = "LOCAL"                        # every block a node announces is in its own tiers
GROUP_IDX = 0                             # one KV cache group per namespace
MAX_HINTS = 65_536                        # chains noted but not yet stored (oldest dropped first)

Event = dict[str, Any]


def external_hash(block_hash: bytes) -> int:
    """vLLM's int form of a block hash (`ExternalBlockHash`): its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class ChainHint:
    """What events say of one block besides its hash."""

    parent: BlockHash | None          # None: the first block of a sequence
    token_ids: tuple[int, ...]        # the block's tokens; () when unknown or withheld
    block_size: int                   # 0 with no tokens (vLLM's shape for a block it cannot describe)
    extra_keys: tuple[Any, ...] | None = None   # an engine's per-block extra hash keys (LoRA, cache salt)
    lora_name: str | None = None
    spec_kind: str = "full_attention"  # vLLM's kv_cache_spec_kind of the namespace's layout

    def pack(self) -> bytes:
        return msgpack.packb([self.parent, list(self.token_ids), self.block_size,
                              None if self.extra_keys is None else list(self.extra_keys), self.lora_name,
                              self.spec_kind], use_bin_type=True)

    @classmethod
    def unpack(cls, raw: bytes) -> ChainHint:
        parent, tokens, size, extra, lora, kind = msgpack.unpackb(raw, raw=False)
        return cls(None if parent is None else BlockHash(parent), tuple(tokens), size,
                   None if extra is None else tuple(extra), lora, kind)


class ChainRecords(Protocol):
    """Where chains of announced blocks persist across restarts (None of it is needed to serve KV)."""

    def put(self, block_hash: BlockHash, hint: ChainHint) -> None: ...
    def get(self, block_hash: BlockHash) -> ChainHint | None: ...
    def delete(self, block_hash: BlockHash) -> None: ...
    def keep_only(self, held: set[BlockHash]) -> None: ...


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    payload: bytes                    # msgpack KVEventBatch


@dataclass(slots=True)
class _Held:
    medium: str
    layers: set[int] = field(default_factory=set)


def stored_event(hashes: list[int], hint: ChainHint | None, medium: str) -> Event:
    """A `BlockStored` map with vLLM 0.32's fields in its declaration order."""
    event: Event = {"type": "BlockStored", "block_hashes": hashes,
                    "parent_block_hash": None if hint is None or hint.parent is None else external_hash(hint.parent),
                    "token_ids": list(hint.token_ids) if hint is not None else [],
                    "block_size": hint.block_size if hint is not None else 0,
                    "lora_id": None, "medium": medium, "lora_name": hint.lora_name if hint else None}
    if hint is not None and hint.extra_keys is not None:
        event["extra_keys"] = [list(hint.extra_keys)]
    event["group_idx"] = GROUP_IDX
    event["kv_cache_spec_kind"] = hint.spec_kind if hint is not None else "full_attention"
    event["locality"] = LOCALITY
    return event


def removed_event(hashes: list[int], medium: str) -> Event:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium, "group_idx": GROUP_IDX,
            "locality": LOCALITY}


def encode_batch(ts: float, events: list[Event], data_parallel_rank: int) -> bytes:
    return msgpack.packb([float(ts), events, data_parallel_rank], use_bin_type=True)


class KvEventLog:
    """Store events in, numbered vLLM-format batches out, the last `buffer_batches` kept for replay.

    Only the owner's thread calls the inputs; `replay` may be called from any thread."""

    def __init__(self, *, block_size: int, buffer_batches: int, data_parallel_rank: int = 0,
                 max_hints: int = MAX_HINTS, chains: ChainRecords | None = None) -> None:
        if buffer_batches <= 0:
            raise ValueError(f"buffer_batches must be positive, got {buffer_batches}")
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.max_hints = max_hints
        self.chains = chains
        self.held: dict[BlockHash, _Held] = {}
        self._hints: dict[BlockHash, ChainHint] = {}
        self._buffer: collections.deque[EventBatch] = collections.deque(maxlen=buffer_batches)
        self._buffer_lock = threading.Lock()
        self._next_seq = 0
        self._last_stored: BlockHash | None = None

    # ---- input -------------------------------------------------------------------------------------

    def note_chain(self, hashes: Sequence[BlockHash], parent: BlockHash | None,
                   token_ids: Sequence[int] | None, block_size: int, *,
                   extra_keys: Sequence[tuple[Any, ...] | None] | None = None, lora_name: str | None = None,
                   spec_kind: str = "full_attention") -> None:
        """Blocks about to be stored: `hashes[0]` follows `parent`, each next one the one before;
        `token_ids` (len(hashes) * block_size of them) when the caller named blocks by tokens and
        events may show them; `extra_keys` one entry per block when an engine hashes with them."""
        for i, h in enumerate(hashes):
            if h in self.held:
                continue
            tokens = () if token_ids is None else tuple(token_ids[i * block_size:(i + 1) * block_size])
            extra = None if extra_keys is None or extra_keys[i] is None else tuple(extra_keys[i] or ())
            self._hints.pop(h, None)
            self._hints[h] = ChainHint(parent if i == 0 else hashes[i - 1], tokens, block_size if tokens else 0,
                                       extra, lora_name, spec_kind)
        while len(self._hints) > self.max_hints:
            del self._hints[next(iter(self._hints))]

    def apply(self, events: StoreEvents, now: float) -> EventBatch | None:
        """The batch for one drain of store events (None when it changes no block). An overflowed
        drain cannot be applied: call `reset` with a snapshot instead."""
        if events.overflowed:
            raise ValueError("an overflowed store event drain needs reset(snapshot), not apply")
        out: list[Event] = []
        for kind, address in events.events:
            if kind is EventKind.STORED:
                self._stored(address, STORE_MEDIUM, out, self._hints.pop(address.hash, None))
            else:
                self._removed(address, out)
        return self._emit(out, now) if out else None

    def reset(self, held: Iterable[BlockAddress], now: float, *, medium: str) -> EventBatch:
        """`AllBlocksCleared`, then every address of `held` (the store's snapshot) as stored: in the
        medium it was announced in before, else in `medium` (`STORAGE` after a restart: only SSD
        blocks outlive the process), each with the chain recorded when it was first announced."""
        before = {h: held_.medium for h, held_ in self.held.items()}
        self.held.clear()
        self._last_stored = None
        out: list[Event] = [{"type": "AllBlocksCleared"}]
        for address in held:
            hint = None if self.chains is None or address.hash in self.held else self.chains.get(address.hash)
            self._stored(address, before.get(address.hash, medium), out, hint, record=False)
        if self.chains is not None:
            self.chains.keep_only(set(self.held))
        return self._emit(out, now)

    # ---- output ------------------------------------------------------------------------------------

    def replay(self, start_seq: int, limit: int) -> tuple[int, list[EventBatch]]:
        """(the oldest kept sequence number, up to `limit` kept batches numbered `start_seq` or
        later, in order). Safe from any thread."""
        with self._buffer_lock:
            if not self._buffer:
                return self._next_seq, []
            first = self._buffer[0].seq
            skip = max(0, start_seq - first)
            out = [self._buffer[i] for i in range(skip, min(len(self._buffer), skip + limit))]
        return first, out

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # ---- internals ---------------------------------------------------------------------------------

    def _stored(self, address: BlockAddress, medium: str, out: list[Event], hint: ChainHint | None, *,
                record: bool = True) -> None:
        held = self.held.get(address.hash)
        if held is None:
            held = self.held[address.hash] = _Held(medium)
            held.layers.add(address.layer)
            self._announce(address.hash, medium, hint, out)
            if record and hint is not None and self.chains is not None:
                self.chains.put(address.hash, hint)
        else:
            held.layers.add(address.layer)

    def _announce(self, block_hash: BlockHash, medium: str, hint: ChainHint | None, out: list[Event]) -> None:
        last = out[-1] if out else None
        # out[-1], when a BlockStored, ends with _last_stored: extend it if this block follows that one
        # and says the same of itself (tokens of the same size, medium, LoRA, extra keys or none).
        if (hint is not None and hint.token_ids and hint.parent is not None and hint.parent == self._last_stored
                and last is not None and last["type"] == "BlockStored" and last["token_ids"]
                and last["block_size"] == hint.block_size and last["medium"] == medium
                and last["lora_name"] == hint.lora_name and last["kv_cache_spec_kind"] == hint.spec_kind
                and ("extra_keys" in last) == (hint.extra_keys is not None)):
            last["block_hashes"].append(external_hash(block_hash))   # continues the previous event's chain
            last["token_ids"].extend(hint.token_ids)
            if hint.extra_keys is not None:
                last["extra_keys"].append(list(hint.extra_keys))
        else:
            out.append(stored_event([external_hash(block_hash)], hint, medium))
        self._last_stored = block_hash

    def _removed(self, address: BlockAddress, out: list[Event]) -> None:
        held = self.held.get(address.hash)
        if held is None:
            return
        held.layers.discard(address.layer)
        if held.layers:
            return
        del self.held[address.hash]
        if self.chains is not None:
            self.chains.delete(address.hash)
        last = out[-1] if out else None
        if last is not None and last["type"] == "BlockRemoved" and last["medium"] == held.medium:
            last["block_hashes"].append(external_hash(address.hash))
        else:
            out.append(removed_event([external_hash(address.hash)], held.medium))

    def _emit(self, events: list[Event], now: float) -> EventBatch:
        batch = EventBatch(self._next_seq, encode_batch(now, events, self.data_parallel_rank))
        self._next_seq += 1
        with self._buffer_lock:
            self._buffer.append(batch)
        return batch
