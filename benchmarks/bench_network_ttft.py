"""Time to first token of a model prefix pulled between two hosts of a network test bed, per link
profile, against recomputing it.

    python benchmarks/bench_network_ttft.py [--quick] [--profiles lan,dc,wan,lossy] [--tokens 4096]
                                            [--reps 3] [--results PATH]

A bed of two hosts (network namespaces on a private bridge, cluster/netbed/bed.py) runs Ray and the
fabric (TLS-TCP), with a SmolLM2-135M-Instruct engine actor pinned to each host. For each profile
both links are reshaped, host A computes and stores a `--tokens` prefix, and host B answers a prompt
sharing it, three ways:

    plain pull   `mode="full", deadline_s=inf`: B pulls everything A holds, then computes the
                 16-token suffix (the transport's TTFT over the link)
    decided      the default deadline: B's own load-or-recompute choice from its estimates of the
                 link to A and of its prefill rate (learned from earlier requests)
    recompute    B computes the whole prompt with nothing cached (the baseline)

The three alternate order on every repetition. Between requests the bench waits until neither node
has background work left (flushes, mirrors, directory batches) and deletes the copy of A's blocks
that B kept from a pull (`purge_producer`), so every pull crosses the link again. Medians over the
repetitions; TTFT is measured inside the engine actor.

What a profile applied is printed and in the JSON: this kernel has no `tc netem`, so a profile's
rate (tbf) and loss (nftables) are applied and its delay is not.

Last line of stdout: one JSON object with, per profile, `ttft_remote_over_recompute_<profile>`
(plain pull), `ttft_decided_over_recompute_<profile>`, the medians and the pulled tokens. Without
--quick the JSON is also written to benchmarks/results/bench_network_ttft.json (or --results).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_deadline import prompt_pair
from benchmarks.bench_ttft import settle
from benchmarks.harness import emit_json, median, print_table, write_results
from benchmarks.lib.network_runs import profile_figures
from cluster.netbed.bed import NetBed, NetbedUnavailable
from cluster.netbed.plan import NetbedError, parse_profile
from fabric.config import AuditConfig, ClusterConfig, Config, KVConfig

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "bench_network_ttft.json"
BLOCK = 16
PATHS = ("plain", "decided", "recompute")
# A 4k prefix of SmolLM2 over `wan`'s rate comes near the default pull timeout on a loaded host;
# the plain pull must not be cut.
PULL_TIMEOUT_S = 120.0


@dataclass(slots=True)
class Samples:
    """One profile's measurements, per path, in repetition order."""

    ttft: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PATHS})
    pulled: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in PATHS})
    pull_mb_s: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Fabric:
    """The two hosts' engines and NodeActors, A (the owner) and B (the requester)."""

    engine_a: Any
    engine_b: Any
    nodes: tuple[Any, Any]
    producer_a: str              # the name A signs its blocks with
    vocab: int


def _drop_pulled(fab: Fabric) -> int:
    """Delete from B every block A produced (B's copy of a pull); returns how many payloads."""
    import ray

    settle(fab.nodes)          # B's mirror of the pull is written before it is deleted
    removed = int(ray.get(fab.nodes[1].purge_producer.remote(fab.producer_a)))
    settle(fab.nodes)
    return removed


def _request(fab: Fabric, path: str, tokens: list[int], num_prefix: int, samples: Samples) -> None:
    import ray

    from cluster.engines.hf.engine import LoadMode

    settle(fab.nodes)
    if path == "recompute":
        got = ray.get(fab.engine_b.recompute.remote(tokens, 1))
    else:
        got = ray.get(fab.engine_b.answer.remote(tokens, 1, mode=LoadMode.FULL.value, export=False,
                                                 deadline_s=math.inf if path == "plain" else None))
    if path == "plain":
        if got.num_pulled_tokens < num_prefix:
            raise RuntimeError(f"the plain pull reused {got.num_reused_tokens} tokens and pulled "
                               f"{got.num_pulled_tokens}; expected the {num_prefix}-token prefix from A")
        if got.load_s > 0:
            samples.pull_mb_s.append(got.pulled_bytes / got.load_s / 1e6)
    samples.ttft[path].append(got.ttft_s)
    samples.pulled[path].append(got.num_pulled_tokens)
    if got.num_pulled_tokens:
        _drop_pulled(fab)


def measure_profile(fab: Fabric, k: int, num_prefix: int, reps: int) -> Samples:
    """A stores a fresh prefix; B answers a prompt sharing it on every path, `reps` times."""
    import ray

    samples = Samples()
    first, second = prompt_pair(num_prefix, seed=100 * k, vocab=fab.vocab)
    ray.get(fab.engine_a.answer.remote(first, 1))          # A computes and stores the prefix
    for rep in range(reps):
        for path in PATHS if rep % 2 == 0 else PATHS[::-1]:   # no order bias
            _request(fab, path, second, num_prefix, samples)
    return samples


def _start_engines(node_ids: list[str], num_prefix: int) -> Fabric:
    """An engine per host; both warmed up (a recompute each, a pull from A to B) and B's copy dropped."""
    import ray

    from cluster.engines.hf.actor import spawn_engines
    from cluster.engines.hf.engine import SMOLLM2_ID, smollm2_checkpoint
    from cluster.node.actor import node_actor_name, node_name_for

    a, b = node_ids
    checkpoint, fingerprint = smollm2_checkpoint()
    vocab = int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
    engines = spawn_engines([a, b], str(checkpoint), fingerprint=fingerprint, model_id=SMOLLM2_ID,
                            block_size=BLOCK, num_threads=2)
    nodes = (ray.get_actor(node_actor_name(a), namespace="kvfabric"),
             ray.get_actor(node_actor_name(b), namespace="kvfabric"))
    fab = Fabric(engines[a], engines[b], nodes, node_name_for(a), vocab)
    warm_first, warm_second = prompt_pair(num_prefix, seed=999, vocab=vocab)
    ray.get(fab.engine_a.answer.remote(warm_first, 1))
    ray.get(fab.engine_b.recompute.remote(warm_second, 1))     # B's prefill rate, for its decisions
    settle(nodes)
    got = ray.get(fab.engine_b.answer.remote(warm_second, 1, mode="full", export=False, deadline_s=math.inf))
    if got.num_pulled_tokens < num_prefix:
        raise RuntimeError(f"the warm-up pull got {got.num_pulled_tokens} of {num_prefix} tokens from A")
    if _drop_pulled(fab) == 0:
        raise RuntimeError(f"B kept no blocks produced by {fab.producer_a} after pulling them")
    return fab


def run(profiles: list[str], num_prefix: int, reps: int) -> dict[str, Any]:
    """Every profile on one bed of two hosts; the bed (and its Ray) is removed whatever happens."""
    from transformers.utils import logging as hf_logging

    from cluster.netbed.ray_cluster import driver, node_hosts, start_bed_fabric, start_ray

    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    base = Config(kv=KVConfig(ram_gib=1.5), cluster=ClusterConfig(pull_timeout_s=PULL_TIMEOUT_S),
                  audit=AuditConfig(rate=0.0))   # pulls are measured: no sampled recompute (bench_ttft pairs it)
    bed = NetBed.create(2, profile=profiles[0])
    try:
        bed_ray = start_ray(bed, object_store_bytes=1 << 30)
        with driver(bed, bed_ray):
            start_bed_fabric(bed, base)
            hosts = node_hosts()
            fab = _start_engines(sorted(hosts, key=lambda n: hosts[n]), num_prefix)
            out: dict[str, Any] = {"applied": bed.applied, "bed": bed.plan.prefix, "samples": {}}
            for k, name in enumerate(profiles):
                for host in (0, 1):
                    bed.shape(host, name)
                out["samples"][name] = measure_profile(fab, k, num_prefix, reps)
            return out
    finally:
        bed.teardown()


def summarise(measured: dict[str, Any], profiles: list[str]) -> dict[str, Any]:
    """The JSON keys: per profile the medians, pulled tokens and the ratios to recompute."""
    result: dict[str, Any] = {"applied": measured["applied"], "bed": measured["bed"]}
    for p in profiles:
        s: Samples = measured["samples"][p]
        med = {path: median(s.ttft[path]) for path in PATHS}
        result.update({f"ttft_{path}_s_{p}": round(med[path], 4) for path in PATHS})
        result.update({f"pulled_tokens_{path}_{p}": int(median(s.pulled[path])) for path in ("plain", "decided")})
        result[f"pull_mb_s_{p}"] = round(median(s.pull_mb_s), 1) if s.pull_mb_s else None
        result[f"ttft_remote_over_recompute_{p}"] = round(med["plain"] / med["recompute"], 4)
        result[f"ttft_decided_over_recompute_{p}"] = round(med["decided"] / med["recompute"], 4)
    return result


def report(measured: dict[str, Any], result: dict[str, Any], profiles: list[str], num_prefix: int,
           reps: int) -> None:
    applied = result["applied"]
    shaped = ", ".join(part for part, on in applied.items() if on)
    no_delay = "" if applied["delay"] else " (no delay: this kernel has no netem)"
    rows = []
    for p in profiles:
        s: Samples = measured["samples"][p]
        for path in PATHS:
            pulled = "-" if path == "recompute" else result[f"pulled_tokens_{path}_{p}"]
            ratio = "-" if path == "recompute" else result[f"ttft_{'remote' if path == 'plain' else path}"
                                                           f"_over_recompute_{p}"]
            rows.append([f"{p}: {path}", result[f"ttft_{path}_s_{p}"], pulled, ratio,
                         " ".join(f"{t:.2f}" for t in s.ttft[path])])
    print_table(f"TTFT on host B, {num_prefix}-token SmolLM2 prefix held by host A, TLS-TCP; applied: {shaped}"
                f"{no_delay}; medians of {reps}", ["profile: path", "TTFT s", "pulled tokens", "÷ recompute",
                                                   "each repetition"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="256-token prefix, lan and wan, one repetition (smoke test)")
    parser.add_argument("--profiles", default=None, help="comma-separated link profiles (default lan,dc,wan,lossy)")
    parser.add_argument("--tokens", type=int, default=None, help="prefix tokens, a multiple of 16 (default 4096)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per profile (default 3)")
    parser.add_argument("--results", default=None, help=f"where to write the JSON (default {DEFAULT_RESULTS})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TQDM_DISABLE", "1")
    profiles = (args.profiles or ("lan,wan" if args.quick else "lan,dc,wan,lossy")).split(",")
    num_prefix = args.tokens or (256 if args.quick else 4096)
    reps = args.reps or (1 if args.quick else 3)
    if num_prefix <= 0 or num_prefix % BLOCK:
        parser.error(f"--tokens must be a positive multiple of {BLOCK}, got {num_prefix}")
    if reps <= 0:
        parser.error(f"--reps must be positive, got {reps}")
    try:
        for name in profiles:
            parse_profile(name)
    except NetbedError as e:
        parser.error(str(e))
    start = time.monotonic()
    try:
        measured = run(profiles, num_prefix, reps)
    except NetbedUnavailable as e:
        print(f"bench_network_ttft: {e}", file=sys.stderr)
        sys.exit(2)
    result = summarise(measured, profiles)
    result.update({"quick": args.quick, "reps": reps, "tokens": num_prefix, "transport": "tls-tcp",
                   "profiles": profile_figures(profiles), "wall_s": round(time.monotonic() - start, 1)})
    report(measured, result, profiles, num_prefix, reps)
    if not args.quick or args.results:
        write_results(result, Path(args.results) if args.results else DEFAULT_RESULTS)
    emit_json(result)


if __name__ == "__main__":
    main()
