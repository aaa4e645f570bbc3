"""The NodeActor's tenant gate: every public call's namespace is rebound to its caller's verified tenant.

    client: FabricClient(credential) ──token──► NodeActor.load(ns, …, tenant_token=token)
                                                  ns = self.tenancy.bind(ns, tenant_token)
                                                       │ TenantVerifier: CA, revocation, expiry, signature
                                                       │ TenancyPolicy: served?, salt(tenant)
                                                       ▼
                                                  ns with tenant_salt = salt(tenant)   (the caller's is ignored)

Node-wide calls (purge, send rate, node-wide listings and stats) are the operator's: `operator`
admits a caller whose token an operator credential made, and the anonymous caller only where this
node serves anonymous calls (tenancy not required, node not restricted to tenants: one trust domain,
whoever reaches the Ray cluster). `scope` says what a listing shows: everything to the operator, a
tenant only its own namespaces.

A refused call raises `TenantRefusedError` (the client sees it as that type) and is counted in
`kvfabric_tenant_refusals_total{reason}`: malformed, untrusted, not_a_tenant, bad_signature,
expired, revoked (the token), required (no token where tenants are required), not_served (a
tenant this node's certificate does not list), operator_required (an operator call with no token
where anonymous calls are not served), not_operator (an operator call with a tenant's token).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from cluster.errors import ClusterError
from fabric.config import TenancyConfig
from fabric.keys import Namespace
from fabric.tenancy import TenancyPolicy
from transports.trust.identity import TrustAnchor
from transports.trust.tenant_tokens import Principal, TenantError, TenantVerifier, tenants_of_node

logger = logging.getLogger(__name__)

MAX_ROOTS = 65536   # namespace roots remembered for the transport's per-peer tenant check


class TenantRefusedError(ClusterError, PermissionError):
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

    def admit(self, token: bytes | None) -> str | None:
        """The tenant `token` proves (None: the anonymous tenant); raises TenantRefusedError when the
        token proves none or its tenant may not call this node."""
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
        return tenant

    def bind(self, ns: Namespace, token: bytes | None) -> Namespace:
        """`ns` with the salt of the tenant `token` proves (None: the anonymous tenant); raises
        TenantRefusedError when the token proves none or its tenant may not call this node."""
        tenant = self.admit(token)
        salt = self.policy.salt(tenant)
        if tenant is not None and salt not in self._tenants_by_salt:
            self._tenants_by_salt[salt] = self.policy.members(tenant)
        bound = ns if ns.tenant_salt == salt else dataclasses.replace(ns, tenant_salt=salt)
        if bound.root not in self._tenants_by_root:
            if len(self._tenants_by_root) >= MAX_ROOTS:   # oldest first; a forgotten root is refused, not leaked
                del self._tenants_by_root[next(iter(self._tenants_by_root))]
            self._tenants_by_root[bound.root] = self._tenants_by_salt[salt]
        return bound

    def operator(self, token: bytes | None, call: str) -> None:
        """Admit the caller of the operator call `call`, or raise TenantRefusedError saying why not."""
        principal = self._principal(token)
        if principal is None:
            if not self.policy.serves(None):
                raise self._refuse("operator_required", f"{call} is an operator call: connect with an operator "
                                                        "credential (kvfabric certs issue-operator)")
        elif not principal.operator:
            raise self._refuse("not_operator", f"{call} is an operator call; tenant {principal.name} may not make it")

    def scope(self, token: bytes | None, call: str) -> frozenset[str] | None:
        """What a node-wide listing `call` shows its caller: None, everything (the operator); else
        the tenants whose namespaces it may see (a tenant's: itself and its shared group)."""
        principal = self._principal(token)
        if principal is not None and not principal.operator:
            if not self.policy.serves(principal.name):
                raise self._refuse("not_served", f"this node does not serve tenant {principal.name!r}")
            return self.policy.members(principal.name)
        self.operator(token, call)
        return None

    def in_scope(self, root: bytes, tenants: frozenset[str]) -> bool:
        """Whether the namespace `root` belongs to one of `tenants` (bound here since the node started)."""
        return bool((self._tenants_by_root.get(root) or frozenset()) & tenants)

    def _principal(self, token: bytes | None) -> Principal | None:
        if token is None:
            return None
        try:
            return self.verifier.verify_principal(token, self.clock())
        except TenantError as e:
            raise self._refuse(e.reason, f"token refused: {e}") from None

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
