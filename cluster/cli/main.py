"""The `kvfabric` command line.

Each command group lives in its own module exposing `register(subparsers)`; every handler
returns a process exit code. Errors a user can fix (bad config, missing files) are printed
as one line on stderr with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from cluster.errors import ClusterError

# Modules that add sub-commands; each has register(subparsers: argparse._SubParsersAction).
COMMAND_MODULES = ("cluster.cli.cluster", "cluster.cli.demo", "cluster.cli.inspect", "cluster.cli.certs",
                   "cluster.cli.purge", "cluster.cli.unbind")


class CLIError(ClusterError):
    """A user-facing error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfabric", description="kvfabric: a KV-cache fabric for LLM inference")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
    except CLIError as e:
        print(f"kvfabric {args.command}: {e}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
