"""Provenance records, pure: the signed message is canonical, records round-trip, garbage is named."""

from __future__ import annotations

import dataclasses
import struct

import blake3
import pytest

from fabric.provenance import (
    DOMAIN,
    Provenance,
    ProvenanceError,
    Rejection,
    layers_digest,
    sign_block,
    sign_run,
    signed_message,
)

NS, BLOCK = b"n" * 32, b"h" * 32
DIGESTS = [bytes([i]) * 32 for i in range(4)]


def _sign(message: bytes) -> bytes:
    return b"sig:" + blake3.blake3(message).digest()   # a stand-in key: these tests check bytes, not crypto


def test_the_signed_message_is_fixed_width_and_domain_separated() -> None:
    msg = signed_message(NS, BLOCK, 0, 4, layers_digest(DIGESTS), "node-a")
    assert msg == (DOMAIN + NS + BLOCK + struct.pack("<II", 0, 4) + blake3.blake3(b"".join(DIGESTS)).digest()
                   + struct.pack("<H", 6) + b"node-a")
    # every field is bound: changing any one changes the message
    others = [signed_message(b"m" * 32, BLOCK, 0, 4, layers_digest(DIGESTS), "node-a"),
              signed_message(NS, b"g" * 32, 0, 4, layers_digest(DIGESTS), "node-a"),
              signed_message(NS, BLOCK, 1, 4, layers_digest(DIGESTS), "node-a"),
              signed_message(NS, BLOCK, 0, 3, layers_digest(DIGESTS), "node-a"),
              signed_message(NS, BLOCK, 0, 4, layers_digest(DIGESTS[::-1]), "node-a"),
              signed_message(NS, BLOCK, 0, 4, layers_digest(DIGESTS), "node-b")]
    assert msg not in others and len(set(others)) == len(others)


def test_a_record_round_trips_and_speaks_only_for_its_layers() -> None:
    record = sign_block(NS, BLOCK, DIGESTS, "node-a", b"cert", _sign)
    assert record.signature == _sign(record.message())
    again = Provenance.decode(record.encode(), b"cert")
    assert again == record and again.cert_der == b"cert"
    assert record.check_claim(NS, BLOCK, 2, DIGESTS[2]) is None
    assert record.check_claim(None, BLOCK, 3, DIGESTS[3]) is None
    assert record.check_claim(NS, BLOCK, 2, DIGESTS[1]) is Rejection.WRONG_DIGEST
    assert record.check_claim(NS, BLOCK, 4, DIGESTS[0]) is Rejection.WRONG_BLOCK
    assert record.check_claim(NS, b"g" * 32, 0, DIGESTS[0]) is Rejection.WRONG_BLOCK
    assert record.check_claim(b"m" * 32, BLOCK, 0, DIGESTS[0]) is Rejection.WRONG_BLOCK


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda raw: raw[:10], "shorter than its fixed part"),
    (lambda raw: b"XXXX" + raw[4:], "not a version-1"),
    (lambda raw: raw + b"x", "does not match its lengths"),
    (lambda raw: raw[:-1], "does not match its lengths"),
    (lambda raw: raw[:72] + struct.pack("<I", 0) + raw[76:], "out of range"),
])
def test_malformed_records_are_named(mangle, message: str) -> None:
    raw = sign_block(NS, BLOCK, DIGESTS, "node-a", b"", _sign).encode()
    with pytest.raises(ProvenanceError, match=message):
        Provenance.decode(mangle(raw))


def test_a_block_needs_a_digest_per_layer() -> None:
    with pytest.raises(ProvenanceError):
        sign_block(NS, BLOCK, [], "node-a", b"", _sign)
    with pytest.raises(ProvenanceError):
        sign_block(NS, BLOCK, [b"short"], "node-a", b"", _sign)


def _run(n: int, sign=_sign) -> list[Provenance]:
    blocks = [(bytes([i]) * 32, [bytes([i, j]) * 16 for j in range(3)]) for i in range(n)]
    return sign_run(NS, blocks, "node-a", b"cert", sign)


def test_a_run_is_signed_once_and_every_record_proves_its_own_block() -> None:
    calls: list[bytes] = []

    def counting(message: bytes) -> bytes:
        calls.append(message)
        return _sign(message)

    records = _run(5, counting)
    assert len(calls) == 1
    assert {r.signature for r in records} == {_sign(calls[0])}
    for i, record in enumerate(records):
        assert record.block_hash == bytes([i]) * 32
        assert record.message() == calls[0]          # each record leads to the signed run root
        again = Provenance.decode(record.encode(), b"cert")
        assert again == record and again.message() == calls[0]
        assert again.check_claim(NS, record.block_hash, 1, bytes([i, 1]) * 16) is None


def test_a_run_of_one_block_is_the_plain_block_record() -> None:
    [record] = _run(1)
    assert record == sign_block(NS, b"\0" * 32, [bytes([0, j]) * 16 for j in range(3)], "node-a", b"cert", _sign)
    assert record.encode()[4] == 1   # version-1 encoding: no inclusion path


def _proves(record: Provenance) -> bytes | None:
    """The message the record's signature must cover; None when its path leads to no run root."""
    try:
        return record.message()
    except ProvenanceError:
        return None


def test_a_tampered_inclusion_path_no_longer_leads_to_the_signed_root() -> None:
    records = _run(6)
    signed = records[0].message()
    r = records[2]
    flipped = bytes([r.path[0] ^ 1]) + r.path[1:]
    forged = [
        dataclasses.replace(r, path=flipped),                                  # a changed sibling
        dataclasses.replace(r, leaf_index=3),                                  # another position
        dataclasses.replace(r, num_leaves=7),                                  # another run size
        dataclasses.replace(r, layer_digests=records[3].layer_digests),        # another block's digests
        dataclasses.replace(records[3], path=r.path, leaf_index=2),            # a block with a sibling's path
    ]
    assert all(_proves(f) != signed for f in forged)
    with pytest.raises(ProvenanceError, match="inclusion path"):
        dataclasses.replace(r, path=r.path[:-32]).message()


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda raw: raw[:-1], "does not match its lengths"),
    (lambda raw: raw[:-33], "does not match its lengths"),
    (lambda raw: raw[:81] + struct.pack("<II", 9, 6) + raw[89:], "out of range"),
    (lambda raw: raw[:81] + struct.pack("<II", 0, 1) + raw[89:], "out of range"),
    (lambda raw: raw[:89] + b"\x40" + raw[90:], "out of range"),
])
def test_malformed_run_records_are_named(mangle, message: str) -> None:
    raw = _run(6)[5].encode()
    assert Provenance.decode(raw).message() == _run(6)[0].message()
    with pytest.raises(ProvenanceError, match=message):
        Provenance.decode(mangle(raw))
