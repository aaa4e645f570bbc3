"""The suite tiers itself: every test gets the markers of what it starts.

- ``cluster``: starts a local multi-node Ray cluster (or the CLI that starts one).
- ``bench``: runs a benchmark script end to end (its smoke test).
- ``slow``: loads a real model or runs a long soak; correct but not for the edit loop.
- ``vllm``: runs a real vLLM engine (marked in the test module itself).

``make test-fast`` runs what carries none of them; ``make test`` runs everything. A module joins a tier
here by name, so a new module that starts a cluster is listed once, beside its neighbours.

Shared fixtures: `wait_until` (wait for a condition, never for a fixed time) and `make_pki` / `pki`
(a real cluster CA and the certificates it issues); both live in tests/testkit.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from testkit import Pki, PkiFactory, Wait, make_pki
from testkit import wait_until as testkit_wait_until

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


@pytest.fixture(scope="session")
def wait_until() -> Wait:
    """`wait_until(predicate, what, timeout_s=30)`: poll until true, else fail naming `what`."""
    return testkit_wait_until



PKI_NODES = ("node-a", "node-b", "client-1")


@pytest.fixture(name="make_pki", scope="session")
def _make_pki() -> PkiFactory:
    """`make_pki(dir, *nodes, extra_sans=())`: a new cluster CA in `dir` and each node's certificate."""
    return make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A cluster CA of this test alone (in `tmp_path/certs`) with certificates for PKI_NODES."""
    return make_pki(tmp_path / "certs", *PKI_NODES)
