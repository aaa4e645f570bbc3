"""Trust: what the cluster CA vouches for, in one place.

    certs              the cluster CA, node / tenant / operator credentials, the revocation list (files)
    revocation         the revocation list, re-read when it changes (`RevocationFile`)
    identity           `TrustAnchor` (CA + revocation list) → `NodeIdentity`; node-key signatures
    client_auth        which client certificates a server accepts where the TLS stack leaves it to us
    tenant_tokens      tenant and operator credentials and the short-lived tokens they mint
    provenance_tables  how producers' provenance records travel in BLOCK / BLOCKS headers (pure)
    provenance_check   a payload's provenance checked against the cluster CA
"""
