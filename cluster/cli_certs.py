"""`kvfabric certs init|issue`: make the cluster CA and node certificates."""

from __future__ import annotations

import argparse
from typing import Any

from cluster.cli import CLIError
from transports.certs import CertificateError, init_ca, issue_node


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
    issue.set_defaults(func=_issue)


def _init(args: argparse.Namespace) -> int:
    try:
        path = init_ca(args.dir, days=args.days, overwrite=args.force)
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"cluster CA: {path}")
    return 0


def _issue(args: argparse.Namespace) -> int:
    try:
        cert, key = issue_node(args.dir, args.node, days=args.days, extra_sans=tuple(args.san))
    except CertificateError as e:
        raise CLIError(str(e)) from None
    print(f"node {args.node}: {cert} {key}")
    return 0
