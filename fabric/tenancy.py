"""Which namespace salt a verified tenant gets (pure): the rule behind tenant isolation.

A namespace's root hash covers its `tenant_salt`, so two tenants with different salts never share a
block address. The salt is derived here from the tenant's name, which only a verified credential
supplies (transports/trust/tenant_tokens.py); the salt a caller passes is ignored. So knowing another
tenant's salt, or its addresses, gets a caller nothing: its own calls are rebound to its own salt.

    salt(tenant) = BLAKE3-derive-key(SALT_CONTEXT, "tenant\\0" || NAME)                 (32 bytes)
    salt(group)  = BLAKE3-derive-key(SALT_CONTEXT, "group\\0" || sorted names joined by \\0)
    anonymous    = b"" (the default tenant: what every caller had before tenants)

Tenants listed together in a shared group derive one salt, so they see each other's blocks; that
is the only way two tenants share a namespace, and it is explicit in the config.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import blake3

from fabric.errors import FabricError

SALT_CONTEXT = "kvfabric 2026-11 tenant namespace salt v1"
ANONYMOUS_SALT = b""


class TenancyConfigError(FabricError, ValueError):
    """A shared-group list that is not a partition of tenant names."""


def derive_salt(kind: str, names: Sequence[str]) -> bytes:
    material = (kind + "\0" + "\0".join(names)).encode()
    return blake3.blake3(material, derive_key_context=SALT_CONTEXT).digest()


@dataclass(frozen=True, slots=True)
class TenancyPolicy:
    """`required`: calls without a valid tenant are refused (else they are the anonymous tenant).
    `shared`: groups of tenants that share one namespace. `served`: the tenants this node serves
    (its certificate's restriction; empty: every tenant)."""

    required: bool = False
    shared: tuple[frozenset[str], ...] = ()
    served: frozenset[str] = frozenset()
    _group_of: dict[str, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for group in self.shared:
            if len(group) < 2:
                raise TenancyConfigError(f"a shared group names at least two tenants, got {sorted(group)}")
            members = tuple(sorted(group))
            for name in members:
                if not name:
                    raise TenancyConfigError("a shared group names an empty tenant")
                if name in self._group_of:
                    raise TenancyConfigError(f"tenant {name!r} is in two shared groups")
                self._group_of[name] = members

    @classmethod
    def from_lists(cls, required: bool, shared: Iterable[Iterable[str]],
                   served: Iterable[str] = ()) -> TenancyPolicy:
        return cls(required, tuple(frozenset(g) for g in shared), frozenset(served))

    def serves(self, tenant: str | None) -> bool:
        """Whether this node may answer `tenant` (None: anonymous). A node restricted to tenants
        serves only them; anonymous calls only where tenants are not required."""
        if tenant is None:
            return not self.required and not self.served
        return not self.served or tenant in self.served

    def members(self, tenant: str) -> frozenset[str]:
        """The tenants that share `tenant`'s namespace (itself, or its shared group)."""
        return frozenset(self._group_of.get(tenant, (tenant,)))

    def salt(self, tenant: str | None) -> bytes:
        """The namespace salt of `tenant` (None: anonymous, the empty salt)."""
        if tenant is None:
            return ANONYMOUS_SALT
        group = self._group_of.get(tenant)
        return derive_salt("group", group) if group is not None else derive_salt("tenant", (tenant,))
