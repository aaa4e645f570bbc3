"""The cluster CA's revocation list (`crl.pem` beside `ca.pem`), read and re-read when it changes.

Only the operator can write a list the nodes believe: it must be signed by the cluster CA
(`certs.revoke`). A list that does not verify is an error, and a reader that already has a list
keeps it (a half-written or forged file never un-revokes anything).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography import x509

from transports.trust.certs import revoked_serials

logger = logging.getLogger(__name__)


class RevocationFile:
    """`path`'s revoked serials, re-read when the file changes; looked at most every `check_every_s`."""

    def __init__(self, path: Path, ca_cert: x509.Certificate, *, check_every_s: float = 1.0) -> None:
        self.path = path
        self.ca_cert = ca_cert
        self.check_every_s = check_every_s
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = float("-inf")

    def poll(self, now: float) -> frozenset[int] | None:
        """The revoked serials when the file changed since the last poll, else None.
        Raises CertificateError for a file that is not a list signed by the CA."""
        if now < self._next_check:
            return None
        self._next_check = now + self.check_every_s
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return revoked_serials(self.path.read_bytes(), self.ca_cert, str(self.path))
