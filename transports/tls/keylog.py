"""The TLS 1.3 traffic secrets of this process's own handshakes: `traffic_secrets(context, client_random)`.

OpenSSL reveals a connection's traffic secrets only through its key log callback, which the `ssl`
module exposes as `SSLContext.keylog_filename`. Each context that carries a connection whose
records this process seals itself (records.py) logs to an anonymous in-memory file of its own
(`memfd_create`, close-on-exec; no name on any file system, so only this process and whoever may
already read its memory can read it). After a handshake its lines are parsed, the two traffic
secrets of that connection (found by its ClientHello's random) are taken out, and the rest are
kept only until their own handshakes finish (at most MAX_PENDING). The file is replaced once it
has grown past ROTATE_BYTES.

A client picks its ClientHello random, so two handshakes on one context may log the same one (a
peer replaying another's hello). Their secrets could then be handed to the wrong connection, and
two connections would seal under one key and one nonce sequence. A random seen twice, logged
twice or logged after it was taken, is therefore poisoned: no connection gets secrets for it, and
its records stay with OpenSSL.

Returns None when the secrets cannot be had (no memfd on this platform, a line lost to a
rotation): the caller then leaves the records to OpenSSL.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import threading
import weakref
from collections import OrderedDict

__all__ = ["available", "traffic_secrets", "watch"]

ROTATE_BYTES = 1 << 20
MAX_PENDING = 4096          # handshakes whose secrets were logged but not taken yet
MAX_TAKEN = 1 << 16         # randoms already handed out, remembered to poison a replay of one
_LABELS = {b"CLIENT_TRAFFIC_SECRET_0": 0, b"SERVER_TRAFFIC_SECRET_0": 1}


def available() -> bool:
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class _KeyLog:
    """One context's key log: a memfd, how far it was read, and secrets not taken yet."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = weakref.ref(context)
        self._lock = threading.Lock()
        self._pending: OrderedDict[bytes, list[bytes | None]] = OrderedDict()
        self._taken: OrderedDict[bytes, None] = OrderedDict()
        self._poisoned: OrderedDict[bytes, None] = OrderedDict()
        self._fd = -1
        self._offset = 0
        self._partial = b""
        self._open(context)

    def _open(self, context: ssl.SSLContext) -> None:
        fd = os.memfd_create("kvfabric-tls-keys", os.MFD_CLOEXEC)
        try:
            context.keylog_filename = f"/proc/self/fd/{fd}"
        except BaseException:
            os.close(fd)
            raise
        old, self._fd, self._offset, self._partial = self._fd, fd, 0, b""
        if old >= 0:
            os.close(old)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def take(self, client_random: bytes) -> tuple[bytes, bytes] | None:
        """(client, server) traffic secrets of the handshake with this ClientHello random."""
        with self._lock:
            self._read()
            got = self._pending.pop(client_random, None)
            if client_random in self._poisoned:
                got = None
            self._remember(self._taken, client_random)
            context = self._context()
            if self._offset >= ROTATE_BYTES and context is not None:
                self._read()
                self._open(context)
        if got is None or got[0] is None or got[1] is None:
            return None
        return got[0], got[1]

    def _read(self) -> None:
        while True:
            data = os.pread(self._fd, 1 << 16, self._offset)
            if not data:
                return
            self._offset += len(data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()
            for line in lines:
                fields = line.split()
                if len(fields) != 3 or fields[0] not in _LABELS:
                    continue
                with contextlib.suppress(ValueError):
                    random, secret = bytes.fromhex(fields[1].decode()), bytes.fromhex(fields[2].decode())
                    slot = self._pending.setdefault(random, [None, None])
                    label = _LABELS[fields[0]]
                    if slot[label] is not None or random in self._taken:
                        self._remember(self._poisoned, random)
                    slot[label] = secret
                    while len(self._pending) > MAX_PENDING:
                        self._pending.popitem(last=False)

    @staticmethod
    def _remember(seen: OrderedDict[bytes, None], random: bytes) -> None:
        seen[random] = None
        seen.move_to_end(random)
        while len(seen) > MAX_TAKEN:
            seen.popitem(last=False)


_logs: weakref.WeakKeyDictionary[ssl.SSLContext, _KeyLog] = weakref.WeakKeyDictionary()
_logs_lock = threading.Lock()


def watch(context: ssl.SSLContext) -> bool:
    """Make `context` log its handshakes' secrets to this process's in-memory key log (before the
    handshake). False where that cannot be done."""
    if not available():
        return False
    with _logs_lock:
        if context in _logs:
            return True
        try:
            log = _KeyLog(context)
        except (OSError, AttributeError, ValueError):
            return False
        _logs[context] = log
        weakref.finalize(context, log.close)
    return True


def traffic_secrets(context: ssl.SSLContext, client_random: bytes) -> tuple[bytes, bytes] | None:
    """(client, server) application traffic secrets of a finished handshake made with `context`
    (which `watch` was called on before it), or None."""
    with _logs_lock:
        log = _logs.get(context)
    return None if log is None else log.take(client_random)
