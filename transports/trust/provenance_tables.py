"""How producers' provenance records travel in BLOCK and BLOCKS headers (transports/core/codec.py).
Pure: header fields in, records out.

Optional header fields, in one of two forms. Per frame (all three or none), which any stream may
carry and a reader of independent messages (a QUIC stream per pull) needs::

    certs  [DER, ...]               each producer certificate once per frame
    provs  [[record, cert index]]   each distinct record once per frame (fabric/provenance.py)
    pix    [index or -1, ...]       one per part (a BLOCK has one part): its record, or -1 unsigned

Per stream, on an ordered byte stream whose writer keeps a `SentRecords` (TLS-TCP): each record and
each certificate is sent once, and later frames name it by its number on the stream::

    rref   [record base, cert base] the stream numbers of this frame's first new record and certificate
    certs  [DER, ...]               new certificates, numbered from cert base   (absent: none)
    provs  [[record, cert number]]  new records, numbered from record base     (absent: none)
    pix    [number or -1, ...]      one per part: its record's stream number, or -1 unsigned

Both ends keep the last `STREAM_WINDOW` records and certificates; a writer names only what is at
least `MAX_NEW` numbers inside that window (a frame adds at most one record per part), so what it
names is always still held by the reader. A base that is not the reader's next number, or a number
outside the window, is a protocol error.

A block's layers share one record, so a frame of many layers of few blocks carries few records:
building the tables is O(parts) identity tests plus O(records) lookups, reading them O(parts).
A reader keeps the records it decoded on one stream (`StreamRecords`): a record that comes again
(per frame: byte for byte with the same certificate, e.g. the next frame of the same block's layers;
per stream: by number) is the same object, which the verifier has already checked.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from fabric.provenance import Provenance, ProvenanceError

MAX_KNOWN_RECORDS = 64   # per-frame form: a few frames' worth of blocks; emptied when full
STREAM_WINDOW = 512      # per-stream form: records (and certificates) both ends keep ...
MAX_HELD_BYTES = 8 << 20  # ... and at most this many bytes of them per stream and form: past it the
                          # peer is flooding (honest records of a 128-layer model fill a window with
                          # about 2 MiB), and the frame is a protocol error for that peer only
MAX_NEW = 256            # at most this many records are new in one frame (one per part: MAX_PARTS)


class SentRecords:
    """The writer's side of the per-stream form, for one ordered stream: what it has sent, by
    identity (each record held, so that its identity stays its own), with its stream number.
    `tables` numbers a frame's new records; `commit` once that frame is encoded for the stream, or
    `discard` when it is refused (the stream's numbering is then as it was)."""

    def __init__(self) -> None:
        self.next_record = 0
        self.next_cert = 0
        self._records: OrderedDict[int, tuple[int, Provenance]] = OrderedDict()   # id -> (number, record)
        self._certs: OrderedDict[bytes, int] = OrderedDict()                       # DER -> number
        self._pending: tuple[dict[int, tuple[int, Provenance]], dict[bytes, int]] = ({}, {})

    def tables(self, provs: Iterable[Provenance | None]) -> dict[str, Any]:
        """The `rref` / `certs` / `provs` / `pix` header fields for parts with these records,
        numbering the ones this stream has not carried (or no longer holds) from `next_record`."""
        records: dict[int, tuple[int, Provenance]] = {}   # this frame's new records
        certs: dict[bytes, int] = {}                      # this frame's new certificates
        new_records: list[list[Any]] = []

        def number(prov: Provenance) -> int:
            sent = records.get(id(prov)) or self._records.get(id(prov))
            if sent is not None and (sent[0] >= self.next_record or _held(sent[0], self.next_record)):
                return sent[0]   # new in this frame, or held by the reader
            i = self.next_record + len(records)
            records[id(prov)] = (i, prov)
            new_records.append([prov.encode(), self._cert_number(prov.cert_der, certs)])
            return i

        pix = _part_numbers(provs, number)
        if len(records) > MAX_NEW:   # the reader would refuse it: a frame of more parts than a session cuts
            raise ValueError(f"a frame may name at most {MAX_NEW} records new on its stream, not {len(records)}")
        self._pending = (records, certs)
        fields: dict[str, Any] = {"rref": [self.next_record, self.next_cert], "pix": pix}
        if new_records:
            fields["provs"] = new_records
            if certs:
                fields["certs"] = list(certs)
        return fields

    def table(self, prov: Provenance) -> dict[str, Any]:
        """`tables((prov,))`, for a one-part frame: its record named by number when held."""
        sent = self._records.get(id(prov))
        if sent is not None and _held(sent[0], self.next_record):
            self._pending = ({}, {})
            return {"rref": [self.next_record, self.next_cert], "pix": [sent[0]]}
        return self.tables((prov,))

    def _cert_number(self, cert: bytes, certs: dict[bytes, int]) -> int:
        number = certs.get(cert)
        if number is None:
            number = self._certs.get(cert)
            if number is None or not _held(number, self.next_cert):
                number = certs[cert] = self.next_cert + len(certs)
        return number

    def discard(self) -> None:
        """The frame whose tables were made last was refused: its new numbers never held."""
        self._pending = ({}, {})

    def commit(self) -> None:
        """The frame whose tables were made last is on the stream: its new numbers hold."""
        records, certs = self._pending
        self._pending = ({}, {})
        for key, sent in records.items():
            self._records[key] = sent
            self._records.move_to_end(key)
        for cert, number in certs.items():
            self._certs[cert] = number
            self._certs.move_to_end(cert)
        self.next_record += len(records)
        self.next_cert += len(certs)
        while len(self._records) > STREAM_WINDOW:
            self._records.popitem(last=False)
        while len(self._certs) > STREAM_WINDOW:
            self._certs.popitem(last=False)


class StreamRecords:
    """The reader's side, for one stream: the records it decoded lately (per-frame form) and the
    ones it holds by stream number (per-stream form)."""

    def __init__(self) -> None:
        self.known: dict[tuple[bytes, bytes], Provenance] = {}   # (record, certificate) -> record
        self.known_bytes = 0
        self.records: dict[int, Provenance] = {}
        self.certs: dict[int, bytes] = {}
        self.next_record = 0
        self.next_cert = 0
        self._sizes: dict[tuple[bool, int], int] = {}   # (is a certificate, stream number) -> its bytes
        self.held_bytes = 0                             # what `records` and `certs` hold, in those bytes

    def hold(self, cert: bool, number: int, size: int, what: str) -> None:
        """Count `size` bytes for the record or certificate numbered `number`, and drop the one that
        left the window; ValueError when the stream would then hold over MAX_HELD_BYTES."""
        gone = self._sizes.pop((cert, number - STREAM_WINDOW), 0)
        self._sizes[(cert, number)] = size
        self.held_bytes += size - gone
        if self.held_bytes > MAX_HELD_BYTES:
            raise ValueError(f"{what}: the stream's records and certificates would take {self.held_bytes} bytes, "
                             f"over the {MAX_HELD_BYTES}-byte bound")


def _held(number: int, next_number: int) -> bool:
    """Whether a reader still holds stream number `number` after the frame being built, which
    numbers at most MAX_NEW new ones from `next_number`."""
    return number >= next_number + MAX_NEW - STREAM_WINDOW


def _part_numbers(provs: Iterable[Provenance | None], number: Callable[[Provenance], int]) -> list[int]:
    """`pix`: each part's record number from `number`, or -1 unsigned. A block's layers share one
    record object, so consecutive parts mostly repeat the last one: an identity test then, and
    `number` is asked once per run of parts under one record."""
    pix: list[int] = []
    last: Provenance | None = None
    i = -1
    for prov in provs:
        if prov is not last:
            last = prov
            i = -1 if prov is None else number(prov)
        pix.append(i)
    return pix


def record_tables(provs: Iterable[Provenance | None]) -> dict[str, Any]:
    """The per-frame `certs` / `provs` / `pix` header fields for parts with these records."""
    certs: dict[bytes, int] = {}
    records: dict[int, int] = {}   # id(record) -> its index: every record here is alive in `provs`
    table: list[list[Any]] = []

    def number(prov: Provenance) -> int:
        # By identity: equal records that are distinct objects each get an entry (a few more header
        # bytes, never a wrong one).
        i = records.get(id(prov), -1)
        if i < 0:
            i = records[id(prov)] = len(table)
            table.append([prov.encode(), certs.setdefault(prov.cert_der, len(certs))])
        return i

    pix = _part_numbers(provs, number)
    return {"certs": list(certs), "provs": table, "pix": pix}


def part_records(header: dict[Any, Any], num_parts: int, what: str,
                 stream: StreamRecords | None = None) -> tuple[Provenance | None, ...]:
    """The record of each part of a `what` frame from its record fields; () when there are none.
    Anything malformed is a ValueError naming it (the codec makes it a ProtocolError). Runs once
    per frame received: plain loops, each record decoded once, or taken from `stream`."""
    if "pix" not in header and "provs" not in header and "certs" not in header and "rref" not in header:
        return ()
    if "rref" in header:
        if stream is not None and num_parts == 1 and "provs" not in header and "certs" not in header:
            # The data path: a one-part frame naming a record this stream holds. Anything else, or
            # anything off here, takes the checked path below.
            rref, pix = header["rref"], header.get("pix")
            if type(rref) is list and len(rref) == 2 and type(pix) is list and len(pix) == 1 and \
                    type(first := rref[0]) is int and type(cert := rref[1]) is int and type(i := pix[0]) is int \
                    and first == stream.next_record and cert == stream.next_cert \
                    and (record := stream.records.get(i)) is not None:   # held: within the window
                return (record,)
        return _stream_records(header, _pix(header, num_parts, what), what,
                               stream if stream is not None else StreamRecords())
    certs, table = _check_certs(header.get("certs"), what), header.get("provs")
    if type(table) is not list or len(table) > num_parts:
        raise ValueError(f"{what} provs must be a list of at most one record per part")
    pix = _pix(header, num_parts, what)
    known = stream.known if stream is not None else None
    records: list[Provenance | None] = []
    for entry in table:
        _check_entry(entry, what)
        if not 0 <= entry[1] < len(certs):
            raise ValueError(f"{what} provs entries must be [record bytes, certificate index]")
        key = (entry[0], certs[entry[1]])
        record = known.get(key) if known is not None else None
        if record is None:
            record = _decode(key[0], key[1], what)
            if known is not None and stream is not None:
                size = len(key[0]) + len(key[1])
                if len(known) >= MAX_KNOWN_RECORDS or stream.known_bytes + size > MAX_HELD_BYTES:
                    known.clear()
                    stream.known_bytes = 0
                known[key] = record
                stream.known_bytes += size
        records.append(record)
    return _pick(records, pix, len(records), 0, what)


def _stream_records(header: dict[Any, Any], pix: list[Any], what: str,
                    stream: StreamRecords) -> tuple[Provenance | None, ...]:
    rref = header["rref"]
    if type(rref) is not list or len(rref) != 2 or rref[0] != stream.next_record or rref[1] != stream.next_cert \
            or type(rref[0]) is not int or type(rref[1]) is not int:
        raise ValueError(f"{what} rref {rref!r} is not this stream's next record and certificate numbers "
                         f"[{stream.next_record}, {stream.next_cert}]")
    certs, table = _check_certs(header.get("certs", []), what), header.get("provs", [])
    if type(table) is not list or len(table) > min(len(pix), MAX_NEW):
        raise ValueError(f"{what} provs must be a list of at most one new record per part")
    if len(certs) > len(table):
        raise ValueError(f"{what} carries {len(certs)} new certificates for {len(table)} new records")
    for cert in certs:
        stream.hold(True, stream.next_cert, len(cert), what)
        stream.certs[stream.next_cert] = cert
        stream.certs.pop(stream.next_cert - STREAM_WINDOW, None)
        stream.next_cert += 1
    for entry in table:
        _check_entry(entry, what)
        held = stream.certs.get(entry[1])
        if held is None:
            raise ValueError(f"{what} names certificate {entry[1]}, which this stream does not hold")
        stream.hold(False, stream.next_record, len(entry[0]), what)
        stream.records[stream.next_record] = _decode(entry[0], held, what)
        stream.records.pop(stream.next_record - STREAM_WINDOW, None)
        stream.next_record += 1
    low = max(0, stream.next_record - STREAM_WINDOW)
    return _pick(stream.records, pix, stream.next_record, low, what)


def _pix(header: dict[Any, Any], num_parts: int, what: str) -> list[Any]:
    pix = header.get("pix")
    if type(pix) is not list:
        raise ValueError(f"{what} pix must be a list")
    if len(pix) != num_parts:
        raise ValueError(f"{what} needs one pix entry per part ({num_parts}), got {len(pix)}")
    return pix


def _check_certs(certs: Any, what: str) -> list[bytes]:
    if type(certs) is not list:
        raise ValueError(f"{what} certs must be a list of bytes")
    for cert in certs:
        if type(cert) is not bytes:
            raise ValueError(f"{what} certs must be a list of bytes")
    return certs


def _check_entry(entry: Any, what: str) -> None:
    if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not bytes or type(entry[1]) is not int:
        raise ValueError(f"{what} provs entries must be [record bytes, certificate index]")


def _decode(record: bytes, cert: bytes, what: str) -> Provenance:
    try:
        return Provenance.decode(record, cert)
    except ProvenanceError as e:
        raise ValueError(f"{what} carries a bad provenance record: {e}") from None


def _pick(records: list[Provenance | None] | dict[int, Provenance], pix: list[Any], end: int, low: int,
          what: str) -> tuple[Provenance | None, ...]:
    """Each part's record: pix entries are ints (not bools) in low .. end - 1, or -1 (unsigned).
    A frame's parts name few records (a block's layers share one), so each distinct entry is
    checked once and the parts are mapped without a Python loop per part."""
    if not pix:
        return ()
    if set(map(type, pix)) != {int}:
        bad = next(i for i in pix if type(i) is not int)
        raise ValueError(f"{what} pix entry {bad!r} out of range: this stream holds records {low}..{end - 1}")
    chosen: dict[int, Provenance | None] = {}
    for i in set(pix):
        if i == -1:
            chosen[i] = None
        elif low <= i < end:
            chosen[i] = records[i]
        else:
            raise ValueError(f"{what} pix entry {i!r} out of range: this stream holds records {low}..{end - 1}")
    return tuple(map(chosen.__getitem__, pix))
