"""Provenance in bench_transfer.py: blocks that carry their producer's record, and what signing and
checking those records costs on its own.

    tls_tcp_provenance   the tls_tcp method against a server whose payloads carry records; the client
                         checks every payload as a NodeActor's puller does (transports/trust/provenance_check.py).
                         LAYERS_PER_BLOCK consecutive payloads are the layers of one block and share
                         one record; RUN_BLOCKS consecutive blocks were stored as one run and share
                         one signature (as `LocalFabric.write_blocks` signs what an engine stores at
                         once). Each pass over the distinct blocks is one load (several PULLs sharing
                         the node's verifier, as a NodeActor loads a prompt) with a fresh verifier:
                         the run's signature is checked once per load, never served from an
                         earlier one, and each block's path and each layer as it arrives.

`frame_ms_per_mib` times what records add to a pull's frames on each end, on this process alone.
`sign_verify_ms_per_mib` times, on this process alone, signing runs of RUN_BLOCKS blocks and
checking every layer of every block from its own record (one signature verification per run, one
inclusion path per block, the rest cached), per MiB of block.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import blake3

from benchmarks.harness import MemorySource
from benchmarks.lib.transfer_baselines import BLOCK_SIZES, num_distinct, random_blocks
from fabric.keys import BlockAddress, BlockHash
from fabric.provenance import Provenance, sign_run
from transports.core.codec import FrameDecoder, encode
from transports.core.frames import Block, Blocks
from transports.core.session import GROUP_BYTES, GROUP_PART_MAX
from transports.trust.certs import CA_CERT
from transports.trust.identity import NodeSigner, TrustAnchor
from transports.trust.provenance_check import ProvenanceVerifier

# A Llama-3-8B-class layout: 32 layers, and 16 tokens x 8 KV heads x 128 dims x K,V x fp16 = 64 KiB
# per (block, layer), the benchmark's smallest payload.
LAYERS_PER_BLOCK = 32
RUN_BLOCKS = 32      # blocks stored (and signed) at once: a 512-token prompt at 16 tokens per block
NAMESPACE = blake3.blake3(b"bench-transfer-namespace").digest()


@functools.cache   # as bench_transfer.address: the pull loop should not time naming the blocks
def signed_address(block_size: int, i: int) -> BlockAddress:
    """Payload i of a size: layer i % LAYERS_PER_BLOCK of block i // LAYERS_PER_BLOCK."""
    block = blake3.blake3(b"bench-signed-%d-%d" % (block_size, i // LAYERS_PER_BLOCK)).digest()
    return BlockAddress(BlockHash(block), i % LAYERS_PER_BLOCK)


class SignedSource(MemorySource):
    """Random payloads of every benchmarked size, one producer record per block of LAYERS_PER_BLOCK.
    With `plain_address`, each payload is also served unsigned at `plain_address(size, i)`: the very
    same bytes object, so that a pull of signed blocks and a pull of plain ones from this one server
    process differ only in the records (not in where the server's payloads happen to lie in memory)."""

    def __init__(self, signer: NodeSigner,
                 plain_address: Callable[[int, int], BlockAddress] | None = None) -> None:
        super().__init__()
        for size in BLOCK_SIZES.values():
            payloads = random_blocks(size)
            digests = [blake3.blake3(p).digest() for p in payloads]
            run_payloads = RUN_BLOCKS * LAYERS_PER_BLOCK
            for run_start in range(0, len(payloads), run_payloads):
                starts = range(run_start, min(len(payloads), run_start + run_payloads), LAYERS_PER_BLOCK)
                records = sign_run(NAMESPACE, [(signed_address(size, start).hash,
                                                digests[start:start + LAYERS_PER_BLOCK]) for start in starts],
                                   signer.node, signer.cert_der, signer.sign)
                for start, record in zip(starts, records, strict=True):
                    for i in range(start, min(len(payloads), start + LAYERS_PER_BLOCK)):
                        self.put(signed_address(size, i), payloads[i], digests[i], record)
            if plain_address is not None:
                for i, (payload, digest) in enumerate(zip(payloads, digests, strict=True)):
                    self.put(plain_address(size, i), payload, digest)


def sign_verify_ms_per_mib(cert_dir: Path, node: str, layer_bytes: int = 64 << 10,
                           num_blocks: int = 64) -> tuple[float, float]:
    """(sign, verify) ms per MiB of block for runs of RUN_BLOCKS blocks of LAYERS_PER_BLOCK layers of
    `layer_bytes` (medians of 5 passes; digests are given, as a store has them already)."""
    signer = NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    trust = TrustAnchor.from_files(cert_dir / CA_CERT)
    blocks = [(os.urandom(32), [os.urandom(32) for _ in range(LAYERS_PER_BLOCK)]) for _ in range(num_blocks)]
    mib = num_blocks * LAYERS_PER_BLOCK * layer_bytes / (1 << 20)
    sign_ms, verify_ms = [], []
    records: list[Provenance] = []
    for _ in range(5):
        start = time.perf_counter()
        records = [record for run in range(0, num_blocks, RUN_BLOCKS)
                   for record in sign_run(NAMESPACE, blocks[run:run + RUN_BLOCKS], signer.node, signer.cert_der,
                                          signer.sign)]
        sign_ms.append((time.perf_counter() - start) * 1e3 / mib)
        verifier = ProvenanceVerifier(trust)
        start = time.perf_counter()
        for record, (h, digests) in zip(records, blocks, strict=True):
            for layer, digest in enumerate(digests):
                if verifier.check(record, NAMESPACE, h, layer, digest) is not None:
                    raise RuntimeError("a record signed here did not verify")
        verify_ms.append((time.perf_counter() - start) * 1e3 / mib)
    return round(sorted(sign_ms)[2], 4), round(sorted(verify_ms)[2], 4)


def frame_ms_per_mib(cert_dir: Path, node: str, block_size: int, passes: int = 7,
                     run_blocks: int = RUN_BLOCKS) -> tuple[float, float]:
    """(serve, pull): the CPU per MiB that records add to the frames of a pull of `block_size`
    payloads, in this process alone: the server building BLOCK / BLOCKS headers with record tables,
    and the client parsing them and checking every payload's record (one fresh verifier for the
    pass, one load, as the tls_tcp_provenance method), each minus the same work on unsigned frames. Frames are cut as
    a server cuts them; their payloads are left out (they cost the same signed or not). Each figure
    is the fastest of `passes` passes, so that other work on the machine does not count.
    `run_blocks` = 1 gives the cost of records signed block by block."""
    signer = NodeSigner(cert_dir / f"{node}.pem", cert_dir / f"{node}.key")
    trust = TrustAnchor.from_files(cert_dir / CA_CERT)
    num = num_distinct(block_size)
    addresses = [signed_address(block_size, i) for i in range(num)]
    digests = [os.urandom(32) for _ in range(num)]
    records: list[Provenance] = []
    for start in range(0, num, run_blocks * LAYERS_PER_BLOCK):
        blocks = [(addresses[b].hash, digests[b:b + LAYERS_PER_BLOCK])
                  for b in range(start, min(num, start + run_blocks * LAYERS_PER_BLOCK), LAYERS_PER_BLOCK)]
        records += sign_run(NAMESPACE, blocks, signer.node, signer.cert_der, signer.sign)
    per_frame = 1 if block_size > GROUP_PART_MAX else GROUP_BYTES // block_size
    mib = num * block_size / (1 << 20)

    def frames(signed: bool) -> list[Block | Blocks]:
        out: list[Block | Blocks] = []
        for first in range(0, num, per_frame):
            parts = range(first, min(num, first + per_frame))
            provs = tuple(records[i // LAYERS_PER_BLOCK] for i in parts) if signed else ()
            if per_frame == 1:
                out.append(Block(1, addresses[first], digests[first], b"p", provs[0] if provs else None))
            else:
                out.append(Blocks(1, first, b"".join(digests[i] for i in parts), (1,) * len(parts),
                                  b"p" * len(parts), provs))
        return out

    def parts(frame: Block | Blocks) -> list[tuple[bytes, Provenance | None]]:
        if isinstance(frame, Block):
            return [(frame.digest, frame.provenance)]
        return [(frame.digests[j * 32:(j + 1) * 32], frame.provenances[j]) for j in range(len(frame.sizes))]

    def one_pass(signed: bool) -> tuple[float, float]:
        sent = frames(signed)
        start = time.perf_counter()
        wire = [encode(f) for f in sent]
        served = time.perf_counter()
        decoder = FrameDecoder()   # one connection
        received = [f for raw in wire for f in decoder.feed(raw)]
        if signed:
            k = 0
            verifier = ProvenanceVerifier(trust)   # one load: a pass over the distinct blocks
            for frame in received:
                assert isinstance(frame, Block | Blocks)
                for digest, record in parts(frame):
                    address = addresses[k]
                    if verifier.check(record, NAMESPACE, address.hash, address.layer, digest) is not None:
                        raise RuntimeError("a record signed here did not verify")
                    k += 1
        return (served - start) * 1e3 / mib, (time.perf_counter() - served) * 1e3 / mib

    serve, pull = {}, {}
    for signed in (False, True):
        times = [one_pass(signed) for _ in range(passes)]
        serve[signed], pull[signed] = min(t[0] for t in times), min(t[1] for t in times)
    return round(serve[True] - serve[False], 4), round(pull[True] - pull[False], 4)
