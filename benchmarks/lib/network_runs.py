"""One profile's measurements for `bench_network.py`, interleaved round by round, and the ratios
derived from them (keys without the profile suffix; the caller appends it)."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from benchmarks.harness import percentile
from benchmarks.lib.network_client import (
    ServerHost,
    get_ms,
    loaded_get_ms,
    make_client,
    pull_mb_s,
    round_ms,
    stream_mb_s,
)
from benchmarks.lib.network_serve import (
    BLOCK_SIZES,
    DATAGRAM,
    QUIC_PORT,
    QUIC_STOCK_PORT,
    SERVER_NODE,
    TCP_PORT,
    TLS_PORT,
    TLS_TCP_PORT,
)
from cluster.netbed.plan import parse_profile
from transports.core.base import Peer, TransportClient
from transports.quic import QuicTuning
from transports.quic.backend import resolve

Figures = dict[str, float | None]
LOADERS = 4            # concurrent pulls of other prefixes during the loaded gets


@dataclass(frozen=True, slots=True)
class Measures:
    """How long and how often each method runs in a profile."""

    limit_s: float = 1.0          # per throughput run
    rounds: int = 2               # interleaved rounds of every method
    num_gets: int = 40            # single gets per method, size and round (also bounded by get_limit_s)
    get_limit_s: float = 2.0
    loaded_limit_s: float = 3.0   # loaded gets per transport (profiles with loss)
    quic_stock: bool = False

    @classmethod
    def quick(cls) -> Measures:
        return cls(limit_s=0.3, rounds=1, num_gets=8, get_limit_s=0.5, loaded_limit_s=0.8)

    def with_overrides(self, *, limit_s: float | None, rounds: int | None, quic_stock: bool) -> Measures:
        return dataclasses.replace(self, limit_s=self.limit_s if limit_s is None else limit_s,
                                   rounds=self.rounds if rounds is None else rounds,
                                   quic_stock=quic_stock or self.quic_stock)


def profile_figures(names: list[str]) -> dict[str, dict[str, float]]:
    """What each named link profile asks for (rate, delay, loss), for a benchmark's JSON."""
    return {name: {"rate_mbit": (p := parse_profile(name)).rate_bps / 1e6, "delay_ms": p.delay_ms,
                   "loss_percent": p.loss_percent} for name in names}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _median(samples: list[float]) -> float | None:
    return round(statistics.median(samples), 2) if samples else None


def _latency(out: Figures, key: str, samples: list[float]) -> None:
    out[f"{key}_p50_ms"] = round(percentile(samples, 50), 3) if samples else None
    out[f"{key}_p99_ms"] = round(percentile(samples, 99), 3) if samples else None


async def measure_profile(server: ServerHost, profile: str, m: Measures) -> Figures:
    """Every method of `bench_network.py` over the link the bed has now (run inside the client host)."""
    peers = {"tls_tcp": Peer(SERVER_NODE, server.host, TLS_TCP_PORT), "quic": Peer(SERVER_NODE, server.host, QUIC_PORT),
             "quic_stock": Peer(SERVER_NODE, server.host, QUIC_STOCK_PORT)}
    clients: dict[str, TransportClient] = {
        "tls_tcp": make_client("tls_tcp", server), "quic": make_client("quic", server, QuicTuning(DATAGRAM))}
    if m.quic_stock:
        clients["quic_stock"] = make_client("quic", server, QuicTuning.library_defaults(DATAGRAM, resolve("auto")))
    rates: dict[str, list[float]] = {}
    gets: dict[str, list[float]] = {}
    out: Figures = {}
    try:
        for label, size in BLOCK_SIZES.items():
            for _ in range(m.rounds):
                rates.setdefault(f"tcp_socket_{label}", []).append(
                    stream_mb_s(server, TCP_PORT, False, size, m.limit_s))
                rates.setdefault(f"tls_socket_{label}", []).append(
                    stream_mb_s(server, TLS_PORT, True, size, m.limit_s))
                for name, client in clients.items():
                    rates.setdefault(f"{name}_{label}", []).append(
                        await pull_mb_s(client, peers[name], size, m.limit_s))
                gets.setdefault(f"tls_round_{label}", []).extend(
                    round_ms(server, TLS_PORT, size, m.num_gets, m.get_limit_s))
                for name, client in clients.items():
                    gets.setdefault(f"{name}_get_{label}", []).extend(
                        await get_ms(client, peers[name], size, m.num_gets, m.get_limit_s))
        if parse_profile(profile).loss_percent > 0:
            for name in ("tls_tcp", "quic"):
                times, loaded = await loaded_get_ms(clients[name], peers[name], 64 << 10, LOADERS,
                                                    m.num_gets * 10, m.loaded_limit_s)
                gets[f"{name}_loaded_get_64k"] = times
                out[f"{name}_loaded_pulls_mb_s"] = round(loaded, 2)
    finally:
        for client in clients.values():
            await client.close()
    for key, samples in rates.items():
        name, label = key.rsplit("_", 1)
        out[f"{name}_mb_s" + ("" if label == "1m" else f"_{label}")] = _median(samples)
    for key, samples in gets.items():
        _latency(out, key, samples)
    for suffix in ("", "_64k"):
        out[f"tls_tcp_vs_tls_socket{suffix}"] = _ratio(out[f"tls_tcp_mb_s{suffix}"], out[f"tls_socket_mb_s{suffix}"])
        out[f"tls_socket_vs_tcp_socket{suffix}"] = _ratio(out[f"tls_socket_mb_s{suffix}"],
                                                          out[f"tcp_socket_mb_s{suffix}"])
        out[f"quic_vs_tls_tcp{suffix}"] = _ratio(out[f"quic_mb_s{suffix}"], out[f"tls_tcp_mb_s{suffix}"])
        if m.quic_stock:
            out[f"quic_vs_quic_stock{suffix}"] = _ratio(out[f"quic_mb_s{suffix}"], out[f"quic_stock_mb_s{suffix}"])
    for label in BLOCK_SIZES:
        out[f"get_{label}_p50_over_tls_round"] = _ratio(out[f"tls_tcp_get_{label}_p50_ms"],
                                                        out[f"tls_round_{label}_p50_ms"])
        out[f"quic_get_{label}_p50_over_tls_round"] = _ratio(out[f"quic_get_{label}_p50_ms"],
                                                             out[f"tls_round_{label}_p50_ms"])
    out["quic_get_p99_over_tls_tcp_get_p99"] = _ratio(out["quic_get_64k_p99_ms"], out["tls_tcp_get_64k_p99_ms"])
    if "quic_loaded_get_64k" in gets:
        out["quic_p99_over_tls_tcp_p99"] = _ratio(out["quic_loaded_get_64k_p99_ms"],
                                                  out["tls_tcp_loaded_get_64k_p99_ms"])
    return out
