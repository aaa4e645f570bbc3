"""How producers' provenance records travel in BLOCK and BLOCKS headers (transports/core/codec.py).
Pure: header fields in, records out.

Optional header fields (all three or none)::

    certs  [DER, ...]               each producer certificate once per frame
    provs  [[record, cert index]]   each distinct record once per frame (fabric/provenance.py)
    pix    [index or -1, ...]       one per part (a BLOCK has one part): its record, or -1 unsigned

A block's layers share one record, so a frame of many layers of few blocks carries few records:
building the tables is O(parts) identity tests plus O(records) lookups, reading them O(parts).
A reader may keep the records it decoded on one connection (`KnownRecords`): a record that comes
again, byte for byte with the same certificate (the next frame of the same block's layers), is
then the same object, which the verifier has already checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fabric.provenance import Provenance, ProvenanceError

# (record bytes, certificate bytes) -> the record decoded from them, for one connection
KnownRecords = dict[tuple[bytes, bytes], Provenance]
MAX_KNOWN_RECORDS = 64   # a few frames' worth of blocks; the table is emptied when it is full


def record_tables(provs: Iterable[Provenance | None]) -> dict[str, Any]:
    """The `certs` / `provs` / `pix` header fields for parts with these records."""
    certs: dict[bytes, int] = {}
    records: dict[int, int] = {}   # id(record) -> its index: every record here is alive in `provs`
    table: list[list[Any]] = []
    pix: list[int] = []
    last: Provenance | None = None
    i = -1
    for prov in provs:
        # A block's layers share one record object, so consecutive parts mostly repeat the last one:
        # an identity test then, and a dictionary lookup by identity only per record. (Equal records
        # that are distinct objects each get an entry: a few more header bytes, never a wrong one.)
        if prov is not last:
            last = prov
            if prov is None:
                i = -1
            elif (i := records.get(id(prov), -1)) < 0:
                i = records[id(prov)] = len(table)
                table.append([prov.encode(), certs.setdefault(prov.cert_der, len(certs))])
        pix.append(i)
    return {"certs": list(certs), "provs": table, "pix": pix}


def part_records(header: dict[Any, Any], num_parts: int, what: str,
                 known: KnownRecords | None = None) -> tuple[Provenance | None, ...]:
    """The record of each part of a `what` frame from its `certs` / `provs` / `pix` fields; () when
    there are none. Anything malformed is a ValueError naming it (the codec makes it a ProtocolError).
    Runs once per frame received: plain loops, each record decoded once, or taken from `known`."""
    if "pix" not in header and "provs" not in header and "certs" not in header:
        return ()
    certs, table, pix = header.get("certs"), header.get("provs"), header.get("pix")
    if type(certs) is not list:
        raise ValueError(f"{what} certs must be a list of bytes")
    for cert in certs:
        if type(cert) is not bytes:
            raise ValueError(f"{what} certs must be a list of bytes")
    if type(table) is not list or len(table) > num_parts:
        raise ValueError(f"{what} provs must be a list of at most one record per part")
    if type(pix) is not list:
        raise ValueError(f"{what} pix must be a list")
    if len(pix) != num_parts:
        raise ValueError(f"{what} needs one pix entry per part ({num_parts}), got {len(pix)}")
    records: list[Provenance | None] = []
    for entry in table:
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not bytes or type(entry[1]) is not int \
                or not 0 <= entry[1] < len(certs):
            raise ValueError(f"{what} provs entries must be [record bytes, certificate index]")
        key = (entry[0], certs[entry[1]])
        record = known.get(key) if known is not None else None
        if record is None:
            try:
                record = Provenance.decode(*key)
            except ProvenanceError as e:
                raise ValueError(f"{what} carries a bad provenance record: {e}") from None
            if known is not None:
                if len(known) >= MAX_KNOWN_RECORDS:
                    known.clear()
                known[key] = record
        records.append(record)
    num_records = len(records)
    # Every entry an int (not a bool) in -1 .. num_records - 1, checked without a Python loop per part.
    if pix and (set(map(type, pix)) != {int} or min(pix) < -1 or max(pix) >= num_records):
        bad = next(i for i in pix if type(i) is not int or not -1 <= i < num_records)
        raise ValueError(f"{what} pix entry {bad!r} out of range for {num_records} records")
    records.append(None)   # pix -1 (unsigned) picks the last entry
    return tuple([records[i] for i in pix])
