"""`kvfabric certs init|issue|issue-tenant|issue-operator|revoke`: the operator's cluster CA, node
certificates, tenant and operator credentials and revocation list.

These run where the CA key is (`ca.key`), never on a node: nodes get `ca.pem`, `crl.pem` and their
own `<node>.pem` / `<node>.key` only (docs/operations-certificates.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from cryptography import x509

from cluster.cli import events_keys
from cluster.cli.main import CLIError
from transports.trust.certs import CRL, CertificateError, init_ca, issue_node, issue_operator, issue_tenant, revoke


def register(sub: Any) -> None:
    certs = sub.add_parser("certs", help="cluster CA and node certificates")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    init = certs_sub.add_parser("init", help="create the cluster CA")
    init.add_argument("--dir", required=True, help="folder for ca.pem / ca.key")
    init.add_argument("--days", type=int, default=3650)
    init.add_argument("--force", action="store_true", help="replace an existing CA")
    init.set_defaults(func=_init)
    issue = certs_sub.add_parser("issue", help="issue a node certificate signed by the cluster CA")
    issue.add_argument("--dir", required=True, help="folder holding the cluster CA")
    issue.add_argument("--node", required=True, help="node name (becomes the certificate's DNS SAN)")
    issue.add_argument("--days", type=int, default=365)
    issue.add_argument("--san", action="append", default=[], help="extra DNS name or IP address")
    issue.add_argument("--tenant", action="append", default=[], metavar="NAME",
                       help="restrict the node to serving this tenant (repeat for several; none: every tenant)")
    issue.set_defaults(func=_issue)
    tenant = certs_sub.add_parser("issue-tenant", help="issue a tenant credential signed by the cluster CA")
    tenant.add_argument("name", metavar="NAME", help="tenant name (letters, digits, '-', '_', '.')")
    tenant.add_argument("--dir", required=True, help="folder holding the cluster CA")
    tenant.add_argument("--out", default=None, help="folder for NAME.tenant.pem / .key (default: --dir)")
    tenant.add_argument("--days", type=int, default=365)
    tenant.set_defaults(func=_issue_tenant)
    operator = certs_sub.add_parser("issue-operator", help="issue an operator credential (purge, node-wide stats)")
    operator.add_argument("name", metavar="NAME", nargs="?", default="operator",
                          help="operator name (letters, digits, '-', '_', '.'; default: operator)")
    operator.add_argument("--dir", required=True, help="folder holding the cluster CA")
    operator.add_argument("--out", default=None, help="folder for NAME.operator.pem / .key (default: --dir)")
    operator.add_argument("--days", type=int, default=365)
    operator.set_defaults(func=_issue_operator)
    rev = certs_sub.add_parser("revoke", help="revoke node certificates: add them to the CA's crl.pem")
    rev.add_argument("--dir", required=True, help="folder holding the cluster CA and the node certificates")
    rev.add_argument("nodes", nargs="*", metavar="NODE",
                     help="node names (<dir>/<NODE>.pem); none: re-sign the list with a fresh validity")
    rev.add_argument("--serial", action="append", default=[], metavar="HEX",
                     help="a certificate serial number (hex) to revoke, for certificates not in --dir")
    rev.add_argument("--days", type=int, default=365,
                     help="the list's validity; nodes refuse every peer once it passes, so republish before")
    rev.set_defaults(func=_revoke)
    events_keys.register(certs_sub)


def _init(args: argparse.Namespace) -> int:
    try:
        path = init_ca(args.dir, days=args.days, overwrite=args.force)
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"cluster CA: {path}")
    return 0


def _issue(args: argparse.Namespace) -> int:
    try:
        cert, key = issue_node(args.dir, args.node, days=args.days, extra_sans=tuple(args.san),
                               tenants=tuple(args.tenant))
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"node {args.node}: {cert} {key}")
    return 0


def _issue_tenant(args: argparse.Namespace) -> int:
    try:
        cert, key = issue_tenant(args.dir, args.name, days=args.days, out_dir=args.out)
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"tenant {args.name}: {cert} {key}; give both to the tenant's clients "
          f"(FabricClient.connect(credential=...) or [tenancy] credential); revoke with --serial")
    return 0


def _issue_operator(args: argparse.Namespace) -> int:
    try:
        cert, key = issue_operator(args.dir, args.name, days=args.days, out_dir=args.out)
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"operator {args.name}: {cert} {key}; keep both with the operator (kvfabric purge/stats --credential, "
          f"[tenancy] operator_credential, FabricClient.connect(credential=...)); revoke with --serial")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    serials: dict[str, int] = {}
    for node in args.nodes:
        try:
            serials[node] = x509.load_pem_x509_certificate((d / f"{node}.pem").read_bytes()).serial_number
        except (OSError, ValueError) as e:
            raise CLIError(f"cannot read the certificate of node {node} ({d / f'{node}.pem'}): {e}") from None
    for text in args.serial:
        try:
            serials[f"serial {text}"] = int(text.removeprefix("0x").replace(":", ""), 16)
        except ValueError:
            raise CLIError(f"--serial {text!r} is not a hexadecimal serial number") from None
    try:
        path = revoke(d, set(serials.values()), days=args.days)
    except CertificateError as e:
        raise CLIError(str(e)) from None
    for what, serial in serials.items():
        print(f"revoked {what if what.startswith('serial ') else f'node {what}'}: serial {serial:x}")
    print(f"revocation list: {path}; copy it to every node's certificate folder as {CRL} "
          "(nodes and the directory reload it)")
    return 0
