"""Block provenance, pure: who produced a block, as a record signed with the producer's node key.

A digest proves a payload was not changed on the way; it says nothing about who made it when the
sender announces the digest too. A provenance record binds a block's content to the node whose
engine computed it. When its own engine stores a run of blocks, the producer signs that run once:
one signature over the Merkle root (fabric/merkle.py) of the blocks' messages, and each block's
record keeps the signature and its inclusion path. Every node that keeps a copy (a mirror) keeps the
record verbatim and never signs as a producer. A puller recomputes the root from one record's path,
verifies the signature once per run (and caches the result), then checks each layer it receives
against the record's digest for that layer, so a layer can be used the moment it arrives. A run of
one block is signed directly, without a tree.

Block message (canonical; fixed-width little-endian integers, nothing process-dependent)::

    offset  size  field
    0       24    DOMAIN  b"kvfabric/provenance/v1\\0\\0"  (a signature made for anything else never verifies here)
    24      32    namespace root id
    56      32    block hash
    88      4     first layer (u32)
    92      4     number of layers (u32)      the layer set is first .. first + n - 1
    96      32    BLAKE3 of the layers' content digests, concatenated in layer order
    128     2     producer node name length (u16)
    130     n     producer node name (UTF-8)

Run message (what a run's one signature covers)::

    0       24    RUN_DOMAIN  b"kvfabric/provenance/r1\\0\\0"
    24      32    Merkle root over leaf_hash(block message) of each block, in the run's order
    56      4     number of blocks in the run (u32)

Record encoding (what frames carry and the index stores, beside the producer's certificate)::

    version 1 (a block signed alone): RECORD header "<4sB32s32sIIHH": magic b"KVPR", version,
    namespace, block hash, first layer, number of layers, name length, signature length; then
    32 bytes of digest per layer, the name, the signature.
    version 2 (a block of a signed run): the same header, then "<IIB" (the block's index in the
    run, the run's number of blocks, the path's number of hashes); digests, name, signature as
    above; then the inclusion path, 32 bytes per hash, leaf side first.

The certificate (DER) travels beside the record, never inside the signed bytes: the CA's signature
on it binds the signing key to the producer's name, and verifying that is the verifier's job
(transports/trust/provenance_check.py).
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import blake3

from fabric.errors import FabricError
from fabric.keys import HASH_SIZE
from fabric.merkle import MAX_DEPTH, leaf_hash, root_and_paths, root_from_path

DOMAIN = b"kvfabric/provenance/v1\0\0"
RUN_DOMAIN = b"kvfabric/provenance/r1\0\0"
MAGIC = b"KVPR"
VERSION = 1        # a block signed alone
RUN_VERSION = 2    # a block of a signed run, with its inclusion path
DIGEST_SIZE = 32
MAX_LAYERS = 4096
MAX_NAME = 255
MAX_SIGNATURE = 256
MAX_CERT = 16 * 1024
_RECORD = struct.Struct("<4sB32s32sIIHH")
_RUN = struct.Struct("<IIB")
_RUN_MESSAGE = struct.Struct("<I")
_LAYERS = struct.Struct("<II")
_NAME_LEN = struct.Struct("<H")


class ProvenanceError(FabricError, ValueError):
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
    MIXED_RECORDS = "mixed_records"          # another layer of the block came under a different record
    QUARANTINED = "quarantined"              # its producer is quarantined (caught signing wrong KV)


VERSION_TAG_SIZE = 8   # bytes of a block version's content tag (see `block_version`)


def block_version(record: Provenance | None) -> bytes:
    """What a node tells the directory about the version of a block it holds: an 8-byte tag of the
    layers' digests its record signs, then the producer's name (b"": unsigned, version unknown).
    Two holders whose tags differ hold different bytes at one address; the name says whose."""
    if record is None:
        return b""
    return blake3.blake3(record.layer_digests).digest()[:VERSION_TAG_SIZE] + record.producer.encode()


def version_producer(version: bytes) -> str:
    """The producer a `block_version` names ("" for an unknown version)."""
    return version[VERSION_TAG_SIZE:].decode(errors="replace")


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


def run_message(root: bytes, num_blocks: int) -> bytes:
    """The exact bytes a producer signs for a run of `num_blocks` blocks with Merkle root `root`."""
    return RUN_DOMAIN + root + _RUN_MESSAGE.pack(num_blocks)


@dataclass(frozen=True, slots=True)
class Provenance:
    """One block's signed record, and the producer's certificate (DER) that proves the key. A block
    of a signed run also has its position in the run and its inclusion path (`path`: 32 bytes per
    hash); a block signed alone has index 0 of a run of 1 and no path."""

    namespace: bytes
    block_hash: bytes
    first_layer: int
    layer_digests: bytes     # DIGEST_SIZE bytes per layer, in layer order
    producer: str
    signature: bytes
    cert_der: bytes = b""
    leaf_index: int = 0
    num_leaves: int = 1
    path: bytes = b""
    # Derived once per record object (a pure function of the fields above): the encoding that every
    # frame serving the record carries, and the message its signature covers, which a puller needs
    # for each block it receives under the record. `dataclasses.replace` starts them over.
    _encoded: bytes | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    _message: bytes | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_digests) // DIGEST_SIZE

    def layer_digest(self, layer: int) -> bytes | None:
        """The digest the producer signed for `layer`, None if the layer is not in the record."""
        i = layer - self.first_layer
        if not 0 <= i < self.num_layers:
            return None
        return self.layer_digests[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE]

    def block_message(self) -> bytes:
        """The block's own message (module docstring): what is signed for a block signed alone, the
        Merkle leaf for a block of a run."""
        return signed_message(self.namespace, self.block_hash, self.first_layer, self.num_layers,
                              layers_digest([self.layer_digests]), self.producer)

    def message(self) -> bytes:
        """The bytes `signature` must verify over; raises ProvenanceError when the inclusion path
        cannot lead to a run root from this block's position."""
        if self._message is not None:
            return self._message
        block = self.block_message()
        if self.num_leaves == 1 and not self.path:
            message = block
        else:
            path = [self.path[i:i + HASH_SIZE] for i in range(0, len(self.path), HASH_SIZE)]
            root = root_from_path(leaf_hash(block), self.leaf_index, self.num_leaves, path) \
                if len(self.path) % HASH_SIZE == 0 else None
            if root is None:
                raise ProvenanceError(f"inclusion path does not fit block {self.leaf_index} of a run of "
                                      f"{self.num_leaves}")
            message = run_message(root, self.num_leaves)
        object.__setattr__(self, "_message", message)   # frozen: set once, derived from the fields
        return message

    def encode(self) -> bytes:
        """The record without the certificate (see the module docstring)."""
        if self._encoded is not None:
            return self._encoded
        name = self.producer.encode()
        run = self.num_leaves != 1 or bool(self.path)
        head = _RECORD.pack(MAGIC, RUN_VERSION if run else VERSION, self.namespace, self.block_hash,
                            self.first_layer, self.num_layers, len(name), len(self.signature))
        if not run:
            encoded = b"".join((head, self.layer_digests, name, self.signature))
        else:
            encoded = b"".join((head, _RUN.pack(self.leaf_index, self.num_leaves, len(self.path) // HASH_SIZE),
                                self.layer_digests, name, self.signature, self.path))
        object.__setattr__(self, "_encoded", encoded)
        return encoded

    @classmethod
    def decode(cls, raw: bytes, cert_der: bytes = b"") -> Provenance:
        """Parse a record; raises ProvenanceError saying what is wrong."""
        if type(raw) is not bytes or len(raw) < _RECORD.size:
            raise ProvenanceError("provenance record shorter than its fixed part")
        if type(cert_der) is not bytes or len(cert_der) > MAX_CERT:
            raise ProvenanceError(f"producer certificate must be at most {MAX_CERT} bytes")
        magic, version, ns, block_hash, first, num, name_len, sig_len = _RECORD.unpack_from(raw)
        if magic != MAGIC or version not in (VERSION, RUN_VERSION):
            raise ProvenanceError(f"not a version-{VERSION} or version-{RUN_VERSION} provenance record")
        if not 0 < num <= MAX_LAYERS or first + num > 2**32 or not 0 < name_len <= MAX_NAME \
                or not 0 < sig_len <= MAX_SIGNATURE:
            raise ProvenanceError("provenance record with a layer count, name or signature out of range")
        index, num_leaves, path_len, start = 0, 1, 0, _RECORD.size
        if version == RUN_VERSION:
            if len(raw) < start + _RUN.size:
                raise ProvenanceError(f"provenance record of {len(raw)} bytes does not match its lengths")
            index, num_leaves, path_len = _RUN.unpack_from(raw, start)
            if num_leaves < 2 or index >= num_leaves or not 0 < path_len <= MAX_DEPTH:
                raise ProvenanceError("provenance run record with a position, run size or path out of range")
            start += _RUN.size
        end_digests = start + num * DIGEST_SIZE
        end_signature = end_digests + name_len + sig_len
        if len(raw) != end_signature + path_len * HASH_SIZE:
            raise ProvenanceError(f"provenance record of {len(raw)} bytes does not match its lengths")
        try:
            producer = raw[end_digests:end_digests + name_len].decode()
        except UnicodeDecodeError:
            raise ProvenanceError("provenance producer name is not UTF-8") from None
        return cls(ns, block_hash, first, raw[start:end_digests], producer, raw[end_digests + name_len:end_signature],
                   cert_der, index, num_leaves, raw[end_signature:])

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
    (transports.trust.identity.NodeSigner)."""

    @property
    def node(self) -> str: ...
    @property
    def cert_der(self) -> bytes: ...
    def sign(self, message: bytes) -> bytes: ...


def _unsigned(namespace: bytes, block_hash: bytes, digests: Sequence[bytes], producer: str, cert_der: bytes,
              first_layer: int) -> Provenance:
    if not digests or any(len(d) != DIGEST_SIZE for d in digests):
        raise ProvenanceError("a block needs one 32-byte digest per layer")
    return Provenance(bytes(namespace), bytes(block_hash), first_layer, b"".join(digests), producer, b"", cert_der)


def sign_block(namespace: bytes, block_hash: bytes, digests: Sequence[bytes], producer: str, cert_der: bytes,
               sign: Callable[[bytes], bytes], first_layer: int = 0) -> Provenance:
    """The record a producer makes for one block whose layers have `digests` (one signature)."""
    record = _unsigned(namespace, block_hash, digests, producer, cert_der, first_layer)
    return dataclasses.replace(record, signature=sign(record.message()))


def sign_run(namespace: bytes, blocks: Sequence[tuple[bytes, Sequence[bytes]]], producer: str, cert_der: bytes,
             sign: Callable[[bytes], bytes], first_layer: int = 0) -> list[Provenance]:
    """The records a producer makes for a run of blocks, given as (block hash, layer digests), with
    one signature over the run: one record per block, each with its inclusion path. A run of one
    block is `sign_block`'s record."""
    records = [_unsigned(namespace, h, digests, producer, cert_der, first_layer) for h, digests in blocks]
    if len(records) <= 1:
        return [dataclasses.replace(r, signature=sign(r.message())) for r in records]
    if len(records) >= 2**32:
        raise ProvenanceError(f"a signed run holds at most {2**32 - 1} blocks")
    root, paths = root_and_paths([leaf_hash(r.block_message()) for r in records])
    signature = sign(run_message(root, len(records)))
    return [dataclasses.replace(r, signature=signature, leaf_index=i, num_leaves=len(records), path=b"".join(path))
            for i, (r, path) in enumerate(zip(records, paths, strict=True))]
