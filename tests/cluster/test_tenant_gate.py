"""The NodeActor's tenant gate, without Ray: which calls it refuses and which salt it binds."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from testkit import PkiFactory

from cluster.tenancy import TenantGate, TenantRefusedError
from fabric.config import TenancyConfig
from fabric.keys import Namespace
from fabric.layout import KVLayout
from fabric.tenancy import TenancyPolicy
from transports.trust.certs import issue_operator, issue_tenant
from transports.trust.identity import TrustAnchor
from transports.trust.tenant_tokens import TenantMinter

NOW = 1_800_000_000.0
NS = Namespace("m", KVLayout.mha(2, 2, 8, "f16"), 16)


@pytest.fixture
def ca(tmp_path: Path, make_pki: PkiFactory) -> Path:
    pki = make_pki(tmp_path, "node-open")
    pki.node("node-acme", tenants=("acme",))
    return pki.dir


def _gate(ca: Path, node: str = "node-open", **tenancy: object) -> tuple[TenantGate, CollectorRegistry]:
    registry = CollectorRegistry()
    gate = TenantGate(TenancyConfig(**tenancy), TrustAnchor.from_files(ca / "ca.pem"),  # type: ignore[arg-type]
                      (ca / f"{node}.pem").read_bytes(), registry, clock=lambda: NOW)
    return gate, registry


def _token(ca: Path, tenant: str) -> bytes:
    return TenantMinter(*issue_tenant(ca, tenant)).token(NOW)


def _refused(registry: CollectorRegistry, reason: str) -> float:
    return registry.get_sample_value("kvfabric_tenant_refusals_total", {"reason": reason}) or 0.0


def test_the_callers_salt_is_replaced_by_its_tenants(ca: Path) -> None:
    gate, _ = _gate(ca)
    claimed = Namespace("m", NS.layout, 16, tenant_salt=TenancyPolicy().salt("acme"))
    bound = gate.bind(claimed, _token(ca, "globex"))
    assert bound.tenant_salt == TenancyPolicy().salt("globex") and bound.root != claimed.root
    assert gate.bind(claimed, None).tenant_salt == b""   # anonymous: the default tenant's namespace
    assert gate.bind(NS, _token(ca, "acme")).root == claimed.root


def test_required_refuses_anonymous_calls_and_counts_them(ca: Path) -> None:
    gate, registry = _gate(ca, required=True)
    with pytest.raises(TenantRefusedError, match="only calls with a tenant token"):
        gate.bind(NS, None)
    assert _refused(registry, "required") == 1
    assert gate.bind(NS, _token(ca, "acme")).tenant_salt == TenancyPolicy().salt("acme")


def test_a_node_restricted_to_tenants_refuses_the_others(ca: Path) -> None:
    gate, registry = _gate(ca, node="node-acme")
    assert gate.bind(NS, _token(ca, "acme")).tenant_salt == TenancyPolicy().salt("acme")
    with pytest.raises(TenantRefusedError, match="does not serve tenant 'globex'"):
        gate.bind(NS, _token(ca, "globex"))
    with pytest.raises(TenantRefusedError):
        gate.bind(NS, None)
    assert (_refused(registry, "not_served"), _refused(registry, "required")) == (1, 1)


def test_an_invalid_token_is_refused_not_taken_as_anonymous(ca: Path) -> None:
    gate, registry = _gate(ca)
    with pytest.raises(TenantRefusedError, match="tenant token refused"):
        gate.bind(NS, b"garbage")
    assert _refused(registry, "malformed") == 1


def test_shared_groups_bind_one_namespace(ca: Path) -> None:
    gate, _ = _gate(ca, shared=[["acme", "globex"]])
    assert gate.bind(NS, _token(ca, "acme")).root == gate.bind(NS, _token(ca, "globex")).root
    assert gate.bind(NS, _token(ca, "initech")).root != gate.bind(NS, _token(ca, "acme")).root


def test_a_bound_namespace_names_the_tenants_its_producers_must_serve(ca: Path) -> None:
    gate, _ = _gate(ca, shared=[["acme", "globex"]])
    assert gate.tenants_of(gate.bind(NS, _token(ca, "acme"))) == {"acme", "globex"}
    assert gate.tenants_of(gate.bind(NS, _token(ca, "initech"))) == {"initech"}
    assert gate.tenants_of(gate.bind(NS, None)) == frozenset()
    assert gate.tenants_of(Namespace("m", NS.layout, 16, tenant_salt=b"never bound here")) is None


def test_the_transport_learns_each_bound_roots_tenants(ca: Path) -> None:
    """What the transport server asks before it serves a peer restricted to tenants."""
    gate, _ = _gate(ca, shared=[["acme", "globex"]])
    acme, initech, anonymous = (gate.bind(NS, _token(ca, "acme")), gate.bind(NS, _token(ca, "initech")),
                                gate.bind(NS, None))
    assert gate.tenants_of_root(acme.root) == {"acme", "globex"}
    assert gate.tenants_of_root(initech.root) == {"initech"}
    assert gate.tenants_of_root(anonymous.root) == frozenset()
    assert gate.tenants_of_root(Namespace("m", NS.layout, 16, tenant_salt=b"never bound here").root) is None


def test_operator_calls_need_the_operator_where_anonymous_callers_are_not_served(ca: Path) -> None:
    operator = TenantMinter(*issue_operator(ca, "ops")).token(NOW)
    for node, required in (("node-open", True), ("node-acme", False)):
        gate, registry = _gate(ca, node, required=required)
        with pytest.raises(TenantRefusedError, match="operator call"):
            gate.operator(None, "purge_producer")
        with pytest.raises(TenantRefusedError, match="tenant acme may not"):
            gate.operator(_token(ca, "acme"), "purge_producer")
        assert (_refused(registry, "operator_required"), _refused(registry, "not_operator")) == (1, 1)
        gate.operator(operator, "purge_producer")
        assert gate.scope(operator, "stats") is None
        with pytest.raises(TenantRefusedError, match="not a tenant"):   # an operator is no tenant
            gate.bind(NS, operator)
    gate, _ = _gate(ca)   # tenancy off, a node serving everyone: the anonymous caller is the operator
    gate.operator(None, "purge_producer")
    assert gate.scope(None, "stats") is None


def test_a_tenant_lists_only_the_namespaces_of_its_own_group(ca: Path) -> None:
    gate, _ = _gate(ca, shared=[["c", "d"]])
    roots = {t: gate.bind(NS, _token(ca, t)).root for t in ("acme", "c")}
    anonymous_root = gate.bind(NS, None).root
    scope = gate.scope(_token(ca, "d"), "held_block_hashes")
    assert scope == {"c", "d"}
    assert gate.in_scope(roots["c"], scope) and not gate.in_scope(roots["acme"], scope)
    assert not gate.in_scope(anonymous_root, scope) and not gate.in_scope(b"\0" * 32, scope)
