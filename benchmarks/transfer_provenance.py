"""Provenance in bench_transfer.py: blocks that carry their producer's record, and what signing and
checking those records costs on its own.

    tls_tcp_provenance   the tls_tcp method against a server whose payloads carry records; the client
                         checks every payload as a NodeActor's puller does (transports/core/provenance_check.py).
                         LAYERS_PER_BLOCK consecutive payloads are the layers of one block and share
                         one record, and each PULL gets a fresh verifier, so every block's signature
                         is checked once per pull (what a load pays), never served from an earlier pull.

`sign_verify_ms_per_mib` times, on this process alone, signing one record per block and checking
every layer of it (one signature verification per block, the rest cached), per MiB of block.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import blake3

from benchmarks.transfer_baselines import BLOCK_SIZES, random_blocks
from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_block
from transports.core.certs import CA_CERT
from transports.core.identity import NodeSigner, TrustAnchor
from transports.core.provenance_check import ProvenanceVerifier

# A Llama-3-8B-class layout: 32 layers, and 16 tokens x 8 KV heads x 128 dims x K,V x fp16 = 64 KiB
# per (block, layer), the benchmark's smallest payload.
LAYERS_PER_BLOCK = 32
NAMESPACE = blake3.blake3(b"bench-transfer-namespace").digest()


@functools.cache   # as bench_transfer.address: the pull loop should not time naming the blocks
def signed_address(block_size: int, i: int) -> BlockAddress:
    """Payload i of a size: layer i % LAYERS_PER_BLOCK of block i // LAYERS_PER_BLOCK."""
    block = blake3.blake3(b"bench-signed-%d-%d" % (block_size, i // LAYERS_PER_BLOCK)).digest()
    return BlockAddress(BlockHash(block), i % LAYERS_PER_BLOCK)


class _Signed:
    __slots__ = ("digest", "payload", "provenance")

    def __init__(self, payload: bytes, digest: bytes, provenance: Provenance) -> None:
        self.payload = payload
        self.digest = digest
        self.provenance = provenance


class SignedSource:
    """Random payloads of every benchmarked size, one producer record per block of LAYERS_PER_BLOCK."""

    def __init__(self, signer: NodeSigner) -> None:
        self.blocks: dict[BlockAddress, _Signed] = {}
        for size in BLOCK_SIZES.values():
            payloads = random_blocks(size)
            for start in range(0, len(payloads), LAYERS_PER_BLOCK):
                layers = payloads[start:start + LAYERS_PER_BLOCK]
                digests = [blake3.blake3(p).digest() for p in layers]
                record = sign_block(NAMESPACE, signed_address(size, start).hash, digests, signer.node,
                                    signer.cert_der, signer.sign)
                for j, (payload, digest) in enumerate(zip(layers, digests, strict=True)):
                    self.blocks[signed_address(size, start + j)] = _Signed(payload, digest, record)

    def get_block(self, addr: BlockAddress) -> _Signed | None:
        return self.blocks.get(addr)


def sign_verify_ms_per_mib(cert_dir: Path, node: str, layer_bytes: int = 64 << 10,
                           num_blocks: int = 64) -> tuple[float, float]:
    """(sign, verify) ms per MiB of block for blocks of LAYERS_PER_BLOCK layers of `layer_bytes`
    (medians of 5 passes; digests are given, as a store has them already)."""
    signer = NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    trust = TrustAnchor.from_files(cert_dir / CA_CERT)
    blocks = [(os.urandom(32), [os.urandom(32) for _ in range(LAYERS_PER_BLOCK)]) for _ in range(num_blocks)]
    mib = num_blocks * LAYERS_PER_BLOCK * layer_bytes / (1 << 20)
    sign_ms, verify_ms = [], []
    records: list[Provenance] = []
    for _ in range(5):
        start = time.perf_counter()
        records = [sign_block(NAMESPACE, h, d, signer.node, signer.cert_der, signer.sign) for h, d in blocks]
        sign_ms.append((time.perf_counter() - start) * 1e3 / mib)
        verifier = ProvenanceVerifier(trust)
        start = time.perf_counter()
        for record, (h, digests) in zip(records, blocks, strict=True):
            for layer, digest in enumerate(digests):
                if verifier.check(record, NAMESPACE, h, layer, digest) is not None:
                    raise RuntimeError("a record signed here did not verify")
        verify_ms.append((time.perf_counter() - start) * 1e3 / mib)
    return round(sorted(sign_ms)[2], 4), round(sorted(verify_ms)[2], 4)
