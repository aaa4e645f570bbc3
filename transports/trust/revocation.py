"""The cluster CA's revocation list (`crl.pem` beside `ca.pem`), read and re-read when it changes.

Only the operator can write a list the nodes believe: it must be signed by the cluster CA
(`certs.revoke`). A list that does not verify is an error, and a reader that already has a list
keeps it (a half-written or forged file never un-revokes anything); so does a reader whose list
disappears. A file counts as changed when its `certs.file_stamp` (mtime, size, inode) changes: the
one rule every reader of the list (transports, nodes, directory shards) goes by.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography import x509

from transports.trust.certs import file_stamp, revoked_serials

logger = logging.getLogger(__name__)


class RevocationFile:
    """`path`'s revoked serials, re-read when the file changes; looked at most every `check_every_s`.

    `next_update` is the nextUpdate (unix s) of the last list read (None: no list yet, or none in it)."""

    def __init__(self, path: Path, ca_cert: x509.Certificate, *, check_every_s: float = 1.0) -> None:
        self.path = path
        self.ca_cert = ca_cert
        self.check_every_s = check_every_s
        self.next_update: float | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._next_check = float("-inf")

    def load(self) -> frozenset[int]:
        """The revoked serials now (none without a file); later polls report only changes after this.
        Raises CertificateError for a file that is not a list signed by the CA."""
        revoked = self._read()
        return frozenset() if revoked is None else revoked

    def poll(self, now: float) -> frozenset[int] | None:
        """The revoked serials when the file changed since the last poll, else None.
        Raises CertificateError for a file that is not a list signed by the CA."""
        if now < self._next_check:
            return None
        self._next_check = now + self.check_every_s
        return self._read()

    def _read(self) -> frozenset[int] | None:
        try:
            stamp = file_stamp(self.path)
        except FileNotFoundError:
            return None
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        data = self.path.read_bytes()
        revoked = revoked_serials(data, self.ca_cert, str(self.path))
        next_update = x509.load_pem_x509_crl(data).next_update_utc
        self.next_update = None if next_update is None else next_update.timestamp()
        return revoked
