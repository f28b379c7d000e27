"""Alipay certificate mode (公钥证书模式): every request carries app_cert_sn and alipay_root_cert_sn.

An application switched to certificate mode is refused by Alipay on every
call (``isv.missing-app-cert-sn``) unless both SNs come with the request. The
fake gateway computes them with its own code from the certificates it was
given, and refuses as Alipay does; the adapter computes them as Alipay's SDKs
do. A configuration that would send requests without them is refused at start.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support
from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from payments.errors import ConfigError
from payments.providers import build_providers
from payments.providers.alipay import sign as sig
from payments.providers.alipay.adapter import from_settings
from payments.providers.alipay.adapter import validate as check_alipay_settings
from payments.providers.base import ChargeRequest, Failed, NotFound, Pending
from sandbox.fakes import alipay as fake_platform
from sandbox.fakes.alipay import FakeAlipay, serve
from tests.alipay_support import APP_ID, FakeServer, _name, certs, fake_alipay, issue, keys, provider_for  # noqa: F401
from tests.support import make_settings


def cert_settings(keys, certs, gateway="http://127.0.0.1:9/gateway.do", **overrides):
    values = {
        "alipay_app_id": APP_ID,
        "alipay_app_private_key_file": keys.files["app"],
        "alipay_public_key_files": (certs.alipay_cert,),
        "alipay_app_cert_file": certs.app_cert,
        "alipay_root_cert_file": certs.root_cert,
        "alipay_gateway_url": gateway,
    }
    return make_settings(**{**values, **overrides})


@pytest.fixture
def cert_fake(keys, certs):
    """The fake gateway with the application in certificate mode."""
    fake = FakeAlipay(
        APP_ID,
        [keys.app.public_key()],
        keys.alipay,
        retry_delays=(0.2,),
        app_cert_pem=Path(certs.app_cert).read_bytes(),
        root_cert_pem=Path(certs.root_cert).read_bytes(),
        platform_cert_pem=Path(certs.alipay_cert).read_bytes(),
    )
    server, thread = serve(fake)
    yield FakeServer(fake, f"http://127.0.0.1:{server.server_port}")
    server.shutdown()
    thread.join(5)
    fake.close()


def test_a_certificate_sn_is_the_one_alipay_publishes_for_that_issuer_and_serial(keys):
    # An Alipay-issued app certificate with this issuer and serial has SN 4498aaa8… (the value SDK test suites
    # check against Alipay's own file): md5 of the RFC 2253 issuer and the decimal serial.
    issuer = _name("Ant Financial Certification Authority Class 2 R1")
    pem = issue(
        _name("app"), keys.app.public_key(), issuer, keys.stranger, serial=42665286089147897176658588328833420416
    )
    assert sig.cert_sn(x509.load_pem_x509_certificate(pem)) == "4498aaa8ab0c8986c15c41b36186db7d"


def test_the_root_sn_joins_the_rsa_signed_roots_in_file_order_and_leaves_the_others_out(certs):
    chain = sig.read_certificates("ALIPAY_ROOT_CERT_FILE", certs.root_cert)
    assert len(chain) == 3
    rsa_r1, _ecdsa_e1, rsa_itrus = chain
    assert sig.root_cert_sn(chain) == f"{sig.cert_sn(rsa_r1)}_{sig.cert_sn(rsa_itrus)}"
    # The fake's own reading of the same file agrees.
    assert sig.root_cert_sn(chain) == fake_platform.root_chain_sn(Path(certs.root_cert).read_bytes())


def test_in_certificate_mode_every_request_carries_both_sns_and_alipay_takes_it(keys, certs, cert_fake):
    adapter = from_settings(cert_settings(keys, certs, cert_fake.gateway))
    payment = ChargeRequest("pay_cert_mode_1", 1000, "CNY")
    charged = adapter.charge(payment, None, 5)
    assert isinstance(charged, Pending) and charged.qr_code, charged
    assert isinstance(adapter.query(payment.payment_id, 5, payment), NotFound)  # not scanned yet: as in key mode
    sent = cert_fake.fake.requests
    assert len(sent) == 2 and all(r["verified"] for r in sent)
    for request in sent:
        assert request["params"]["app_cert_sn"] == cert_fake.fake.app_cert_sn
        assert request["params"]["alipay_root_cert_sn"] == cert_fake.fake.root_cert_sn
    assert '"alipay_cert_sn"' in charged.evidence.response  # answers name the signing cert; they still verify


def test_a_request_without_the_sns_is_refused_by_a_certificate_mode_app_as_alipay_does(keys, certs, cert_fake):
    keyed = provider_for(keys, cert_fake, public_keys=[keys.alipay.public_key()])
    refused = keyed.charge(ChargeRequest("pay_cert_mode_2", 1000, "CNY"), None, 5)
    assert isinstance(refused, Failed) and refused.code == "40001:isv.missing-app-cert-sn"
    assert not refused.definitive  # our configuration, not the buyer: retried once fixed
    wrong_root = provider_for(keys, cert_fake, cert_mode=sig.CertMode(cert_fake.fake.app_cert_sn, "0" * 32))
    refused = wrong_root.charge(ChargeRequest("pay_cert_mode_2", 1000, "CNY"), None, 5)
    assert isinstance(refused, Failed) and refused.code == "40002:isv.invalid-alipay-root-cert-sn"
    assert "pay_cert_mode_2" not in cert_fake.fake.trades


def test_a_certificate_without_certificate_mode_or_half_of_it_is_refused_at_start(keys, certs):
    keyed_with_cert = cert_settings(keys, certs, alipay_app_cert_file="", alipay_root_cert_file="")
    half = cert_settings(keys, certs, alipay_root_cert_file="")
    not_our_key = cert_settings(keys, certs, alipay_app_cert_file=certs.stranger_cert)
    cases = {
        "an Alipay certificate, key mode": (keyed_with_cert, "ALIPAY_PUBLIC_KEY_FILES: .* is a certificate"),
        "only the app certificate": (half, "ALIPAY_ROOT_CERT_FILE is not set"),
        "another key's certificate": (not_our_key, "ALIPAY_APP_CERT_FILE: .* is not the certificate of"),
        "no RSA root": (
            cert_settings(keys, certs, alipay_root_cert_file=keys.files["alipay.pub"]),
            "ALIPAY_ROOT_CERT_FILE: .* holds no PEM certificate",
        ),
    }
    for settings, message in cases.values():
        with pytest.raises(ConfigError, match=message):
            check_alipay_settings(settings)
        with pytest.raises(ConfigError, match=message):
            build_providers(settings)
    # Whole certificate mode starts, and so does public-key mode with Alipay's public key.
    check_alipay_settings(cert_settings(keys, certs))
    keyed = make_settings(
        alipay_app_id=APP_ID,
        alipay_app_private_key_file=keys.files["app"],
        alipay_public_key_files=(keys.files["alipay.pub"],),
    )
    check_alipay_settings(keyed)
    assert "alipay" in build_providers(keyed)


def test_alipays_certificate_is_the_leaf_of_its_bundle_whatever_the_order(keys, certs, tmp_path):
    leaf, ca = sig.read_certificates("ALIPAY_PUBLIC_KEY_FILES", certs.alipay_cert)
    reversed_bundle = tmp_path / "alipayCertPublicKey_RSA2.crt"
    reversed_bundle.write_bytes(b"".join(c.public_bytes(serialization.Encoding.PEM) for c in (ca, leaf)))
    (key,) = sig.load_public_keys("ALIPAY_PUBLIC_KEY_FILES", [str(reversed_bundle)])
    assert key.public_numbers() == keys.alipay.public_key().public_numbers()
