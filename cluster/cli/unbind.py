"""`kvfabric unbind NODE_ID`: the operator clears which certificate the directory binds a Ray node id to.

The directory believes reports for a Ray node id only from the certificate bound to it
(cluster/directory/auth.py). A node whose name derives from its Ray id takes its id back by itself,
and any other binding ends one lease after its holder stops reporting; a certificate that keeps
reporting under an id that is not its own (named by `$KVFABRIC_NODE_NAME`, so no name says whose the
id is) holds it until this command clears it. Revoke that certificate too, or it binds the id again.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from cluster.cli.cluster import add_credential_argument
from cluster.cli.main import CLIError


def register(sub: Any) -> None:
    unbind = sub.add_parser("unbind", help="clear the directory's binding of a Ray node id to a certificate")
    unbind.add_argument("node_id", metavar="NODE_ID", help="the Ray node id (hex)")
    unbind.add_argument("--address", help="Ray address (default: the cluster `up` started, else auto)")
    unbind.add_argument("--config", help="kvfabric TOML config (its [cluster] namespace and directory)")
    unbind.add_argument("--json", action="store_true", help="print one JSON object")
    add_credential_argument(unbind)
    unbind.set_defaults(func=cmd_unbind)


def cmd_unbind(args: argparse.Namespace) -> int:
    from cluster.cli.cluster import _config, _connect, operator_minter
    from cluster.client import unbind_node
    from cluster.tenancy import TenantRefusedError

    if not args.node_id.strip():
        raise CLIError("NODE_ID needs a Ray node id")
    _, state = _connect(args.address)
    config = _config(args.config or (state or {}).get("config"))
    operator = operator_minter(args.credential, config, state)
    if operator is None:
        raise CLIError("unbind needs the operator credential: --credential <name>.operator.pem "
                       "(kvfabric certs issue-operator)")
    try:
        bound = unbind_node(args.node_id, operator=operator, cluster=config.cluster)
    except TenantRefusedError as e:
        raise CLIError(str(getattr(e, "cause", e))) from None
    if args.json:
        print(json.dumps({"node_id": args.node_id, "was_bound_to": {str(k): v for k, v in bound.items()}}))
    else:
        names = sorted({v for v in bound.values() if v is not None})
        print(f"{args.node_id[:12]}  unbound ({', '.join(names) if names else 'it was bound to no certificate'})")
    return 0
