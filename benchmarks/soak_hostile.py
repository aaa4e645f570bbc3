"""Soak: one kvfabric node under hostile peers while a good client pulls; its latency idle vs under attack.

    .venv/bin/python benchmarks/soak_hostile.py [--quick] [--idle-s 12] [--attack-s 30] [--rounds 3]

A node (`soak_node.py`: QUIC and TLS-TCP servers, default limits) runs in its own process. A good
client (its own certificate) pulls PULL_BLOCKS blocks of 64 KiB every PULL_EVERY_S, alternating
QUIC and TLS-TCP, with the node otherwise idle (the baseline, `--idle-s` in all) and while an
attacker process (`hostile_attacks.py`, certificate "bad-1") runs every hostile case against the
node (`--attack-s` in all); the two phases alternate `--rounds` times. The cases: streams ended
right after their PULL, half-open QUIC handshakes, PULL floods on both transports, connections
past the per-peer cap, a block over the attacker's payload limit.
Then the node gets SIGTERM and must exit 0. The attacker runs at nice 19: on a real network it
sits on another machine, and here its own CPU (aioquic in Python) would otherwise starve the node
and the client of this machine's cores, which measures the machine rather than the node's defences.

Reported: the good client's pull latency p50 / p99 per phase and transport (ms), its failed
pulls, the node's RSS (MiB, /proc), CPU seconds and event-loop lag (how late a 10 ms timer fired:
max and p99 of its per-second reports, ms; it includes time the OS gave other processes), the
machine's 1-minute load average, and the attacker's counts. A table, then one JSON line with
`good_p99_under_attack_over_idle` (both transports' pulls together). Client, attacker and node
share this machine's cores: the latencies include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import credentials, emit_json, ensure_certs, percentile, print_table, rss_mib
from benchmarks.lib.hostile_attacks import ATTACKER, SERVER_NODE
from benchmarks.lib.soak_node import address
from benchmarks.lib.transfer_baselines import process_cpu_s
from transports.core.base import Hit, Peer
from transports.quic import QuicTransportClient
from transports.tls.client import TlsTcpClient

HERE = Path(__file__).resolve().parent
GOOD = "good-1"
BLOCK_SIZE, NUM_BLOCKS, PULL_BLOCKS, PULL_EVERY_S = 64 << 10, 16, 4, 0.02
BIG_BYTES = 2 << 20
RESULTS = HERE / "results" / "soak_hostile.json"


class Node:
    """The node process; a thread keeps its per-second loop-lag reports (and drains its stdout)."""

    def __init__(self, cert_dir: Path, config: Path | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "lib" / "soak_node.py"), "--cert-dir", str(cert_dir), "--node", SERVER_NODE,
             "--blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--big-bytes", str(BIG_BYTES),
             *(["--config", str(config)] if config is not None else [])],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"node did not start (said {line!r})")
        self.quic_port, self.tcp_port = (int(p) for p in line.split()[1:])
        self.lags: list[tuple[float, float, float]] = []   # (when, max ms, p99 ms)
        self.stopped = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("LAG "):
                _, worst, p99 = line.split()
                self.lags.append((time.monotonic(), float(worst), float(p99)))
            elif line.startswith("STOPPED"):
                self.stopped = True

    def terminate(self) -> int | None:
        self.proc.terminate()
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        self._reader.join(timeout=5)
        return code


class GoodClient:
    def __init__(self, cert_dir: Path, node: Node) -> None:
        creds = credentials(cert_dir, GOOD)
        self.clients: dict[str, QuicTransportClient | TlsTcpClient] = {
            "quic": QuicTransportClient(creds, frame_timeout_s=5.0),
            "tls-tcp": TlsTcpClient(creds, frame_timeout_s=5.0)}
        self.peers = {"quic": Peer(SERVER_NODE, "127.0.0.1", node.quic_port),
                      "tls-tcp": Peer(SERVER_NODE, "127.0.0.1", node.tcp_port)}
        self.wanted = [address(i) for i in range(PULL_BLOCKS)]

    async def pull(self, transport: str) -> tuple[float, bool]:
        start = time.perf_counter()
        results = [r async for r in self.clients[transport].pull(self.peers[transport], self.wanted)]
        return (time.perf_counter() - start) * 1e3, all(isinstance(r, Hit) for r in results)

    async def run_for(self, seconds: float, node: Node) -> dict[str, Any]:
        latencies: dict[str, list[float]] = {"quic": [], "tls-tcp": []}
        failed, peak_rss = 0, 0.0
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            transport = "quic" if i % 2 == 0 else "tls-tcp"
            ms, ok = await self.pull(transport)
            latencies[transport].append(ms)
            failed += not ok
            peak_rss = max(peak_rss, rss_mib(node.proc.pid) or 0.0)
            i += 1
            await asyncio.sleep(PULL_EVERY_S)
        return {"latencies": latencies, "failed": failed, "peak_rss": peak_rss}

    async def close(self) -> None:
        for client in self.clients.values():
            await client.close()


def _stats(latencies: dict[str, list[float]]) -> dict[str, float]:
    everything = latencies["quic"] + latencies["tls-tcp"]
    out = {"p50_ms": percentile(everything, 50), "p99_ms": percentile(everything, 99)}
    for transport, samples in latencies.items():
        key = transport.replace("-", "_")
        out[f"{key}_p50_ms"] = percentile(samples, 50)
        out[f"{key}_p99_ms"] = percentile(samples, 99)
    out["pulls"] = float(len(everything))
    return out


class Phase:
    """What the good client and the node showed over every window of one phase (idle or attacked)."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {"quic": [], "tls-tcp": []}
        self.failed, self.peak_rss, self.cpu_s = 0, 0.0, 0.0
        self.windows: list[tuple[float, float]] = []

    async def run(self, good: GoodClient, node: Node, seconds: float) -> None:
        start, cpu = time.monotonic(), process_cpu_s(node.proc.pid)
        got = await good.run_for(seconds, node)
        for transport, samples in got["latencies"].items():
            self.latencies[transport] += samples
        self.failed += got["failed"]
        self.peak_rss = max(self.peak_rss, got["peak_rss"])
        end_cpu = process_cpu_s(node.proc.pid)
        self.cpu_s += 0.0 if cpu is None or end_cpu is None else end_cpu - cpu
        self.windows.append((start, time.monotonic()))

    def lag(self, node: Node) -> tuple[float | None, float | None]:
        picked = [(w, p) for t, w, p in node.lags if any(a < t <= b + 0.5 for a, b in self.windows)]
        if not picked:
            return None, None
        return max(w for w, _ in picked), percentile([p for _, p in picked], 99)


async def soak(cert_dir: Path, idle_s: float, attack_s: float, rounds: int,
               config: Path | None = None) -> dict[str, Any]:
    """`rounds` times: the good client alone for idle_s / rounds, then attacked for attack_s / rounds
    (interleaved, so that a change in the machine's load touches both phases alike)."""
    node = Node(cert_dir, config)
    good = GoodClient(cert_dir, node)
    idle, attack = Phase(), Phase()
    counts: dict[str, int] = {}
    try:
        for transport in ("quic", "tls-tcp"):   # warm up: connections, handshakes
            for _ in range(5):
                await good.pull(transport)
        for _ in range(rounds):
            await idle.run(good, node, idle_s / rounds)
            attacker = subprocess.Popen(
                [sys.executable, str(HERE / "lib" / "hostile_attacks.py"), "--cert-dir", str(cert_dir),
                 "--quic-port", str(node.quic_port), "--tcp-port", str(node.tcp_port),
                 "--seconds", str(attack_s / rounds)],
                stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(19))
            await attack.run(good, node, attack_s / rounds)
            out, _ = await asyncio.to_thread(attacker.communicate, timeout=60)
            for what, n in (json.loads(out.strip().splitlines()[-1]) if out.strip() else {}).items():
                counts[what] = counts.get(what, 0) + n
        _, after_ok = await good.pull("quic")
        _, after_tls_ok = await good.pull("tls-tcp")
    finally:
        await good.close()
        code = node.terminate()
    return {"idle": idle, "attack": attack, "counts": counts, "lag_idle": idle.lag(node),
            "lag_attack": attack.lag(node), "answered_after": after_ok and after_tls_ok,
            "exit_code": code, "stopped": node.stopped, "load": os.getloadavg()[0]}


def report(raw: dict[str, Any], quick: bool, idle_s: float, attack_s: float, rounds: int) -> dict[str, object]:
    idle, attack = _stats(raw["idle"].latencies), _stats(raw["attack"].latencies)
    rows = [[name, s["p50_ms"], s["p99_ms"], s["quic_p50_ms"], s["quic_p99_ms"], s["tls_tcp_p50_ms"],
             s["tls_tcp_p99_ms"], int(s["pulls"]), raw[phase].failed, raw[phase].peak_rss,
             raw[phase].cpu_s, raw[f"lag_{phase}"][0], raw[f"lag_{phase}"][1]]
            for name, phase, s in (("idle", "idle", idle), ("attacked", "attack", attack))]
    print_table(f"Good client pulling {PULL_BLOCKS} x {BLOCK_SIZE >> 10} KiB every {PULL_EVERY_S * 1e3:.0f} ms "
                f"(idle {idle_s:.0f} s and attacked {attack_s:.0f} s, interleaved in {rounds} rounds)",
                ["phase", "p50 ms", "p99 ms", "quic p50", "quic p99", "tls p50", "tls p99", "pulls", "failed",
                 "node RSS MiB", "node CPU s", "loop lag max ms", "loop lag p99 ms"], rows)
    counts = raw["counts"]
    print_table("Attacker (certificate bad-1)", ["what", "count"], sorted(counts.items()))
    result: dict[str, object] = {
        "good_p50_idle_ms": round(idle["p50_ms"], 2), "good_p99_idle_ms": round(idle["p99_ms"], 2),
        "good_p50_under_attack_ms": round(attack["p50_ms"], 2),
        "good_p99_under_attack_ms": round(attack["p99_ms"], 2),
        "good_p99_under_attack_over_idle": round(attack["p99_ms"] / idle["p99_ms"], 2),
        "good_p50_under_attack_over_idle": round(attack["p50_ms"] / idle["p50_ms"], 2),
        "good_quic_p99_under_attack_over_idle": round(attack["quic_p99_ms"] / idle["quic_p99_ms"], 2),
        "good_tls_tcp_p99_under_attack_over_idle": round(attack["tls_tcp_p99_ms"] / idle["tls_tcp_p99_ms"], 2),
        "good_failed_pulls_idle": raw["idle"].failed, "good_failed_pulls_under_attack": raw["attack"].failed,
        "server_rss_idle_mib": round(raw["idle"].peak_rss, 1),
        "server_rss_under_attack_mib": round(raw["attack"].peak_rss, 1),
        "loop_lag_idle_max_ms": raw["lag_idle"][0], "loop_lag_under_attack_max_ms": raw["lag_attack"][0],
        "loop_lag_idle_p99_ms": raw["lag_idle"][1], "loop_lag_under_attack_p99_ms": raw["lag_attack"][1],
        "server_cpu_idle_s": round(raw["idle"].cpu_s, 2), "server_cpu_under_attack_s": round(raw["attack"].cpu_s, 2),
        "load_average_1m": round(raw["load"], 2),
        "server_answered_after_attack": raw["answered_after"],
        "server_exit_code": raw["exit_code"], "server_stopped_cleanly": raw["stopped"] and raw["exit_code"] == 0,
        "attack": counts, "idle_s": idle_s, "attack_s": attack_s, "rounds": rounds, "quick": quick,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="4 s idle, 8 s attacked, per-peer PULL budget 100/s (smoke test)")
    parser.add_argument("--idle-s", type=float, default=12.0)
    parser.add_argument("--attack-s", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3, help="idle / attacked phases interleaved this many times")
    parser.add_argument("--write-results", action="store_true", help=f"also write {RESULTS.relative_to(HERE.parent)}")
    args = parser.parse_args()
    idle_s, attack_s, rounds = (4.0, 8.0, 1) if args.quick else (args.idle_s, args.attack_s, args.rounds)
    with tempfile.TemporaryDirectory(prefix="kvfabric-soak-") as tmp:
        cert_dir = ensure_certs(tmp, (SERVER_NODE, GOOD, ATTACKER), days=1)
        config = None
        if args.quick:
            # A short run on a slow or busy machine may not flood past the default PULL budget
            # (1,000/s): a small one makes sure the overloaded answers are exercised. Budgets are per
            # peer, so the good client (well under it) is unaffected.
            config = cert_dir / "quick.toml"
            config.write_text("[transport]\npeer_pulls_per_s = 100.0\npeer_pull_burst = 100.0\n")
        raw = asyncio.run(soak(cert_dir, idle_s, attack_s, rounds, config))
    result = report(raw, args.quick, idle_s, attack_s, rounds)
    if args.write_results:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    emit_json(result)


if __name__ == "__main__":
    main()
