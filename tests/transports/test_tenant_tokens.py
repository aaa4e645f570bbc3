"""Tenant credentials and tokens: only a CA-issued, unrevoked tenant certificate's fresh token names a tenant."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import msgpack
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from hypothesis import given, settings
from hypothesis import strategies as st
from testkit import PkiFactory

from transports.trust.certs import (
    CertificateError,
    issue_node,
    issue_operator,
    issue_tenant,
    node_name_of,
    revoke,
)
from transports.trust.identity import IdentityError, TrustAnchor
from transports.trust.tenant_tokens import (
    MAX_TTL_S,
    Principal,
    TenantError,
    TenantMinter,
    TenantToken,
    TenantVerifier,
    tenants_of_node,
)

NOW = 1_800_000_000.0   # unix seconds, within the certificates' validity below


@pytest.fixture
def ca(tmp_path: Path, make_pki: PkiFactory) -> Path:
    return make_pki(tmp_path / "ca").dir


@pytest.fixture(scope="module")
def module_ca(tmp_path_factory: pytest.TempPathFactory, make_pki: PkiFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("ca")).dir


def _anchor(ca: Path) -> TrustAnchor:
    return TrustAnchor.from_files(ca / "ca.pem")


def _minter(ca: Path, name: str, ttl_s: float = 300.0, days: int = 3650) -> TenantMinter:
    cert, key = issue_tenant(ca, name, days=days)
    return TenantMinter(cert, key, ttl_s=ttl_s)


def test_a_tenant_token_names_its_tenant_and_is_reused_until_half_its_life(ca: Path) -> None:
    minter = _minter(ca, "acme")
    verifier = TenantVerifier(_anchor(ca))
    token = minter.token(NOW)
    assert verifier.verify(token, NOW) == "acme"
    assert minter.token(NOW + 100) == token
    renewed = minter.token(NOW + 151)
    assert renewed != token and verifier.verify(renewed, NOW + 151) == "acme"


def test_an_expired_token_is_refused(ca: Path) -> None:
    token = _minter(ca, "acme", ttl_s=60).token(NOW)
    verifier = TenantVerifier(_anchor(ca))
    assert verifier.verify(token, NOW + 59) == "acme"   # cached now: the cache still checks expiry
    with pytest.raises(TenantError) as e:
        verifier.verify(token, NOW + 61)
    assert e.value.reason == "expired"
    with pytest.raises(TenantError) as e:
        TenantVerifier(_anchor(ca)).verify(token, NOW + 61)
    assert e.value.reason == "expired"


def test_a_revoked_tenant_is_refused_even_with_a_cached_token(ca: Path) -> None:
    cert, key = issue_tenant(ca, "acme")
    token = TenantMinter(cert, key).token(NOW)
    verifier = TenantVerifier(_anchor(ca))
    assert verifier.verify(token, NOW) == "acme"
    revoke(ca, {x509.load_pem_x509_certificate(cert.read_bytes()).serial_number})
    verifier.trust = _anchor(ca)   # what a node does when crl.pem changes
    with pytest.raises(TenantError) as e:
        verifier.verify(token, NOW)
    assert e.value.reason == "revoked"


def test_a_token_from_another_ca_is_refused(ca: Path, tmp_path: Path, make_pki: PkiFactory) -> None:
    other = make_pki(tmp_path / "other").dir
    token = _minter(other, "acme").token(NOW)
    with pytest.raises(TenantError) as e:
        TenantVerifier(_anchor(ca)).verify(token, NOW)
    assert e.value.reason == "untrusted"


def test_a_node_certificate_is_not_a_tenant_and_a_tenant_certificate_is_not_a_node(ca: Path) -> None:
    cert, key = issue_node(ca, "node-1", extra_sans=("127.0.0.1",))
    with pytest.raises(CertificateError, match="node certificate is not a tenant"):
        TenantMinter(cert, key)
    # a token forged around a node certificate (signed with the node's own key) is refused too
    minter = _minter(ca, "acme")
    node_der = x509.load_pem_x509_certificate(cert.read_bytes()).public_bytes(serialization.Encoding.DER)
    forged = TenantToken(node_der, int(NOW * 1000), int(NOW * 1000) + 60_000, b"sig")
    with pytest.raises(TenantError) as e:
        TenantVerifier(_anchor(ca)).verify(forged.encode(), NOW)
    assert e.value.reason == "not_a_tenant"
    tenant_cert = x509.load_pem_x509_certificate((ca / "acme.tenant.pem").read_bytes())
    with pytest.raises(CertificateError):
        node_name_of(tenant_cert)
    with pytest.raises(IdentityError) as ie:
        _anchor(ca).identity(tenant_cert)
    assert ie.value.reason == "not_a_node"
    assert minter.tenant == "acme"


def test_a_token_signed_by_another_key_or_tampered_is_refused(ca: Path) -> None:
    acme, other = _minter(ca, "acme"), _minter(ca, "other")
    good = TenantToken.decode(acme.token(NOW))
    stolen = TenantToken(good.cert_der, good.issued_ms, good.expires_ms,
                         TenantToken.decode(other.token(NOW)).signature)
    longer = TenantToken(good.cert_der, good.issued_ms, good.expires_ms + 1, good.signature)
    for raw in (stolen.encode(), longer.encode()):
        with pytest.raises(TenantError) as e:
            TenantVerifier(_anchor(ca)).verify(raw, NOW)
        assert e.value.reason == "bad_signature"
    far = TenantToken(good.cert_der, 2**63, 2**63 + 1, good.signature)   # times no i64 holds
    for raw in (b"", b"\x93\x01\x02\x03", b"x" * 40_000, far.encode()):
        with pytest.raises(TenantError) as e:
            TenantVerifier(_anchor(ca)).verify(raw, NOW)
        assert e.value.reason == "malformed"


def test_a_token_claiming_a_lifetime_over_the_limit_is_refused(ca: Path) -> None:
    with pytest.raises(ValueError, match="lifetime"):
        _minter(ca, "acme", ttl_s=MAX_TTL_S + 1)


def test_a_tenant_certificate_past_its_validity_is_refused(ca: Path) -> None:
    cert, key = issue_tenant(ca, "old", days=1, not_before=dt.datetime.fromtimestamp(NOW, dt.UTC)
                             - dt.timedelta(days=3))
    token = TenantMinter(cert, key).token(NOW)
    with pytest.raises(TenantError) as e:
        TenantVerifier(_anchor(ca)).verify(token, NOW)
    assert e.value.reason == "expired"


def test_node_certificates_may_restrict_their_node_to_tenants(ca: Path) -> None:
    cert, _ = issue_node(ca, "node-2", tenants=("acme", "globex"))
    assert tenants_of_node(cert.read_bytes()) == {"acme", "globex"}
    assert node_name_of(x509.load_pem_x509_certificate(cert.read_bytes())) == "node-2"
    plain, _ = issue_node(ca, "node-3")
    assert tenants_of_node(plain.read_bytes()) == frozenset()
    with pytest.raises(CertificateError, match="invalid tenant name"):
        issue_tenant(ca, "a/b")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=300),
                 st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.binary(max_size=40), st.text(max_size=5),
                                    st.none()), max_size=6).map(lambda xs: msgpack.packb(xs, use_bin_type=True))))
def test_any_bytes_are_refused_with_a_reason_never_an_internal_error(module_ca: Path, raw: bytes) -> None:
    verifier = TenantVerifier(_anchor(module_ca))
    with pytest.raises(TenantError) as e:
        verifier.verify(raw, NOW)
    assert e.value.reason in ("malformed", "untrusted")


def test_an_operator_token_proves_the_operator_and_never_a_tenant(ca: Path) -> None:
    cert, key = issue_operator(ca, "ops")
    token = TenantMinter(cert, key).token(NOW)
    verifier = TenantVerifier(_anchor(ca))
    assert verifier.verify_principal(token, NOW) == Principal("ops", operator=True)
    with pytest.raises(TenantError) as e:
        verifier.verify(token, NOW)
    assert e.value.reason == "not_a_tenant"
    assert verifier.verify_principal(_minter(ca, "ops").token(NOW), NOW) == Principal("ops")   # a tenant "ops"
    revoke(ca, {x509.load_pem_x509_certificate(cert.read_bytes()).serial_number})
    with pytest.raises(TenantError) as e:
        TenantVerifier(_anchor(ca)).verify_principal(token, NOW)
    assert e.value.reason == "revoked"
