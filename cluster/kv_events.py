"""A node's tier changes as KV events in vLLM's wire format: pure, no sockets, no clock.

The Store reports (block, layer) addresses that became held or left their last tier; routers
outside kvfabric (vLLM's subscriber, llm-d's KV-cache indexer, Dynamo's KV router) learn what a
worker holds from msgpack batches of array-like tagged structs:

    EventBatch       = [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored      = ["BlockStored", block_hashes: [u64], parent_block_hash: u64 | nil,
                        token_ids: [int], block_size: int, lora_id: nil, medium: str]
    BlockRemoved     = ["BlockRemoved", block_hashes: [u64], medium: str]
    AllBlocksCleared = ["AllBlocksCleared"]

A block hash goes out as vLLM's int form: the last 8 bytes of kvfabric's 32-byte hash, big-endian.
A block is held while any of its layers is (the node's `held` set): `BlockStored` when its first
layer arrives, `BlockRemoved` when its last layer leaves the node (an eviction from RAM that
leaves the SSD copy is no removal). `medium` names the tier it was announced in (`GPU` / `CPU` /
`DISK`, the names Dynamo's router maps to device / host / disk), and its removal repeats it.
Consecutive new blocks whose chain is known (`note_chain`: parent and tokens, from the request
that stored them) share one `BlockStored`, as vLLM sends them; a block stored without its tokens
(a mirror of an id chain) goes alone with `token_ids` empty.

`KvEventLog` numbers batches 0, 1, 2, ... for its whole life (sequence numbers never go back) and
keeps the last `buffer_batches` for replay. `reset(held)` starts over the view a subscriber
holds: `AllBlocksCleared`, then `BlockStored` for every held block (a restart, or a store event
queue that overflowed). Cost: O(1) per store event, O(held blocks) per reset.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fabric.events import EventKind, StoreEvents
from fabric.keys import BlockAddress, BlockHash
from fabric.tiers.base import Tier

MEDIUM_OF_TIER = {Tier.DEVICE: "GPU", Tier.RAM: "CPU", Tier.SSD: "DISK"}
STORE_MEDIUM = MEDIUM_OF_TIER[Tier.RAM]   # where an acknowledged put or a mirror lands first
MAX_HINTS = 65_536                        # chains noted but not yet stored (oldest dropped first)

Event = list[Any]


def external_hash(block_hash: bytes) -> int:
    """vLLM's int form of a block hash (`ExternalBlockHash`): its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclass(frozen=True, slots=True)
class ChainHint:
    parent: BlockHash | None          # None: the first block of a sequence
    token_ids: tuple[int, ...]        # the block's tokens; () when the caller named it by id
    block_size: int


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int
    payload: bytes                    # msgpack EventBatch


@dataclass(slots=True)
class _Held:
    medium: str
    layers: set[int] = field(default_factory=set)


class KvEventLog:
    """Store events in, numbered vLLM-format batches out, the last `buffer_batches` kept for replay."""

    def __init__(self, *, block_size: int, buffer_batches: int, data_parallel_rank: int = 0,
                 max_hints: int = MAX_HINTS) -> None:
        if buffer_batches <= 0:
            raise ValueError(f"buffer_batches must be positive, got {buffer_batches}")
        self.block_size = block_size
        self.data_parallel_rank = data_parallel_rank
        self.max_hints = max_hints
        self.held: dict[BlockHash, _Held] = {}
        self._hints: dict[BlockHash, ChainHint] = {}
        self._buffer: collections.deque[EventBatch] = collections.deque(maxlen=buffer_batches)
        self._next_seq = 0
        self._last_stored: BlockHash | None = None

    # ---- input -------------------------------------------------------------------------------------

    def note_chain(self, hashes: Sequence[BlockHash], parent: BlockHash | None,
                   token_ids: Sequence[int] | None, block_size: int) -> None:
        """Blocks about to be stored: `hashes[0]` follows `parent`, each next one the one before;
        `token_ids` (len(hashes) * block_size of them) when the caller named blocks by tokens."""
        for i, h in enumerate(hashes):
            if h in self.held:
                continue
            tokens = () if token_ids is None else tuple(token_ids[i * block_size:(i + 1) * block_size])
            self._hints.pop(h, None)
            self._hints[h] = ChainHint(parent if i == 0 else hashes[i - 1], tokens, block_size)
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
                self._stored(address, STORE_MEDIUM, out)
            else:
                self._removed(address, out)
        return self._emit(out, now) if out else None

    def reset(self, held: Iterable[BlockAddress], now: float, *, medium: str) -> EventBatch:
        """`AllBlocksCleared`, then every address of `held` (the store's snapshot) as stored: in the
        medium it was announced in before, else in `medium` (`DISK` after a restart: only SSD
        blocks outlive the process)."""
        before = {h: held_.medium for h, held_ in self.held.items()}
        self.held.clear()
        out: list[Event] = [["AllBlocksCleared"]]
        for address in held:
            self._stored(address, before.get(address.hash, medium), out)
        return self._emit(out, now)

    # ---- output ------------------------------------------------------------------------------------

    def replay(self, start_seq: int) -> list[EventBatch]:
        """The kept batches numbered `start_seq` or later, in order."""
        return [b for b in self._buffer if b.seq >= start_seq]

    @property
    def next_seq(self) -> int:
        return self._next_seq

    # ---- internals ---------------------------------------------------------------------------------

    def _stored(self, address: BlockAddress, medium: str, out: list[Event]) -> None:
        held = self.held.get(address.hash)
        if held is None:
            held = self.held[address.hash] = _Held(medium)
            held.layers.add(address.layer)
            self._announce(address.hash, medium, self._hints.pop(address.hash, None), out)
        else:
            held.layers.add(address.layer)

    def _announce(self, block_hash: BlockHash, medium: str, hint: ChainHint | None, out: list[Event]) -> None:
        last = out[-1] if out else None
        # out[-1], when a BlockStored, ends with _last_stored: extend it if this block follows that one.
        if (hint is not None and hint.token_ids and hint.parent is not None and hint.parent == self._last_stored
                and last is not None and last[0] == "BlockStored" and last[3] and last[4] == hint.block_size
                and last[6] == medium):
            last[1].append(external_hash(block_hash))   # continues the chain of the previous event
            last[3].extend(hint.token_ids)
        else:
            parent = None if hint is None or hint.parent is None else external_hash(hint.parent)
            out.append(["BlockStored", [external_hash(block_hash)], parent,
                        list(hint.token_ids) if hint else [], hint.block_size if hint else self.block_size,
                        None, medium])
        self._last_stored = block_hash

    def _removed(self, address: BlockAddress, out: list[Event]) -> None:
        held = self.held.get(address.hash)
        if held is None:
            return
        held.layers.discard(address.layer)
        if held.layers:
            return
        del self.held[address.hash]
        last = out[-1] if out else None
        if last is not None and last[0] == "BlockRemoved" and last[2] == held.medium:
            last[1].append(external_hash(address.hash))
        else:
            out.append(["BlockRemoved", [external_hash(address.hash)], held.medium])

    def _emit(self, events: list[Event], now: float) -> EventBatch:
        payload = msgpack.packb([now, events, self.data_parallel_rank], use_bin_type=True)
        batch = EventBatch(self._next_seq, payload)
        self._next_seq += 1
        self._buffer.append(batch)
        return batch
