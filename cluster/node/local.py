"""The `Fabric` protocol over one in-process `Store`: what a node holds itself, no Ray, no peers.

The NodeActor builds its answers on this (local blocks first, then pulls for the rest), and a
single-process engine or a test can use it directly.

A block counts as held only when every layer of it is: `lookup` asks the store for the leading
run of blocks held in full (one walk over the store that stops at the first gap), and a block's
tier is its coldest layer's. `load` reads that run in one walk (`Store.read_run`), which stops at
the first block with a layer that is missing or fails its digest (the store re-hashes anything it
reads from a file), so the reply is always a verified leading run. Each payload stored is hashed
once: `write_blocks` hands the same digest to the signer and to the store.

A block whose record names a producer whose certificate is revoked (`revoked`, the node's
revocation list) is not served either: it is deleted on that read, so a mirror of a revoked
producer's block is gone once its node reads the new list, wherever it lives.
The same holds for a producer the cluster quarantined (`quarantined`, names; docs/security.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np
from cryptography import x509

from cluster.api import (
    AuditReport,
    BlockLocation,
    CacheFill,
    EngineLoad,
    LoadReply,
    LookupReply,
    StoreReply,
    Tokens,
    Where,
    check_block_payloads,
    check_payloads,
    payload_shape,
)
from cluster.node.estimates import PrefillRates
from fabric.block_ids import BlockId, block_id_hashes
from fabric.keys import BlockAddress, BlockHash, Namespace, block_hashes
from fabric.provenance import BlockSigner, Provenance, sign_run
from fabric.store import Store, hash_payload
from fabric.tiers.base import Tier

WHERE_OF_TIER = {Tier.DEVICE: Where.DEVICE, Tier.RAM: Where.RAM, Tier.SSD: Where.SSD}
MAX_PRODUCER_CERTS = 4096   # producer certificates whose serials a node remembers
_COLDNESS = {Tier.DEVICE: 0, Tier.RAM: 1, Tier.SSD: 2}


def block_addresses(hashes: Sequence[BlockHash], num_layers: int) -> list[BlockAddress]:
    """Every (block, layer) address of `hashes`, block-major."""
    return [BlockAddress(h, layer) for h in hashes for layer in range(num_layers)]


class LocalFabric:
    """Lookup / load / store against one node's Store. Thread-safe (the Store is)."""

    def __init__(self, store: Store, node_id: str = "local") -> None:
        self.local_store = store
        self.node_id = node_id
        self.engine_load = EngineLoad()
        self.prefill = PrefillRates()
        self.revoked: frozenset[int] = frozenset()   # serials of revoked certificates (set by the node)
        self.quarantined: frozenset[str] = frozenset()   # producers quarantined cluster-wide (set by the node)
        self._serials: dict[bytes, int] = {}         # producer certificate (DER) -> its serial

    def _of_revoked_producer(self, record: Provenance | None) -> bool:
        if record is not None and record.producer in self.quarantined:
            return True
        if record is None or not self.revoked:
            return False
        serial = self._serials.get(record.cert_der)
        if serial is None:
            try:
                serial = x509.load_der_x509_certificate(record.cert_der).serial_number
            except ValueError:   # a record the store kept with no readable certificate vouches for nothing
                return True
            if len(self._serials) >= MAX_PRODUCER_CERTS:
                self._serials.clear()
            self._serials[record.cert_der] = serial
        return serial in self.revoked

    # ---- building blocks the NodeActor reuses ------------------------------------------------------

    def local_tiers(self, hashes: Sequence[BlockHash], num_layers: int, *, peek: bool = False) -> list[Tier]:
        """The tier of each leading block held in full (its coldest layer), up to the first gap, in one
        pass over the store that stops there. `peek`: answer without counting it as an access (a
        routing probe, not a load)."""
        run = self.local_store.lookup_run((block_addresses([h], num_layers) for h in hashes), peek=peek)
        return [max(layer_tiers, key=_COLDNESS.__getitem__) for layer_tiers in run]

    def cache_fill(self, ns: Namespace) -> CacheFill:
        """How full this node's RAM and SSD are, in `ns`'s blocks (all layers). A tier holds as many
        blocks as its byte capacity allows, or its block capacity (`ram_blocks` / `ssd_blocks`) if
        smaller; it holds its distinct blocks, or its share of bytes used (which counts the SSD files'
        headers on both sides) of that, if more. The node can hold what its larger tier can (the SSD
        keeps what RAM offloads) and holds at least what its fuller tier does."""
        stats = self.local_store.stats()
        per_block = max(1, ns.layout.bytes_per_block(ns.block_size))
        capacity = held = 0
        for tier in (stats["ram"], stats["ssd"]):
            cap_bytes, cap_blocks = int(tier["capacity_bytes"]), int(tier["capacity_blocks"])
            cap = min(cap_bytes // per_block, cap_blocks) if cap_blocks else cap_bytes // per_block
            by_bytes = round(int(tier["bytes"]) / cap_bytes * cap) if cap_bytes else 0
            capacity, held = max(capacity, cap), max(held, int(tier["held_blocks"]), by_bytes)
        return CacheFill(min(capacity, held), capacity)

    def read_blocks(self, hashes: Sequence[BlockHash], out: np.ndarray) -> list[Tier]:
        """Copy the leading run of `hashes` held here in full into `out` (uint8, [blocks, layers, bytes])
        in one pass over the store; the coldest tier of each block copied. The run ends before the
        first block with a layer missing, the wrong size, failing its digest, or of a revoked producer."""
        run = self._verified_run(hashes[:out.shape[0]], out.shape[1], out.shape[2])
        return _copy_run(run, out)

    def _verified_run(self, hashes: Sequence[BlockHash], num_layers: int, layer_bytes: int
                      ) -> list[tuple[Tier, list[memoryview]]]:
        """The store's leading run (one read), cut before the first block with a layer of the wrong
        size or of a revoked producer (that block is deleted: it is never served again)."""
        run = self.local_store.read_run(block_addresses([h], num_layers) for h in hashes)
        out: list[tuple[Tier, list[memoryview]]] = []
        for h, layers in zip(hashes, run, strict=False):
            if any(len(block.payload) != layer_bytes for block in layers):
                break
            if any(self._of_revoked_producer(block.provenance) for block in layers):
                for gone in range(num_layers):
                    self.local_store.delete(BlockAddress(h, gone))
                break
            out.append((max((block.tier for block in layers), key=_COLDNESS.__getitem__),
                        [block.payload for block in layers]))
        return out

    def write_blocks(self, ns: Namespace, hashes: Sequence[BlockHash], payloads: np.ndarray,
                     *, digests: Sequence[Sequence[bytes]] | None = None,
                     provenance: Sequence[Provenance | None] | None = None,
                     signer: BlockSigner | None = None) -> StoreReply:
        """Put `payloads[i]` (all layers) under `hashes[i]`; a block counts once all its layers are held.
        With `digests` (a pull's, per block and layer) each payload is verified against them first.

        Provenance: `signer` (this node, when its own engine produced the blocks) signs the blocks
        as one run (one signature; a record per block over all its layers, with its inclusion path);
        `provenance` (a mirror's) is kept verbatim, one per block.
        Neither: the blocks are unsigned and no peer accepts them."""
        num_layers = payloads.shape[1]
        # Each payload is hashed once: the digest its record signs is the one the store keeps.
        hashed = [[hash_payload(memoryview(payloads[i, layer])) for layer in range(num_layers)]
                  for i in range(len(hashes))]
        items = [(BlockAddress(h, layer), hashed[i][layer])
                 for i, h in enumerate(hashes) for layer in range(num_layers)]
        if signer is not None:
            signed = [[p.digest for p in per_block] for per_block in hashed]
            provenance = sign_run(ns.root, list(zip(hashes, signed, strict=True)), signer.node, signer.cert_der,
                                  signer.sign)
        flat_digests = None if digests is None else [d for per_block in digests for d in per_block]
        flat_provenance = None if provenance is None else [p for p in provenance for _ in range(num_layers)]
        results = self.local_store.put_many(items, model=ns.model_id, digests=flat_digests,
                                            provenance=flat_provenance)
        num_refused = sum(1 for b in range(len(hashes))
                          if not all(r.ok for r in results[b * num_layers:(b + 1) * num_layers]))
        return StoreReply(num_stored=len(hashes) - num_refused, num_refused=num_refused)

    # ---- by block hash: what both the token and the block-id paths come down to ------------------

    def lookup_hashes(self, ns: Namespace, hashes: Sequence[BlockHash], *, peek: bool = False) -> LookupReply:
        tiers = self.local_tiers(hashes, ns.layout.num_layers, peek=peek)
        return LookupReply(ns.block_size, tuple(BlockLocation(WHERE_OF_TIER[t], self.node_id) for t in tiers),
                           self.engine_load, self.cache_fill(ns))

    def load_hashes(self, ns: Namespace, hashes: Sequence[BlockHash]) -> LoadReply:
        """The verified leading run of `hashes` held here, read from the store in one pass."""
        _, num_layers, layer_bytes = payload_shape(ns, 0)
        run = self._verified_run(hashes, num_layers, layer_bytes)
        out = np.empty(payload_shape(ns, len(run)), dtype=np.uint8)
        tiers = _copy_run(run, out)
        out.flags.writeable = False
        return LoadReply(ns.block_size, out, tuple(tier.value for tier in tiers), pulled_bytes=0)

    # ---- the Fabric protocol -----------------------------------------------------------------------

    def lookup(self, ns: Namespace, tokens: Tokens, *, peek: bool = False) -> LookupReply:
        return self.lookup_hashes(ns, block_hashes(ns, tokens), peek=peek)

    def load(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
             deadline_s: float | None = None, audit: bool = False) -> LoadReply:
        """Local reads only (no pulls), so there is nothing for `deadline_s` to cut nor to `audit`."""
        return self.load_hashes(ns, block_hashes(ns, tokens)[:max_blocks])

    def report_prefill(self, ns: Namespace, num_tokens: int, seconds: float) -> None:
        self.prefill.of(ns.root).record(num_tokens, seconds)

    def report_load(self, load: EngineLoad) -> None:
        self.engine_load = load

    def load_layers(self, ns: Namespace, tokens: Tokens, *, max_blocks: int | None = None,
                    deadline_s: float | None = None, audit: bool = False) -> LocalLayerStream:
        # Local reads are memory copies: read everything, then hand the layers out in order.
        return LocalLayerStream(self.load(ns, tokens, max_blocks=max_blocks))

    def store(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray, *, first_block: int = 0) -> StoreReply:
        num_blocks = check_payloads(ns, tokens, payloads, first_block)
        hashes = block_hashes(ns, tokens)[first_block:first_block + num_blocks]
        return self.write_blocks(ns, hashes, payloads)

    def audit(self, ns: Namespace, tokens: Tokens, payloads: np.ndarray) -> AuditReport:
        """Nothing to compare: one process's store holds only what its own engine computed (no
        other producer's signed blocks, no pulls), so no load of it is ever sampled."""
        check_payloads(ns, tokens, payloads, 0)
        return AuditReport(0, 0)

    def lookup_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *,
                      parent: BlockId | None = None, peek: bool = False) -> LookupReply:
        return self.lookup_hashes(ns, block_id_hashes(ns, block_ids, parent), peek=peek)

    def load_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                    max_blocks: int | None = None, audit: bool = False) -> LoadReply:
        return self.load_hashes(ns, block_id_hashes(ns, block_ids[:max_blocks], parent))

    def load_blocks_layers(self, ns: Namespace, block_ids: Sequence[BlockId], *, parent: BlockId | None = None,
                           max_blocks: int | None = None, audit: bool = False) -> LocalLayerStream:
        return LocalLayerStream(self.load_blocks(ns, block_ids, parent=parent, max_blocks=max_blocks))

    def store_blocks(self, ns: Namespace, block_ids: Sequence[BlockId], payloads: np.ndarray, *,
                     parent: BlockId | None = None, first_block: int = 0) -> StoreReply:
        num_blocks = check_block_payloads(ns, len(block_ids), payloads, first_block)
        hashes = block_id_hashes(ns, block_ids[:first_block + num_blocks], parent)[first_block:]
        return self.write_blocks(ns, hashes, payloads)


def _copy_run(run: Sequence[tuple[Tier, Sequence[memoryview]]], out: np.ndarray) -> list[Tier]:
    """Copy each block's layers of `run` into `out[i]`; the blocks' tiers."""
    for i, (_, layers) in enumerate(run):
        for layer, payload in enumerate(layers):
            out[i, layer] = np.frombuffer(payload, dtype=np.uint8)
    return [tier for tier, _ in run]


class LocalLayerStream:
    """A `LayerStream` over a finished `LoadReply`."""

    def __init__(self, reply: LoadReply) -> None:
        self.reply = reply
        self.num_blocks = reply.num_blocks
        self.sources = reply.sources
        self.audit_blocks = reply.audit_blocks

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        for layer in range(self.reply.payloads.shape[1]):
            yield layer, self.reply.payloads[:, layer]


if TYPE_CHECKING:
    from cluster.api import Fabric

    # mypy checks that LocalFabric offers every Fabric call with a compatible signature.
    _fabric: type[Fabric] = LocalFabric
