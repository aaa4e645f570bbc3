"""kvfabric's transports between two hosts of a network test bed, per link profile.

    python benchmarks/bench_network.py [--quick] [--profiles lan,dc,lossy,wan] [--limit 1.0] [--results PATH]

A bed of two hosts (network namespaces on a private bridge, cluster/netbed/bed.py): host 0 runs
`network_serve.py` (kvfabric TLS-TCP and QUIC servers, a plain TCP and a bare TLS stream server, all
serving the same random blocks), this process measures from host 1. For each profile, in one run:

    tcp_socket / tls_socket   bare streams of 1 MiB and 64 KiB blocks (TLS: the same certificates)
    tls_tcp / quic            kvfabric pulls, 2 in flight, every payload's BLAKE3 verified; QUIC on
                              the `auto` backend (the JSON names it) at 1452-byte datagrams, mTLS enforced
    quic_stock                with --quic-stock: the same QUIC with the library's own windows and
                              initial round trip (paired with `quic`: the effect of the tuning)
    gets                      single-block gets (p50/p99) over TLS-TCP and QUIC, beside a bare TLS
                              request/response round of the same block
    loaded gets (lossy)       single 64 KiB gets while 4 pulls of other prefixes run on the same
                              client, QUIC vs TLS-TCP

Methods run interleaved, `--rounds` times. What a profile applied is printed and in the JSON: this
kernel has no `tc netem`, so a profile's rate (tbf) and loss (nftables) are applied and its delay is
not. The TTFT of a model prefix pulled over each profile, against recomputing it, is measured by
bench_network_ttft.py (`ttft_remote_over_recompute_<profile>` in benchmarks/results/bench_network_ttft.json);
this JSON's `ttft_figures` names it.

Last line of stdout: one JSON object; keys end in the profile name, e.g. `tls_tcp_vs_tls_socket_dc`,
`quic_vs_tls_tcp_dc`, `quic_p99_over_tls_tcp_p99_lossy`, `get_1m_p50_over_tls_round_lan`.
Without --quick the JSON is also written to benchmarks/results/bench_network.json (or --results).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import emit_json, ensure_certs, print_table, write_results
from benchmarks.lib.network_client import ServerHost
from benchmarks.lib.network_runs import Measures, measure_profile, profile_figures
from benchmarks.lib.network_serve import CLIENT_NODE, SERVER_NODE
from cluster.netbed.bed import NetBed, NetbedUnavailable
from cluster.netbed.plan import NetbedError, parse_profile
from transports.quic.backend import resolve

logger = logging.getLogger("bench_network")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RESULTS = ROOT / "benchmarks" / "results" / "bench_network.json"
SERVER_READY_S = 60.0


def _start_server(bed: NetBed, cert_dir: Path) -> None:
    log = bed.root / "server.log"
    serve = ROOT / "benchmarks" / "lib" / "network_serve.py"
    proc = bed.spawn(0, [sys.executable, str(serve), "--cert-dir", str(cert_dir)], log=log)
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:
        if log.exists() and "READY" in log.read_text():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    said = log.read_text()[-2000:] if log.exists() else ""
    raise RuntimeError(f"the benchmark server in host 0 did not start: {said}")


def run(profiles: list[str], measures: Measures) -> dict[str, object]:
    """Measure every profile on one bed of two hosts; the bed is removed whatever happens."""
    bed = NetBed.create(2, profile=profiles[0])
    try:
        cert_dir = ensure_certs(bed.root / "certs", (SERVER_NODE, CLIENT_NODE), days=2)
        _start_server(bed, cert_dir)
        server = ServerHost(bed.plan.address(0), cert_dir)
        out: dict[str, object] = {"quic_backend": resolve("auto").name, "applied": bed.applied,
                                  "bed": bed.plan.prefix}
        for name in profiles:
            for host in (0, 1):
                bed.shape(host, name)
            with bed.inside(1):
                figures = asyncio.run(measure_profile(server, name, measures))
            out.update({f"{key}_{name}": value for key, value in figures.items()})
        return out
    finally:
        bed.teardown()


METHODS = {"tcp_socket": "plain TCP stream", "tls_socket": "bare TLS 1.3 stream", "tls_round": "bare TLS round",
           "tls_tcp": "kvfabric TLS-TCP", "quic": "kvfabric QUIC", "quic_stock": "kvfabric QUIC, library defaults"}


def _cell(result: dict[str, object], key: str) -> object:
    value = result.get(key)
    return "-" if value is None else value


def report(result: dict[str, object], profiles: list[str], measures: Measures) -> None:
    """The table of every profile's figures, then the ratios that compare methods side by side."""
    applied = result["applied"]
    assert isinstance(applied, dict)
    shaped = ", ".join(part for part, on in applied.items() if on)
    rows = []
    for p in profiles:
        for name, label in METHODS.items():
            if name == "quic_stock" and not measures.quic_stock:
                continue
            rows.append([f"{p}: {label}", _cell(result, f"{name}_mb_s_{p}"), _cell(result, f"{name}_mb_s_64k_{p}"),
                         *(_cell(result, f"{name}{'' if name == 'tls_round' else '_get'}_{size}_{q}_ms_{p}")
                           for size in ("1m", "64k") for q in ("p50", "p99"))])
    print_table(f"Between two bed hosts, QUIC backend {result['quic_backend']} at 1452-byte datagrams; "
                f"applied: {shaped} (no delay: this kernel has no netem); MB/s median of {measures.rounds} round(s)",
                ["profile: method", "MB/s 1 MiB", "MB/s 64 KiB", "get 1 MiB p50 ms", "p99", "get 64 KiB p50 ms",
                 "p99"], rows)
    ratio_keys = ["tls_tcp_vs_tls_socket", "tls_tcp_vs_tls_socket_64k", "quic_vs_tls_tcp", "quic_vs_tls_tcp_64k",
                  "get_1m_p50_over_tls_round", "quic_get_1m_p50_over_tls_round", "quic_p99_over_tls_tcp_p99",
                  *(["quic_vs_quic_stock", "quic_vs_quic_stock_64k"] if measures.quic_stock else [])]
    print_table("Ratios (same run); quic_p99_over_tls_tcp_p99: 64 KiB gets beside 4 pulls, profiles with loss",
                ["ratio", *profiles], [[k, *(_cell(result, f"{k}_{p}") for p in profiles)] for k in ratio_keys])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short runs of lan and lossy only (smoke test)")
    parser.add_argument("--profiles", default=None, help="comma-separated link profiles (default lan,dc,lossy,wan)")
    parser.add_argument("--limit", type=float, default=None, help="seconds per throughput run (default 1.0)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per profile (default 2)")
    parser.add_argument("--quic-stock", action="store_true",
                        help="also QUIC with the library's own windows and initial round trip (paired with ours)")
    parser.add_argument("--results", default=None, help=f"where to write the JSON (default {DEFAULT_RESULTS})")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    profiles = (args.profiles or ("lan,lossy" if args.quick else "lan,dc,lossy,wan")).split(",")
    try:
        for name in profiles:
            parse_profile(name)
    except NetbedError as e:
        parser.error(str(e))
    measures = Measures.quick() if args.quick else Measures()
    measures = measures.with_overrides(limit_s=args.limit, rounds=args.rounds, quic_stock=args.quic_stock)
    try:
        result = run(profiles, measures)
    except NetbedUnavailable as e:
        print(f"bench_network: {e}", file=sys.stderr)
        sys.exit(2)
    result.update({"quick": args.quick, "profiles": profile_figures(profiles)})
    result["ttft_figures"] = "benchmarks/bench_network_ttft.py"
    report(result, profiles, measures)
    if not args.quick or args.results:
        write_results(result, Path(args.results) if args.results else DEFAULT_RESULTS)
    emit_json(result)


if __name__ == "__main__":
    main()
