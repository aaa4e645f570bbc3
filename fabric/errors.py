"""The root of kvfabric's error family: one `except FabricError` catches every error raised on purpose.

    FabricError                                fabric/errors.py
    ├── ConfigError, ProvenanceError, StoreClosedError, CorruptBlockError, ...   (fabric/)
    ├── TransportError                         transports/core/errors.py
    │   ├── ProtocolError (the peer broke the protocol; RemoteProtocolError) ── ControlError (RDMA)
    │   ├── LocalProtocolError (we did: a transport called a session out of turn)
    │   ├── TrustError ── CertificateError, IdentityError, TenantError, ClientRefused
    │   └── TransportUnavailableError, RdmaDeviceError
    └── ClusterError                           cluster/errors.py
        └── FabricUnavailableError, FabricTimeoutError, TenantRefusedError, IncompleteLoadError, ...

Errors keep the built-in base they had as a second base (a `ConfigError` is still a `ValueError`,
a `FabricTimeoutError` still a `TimeoutError`), so existing handlers and messages stay as they are.
Expected outcomes (a miss, a full tier, a peer gone) are return values, never errors.
"""

from __future__ import annotations


class FabricError(Exception):
    """Bad input, a misbehaving peer, a credential the cluster CA does not vouch for, or a part
    that is unavailable: an error kvfabric raises on purpose, with a message for its user."""
