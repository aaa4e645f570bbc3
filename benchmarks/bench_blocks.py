"""BlockManager vs a nano-vllm-style block manager on pools of 10k, 100k and 1M blocks.

Workload (the same request stream for both sides, generated once from a seed):
    a few long system prompts shared by many requests, each request = prompt + a random user
    suffix, then decode tokens one at a time (can_append / may_append), and the sequence is
    deallocated `concurrency` requests later. Before timing, the pool is filled with unique
    requests, so every block holds a cached hash and each miss evicts one, and each prompt is
    run once, so its blocks sit cached near the tail of the free list. A prompt whose
    sequences have all finished is then hit from the *free* list: nano-vllm takes such a block
    out with `deque.remove`, which scans the deque (O(pool)); ours unlinks it in O(1).

Same work on both sides: the same token->bytes conversion, each full block hashed once per
request (ours BLAKE3 chained from the namespace root via fabric.keys; the baseline xxh64
chained as nano-vllm does), hits verified against the block's tokens, same block ids chosen
(checked: the same cached tokens per request, and the same free list where both sides ran the
whole stream). One op = one allocate, one decode step (can_append + may_append) or one
deallocate.

Interleaving: the stream is cut into chunks; chunk k runs on every pool size, ours and the
baseline alternating which goes first, before chunk k+1 runs anywhere. The baseline at 100k / 1M
costs milliseconds per hit, so it runs only the first chunks of the same stream (counts are
printed); per-op figures compare the same kind of op in the same steady state.
A figure is the median over timed chunks of (chunk time / ops in the chunk).

Last stdout line: JSON with us_per_op / baseline_us_per_op per size, ratio_10k, ratio_1m
(baseline / ours) and growth_10k_to_1m (ours at 1M / ours at 10k).
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeAlias

import numpy as np
import xxhash
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import emit_json, median, print_table
from cluster.engines.reference.block_manager import BlockManager
from cluster.engines.reference.sequence import SeqState
from fabric.keys import Namespace
from fabric.layout import KVLayout

logger = logging.getLogger(__name__)

SIZES = {"10k": 10_000, "100k": 100_000, "1m": 1_000_000}


# --------------------------------------------------------------------------- baseline
class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = -1
        self.token_ids = b""


class DequeBlockManager:
    """Built the way nano-vllm's block manager is: Block objects, a deque free list, xxh64 keys.

    Two fixes over nano-vllm, both O(1): reusing a block drops its stale hash -> id entry (nano-vllm
    leaves it, which can serve a reused block for an old prefix); the block holding a prompt's last
    token is never a hit (the engine computes that token, and must not write into a shared block).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.used_block_ids: set[int] = set()

    @staticmethod
    def compute_hash(token_bytes: bytes, prefix: int = -1) -> int:
        h = xxhash.xxh64()
        if prefix != -1:
            h.update(prefix.to_bytes(8, "little"))
        h.update(token_bytes)
        return h.intdigest()

    def _allocate_block(self, block_id: int) -> _Block:
        block = self.blocks[block_id]
        assert block.ref_count == 0
        if block.hash != -1 and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.ref_count = 1
        block.hash = -1
        block.token_ids = b""
        self.free_block_ids.remove(block_id)
        self.used_block_ids.add(block_id)
        return block

    def _deallocate_block(self, block_id: int) -> None:
        assert self.blocks[block_id].ref_count == 0
        self.used_block_ids.remove(block_id)
        self.free_block_ids.append(block_id)

    def can_allocate(self, seq: SeqState) -> bool:
        return len(self.free_block_ids) >= -(-len(seq.token_ids) // self.block_size)

    def allocate(self, seq: SeqState) -> bool:
        assert not seq.block_table
        bs = self.block_size
        data = seq.token_ids.tobytes()
        stride = 4 * bs
        h = -1
        cache_miss = False
        max_hits = (len(seq.token_ids) - 1) // bs  # as ours: the last token's block is computed, never a hit
        for i in range(-(-len(seq.token_ids) // bs)):
            token_ids = data[i * stride:(i + 1) * stride]
            h = self.compute_hash(token_ids, h) if len(token_ids) == stride else -1
            block_id = self.hash_to_block_id.get(h, -1)
            if block_id == -1 or self.blocks[block_id].token_ids != token_ids or i >= max_hits:
                cache_miss = True
            if cache_miss:
                block_id = self.free_block_ids[0]
                block = self._allocate_block(block_id)
            else:
                seq.num_cached_tokens += bs
                if block_id in self.used_block_ids:
                    block = self.blocks[block_id]
                    block.ref_count += 1
                else:
                    block = self._allocate_block(block_id)
            if h != -1:
                block.hash = h
                block.token_ids = token_ids
                self.hash_to_block_id[h] = block_id
            seq.block_table.append(block_id)
        return True

    def deallocate(self, seq: SeqState) -> None:
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._deallocate_block(block_id)
        seq.num_cached_tokens = 0
        seq.block_table.clear()

    def can_append(self, seq: SeqState) -> bool:
        return len(self.free_block_ids) >= (len(seq.token_ids) % self.block_size == 1)

    def may_append(self, seq: SeqState) -> bool:
        block_table = seq.block_table
        last_block = self.blocks[block_table[-1]]
        n = len(seq.token_ids)
        if n % self.block_size == 1:
            assert last_block.hash != -1
            block_id = self.free_block_ids[0]
            self._allocate_block(block_id)
            block_table.append(block_id)
        elif n % self.block_size == 0:
            assert last_block.hash == -1
            token_ids = seq.token_ids[n - self.block_size:].tobytes()
            prefix = self.blocks[block_table[-2]].hash if len(block_table) > 1 else -1
            h = self.compute_hash(token_ids, prefix)
            last_block.hash = h
            last_block.token_ids = token_ids
            self.hash_to_block_id[h] = last_block.block_id
        return True

    def take_events(self) -> list[object]:
        return []


# --------------------------------------------------------------------------- workload
class Manager(Protocol):
    def can_allocate(self, seq: SeqState) -> bool: ...
    def allocate(self, seq: SeqState) -> bool: ...
    def can_append(self, seq: SeqState) -> bool: ...
    def may_append(self, seq: SeqState) -> bool: ...
    def deallocate(self, seq: SeqState) -> None: ...
    def take_events(self) -> Sequence[object]: ...


@dataclass(frozen=True)
class Workload:
    block_size: int = 16
    num_prompts: int = 8
    prompt_blocks: int = 16
    suffix_tokens: tuple[int, int] = (16, 128)
    decode_tokens: int = 24
    concurrency: int = 4
    filler_blocks: int = 1024


Request: TypeAlias = "tuple[array[int], list[int]]"


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 2**31, size=n, dtype=np.uint32)


def make_requests(w: Workload, n: int, rng: np.random.Generator) -> tuple[list[Request], list[Request]]:
    """(prompt warm-up requests, the timed stream) as (prompt tokens, decode tokens)."""
    prompts = [_tokens(rng, w.prompt_blocks * w.block_size) for _ in range(w.num_prompts)]
    warm: list[Request] = [(array("I", p.tobytes()), []) for p in prompts]
    stream: list[Request] = []
    for _ in range(n):
        p = prompts[int(rng.integers(w.num_prompts))]
        suffix = _tokens(rng, int(rng.integers(*w.suffix_tokens, endpoint=True)))
        toks = array("I")
        toks.frombytes(np.concatenate([p, suffix]).tobytes())
        stream.append((toks, _tokens(rng, w.decode_tokens).tolist()))
    return warm, stream


class Driver:
    """Runs requests against one manager; identical code for both sides."""

    def __init__(self, mgr: Manager, w: Workload) -> None:
        self.mgr = mgr
        self.w = w
        self.window: deque[SeqState] = deque()
        self.next_id = 0
        self.cached_tokens: list[int] = []  # per request, to check both sides did the same work

    def run(self, requests: Sequence[Request]) -> int:
        mgr, window, concurrency = self.mgr, self.window, self.w.concurrency
        ops = 0
        for tokens, decode in requests:
            seq = SeqState(self.next_id, tokens)
            self.next_id += 1
            if not mgr.can_allocate(seq) or not mgr.allocate(seq):
                raise RuntimeError("benchmark pool too small for the workload")
            self.cached_tokens.append(seq.num_cached_tokens)
            append = seq.token_ids.append
            for t in decode:
                append(t)
                if not mgr.can_append(seq) or not mgr.may_append(seq):
                    raise RuntimeError("benchmark pool too small for the workload")
            window.append(seq)
            ops += 1 + len(decode)
            if len(window) > concurrency:
                mgr.deallocate(window.popleft())
                ops += 1
            mgr.take_events()
        return ops

    def drain(self) -> None:
        while self.window:
            self.mgr.deallocate(self.window.popleft())
        self.mgr.take_events()


def fill(driver: Driver, num_blocks: int, rng: np.random.Generator) -> None:
    """Cycle unique requests through the whole pool so every block ends up holding a hash."""
    w = driver.w
    for start in range(0, num_blocks, w.filler_blocks):
        n = min(w.filler_blocks, num_blocks - start) * w.block_size
        toks = array("I")
        toks.frombytes(_tokens(rng, n).tobytes())
        seq = SeqState(-1, toks)
        if not driver.mgr.allocate(seq):
            raise RuntimeError("filler request does not fit the pool")
        driver.mgr.deallocate(seq)
    driver.mgr.take_events()


@dataclass
class SizeResult:
    label: str
    num_blocks: int
    ours_us: list[float] = field(default_factory=list)  # us per op of each timed chunk
    ours_requests: int = 0
    base_us: list[float] = field(default_factory=list)
    base_requests: int = 0
    hit_ratio: float = 0.0

    @property
    def us_per_op(self) -> float:
        return median(self.ours_us)

    @property
    def baseline_us_per_op(self) -> float:
        return median(self.base_us)


@dataclass
class Pool:
    """One pool size: both sides set up identically, plus what was measured."""

    result: SizeResult
    ours: Driver
    base: Driver
    base_requests: int


def setup_pool(label: str, num_blocks: int, w: Workload, warm: list[Request], base_requests: int,
               prefill: bool, seed: int) -> Pool:
    logger.info("pool %s: building%s", label, " and filling" if prefill else "")
    ns = Namespace("bench/llama-like", KVLayout.mha(32, 8, 128, "bf16"), w.block_size)
    ours = Driver(BlockManager(ns, num_blocks), w)
    base = Driver(DequeBlockManager(num_blocks, w.block_size), w)
    for d in (ours, base):
        if prefill:
            fill(d, num_blocks, np.random.default_rng(seed + 1))  # same filler tokens on both sides
        d.run(warm)
        d.drain()
        d.cached_tokens.clear()
    return Pool(SizeResult(label, num_blocks), ours, base, base_requests)


def run_interleaved(pools: list[Pool], stream: list[Request], chunk: int) -> None:
    """Chunk k runs on every pool, ours and the baseline alternating first, before chunk k+1.

    Interleaving sizes as well as sides spreads any noise from the machine over all figures.
    """
    gc.collect()
    gc.freeze()  # the pools' long-lived objects stay out of the timed collections
    timer = time.perf_counter
    starts = range(0, len(stream), chunk)
    for k, lo in enumerate(tqdm(starts, desc="chunks", file=sys.stderr, leave=False)):
        part = stream[lo:lo + chunk]
        for p in pools:
            res = p.result
            for d in ((p.ours, p.base) if k % 2 == 0 else (p.base, p.ours)):
                if d is p.base and lo >= p.base_requests:
                    continue
                t0 = timer()
                ops = d.run(part)
                us = (timer() - t0) / ops * 1e6
                if d is p.ours:
                    res.ours_us.append(us)
                    res.ours_requests += len(part)
                else:
                    res.base_us.append(us)
                    res.base_requests += len(part)
    gc.unfreeze()


def check_same_work(p: Pool, stream: list[Request]) -> None:
    """Both sides chose the same blocks: equal hits per request, equal free lists when both ran all."""
    res, ours, base = p.result, p.ours, p.base
    n = res.base_requests
    if ours.cached_tokens[:n] != base.cached_tokens[:n]:
        raise RuntimeError(f"pool {res.label}: the two sides found different cache hits")
    same_requests = n == res.ours_requests
    if (same_requests and isinstance(ours.mgr, BlockManager) and isinstance(base.mgr, DequeBlockManager)
            and ours.mgr.free_block_ids() != list(base.mgr.free_block_ids)):
        raise RuntimeError(f"pool {res.label}: the two sides' free lists differ after the same requests")
    total_tokens = sum(len(t) for t, _ in stream[:res.ours_requests])
    res.hit_ratio = sum(ours.cached_tokens) / total_tokens
    if isinstance(ours.mgr, BlockManager):
        logger.info("pool %s: %s", res.label, ours.mgr.stats())


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="a few seconds: fewer requests, no pool fill")
    ap.add_argument("--requests", type=int, default=None, help="timed requests per pool size (ours)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    w = Workload()
    if args.quick:
        num_requests, chunk, prefill = 100, 10, False
        base_requests = {"10k": 100, "100k": 20, "1m": 10}
    else:
        num_requests, chunk, prefill = 2000, 50, True
        base_requests = {"10k": 2000, "100k": 200, "1m": 50}
    if args.requests is not None:
        num_requests = args.requests
    warm, stream = make_requests(w, num_requests, np.random.default_rng(args.seed))
    pools = [setup_pool(label, num_blocks, w, warm, base_requests[label], prefill, args.seed)
             for label, num_blocks in SIZES.items()]
    run_interleaved(pools, stream, chunk)
    for p in pools:
        check_same_work(p, stream)
    results = [p.result for p in pools]

    print_table(
        f"BlockManager vs nano-vllm-style deque block manager (block size {w.block_size}, us per op)",
        ["pool", "ours us/op", "nano-vllm us/op", "ratio", "ours requests", "baseline requests", "hit ratio"],
        [[r.label, r.us_per_op, r.baseline_us_per_op, r.baseline_us_per_op / r.us_per_op,
          r.ours_requests, r.base_requests, f"{r.hit_ratio:.1%}"] for r in results])
    by = {r.label: r for r in results}
    out = {
        "us_per_op": {r.label: round(r.us_per_op, 3) for r in results},
        "baseline_us_per_op": {r.label: round(r.baseline_us_per_op, 3) for r in results},
        "ratio_10k": round(by["10k"].baseline_us_per_op / by["10k"].us_per_op, 2),
        "ratio_100k": round(by["100k"].baseline_us_per_op / by["100k"].us_per_op, 2),
        "ratio_1m": round(by["1m"].baseline_us_per_op / by["1m"].us_per_op, 2),
        "growth_10k_to_1m": round(by["1m"].us_per_op / by["10k"].us_per_op, 3),
        "requests": {r.label: r.ours_requests for r in results},
        "baseline_requests": {r.label: r.base_requests for r in results},
        "hit_ratio": round(sum(r.hit_ratio for r in results) / len(results), 4),
        "block_size": w.block_size,
        "quick": args.quick,
    }
    emit_json(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
