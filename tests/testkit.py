"""What the tests share besides fixtures: a cluster CA and what it issues, and waiting for a condition.

Certificates come from here alone: `make_pki(dir, "node-a", "node-b")` (also the `make_pki` fixture,
tests/conftest.py) creates a real CA in `dir` (transports/trust/certs.py, as `kvfabric certs init` does)
and issues each named node its certificate; the returned `Pki` issues more nodes, tenant and operator
credentials, and revokes. Every file lands where kvfabric looks for it: `ca.pem`, `crl.pem`,
`<node>.pem/.key` in `dir`.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from transports.trust.certs import (
    CredentialFiles,
    NodeCredentials,
    init_ca,
    issue_node,
    issue_operator,
    issue_tenant,
    revoke,
)


@dataclass(frozen=True, slots=True)
class Pki:
    """The CA in `dir` and the certificates it issued there."""

    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def node(self, name: str, *, extra_sans: tuple[str, ...] = (), tenants: tuple[str, ...] = (),
             days: int = 365, not_before: dt.datetime | None = None) -> tuple[Path, Path]:
        """Issue node `name` its certificate and key (re-issuing rotates them); their paths."""
        return issue_node(self.dir, name, days=days, not_before=not_before, extra_sans=extra_sans,
                          tenants=tenants)

    def tenant(self, name: str, *, out_dir: Path | None = None, days: int = 365,
               not_before: dt.datetime | None = None) -> tuple[Path, Path]:
        """A tenant credential `<name>.tenant.pem/.key` (in `out_dir`, default the CA's folder)."""
        return issue_tenant(self.dir, name, days=days, not_before=not_before, out_dir=out_dir)

    def operator(self, name: str = "ops", *, out_dir: Path | None = None) -> tuple[Path, Path]:
        """An operator credential `<name>.operator.pem/.key` (in `out_dir`, default the CA's folder)."""
        return issue_operator(self.dir, name, out_dir=out_dir)

    def files(self, node: str) -> CredentialFiles:
        return CredentialFiles.for_node(self.dir, node)

    def credentials(self, node: str) -> NodeCredentials:
        return NodeCredentials(self.files(node))

    def serial(self, node: str) -> int:
        return x509.load_pem_x509_certificate((self.dir / f"{node}.pem").read_bytes()).serial_number

    def revoke(self, *nodes: str) -> Path:
        """Add these nodes' current certificates to the CA's revocation list `crl.pem` (none: publish it as is)."""
        return revoke(self.dir, {self.serial(n) for n in nodes})


def make_pki(directory: Path, *nodes: str, extra_sans: tuple[str, ...] = ()) -> Pki:
    """A new cluster CA in `directory` with a certificate for each of `nodes` (each with `extra_sans`)."""
    init_ca(directory)
    pki = Pki(directory)
    for node in nodes:
        pki.node(node, extra_sans=extra_sans)
    return pki


PkiFactory = Callable[..., Pki]   # the `make_pki` fixture's type


Wait = Callable[..., float]   # the `wait_until` fixture's type


def wait_until(predicate: Callable[[], object], what: str, timeout_s: float = 30.0, poll_s: float = 0.05) -> float:
    """Poll `predicate` until it is true; the seconds it took. A test waits for a condition, never for a
    fixed time: this fails with `what` when the condition has not held within `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(poll_s)
    return time.monotonic() - start
