"""`kvfabric purge --producer NODE`: remove every block a node produced, on every node; and
`kvfabric release --producer NODE`: lift the quarantine of a producer caught by sampled recompute.

For a node whose key is compromised or whose engine produced wrong KV: each NodeActor deletes
the blocks whose provenance record names that producer (mirrors' copies included, since a mirror
keeps the producer's record), and the directory forgets them through the nodes' removal events.
An operator call: it carries the operator credential (`--credential`, else as `kvfabric stats`
finds it). Revoke the node's certificate too (`kvfabric certs revoke`, then distribute crl.pem) so that no
block it signs later is accepted.

A quarantine (docs/security.md) is the fabric's own purge: nodes refuse and drop a producer whose
signed KV a sampled recompute found wrong. Once the operator has looked at the evidence (each
node's log and `kvfabric stats`), `release` lifts it on every node; the producer's blocks are gone
and it serves only what it stores from then on.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from cluster.cli.cluster import add_credential_argument
from cluster.cli.main import CLIError


def register(sub: Any) -> None:
    purge = sub.add_parser("purge", help="remove every block a node produced, on every node")
    purge.add_argument("--producer", required=True, help="the producer's node name (its certificate's name)")
    purge.add_argument("--address", help="Ray address (default: the cluster `up` started, else auto)")
    purge.add_argument("--json", action="store_true", help="print one JSON object")
    purge.add_argument("--config", help="kvfabric TOML config (its [tenancy] operator_credential)")
    add_credential_argument(purge)
    purge.set_defaults(func=cmd_purge)
    release = sub.add_parser("release", help="lift a producer's quarantine on every node")
    release.add_argument("--producer", required=True, help="the producer's node name (its certificate's name)")
    release.add_argument("--address", help="Ray address (default: the cluster `up` started, else auto)")
    release.add_argument("--json", action="store_true", help="print one JSON object")
    release.add_argument("--config", help="kvfabric TOML config (its [tenancy] operator_credential)")
    add_credential_argument(release)
    release.set_defaults(func=cmd_release)


def _per_node(args: argparse.Namespace, call: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """`call(producer, namespace=, operator=)` on every node, as the operator; its answer per node."""
    from cluster.cli.cluster import _config, _connect, operator_minter

    if not args.producer.strip():
        raise CLIError("--producer needs a node name")
    _, state = _connect(args.address)
    config = _config(args.config or (state or {}).get("config"))
    answers = call(args.producer, namespace=config.cluster.namespace,
                   operator=operator_minter(args.credential, config, state))
    if not answers:
        raise CLIError("no kvfabric nodes found; start the fabric with `kvfabric start` or `kvfabric up`")
    return answers


def cmd_purge(args: argparse.Namespace) -> int:
    from cluster.client import purge_producer

    removed = _per_node(args, purge_producer)
    if args.json:
        print(json.dumps({"producer": args.producer, "removed": removed}))
    else:
        for node_id, count in removed.items():
            print(f"{node_id[:12]}  {count if isinstance(count, str) else f'{count} payloads removed'}")
    failed = [n for n, c in removed.items() if isinstance(c, str)]
    return 1 if failed else 0


def cmd_release(args: argparse.Namespace) -> int:
    from cluster.client import release_producer

    released = _per_node(args, release_producer)
    if args.json:
        print(json.dumps({"producer": args.producer, "released": released}))
    else:
        for node_id, was in released.items():
            print(f"{node_id[:12]}  {was if isinstance(was, str) else ('released' if was else 'was not quarantined')}")
    return 1 if any(isinstance(w, str) for w in released.values()) else 0
