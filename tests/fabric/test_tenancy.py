"""The tenant salt rule: derived from the verified tenant, shared only by explicit groups."""

from __future__ import annotations

import pytest

from fabric.keys import Namespace
from fabric.layout import KVLayout
from fabric.tenancy import ANONYMOUS_SALT, TenancyConfigError, TenancyPolicy

LAYOUT = KVLayout.mha(2, 2, 8, "f16")


def test_each_tenant_gets_its_own_salt_and_so_its_own_addresses() -> None:
    policy = TenancyPolicy()
    a, b = policy.salt("a"), policy.salt("b")
    assert len(a) == 32 and a != b and ANONYMOUS_SALT not in (a, b)
    assert policy.salt(None) == ANONYMOUS_SALT
    roots = {Namespace("m", LAYOUT, 16, tenant_salt=s).root for s in (a, b, ANONYMOUS_SALT)}
    assert len(roots) == 3
    assert TenancyPolicy().salt("a") == a   # the same in every process: nothing process-dependent


def test_a_tenant_name_never_collides_with_a_group() -> None:
    grouped = TenancyPolicy.from_lists(False, [["a", "b"]])
    assert grouped.salt("a") == grouped.salt("b")
    assert grouped.salt("a") not in (TenancyPolicy().salt("a"), TenancyPolicy().salt("b"),
                                     TenancyPolicy().salt("a\0b"))
    assert grouped.salt("c") == TenancyPolicy().salt("c")


def test_required_and_served_decide_who_may_call() -> None:
    assert TenancyPolicy().serves(None) and TenancyPolicy().serves("a")
    assert not TenancyPolicy(required=True).serves(None)
    restricted = TenancyPolicy.from_lists(False, [], served=["a"])
    assert restricted.serves("a") and not restricted.serves("b") and not restricted.serves(None)


@pytest.mark.parametrize("shared", [[["a"]], [["a", "b"], ["b", "c"]], [["a", ""]]])
def test_shared_groups_must_be_disjoint_pairs_or_more(shared: list[list[str]]) -> None:
    with pytest.raises(TenancyConfigError):
        TenancyPolicy.from_lists(False, shared)
