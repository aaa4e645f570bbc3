"""The NodeActor's tenant gate: every public call's namespace is rebound to its caller's verified tenant.

    client: FabricClient(credential) ──token──► NodeActor.load(ns, …, tenant_token=token)
                                                  ns = self.tenancy.bind(ns, tenant_token)
                                                       │ TenantVerifier: CA, revocation, expiry, signature
                                                       │ TenancyPolicy: served?, salt(tenant)
                                                       ▼
                                                  ns with tenant_salt = salt(tenant)   (the caller's is ignored)

A refused call raises `TenantRefusedError` (the client sees it as that type) and is counted in
`kvfabric_tenant_refusals_total{reason}`: malformed, untrusted, not_a_tenant, bad_signature,
expired, revoked (the token), required (no token where tenants are required), not_served (a
tenant this node's certificate does not list).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from fabric.config import TenancyConfig
from fabric.keys import Namespace
from fabric.tenancy import TenancyPolicy
from transports.core.identity import TrustAnchor
from transports.core.tenant_tokens import TenantError, TenantVerifier, tenants_of_node

logger = logging.getLogger(__name__)

MAX_ROOTS = 65536   # namespace roots remembered for the transport's per-peer tenant check


class TenantRefusedError(PermissionError):
    """The call's tenant token was missing, invalid, or names a tenant this node does not serve."""


class TenantGate:
    """Verifies tenant tokens and rebinds namespaces to the verified tenant's salt."""

    def __init__(self, config: TenancyConfig, trust: TrustAnchor, node_cert: bytes, registry: CollectorRegistry,
                 *, clock: Callable[[], float] = time.time) -> None:
        self.policy = TenancyPolicy.from_lists(config.required, config.shared, tenants_of_node(node_cert))
        self.verifier = TenantVerifier(trust)
        self.clock = clock
        self.refusals = Counter("kvfabric_tenant_refusals_total", "Calls refused for their tenant token, by reason",
                                ["reason"], registry=registry)
        # salt -> the tenants whose namespace it makes (one per tenant or shared group seen here)
        self._tenants_by_salt: dict[bytes, frozenset[str]] = {self.policy.salt(None): frozenset()}
        # namespace root -> its tenants, for every namespace bound here (the transport server asks it
        # which tenants a PULL's root belongs to: a peer restricted to tenants reads only theirs)
        self._tenants_by_root: dict[bytes, frozenset[str]] = {}

    def bind(self, ns: Namespace, token: bytes | None) -> Namespace:
        """`ns` with the salt of the tenant `token` proves (None: the anonymous tenant); raises
        TenantRefusedError when the token proves none or its tenant may not call this node."""
        tenant: str | None = None
        if token is not None:
            try:
                tenant = self.verifier.verify(token, self.clock())
            except TenantError as e:
                raise self._refuse(e.reason, f"tenant token refused: {e}") from None
        if not self.policy.serves(tenant):
            if tenant is None:
                raise self._refuse("required", "this node serves only calls with a tenant token "
                                               "(FabricClient.connect(credential=...))")
            raise self._refuse("not_served", f"this node does not serve tenant {tenant!r}")
        salt = self.policy.salt(tenant)
        if tenant is not None and salt not in self._tenants_by_salt:
            self._tenants_by_salt[salt] = self.policy.members(tenant)
        bound = ns if ns.tenant_salt == salt else dataclasses.replace(ns, tenant_salt=salt)
        if bound.root not in self._tenants_by_root:
            if len(self._tenants_by_root) >= MAX_ROOTS:   # oldest first; a forgotten root is refused, not leaked
                del self._tenants_by_root[next(iter(self._tenants_by_root))]
            self._tenants_by_root[bound.root] = self._tenants_by_salt[salt]
        return bound

    def tenants_of_root(self, root: bytes) -> frozenset[str] | None:
        """The tenants whose namespace `root` is, for a namespace bound on this node since it started
        (empty: the anonymous tenant's; None: not bound here)."""
        return self._tenants_by_root.get(root)

    def tenants_of(self, ns: Namespace) -> frozenset[str] | None:
        """The tenants whose namespace `ns` (as `bind` returned it) is: a block in it counts only if
        its producer may serve one of them (empty: the anonymous tenant's; None: not bound here)."""
        return self._tenants_by_salt.get(ns.tenant_salt)

    def _refuse(self, reason: str, message: str) -> TenantRefusedError:
        self.refusals.labels(reason).inc()
        logger.warning("call refused (%s): %s", reason, message)
        return TenantRefusedError(message)
