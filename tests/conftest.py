"""The suite tiers itself: every test gets the markers of what it starts.

- ``cluster``: starts a local multi-node Ray cluster (or the CLI that starts one).
- ``bench``: runs a benchmark script end to end (its smoke test).
- ``slow``: loads a real model or runs a long soak; correct but not for the edit loop.
- ``vllm``: runs a real vLLM engine (marked in the test module itself).

``make test-fast`` runs what carries none of them; ``make test`` runs everything. A module joins a tier
here by name, so a new module that starts a cluster is listed once, beside its neighbours.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests check outcomes, not speed: hypothesis' per-example deadline (200 ms) fails them on a loaded
# 2-core host for no fault of the code, so no example has one.
settings.register_profile("kvfabric", deadline=None)
settings.load_profile("kvfabric")

BENCH_TIMEOUT_S = 660

_CLUSTER_MODULES = frozenset({
    "test_audit_cluster.py",
    "test_cli_cluster.py",
    "test_cli_demo.py",
    "test_cli_inspect.py",
    "test_cli_purge.py",
    "test_cluster_integration.py",
    "test_directory_stall.py",
    "test_hf_cluster.py",
    "test_kv_events_cluster.py",
    "test_load_deadline.py",
    "test_netbed.py",
    "test_provenance_cluster.py",
    "test_ray_job_example.py",
    "test_tenancy_cluster.py",
    "test_vllm_cluster.py",
})
_SLOW_MODULES = frozenset({
    "test_hf_engine.py",
    "test_hf_smollm2.py",
    "test_engine_allocator.py",
    "test_store_hardening.py",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name == "benchmarks":
            item.add_marker(pytest.mark.bench)
            # A smoke test bounds its benchmark's subprocess itself (up to 600 s, a run on a loaded
            # 2-core host); the suite's 300 s must not end the test before that bound can fire.
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(BENCH_TIMEOUT_S))
        if path.name in _CLUSTER_MODULES:
            item.add_marker(pytest.mark.cluster)
        if path.name in _SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


Wait = Callable[..., float]


def _wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, poll_s: float = 0.05) -> float:
    """Poll `predicate` until it is true; the seconds it took. A test waits for a condition, never for a
    fixed time: this fails with `what` when the condition has not held within `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(poll_s)
    return time.monotonic() - start


@pytest.fixture(scope="session")
def wait_until() -> Wait:
    """`wait_until(predicate, what, timeout_s=30)`: poll until true, else fail naming `what`."""
    return _wait_until
