"""`kvfabric certs events-key NAME --out DIR`: a CURVE key pair for the KV events plane.

One pair per node publisher (its `NAME.key_secret` is `[events] curve_secret_key`) and one per
consumer (a router or indexer): the operator copies each allowed consumer's public `NAME.key` into
the nodes' `[events] curve_allow_dir`, and gives the consumer its `NAME.key_secret`. A consumer whose
public key is not in that folder is refused by the node's ZAP handler (docs/kv-events.md)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import zmq.auth

from cluster.cli.main import CLIError


def register(certs_sub: Any) -> None:
    keys = certs_sub.add_parser("events-key", help="a CURVE key pair for KV events (a node or a consumer)")
    keys.add_argument("name", metavar="NAME", help="who holds it: a node's publisher or a consumer (router)")
    keys.add_argument("--out", required=True, help="folder for NAME.key (public) and NAME.key_secret")
    keys.add_argument("--force", action="store_true", help="replace an existing pair")
    keys.set_defaults(func=_events_key)


def _events_key(args: argparse.Namespace) -> int:
    if not args.name or not all(c.isalnum() or c in "-_." for c in args.name):
        raise CLIError(f"key name {args.name!r}: use letters, digits, '-', '_', '.'")
    out = Path(args.out)
    public, secret = out / f"{args.name}.key", out / f"{args.name}.key_secret"
    if (public.exists() or secret.exists()) and not args.force:
        raise CLIError(f"{public} or {secret} exists; pass --force to replace it")
    try:
        out.mkdir(parents=True, exist_ok=True)
        made_public, made_secret = zmq.auth.create_certificates(out, args.name)
        Path(made_secret).chmod(0o600)
    except OSError as e:
        raise CLIError(f"cannot write the key pair under {out}: {e}") from None
    print(f"events key {args.name}: public {made_public}, secret {made_secret}; a consumer's public key goes "
          "into every node's [events] curve_allow_dir, a node's secret file is its [events] curve_secret_key")
    return 0
