"""The transports' errors (fabric/errors.py has the whole family): one `except TransportError` rule
holds across TLS-TCP, QUIC and RDMA.

h11's strategy: `ProtocolError` (h11's `RemoteProtocolError`) is the peer breaking the protocol,
caught once at the transport's boundary and answered with an ERROR frame carrying its `code`;
`LocalProtocolError` is us breaking it (a transport called a session out of turn: a bug of ours,
never answered to the peer as its fault). `TrustError` is a certificate, token or signature the
cluster CA does not vouch for (transports/trust/).
"""

from __future__ import annotations

from fabric.errors import FabricError
from transports.core.frames import ErrorCode


class TransportError(FabricError):
    """A transport could not do what was asked: a protocol error, a refused credential, no transport."""


class ProtocolError(TransportError):
    """The peer broke the protocol (h11's RemoteProtocolError): bytes that are not a valid frame
    stream, or valid frames that break the session rules. `code` is what the ERROR frame that
    answers it carries."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.PROTOCOL) -> None:
        super().__init__(message)
        self.code = code


RemoteProtocolError = ProtocolError


class LocalProtocolError(TransportError):
    """We broke the protocol: a transport called a session out of turn (a bug of ours)."""


class TrustError(TransportError):
    """A certificate, revocation list, token or signature the cluster CA does not vouch for."""
