"""TLS 1.3 application-data records sealed and opened in this process: `RecordLayer`.

OpenSSL (the `ssl` module) runs the handshake, certificate checks included; then the connection's
traffic secrets (channel.py reads them from OpenSSL's key log, see keylog.py) give each direction
its key and IV (RFC 8446 §7.1, §7.3), and records are sealed and opened here with `cryptography`'s
AEADs, straight between the socket's buffer and the caller's:

    ciphertext in a large receive buffer ──decrypt_into──► the frame decoder's buffer (a payload's own)
    plaintext pieces ──copy + content type──► one record's staging ──encrypt_into──► a send buffer

so a pulled byte is decrypted once into the memory it ends in, and a sent byte is copied once
into a cache-warm staging area and encrypted into the buffer `sendmsg` sends: no memory BIO in
between. Wire-compatible with any TLS 1.3 peer: the record format is RFC 8446 §5.2, the nonce is
the IV XOR the 64-bit record sequence number, the additional data the record header.

Fails closed: a record that does not authenticate, is too long, or has no content type raises
`RecordError` (an `ssl.SSLError`), whose plaintext is never counted as received; the caller closes
the connection. Post-handshake messages: NewSessionTicket (to a client) is read and dropped,
KeyUpdate is carried out (and answered when the peer asks), anything else is refused. This side
sends a KeyUpdate of its own every KEY_UPDATE_RECORDS records, well inside AES-GCM's limits.
Alerts: close_notify ends the stream (`peer_closed`); any other alert is a `RecordError` named as
OpenSSL names it. Not thread-safe: one connection, one thread.
"""

from __future__ import annotations

import ssl
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

__all__ = ["HEADER", "MAX_CONTENT", "MAX_RECORD", "SUITES", "RecordError", "RecordLayer", "TrafficKeys",
           "hkdf_expand_label"]

HEADER = 5                       # type, legacy version, length
TAG = 16                         # AEAD tag of every suite here
MAX_CONTENT = 16 * 1024          # largest plaintext of a record
MAX_CIPHERTEXT = MAX_CONTENT + 256
MAX_RECORD = HEADER + MAX_CIPHERTEXT
RECORD_OVERHEAD = HEADER + 1 + TAG   # bytes a record adds to its content: header, content type, tag
MAX_HANDSHAKE = 64 * 1024        # post-handshake message bytes held while reassembling one
KEY_UPDATE_RECORDS = 1 << 23     # records sealed under one key before a KeyUpdate (AES-GCM allows ~2^24.5)
SEQ_LIMIT = (1 << 64) - 1
_LAST_SEQ = SEQ_LIMIT - 1   # records from this one on take the general path (it refuses SEQ_LIMIT)

APPLICATION_DATA, ALERT, HANDSHAKE, CHANGE_CIPHER_SPEC = 23, 21, 22, 20
NEW_SESSION_TICKET, KEY_UPDATE = 4, 24
_APP_HEADER = struct.Struct(">BHH")
_FULL_LENGTH = MAX_CONTENT + 1 + TAG
_FULL_HEADER = _APP_HEADER.pack(APPLICATION_DATA, 0x0303, _FULL_LENGTH)   # every full record's
_FULL_INNER = MAX_CONTENT + 1             # a full record's content and type byte
_FULL_RECORD = HEADER + _FULL_LENGTH
_COLUMN_RUN = 256                          # full records checked in one pass at most
_FULL_HEADER_COLUMNS = [bytes([b]) * _COLUMN_RUN for b in _FULL_HEADER]   # byte i of full headers in a row

# suite name (SSLObject.cipher()[0]) -> (AEAD class, key length, HKDF hash)
SUITES: dict[str, tuple[type[AESGCM] | type[ChaCha20Poly1305], int, type[hashes.HashAlgorithm]]] = {
    "TLS_AES_256_GCM_SHA384": (AESGCM, 32, hashes.SHA384),
    "TLS_AES_128_GCM_SHA256": (AESGCM, 16, hashes.SHA256),
    "TLS_CHACHA20_POLY1305_SHA256": (ChaCha20Poly1305, 32, hashes.SHA256),
}

# alert description -> OpenSSL's reason name (what `handshake.auth_failure_reason` reads)
_ALERTS = {0: "SSLV3_ALERT_CLOSE_NOTIFY", 10: "SSLV3_ALERT_UNEXPECTED_MESSAGE", 20: "SSLV3_ALERT_BAD_RECORD_MAC",
           22: "TLSV1_ALERT_RECORD_OVERFLOW", 40: "SSLV3_ALERT_HANDSHAKE_FAILURE", 42: "SSLV3_ALERT_BAD_CERTIFICATE",
           43: "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE", 44: "SSLV3_ALERT_CERTIFICATE_REVOKED",
           45: "SSLV3_ALERT_CERTIFICATE_EXPIRED", 46: "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
           47: "SSLV3_ALERT_ILLEGAL_PARAMETER", 48: "TLSV1_ALERT_UNKNOWN_CA", 49: "TLSV1_ALERT_ACCESS_DENIED",
           50: "TLSV1_ALERT_DECODE_ERROR", 51: "TLSV1_ALERT_DECRYPT_ERROR", 70: "TLSV1_ALERT_PROTOCOL_VERSION",
           80: "TLSV1_ALERT_INTERNAL_ERROR", 90: "TLSV1_ALERT_USER_CANCELLED",
           109: "TLSV13_ALERT_MISSING_EXTENSION", 116: "TLSV13_ALERT_CERTIFICATE_REQUIRED"}
UNEXPECTED_MESSAGE, BAD_RECORD_MAC, RECORD_OVERFLOW, DECODE_ERROR, ILLEGAL_PARAMETER = 10, 20, 22, 50, 47
USER_CANCELED = 90


def _full_run(src: memoryview, pos: int, count: int) -> int:
    """How many of the next `count` records from `pos` on, were they all full size, are: each
    starting with a full application-data record's header, up to the first that does not. One
    comparison per header byte for the whole run (a strided view: that byte of every record);
    record by record only when some record in it is not a full one."""
    count = min(count, _COLUMN_RUN)
    if count <= 0:
        return 0
    if count > 4:
        stop, columns = pos + count * _FULL_RECORD, _FULL_HEADER_COLUMNS
        if (src[pos:stop:_FULL_RECORD] == columns[0][:count] and src[pos + 1:stop:_FULL_RECORD] == columns[1][:count]
                and src[pos + 2:stop:_FULL_RECORD] == columns[2][:count]
                and src[pos + 3:stop:_FULL_RECORD] == columns[3][:count]
                and src[pos + 4:stop:_FULL_RECORD] == columns[4][:count]):
            return count
    for k in range(count):
        at = pos + k * _FULL_RECORD
        if src[at:at + HEADER] != _FULL_HEADER:
            return k
    return count


class RecordError(ssl.SSLError):
    """A record that must end the connection: one that failed authentication or broke the
    protocol (`alert`: the alert to send the peer, None when the peer sent one)."""

    def __init__(self, message: str, reason: str, alert: int | None) -> None:
        super().__init__(message)
        self.reason = reason
        self.library = "SSL"
        self.alert = alert

    def __str__(self) -> str:
        return f"[{self.reason}] {self.args[0]}"


def _local_error(message: str, alert: int) -> RecordError:
    return RecordError(message, _ALERTS.get(alert, f"ALERT_{alert}"), alert)


def hkdf_expand_label(secret: bytes, label: bytes, context: bytes, length: int,
                      algorithm: type[hashes.HashAlgorithm]) -> bytes:
    """HKDF-Expand-Label (RFC 8446 §7.1)."""
    full = b"tls13 " + label
    info = struct.pack(">HB", length, len(full)) + full + bytes([len(context)]) + context
    return HKDFExpand(algorithm(), length, info).derive(secret)


class TrafficKeys:
    """One direction's AEAD, IV and record sequence number, from its traffic secret."""

    __slots__ = ("aead", "algorithm", "iv", "key_len", "make", "secret", "seq")

    def __init__(self, suite: str, secret: bytes) -> None:
        self.make, self.key_len, self.algorithm = SUITES[suite]
        self._derive(secret)

    def _derive(self, secret: bytes) -> None:
        self.secret = secret
        self.aead = self.make(hkdf_expand_label(secret, b"key", b"", self.key_len, self.algorithm))
        self.iv = int.from_bytes(hkdf_expand_label(secret, b"iv", b"", 12, self.algorithm), "big")
        self.seq = 0

    def update(self) -> None:
        """The next generation of keys (KeyUpdate, RFC 8446 §7.2): sequence numbers restart."""
        self._derive(hkdf_expand_label(self.secret, b"traffic upd", b"", self.algorithm().digest_size,
                                       self.algorithm))

    def nonce(self) -> bytes:
        seq = self.seq
        if seq >= SEQ_LIMIT:
            raise _local_error("record sequence number exhausted", UNEXPECTED_MESSAGE)
        self.seq = seq + 1
        return (self.iv ^ seq).to_bytes(12, "big")


class RecordLayer:
    """Both directions of one TLS 1.3 connection after its handshake (see the module docstring).

    `rx_seq` / `tx_seq`: records OpenSSL already opened / sealed under these secrets (session
    tickets a server sent at the end of its handshake). `outbox`: records this layer sealed on its
    own (a KeyUpdate, an alert) that the owner must send before anything sealed later."""

    def __init__(self, suite: str, rx_secret: bytes, tx_secret: bytes, *, server_side: bool,
                 rx_seq: int = 0, tx_seq: int = 0, key_update_records: int | None = None) -> None:
        self.suite = suite
        self.server_side = server_side
        self.rx = TrafficKeys(suite, rx_secret)
        self.tx = TrafficKeys(suite, tx_secret)
        self.rx.seq, self.tx.seq = rx_seq, tx_seq
        self.key_update_records = KEY_UPDATE_RECORDS if key_update_records is None else key_update_records
        self.outbox: list[bytes] = []
        self.peer_closed = False          # the peer's close_notify was read
        self.failure: RecordError | None = None   # raised by the owner once the bytes before it are used
        self._handshake = bytearray()     # a post-handshake message split over records
        self._scratch = memoryview(bytearray(MAX_CIPHERTEXT))
        # Written through a memoryview only: a bytearray's slice assignment from another buffer
        # copies that buffer into a temporary bytearray first.
        self._stage = memoryview(bytearray(MAX_CONTENT + 1))   # a full record's content and type

    # -- opening
    @staticmethod
    def record_end(src: memoryview, pos: int, end: int) -> int:
        """Where the record at `pos` ends, or -1 when its header is not all there yet."""
        if end - pos < HEADER:
            return -1
        return pos + HEADER + ((src[pos + 3] << 8) | src[pos + 4])

    def open_into(self, src: memoryview, pos: int, end: int, dst: memoryview) -> tuple[int, int]:
        """Open the whole records in `src[pos:end]`, application data into `dst`, as long as each
        record's plaintext fits in what is left of `dst`. Returns (the position after the last
        record opened, plaintext bytes put in `dst`). Stops early at the peer's close_notify
        (`peer_closed`) or a failure (`failure`): the bytes returned before it are authentic."""
        filled = 0
        room = dst.nbytes
        rx = self.rx
        decrypt, iv, seq = rx.aead.decrypt_into, rx.iv, rx.seq
        full_header = _FULL_HEADER
        while end - pos >= HEADER and self.failure is None and not self.peer_closed:
            # A payload's full records in a row, in as few steps as each allows: as many as the
            # bytes here and the room in `dst` hold, if each starts with a full record's header (its
            # additional data), each decrypted into `dst` where the next record's data goes on.
            run = _full_run(src, pos, min((end - pos) // _FULL_RECORD, (room - filled - 1) // MAX_CONTENT,
                                          _LAST_SEQ - seq))
            for stop in range(pos + _FULL_RECORD, pos + (run + 1) * _FULL_RECORD, _FULL_RECORD):
                out = dst[filled:filled + _FULL_INNER]
                try:
                    decrypt((iv ^ seq).to_bytes(12, "big"), src[pos + HEADER:stop], full_header, out)
                except InvalidTag:
                    break   # opened again below, which refuses it and clears what it wrote
                if out[MAX_CONTENT] != APPLICATION_DATA:
                    break   # padded, or a control record: opened again below, the general way
                seq += 1
                pos = stop
                filled += MAX_CONTENT
            if end - pos < HEADER:
                break
            length = (src[pos + 3] << 8) | src[pos + 4]
            if src[pos] != APPLICATION_DATA or not TAG < length <= MAX_CIPHERTEXT:
                self.failure = self._bad_header(src, pos, length)   # refused from its header alone
                break
            stop = pos + HEADER + length
            inner = length - TAG
            if stop > end or inner > room - filled + 1:
                break   # not all here, or its data may not fit in `dst` (the caller opens it apart: open_one)
            if seq >= SEQ_LIMIT:
                self.failure = _local_error("record sequence number exhausted", UNEXPECTED_MESSAGE)
                break
            # One byte too long for `dst` (a full record that ends a payload: its type byte would
            # not fit), it is opened into the scratch record and its data copied into `dst`.
            apart = inner > room - filled
            out = self._scratch[:inner] if apart else dst[filled:filled + inner]
            try:
                decrypt((iv ^ seq).to_bytes(12, "big"), src[pos + HEADER:stop], src[pos:pos + HEADER], out)
            except InvalidTag:   # nothing unauthenticated stays in the caller's memory
                out[:] = bytes(inner)
                self.failure = _local_error("a record failed authentication (tampered, or not from the peer)",
                                            BAD_RECORD_MAC)
                break
            seq += 1
            pos = stop
            last = inner - 1
            if out[last] != APPLICATION_DATA:
                while last >= 0 and out[last] == 0:   # padding
                    last -= 1
                if last < 0:
                    self.failure = _local_error("a record without a content type", UNEXPECTED_MESSAGE)
                    break
            if out[last] == APPLICATION_DATA:
                if apart:
                    dst[filled:filled + last] = out[:last]
                filled += last
                continue
            rx.seq = seq
            self._control(out[last], bytes(out[:last]))   # copied: the next record may land on it
            rx = self.rx   # a KeyUpdate replaced the keys
            decrypt, iv, seq = rx.aead.decrypt_into, rx.iv, rx.seq
        rx.seq = seq
        return pos, filled

    def open_one(self, src: memoryview, pos: int, end: int) -> tuple[int, memoryview]:
        """Open the one whole record at `pos` into this layer's scratch buffer: (the position after
        it, its application data: valid until the next call). For a record that does not fit where
        `open_into` would put it."""
        stop = self.record_end(src, pos, end)
        if stop < 0 or stop > end:
            return pos, self._scratch[:0]
        pos, n = self.open_into(src, pos, stop, self._scratch)
        return pos, self._scratch[:n]

    def _bad_header(self, src: memoryview, pos: int, length: int) -> RecordError:
        if src[pos] == CHANGE_CIPHER_SPEC:
            return _local_error("change_cipher_spec after the handshake", UNEXPECTED_MESSAGE)
        if src[pos] != APPLICATION_DATA:
            return _local_error(f"a record of outer type {src[pos]} after the handshake", UNEXPECTED_MESSAGE)
        if length > MAX_CIPHERTEXT:
            return _local_error(f"a record of {length} bytes (at most {MAX_CIPHERTEXT})", RECORD_OVERFLOW)
        return _local_error(f"a record of {length} bytes cannot hold a tag", DECODE_ERROR)

    def _control(self, ctype: int, body: bytes) -> None:
        if ctype == ALERT:
            if len(body) != 2:
                self.failure = _local_error(f"an alert record of {len(body)} bytes", DECODE_ERROR)
            elif body[1] == 0:
                self.peer_closed = True
            elif body[1] != USER_CANCELED:
                name = _ALERTS.get(body[1], f"TLS_ALERT_{body[1]}")
                self.failure = RecordError(f"the peer sent alert {body[1]} ({name.lower()})", name, None)
        elif ctype == HANDSHAKE:
            self._handshake += body
            if len(self._handshake) > MAX_HANDSHAKE:
                self.failure = _local_error("a post-handshake message too long", DECODE_ERROR)
                return
            self._handshake_messages()
        else:
            self.failure = _local_error(f"a record of inner type {ctype} after the handshake", UNEXPECTED_MESSAGE)

    def _handshake_messages(self) -> None:
        buf = self._handshake
        while len(buf) >= 4 and self.failure is None:
            size = int.from_bytes(buf[1:4], "big")
            if len(buf) < 4 + size:
                return
            kind, body = buf[0], bytes(buf[4:4 + size])
            del buf[:4 + size]
            if kind == NEW_SESSION_TICKET and not self.server_side:
                continue   # this side never resumes a session
            if kind == KEY_UPDATE:
                if size != 1 or body[0] not in (0, 1):
                    self.failure = _local_error("a malformed KeyUpdate", DECODE_ERROR if size != 1 else
                                                ILLEGAL_PARAMETER)
                    return
                if buf:   # RFC 8446 §5.1: no message may span a key change
                    self.failure = _local_error("handshake bytes after a KeyUpdate in its record", UNEXPECTED_MESSAGE)
                    return
                self.rx.update()
                if body[0] == 1:
                    self._update_tx()
                continue
            self.failure = _local_error(f"post-handshake message {kind} is not accepted", UNEXPECTED_MESSAGE)

    # -- sealing
    def _update_tx(self) -> None:
        """Answer the peer's KeyUpdate request: ours goes to `outbox`, later records use new keys."""
        self.outbox.append(self.update_keys())

    def seal_control(self, ctype: int, body: bytes) -> bytes:
        out = bytearray(HEADER + len(body) + 1 + TAG)
        self._stage[:len(body)] = body
        self._stage[len(body)] = ctype
        self._seal(self._stage[:len(body) + 1], memoryview(out), 0)
        return bytes(out)

    def _seal(self, inner: memoryview, out: memoryview, at: int) -> int:
        """Seal `inner` (content + type byte) as the record at `out[at:]`; returns where it ends."""
        length = inner.nbytes + TAG
        _APP_HEADER.pack_into(out, at, APPLICATION_DATA, 0x0303, length)
        tx = self.tx
        tx.aead.encrypt_into(tx.nonce(), inner, out[at:at + HEADER], out[at + HEADER:at + HEADER + length])
        return at + HEADER + length

    def seal_pieces(self, pieces: list[memoryview], out: memoryview, at: int) -> int:
        """Seal the concatenation of `pieces` (at most MAX_CONTENT bytes) as one application-data
        record at `out[at:]` (room for it: `sealed_size`); returns where it ends. The owner checks
        `key_update_due()` between records and sends `update_keys()` in order."""
        stage, n = self._stage, 0
        for piece in pieces:
            stage[n:n + piece.nbytes] = piece
            n += piece.nbytes
        stage[n] = APPLICATION_DATA
        return self._seal(stage[:n + 1], out, at)

    def seal_run(self, data: memoryview, out: memoryview, at: int) -> int:
        """Seal `data` as records of MAX_CONTENT bytes (the last one shorter) at `out[at:]` (room
        for `run_size(data.nbytes)` bytes, and no KeyUpdate due within `records_before_update()`
        records); returns where they end. One pass per record: a copy into the cache-warm
        staging area, whose last byte is the content type, then AES-GCM from there into `out`.
        Full records, all but maybe the last, share one header (their additional data)."""
        tx = self.tx
        encrypt, iv, seq = tx.aead.encrypt_into, tx.iv, tx.seq
        stage, header = self._stage, _FULL_HEADER
        size = data.nbytes
        stage[MAX_CONTENT] = APPLICATION_DATA
        for off in range(0, size - MAX_CONTENT + 1, MAX_CONTENT):
            stage[:MAX_CONTENT] = data[off:off + MAX_CONTENT]
            body = at + HEADER
            at = body + _FULL_LENGTH
            out[body - HEADER:body] = header
            encrypt((iv ^ seq).to_bytes(12, "big"), stage, header, out[body:at])
            seq += 1
        tx.seq = seq
        rest = size % MAX_CONTENT
        if rest:
            stage[:rest] = data[size - rest:]
            stage[rest] = APPLICATION_DATA
            at = self._seal(stage[:rest + 1], out, at)
        return at

    def records_before_update(self) -> int:
        """Records that may be sealed before the next KeyUpdate is due."""
        return max(0, self.key_update_records - self.tx.seq)

    @staticmethod
    def run_size(size: int) -> int:
        """Bytes of the records `seal_run` makes of `size` bytes."""
        return size + -(-size // MAX_CONTENT) * RECORD_OVERHEAD

    def key_update_due(self) -> bool:
        return self.tx.seq >= self.key_update_records

    def update_keys(self) -> bytes:
        """A KeyUpdate record for the peer; everything sealed after it uses the next keys."""
        record = self.seal_control(HANDSHAKE, bytes([KEY_UPDATE, 0, 0, 1, 0]))
        self.tx.update()
        return record

    def close_notify(self) -> bytes:
        return self.seal_control(ALERT, b"\x01\x00")

    def alert(self, description: int) -> bytes:
        return self.seal_control(ALERT, bytes([2, description]))

    @staticmethod
    def sealed_size(content: int) -> int:
        """Bytes of one record carrying `content` bytes of application data."""
        return content + RECORD_OVERHEAD
