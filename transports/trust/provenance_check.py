"""Checking a payload's provenance against the cluster CA: the puller's side of fabric/provenance.py.

    Hit(address, payload, digest, provenance) ──► ProvenanceVerifier.check ──► None (accept) | Rejection

A payload is accepted only when (in this order, cheapest first) it carries a record; the record is
for that namespace, block and layer and signs that digest; the certificate beside it chains to the
cluster CA, is valid now and not revoked (`TrustAnchor.identity`, itself cached); the certificate
names the record's producer; when the caller names the namespace's tenants, a certificate restricted
to tenants names one of them; and the signature verifies with the certificate's key.

The signature check is the costly step and is the same for every layer of a block and, for a
signed run, for every block of the run: its result is cached per signed message, signature and
certificate (bounded, least recently used out). A block's record leads to its run's message through
its inclusion path (O(log n) hashes, fabric/merkle.py), so a pull of k blocks of one run costs one
signature verification, k path checks and one dictionary lookup per layer. Revocation is checked
for every record object: the layers of one block received on one connection share one object (the
codec keeps the records a connection carried lately), and the last one accepted skips straight to
the per-layer digest check until another record is accepted or the trust changes (a new revocation
list).
"""

from __future__ import annotations

from collections import OrderedDict

from fabric.provenance import DIGEST_SIZE, Provenance, ProvenanceError, Rejection
from transports.trust.identity import IdentityError, NodeIdentity, TrustAnchor

_IDENTITY_REJECTIONS = {r.value: r for r in (Rejection.UNTRUSTED, Rejection.EXPIRED, Rejection.REVOKED,
                                             Rejection.NOT_A_NODE, Rejection.MALFORMED)}


class ProvenanceVerifier:
    """Decides whether a received payload is the producer's, per the cluster CA. Not thread-safe
    (one per event loop)."""

    def __init__(self, trust: TrustAnchor, *, cache_size: int = 8192) -> None:
        self._trust = trust
        # (signed message, signature, certificate) -> whether the signature verified
        self._verified: OrderedDict[tuple[bytes, bytes, bytes], bool] = OrderedDict()
        self._cache_size = cache_size
        self._last_accepted: Provenance | None = None   # this very object passed every check below ...
        self._last_tenants: frozenset[str] | None = None  # ... for these tenants

    @property
    def trust(self) -> TrustAnchor:
        return self._trust

    @trust.setter
    def trust(self, trust: TrustAnchor) -> None:
        """A new CA view (a new revocation list): nothing accepted under the old one is skipped."""
        self._trust = trust
        self._last_accepted = None

    def check(self, provenance: Provenance | None, namespace: bytes | None, block_hash: bytes, layer: int,
              digest: bytes, *, tenants: frozenset[str] | None = None) -> Rejection | None:
        """None when `digest` (already checked against the payload) is what the producer signed for
        (block_hash, layer) in `namespace`, by a producer authorised for `tenants` (the tenants whose
        namespace it is; empty: the anonymous tenant's; None: not checked); else why not."""
        if provenance is self._last_accepted and provenance is not None and tenants == self._last_tenants:
            # The next layer under the record accepted last (most of a pull): only its claim is left.
            # `Provenance.check_claim`, inlined: this runs once per layer received.
            start = (layer - provenance.first_layer) * DIGEST_SIZE
            if block_hash != provenance.block_hash or (namespace is not None and namespace != provenance.namespace) \
                    or not 0 <= start < len(provenance.layer_digests):
                return Rejection.WRONG_BLOCK
            return None if provenance.layer_digests[start:start + DIGEST_SIZE] == digest else Rejection.WRONG_DIGEST
        if provenance is None:
            return Rejection.UNSIGNED
        claim = provenance.check_claim(namespace, block_hash, layer, digest)
        if claim is not None:
            return claim
        try:
            ident = self._trust.identity(provenance.cert_der)
        except IdentityError as e:
            return _IDENTITY_REJECTIONS.get(e.reason, Rejection.UNTRUSTED)
        if ident.node != provenance.producer:
            return Rejection.PRODUCER_MISMATCH
        if tenants is not None and ident.tenants and not ident.tenants & tenants:
            return Rejection.UNAUTHORISED
        if not self._signature_ok(ident, provenance):
            return Rejection.BAD_SIGNATURE
        self._last_accepted, self._last_tenants = provenance, tenants
        return None

    def _signature_ok(self, ident: NodeIdentity, provenance: Provenance) -> bool:
        try:
            message = provenance.message()
        except ProvenanceError:   # an inclusion path that leads to no run root proves nothing
            return False
        key = (message, provenance.signature, provenance.cert_der)
        ok = self._verified.get(key)
        if ok is None:
            ok = ident.verify(provenance.signature, message)
            self._verified[key] = ok
            if len(self._verified) > self._cache_size:
                self._verified.popitem(last=False)
        else:
            self._verified.move_to_end(key)
        return ok
