"""Provenance records, pure: the signed message is canonical, records round-trip, garbage is named."""

from __future__ import annotations

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
