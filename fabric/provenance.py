"""Block provenance, pure: who produced a block, as a record signed with the producer's node key.

A digest proves a payload was not changed on the way; it says nothing about who made it when the
sender announces the digest too. A provenance record binds a block's content to the node whose
engine computed it. The producer signs one record per block, over all its layers, when its own
engine stores the block; every node that keeps a copy (a mirror) keeps the record verbatim and
never signs as a producer. A puller verifies one signature per block (and caches the result), then
checks each layer it receives against the record's digest for that layer, so a layer can be used
the moment it arrives.

Signed message (canonical; fixed-width little-endian integers, nothing process-dependent)::

    offset  size  field
    0       24    DOMAIN  b"kvfabric/provenance/v1\\0\\0"  (a signature made for anything else never verifies here)
    24      32    namespace root id
    56      32    block hash
    88      4     first layer (u32)
    92      4     number of layers (u32)      the layer set is first .. first + n - 1
    96      32    BLAKE3 of the layers' content digests, concatenated in layer order
    128     2     producer node name length (u16)
    130     n     producer node name (UTF-8)

Record encoding (what frames carry and the index stores, beside the producer's certificate)::

    RECORD header "<4sB32s32sIIHH": magic b"KVPR", version, namespace, block hash, first layer,
    number of layers, name length, signature length; then 32 bytes of digest per layer, the
    name, the signature.

The certificate (DER) travels beside the record, never inside the signed bytes: the CA's signature
on it binds the signing key to the producer's name, and verifying that is the verifier's job
(transports/core/provenance_check.py).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3

from fabric.keys import HASH_SIZE

DOMAIN = b"kvfabric/provenance/v1\0\0"
MAGIC = b"KVPR"
VERSION = 1
DIGEST_SIZE = 32
MAX_LAYERS = 4096
MAX_NAME = 255
MAX_SIGNATURE = 256
MAX_CERT = 16 * 1024
_RECORD = struct.Struct("<4sB32s32sIIHH")
_LAYERS = struct.Struct("<II")
_NAME_LEN = struct.Struct("<H")


class ProvenanceError(ValueError):
    """Bytes that are not a provenance record (a peer's or a file's fault)."""


class Rejection(enum.StrEnum):
    """Why a payload's provenance did not hold; the label of kvfabric_provenance_rejections_total."""

    UNSIGNED = "unsigned"                    # no record (a block stored before provenance, or a liar)
    WRONG_BLOCK = "wrong_block"              # the record is for another namespace, block or layer set
    WRONG_DIGEST = "wrong_digest"            # the payload is not the bytes the producer signed
    BAD_SIGNATURE = "bad_signature"          # the signature does not verify with the certificate's key
    PRODUCER_MISMATCH = "producer_mismatch"  # the certificate names another node than the record
    UNTRUSTED = "untrusted"                  # the certificate does not chain to the cluster CA
    EXPIRED = "expired"
    REVOKED = "revoked"
    NOT_A_NODE = "not_a_node"
    MALFORMED = "malformed"
    UNAUTHORISED = "unauthorised"            # the producer's certificate restricts it to other tenants


def layers_digest(digests: Sequence[bytes]) -> bytes:
    """BLAKE3 over the layers' content digests in layer order (what the signature covers)."""
    return blake3.blake3(b"".join(digests)).digest()


def signed_message(namespace: bytes, block_hash: bytes, first_layer: int, num_layers: int,
                   digest_of_layers: bytes, producer: str) -> bytes:
    """The exact bytes a producer signs for one block (module docstring)."""
    name = producer.encode()
    if len(namespace) != HASH_SIZE or len(block_hash) != HASH_SIZE or len(digest_of_layers) != DIGEST_SIZE:
        raise ProvenanceError("namespace, block hash and layers digest must be 32 bytes each")
    if not 0 < len(name) <= MAX_NAME:
        raise ProvenanceError(f"producer name must be 1..{MAX_NAME} bytes of UTF-8")
    return b"".join((DOMAIN, namespace, block_hash, _LAYERS.pack(first_layer, num_layers), digest_of_layers,
                     _NAME_LEN.pack(len(name)), name))


@dataclass(frozen=True, slots=True)
class Provenance:
    """One block's signed record, and the producer's certificate (DER) that proves the key."""

    namespace: bytes
    block_hash: bytes
    first_layer: int
    layer_digests: bytes     # DIGEST_SIZE bytes per layer, in layer order
    producer: str
    signature: bytes
    cert_der: bytes = b""

    @property
    def num_layers(self) -> int:
        return len(self.layer_digests) // DIGEST_SIZE

    def layer_digest(self, layer: int) -> bytes | None:
        """The digest the producer signed for `layer`, None if the layer is not in the record."""
        i = layer - self.first_layer
        if not 0 <= i < self.num_layers:
            return None
        return self.layer_digests[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE]

    def message(self) -> bytes:
        return signed_message(self.namespace, self.block_hash, self.first_layer, self.num_layers,
                              layers_digest([self.layer_digests]), self.producer)

    def encode(self) -> bytes:
        """The record without the certificate (see the module docstring)."""
        name = self.producer.encode()
        return b"".join((_RECORD.pack(MAGIC, VERSION, self.namespace, self.block_hash, self.first_layer,
                                      self.num_layers, len(name), len(self.signature)),
                         self.layer_digests, name, self.signature))

    @classmethod
    def decode(cls, raw: bytes, cert_der: bytes = b"") -> Provenance:
        """Parse a record; raises ProvenanceError saying what is wrong."""
        if type(raw) is not bytes or len(raw) < _RECORD.size:
            raise ProvenanceError("provenance record shorter than its fixed part")
        if type(cert_der) is not bytes or len(cert_der) > MAX_CERT:
            raise ProvenanceError(f"producer certificate must be at most {MAX_CERT} bytes")
        magic, version, ns, block_hash, first, num, name_len, sig_len = _RECORD.unpack_from(raw)
        if magic != MAGIC or version != VERSION:
            raise ProvenanceError(f"not a version-{VERSION} provenance record")
        if not 0 < num <= MAX_LAYERS or first + num > 2**32 or not 0 < name_len <= MAX_NAME \
                or not 0 < sig_len <= MAX_SIGNATURE:
            raise ProvenanceError("provenance record with a layer count, name or signature out of range")
        end_digests = _RECORD.size + num * DIGEST_SIZE
        if len(raw) != end_digests + name_len + sig_len:
            raise ProvenanceError(f"provenance record of {len(raw)} bytes does not match its lengths")
        try:
            producer = raw[end_digests:end_digests + name_len].decode()
        except UnicodeDecodeError:
            raise ProvenanceError("provenance producer name is not UTF-8") from None
        return cls(ns, block_hash, first, raw[_RECORD.size:end_digests], producer,
                   raw[end_digests + name_len:], cert_der)

    def check_claim(self, namespace: bytes | None, block_hash: bytes, layer: int, digest: bytes) -> Rejection | None:
        """Whether this record speaks for `digest` as (block_hash, layer) in `namespace` (None: any);
        the signature is not checked here."""
        # `layer_digest`, inlined: this runs once per layer received
        start = (layer - self.first_layer) * DIGEST_SIZE
        if block_hash != self.block_hash or (namespace is not None and namespace != self.namespace) \
                or not 0 <= start < len(self.layer_digests):
            return Rejection.WRONG_BLOCK
        return None if self.layer_digests[start:start + DIGEST_SIZE] == digest else Rejection.WRONG_DIGEST


class BlockSigner(Protocol):
    """A producer's signing key and the certificate that binds it to its node name
    (transports.core.identity.NodeSigner)."""

    @property
    def node(self) -> str: ...
    @property
    def cert_der(self) -> bytes: ...
    def sign(self, message: bytes) -> bytes: ...


def sign_block(namespace: bytes, block_hash: bytes, digests: Sequence[bytes], producer: str, cert_der: bytes,
               sign: Callable[[bytes], bytes], first_layer: int = 0) -> Provenance:
    """The record a producer makes for one block whose layers have `digests` (one signature)."""
    if not digests or any(len(d) != DIGEST_SIZE for d in digests):
        raise ProvenanceError("a block needs one 32-byte digest per layer")
    record = Provenance(bytes(namespace), bytes(block_hash), first_layer, b"".join(digests), producer, b"",
                        cert_der)
    signature = sign(record.message())
    return Provenance(record.namespace, record.block_hash, first_layer, record.layer_digests, producer, signature,
                      cert_der)
