"""Chained block hashing: kvfabric's BLAKE3 chain beside a SHA-256 chain, same tokens, same run.

    .venv/bin/python benchmarks/bench_hashing.py [--quick]

Hashes 128k tokens (a Python list, as engines hand them over) at block sizes 16 and 256,
interleaving ours and the baseline; reports the median ns per token.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import emit_json, median, print_table
from fabric.keys import Namespace, block_hashes, tokens_to_bytes
from fabric.layout import KVLayout


def sha256_chain(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """Baseline: the same chaining rule with SHA-256 (hashlib), same token encoding."""
    data = tokens_to_bytes(tokens)
    stride = block_size * 4
    view = memoryview(data)
    h = root
    out = []
    for i in range(len(data) // stride):
        h = hashlib.sha256(h + view[i * stride:(i + 1) * stride]).digest()
        out.append(h)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=128 * 1024)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    rng = random.Random(7)
    tokens = [rng.randrange(128_000) for _ in range(args.tokens)]
    tokens_np = np.asarray(tokens, dtype="<u4")
    layout = KVLayout.mha(32, 8, 128, "bf16")
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: object) -> None:
        t0 = time.perf_counter_ns()
        fn()  # type: ignore[operator]
        times.setdefault(name, []).append((time.perf_counter_ns() - t0) / len(tokens))

    for bs in (16, 256):
        ns = Namespace("bench-model", layout, bs)
        assert len(block_hashes(ns, tokens)) == len(sha256_chain(ns.root, tokens, bs)) == len(tokens) // bs
        for _ in tqdm(range(rounds), desc=f"block_size={bs}", file=sys.stderr):  # interleaved A B C
            timed(f"blake3_bs{bs}", lambda ns=ns: block_hashes(ns, tokens))
            timed(f"sha256_bs{bs}", lambda ns=ns, bs=bs: sha256_chain(ns.root, tokens, bs))
            timed(f"blake3_np_bs{bs}", lambda ns=ns: block_hashes(ns, tokens_np))

    med = {k: median(v) for k, v in times.items()}
    rows = [[f"block size {bs}", med[f"blake3_bs{bs}"], med[f"blake3_np_bs{bs}"], med[f"sha256_bs{bs}"],
             med[f"sha256_bs{bs}"] / med[f"blake3_bs{bs}"]] for bs in (16, 256)]
    print_table(f"chained block hashing, {len(tokens)} tokens, median of {rounds} (ns per token)",
                ["case", "kvfabric blake3 (list)", "kvfabric blake3 (numpy u32)", "sha256 chain (list)",
                 "sha256 / ours"], rows)
    emit_json({
        "ns_per_token_bs16": round(med["blake3_bs16"], 2),
        "ns_per_token_bs256": round(med["blake3_bs256"], 2),
        "ns_per_token_numpy_bs16": round(med["blake3_np_bs16"], 2),
        "sha256_ns_per_token_bs16": round(med["sha256_bs16"], 2),
        "sha256_ns_per_token_bs256": round(med["sha256_bs256"], 2),
        "ratio_bs16": round(med["sha256_bs16"] / med["blake3_bs16"], 3),
    })


if __name__ == "__main__":
    main()
