"""A paged inference engine over the fabric: block manager + KV pool + tiny Llama + optional Store.

This is the integration an engine makes with kvfabric, small enough to read in one sitting:

    tokens ──block_hashes──► BlockManager.allocate  (device hits: KV already in the pool)
           ──► Store.get per (block, layer) for the next blocks (RAM / SSD hits, digest-checked)
           ──► scatter those payloads into the pool, prefill only the remaining tokens
           ──► write the new KV into the pool, gather each new full block per layer, Store.put

A block comes back from the store only when every one of its layers verifies; the first block
that does not is where recompute starts. Logits are therefore exactly those of a full prefill.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from cluster.api import Fabric
from cluster.engines.reference.block_manager import BlockManager
from cluster.engines.reference.kv_pool import StorageType, TokenToKVPool
from cluster.engines.reference.sequence import SeqState
from cluster.engines.reference.tiny_llama import TinyLlama
from cluster.errors import ClusterError
from fabric.keys import BlockAddress, BlockHash
from fabric.store import Store
from fabric.tiers.base import Payload


@dataclass(frozen=True, slots=True)
class PrefillResult:
    logits: torch.Tensor
    num_tokens: int
    num_device_hit_tokens: int   # reused from the engine's own pool
    num_store_hit_tokens: int    # loaded from the node's Store (RAM or SSD) or pulled, scattered into the pool
    num_stored_blocks: int       # full blocks newly written to the Store
    prefill_s: float
    seq: SeqState

    @property
    def num_reused_tokens(self) -> int:
        return self.num_device_hit_tokens + self.num_store_hit_tokens


class OutOfBlocks(ClusterError, RuntimeError):
    """The pool has no room for this prompt even after evicting every cached block."""


class PagedEngine:
    def __init__(self, model: TinyLlama, num_blocks: int, block_size: int = 16, store: Store | None = None,
                 storage: StorageType = StorageType.DEVICE, fabric: Fabric | None = None) -> None:
        """`store`: the node's Store in this process. `fabric` instead (e.g. a FabricClient): blocks
        past the pool's hits come from the node's tiers or are pulled from peers, and new blocks are
        stored through it."""
        if store is not None and fabric is not None:
            raise ValueError("give the engine a store or a fabric, not both")
        self.fabric = fabric
        self.model = model
        self.namespace = model.cfg.namespace(block_size)
        self.layout = self.namespace.layout
        self.block_size = block_size
        self.blocks = BlockManager(self.namespace, num_blocks)
        self.pool = TokenToKVPool(self.layout, num_blocks * block_size, storage)
        self.store = store
        self._next_seq_id = 0

    def _slots(self, seq: SeqState, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.int64)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def _block_slots(self, seq: SeqState, block_index: int) -> torch.Tensor:
        start = block_index * self.block_size
        return self._slots(seq, start, start + self.block_size)

    def _load_from_store(self, seq: SeqState, hashes: list[BlockHash], first_block: int,
                         pulled: Mapping[BlockAddress, Payload]) -> int:
        """Scatter verified payloads (store first, then `pulled`) into the pool for blocks first_block..;
        returns how many blocks were loaded."""
        loaded = 0
        for i in range(first_block, len(hashes)):
            payloads = []
            for layer in range(self.layout.num_layers):
                address = BlockAddress(hashes[i], layer)
                payload: Payload | None = self.store.get(address) if self.store is not None else None
                if payload is None:
                    payload = pulled.get(address)
                if payload is None:
                    return loaded
                payloads.append(payload)
            slots = self._block_slots(seq, i)
            for layer, payload in enumerate(payloads):
                self.pool.scatter(payload, slots, layer)
            loaded += 1
        return loaded

    def prefill(self, tokens: list[int], pulled: Mapping[BlockAddress, Payload] | None = None) -> PrefillResult:
        """Run the prompt, reusing every cached prefix block; the sequence stays allocated.

        `pulled` holds digest-verified payloads fetched from peers that the store did not keep
        (mirroring off); they are used like store hits.
        """
        start = time.perf_counter()
        seq = SeqState(self._next_seq_id, tokens)
        self._next_seq_id += 1
        if not self.blocks.allocate(seq):
            raise OutOfBlocks(f"{len(tokens)} tokens need {self.blocks.num_blocks_needed(seq)} blocks; "
                              f"{self.blocks.num_free_blocks} are free")
        device_hit = seq.num_cached_tokens
        hashes = self.blocks.seq_block_hashes(seq)
        store_blocks = 0
        if self.store is not None or pulled:
            store_blocks = self._load_from_store(seq, hashes, device_hit // self.block_size, pulled or {})
        elif self.fabric is not None:
            store_blocks = self._load_from_fabric(seq, tokens, device_hit // self.block_size, len(hashes))
        reused = device_hit + store_blocks * self.block_size
        if reused == len(tokens):  # recompute the last block: the engine needs its logits
            reused -= self.block_size
            device_hit = min(device_hit, reused)
        past = None
        if reused:
            cached_slots = self._slots(seq, 0, reused)
            past = [self.pool.layer_buffer(layer)[:, cached_slots] for layer in range(self.layout.num_layers)]
        logits, new_kv = self.model(torch.tensor(tokens[reused:]), past)
        new_slots = self._slots(seq, reused, len(tokens))
        for layer, kv in enumerate(new_kv):
            self.pool.layer_buffer(layer)[:, new_slots] = kv.to(self.pool.kv.dtype)
        # Blocks hit in the pool or loaded are not put again, nor a recomputed last block that was loaded
        # (its recomputed bytes may differ in the low bits: the store would refuse them as a CONFLICT).
        stored = self._store_new_blocks(seq, hashes, seq.num_cached_tokens // self.block_size + store_blocks)
        self._drain_events()
        return PrefillResult(logits, len(tokens), device_hit, reused - device_hit, stored,
                             time.perf_counter() - start, seq)

    def _load_from_fabric(self, seq: SeqState, tokens: list[int], first_block: int, num_blocks: int) -> int:
        """Scatter blocks first_block.. of the fabric's verified leading run (local tiers, then pulls)
        into the pool; returns how many were loaded. The run starts at block 0, so blocks the pool
        already holds are read again: the Fabric API has no offset."""
        assert self.fabric is not None
        if first_block >= num_blocks:
            return 0
        reply = self.fabric.load(self.namespace, tokens, max_blocks=num_blocks)
        for i in range(first_block, reply.num_blocks):
            slots = self._block_slots(seq, i)
            for layer in range(self.layout.num_layers):
                self.pool.scatter(reply.payloads[i, layer].data, slots, layer)
        return max(0, reply.num_blocks - first_block)

    def _store_new_blocks(self, seq: SeqState, hashes: list[BlockHash], first_block: int) -> int:
        if self.fabric is not None and first_block < len(hashes):
            payloads = np.stack([np.stack([self.pool.gather(self._block_slots(seq, i), layer).numpy()
                                           for layer in range(self.layout.num_layers)])
                                 for i in range(first_block, len(hashes))])
            return self.fabric.store(self.namespace, seq.token_ids, payloads, first_block=first_block).num_stored
        if self.store is None:
            return 0
        items = []
        for i in range(first_block, len(hashes)):
            slots = self._block_slots(seq, i)
            for layer in range(self.layout.num_layers):
                payload = self.pool.gather(slots, layer)
                items.append((BlockAddress(hashes[i], layer), payload.numpy().data))
        results = self.store.put_many(items, model=self.namespace.model_id) if items else []
        return sum(r.ok for r in results) // self.layout.num_layers

    def finish(self, seq: SeqState) -> None:
        """Release the sequence's blocks; full ones stay cached (hit-able) until reused."""
        self.blocks.deallocate(seq)
        self._drain_events()

    def _drain_events(self) -> None:
        if self.store is not None:
            self.store.apply_events(self.blocks.take_events())
        elif self.fabric is not None:
            # The pool's residency is not advertised through a FabricClient (another process);
            # drained so the queue does not grow.
            self.blocks.take_events()
