"""The cluster's errors: the `ClusterError` branch of kvfabric's error family (fabric/errors.py).

Raised to a user of the cluster (a client, the CLI, an engine's connector) with a message that
says what to do; each keeps the built-in base it had as a second base (a `FabricTimeoutError` is
still a `TimeoutError`), so existing handlers stay as they are.
"""

from __future__ import annotations

from fabric.errors import FabricError


class ClusterError(FabricError):
    """The cluster could not do what was asked: a node or the directory unavailable, a caller refused."""
