"""WeChat Pay platform keys: Wechatpay-Serial on every request, and rotated certificates learned from /v3/certificates.

The fake platform refuses a request that does not name one of its platform
keys in ``Wechatpay-Serial`` (as the official SDKs always send it), and serves
its certificates at ``/v3/certificates`` sealed under the APIv3 key. When
WeChat starts signing with a certificate paysync was never told about, a
notification or an answer under that serial is verified after one download,
not refused; a serial nobody lists is still refused, and costs WeChat at
most one download a minute. Public-key mode (``PUB_KEY_ID_…``) never downloads.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.wechatpay_support

from __future__ import annotations

import secrets
from datetime import datetime

import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from gateway import create_app
from payments.errors import SignatureInvalid
from payments.inbound.callbacks import CallbackResult, process_callback
from payments.providers import build_providers
from payments.providers.base import ChargeRequest, Pending, Unknown
from payments.providers.wechatpay import adapter as wechatpay
from payments.providers.wechatpay.adapter import WechatPayProvider
from payments.states import CallbackStatus, PaymentStatus
from sandbox.fakes import wechatpay as fake
from tests.stack import callback_rows, db_url, payment_status
from tests.support import create_payment
from tests.test_wechatpay_callbacks import POLICY
from tests.wechatpay_support import (  # noqa: F401
    FakeServer,
    PlatformKeyFiles,
    fake_config,
    notification,
    transaction,
    wx_keys,
    wx_settings,
)

CREATED = datetime(2024, 5, 1, 2, 0, 0)


@pytest.fixture(scope="module")
def rotated(tmp_path_factory) -> PlatformKeyFiles:  # noqa: ANN001
    """WeChat's next platform certificate: a key and a serial paysync's configuration does not name."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    serial = secrets.randbits(150) | (1 << 149)
    path = tmp_path_factory.mktemp("rotated") / "next_platform.pem"
    path.write_bytes(fake.certificate(key, serial, "Tenpay.com Root CA"))
    return PlatformKeyFiles(f"{serial:X}", key, path)


def platform_and_adapter(keys, signing, configured, **config):  # noqa: ANN001, ANN003, ANN201
    platform = fake.FakeWechatPay(fake_config(keys, signing=signing, **config))
    server = FakeServer(platform)
    adapter = WechatPayProvider.from_settings(wx_settings(keys, api_base=server.url, platform=configured))
    return platform, server, adapter


def certificate_downloads(platform: fake.FakeWechatPay) -> int:
    return sum(1 for entry in platform.auth_log if entry["path"].startswith("/v3/certificates"))


def order(payment_id: str = "pay_01HWXYZCERTIFICATES0001") -> ChargeRequest:
    return ChargeRequest(payment_id, 1000, "CNY", description="证书", created_at=CREATED)


def test_every_request_names_the_platform_key_we_hold_in_wechatpay_serial(wx_keys):
    platform, server, adapter = platform_and_adapter(
        wx_keys, (wx_keys.cert_key, wx_keys.pub_key), (wx_keys.cert_key, wx_keys.pub_key)
    )
    with server:
        assert isinstance(adapter.charge(order(), None, 5), Pending)
        adapter.query(order().payment_id, 5, order())
    assert [e["serial"] for e in platform.auth_log] == [wx_keys.cert_key.key_id] * 2
    assert all(e["ok"] for e in platform.auth_log)


def test_public_key_mode_names_its_pub_key_id_and_keeps_working(wx_keys):
    platform, server, adapter = platform_and_adapter(wx_keys, (wx_keys.pub_key,), (wx_keys.pub_key,))
    with server:
        charged = adapter.charge(order(), None, 5)
        assert isinstance(charged, Pending) and charged.qr_code
        body, headers = notification(wx_keys, transaction(order().payment_id), signer=wx_keys.pub_key)
        event = adapter.parse_callback(body, headers, now=adapter.clock())
        assert event.report == PaymentStatus.SUCCEEDED
        # An unknown public key id is refused at once: WeChat serves no public keys to download.
        body, headers = notification(wx_keys, transaction(order().payment_id), signer=wx_keys.stranger)
        with pytest.raises(SignatureInvalid) as refused:
            adapter.parse_callback(body, headers, now=adapter.clock())
        assert refused.value.code == "unknown_serial"
    assert [e["serial"] for e in platform.auth_log] == [wx_keys.pub_key.key_id]
    assert certificate_downloads(platform) == 0


def test_a_notification_under_a_rotated_certificate_is_verified_after_one_download(wx_keys, rotated):
    platform, server, adapter = platform_and_adapter(
        wx_keys, (wx_keys.cert_key, rotated), (wx_keys.cert_key, wx_keys.pub_key)
    )
    with server:
        for _ in range(2):
            body, headers = notification(wx_keys, transaction("pay_01HWXYZROTATED000001"), signer=rotated)
            event = adapter.parse_callback(body, headers, now=adapter.clock())
            assert event.merchant_reference == "pay_01HWXYZROTATED000001"
        assert certificate_downloads(platform) == 1  # learned once, kept
        assert adapter.platform_keys.get(rotated.key_id) is not None


def test_an_answer_signed_under_a_rotated_certificate_is_trusted_after_the_download(wx_keys, rotated):
    platform, server, adapter = platform_and_adapter(
        wx_keys, (wx_keys.cert_key, rotated), (wx_keys.cert_key, wx_keys.pub_key)
    )
    platform.active_key = rotated.key_id  # WeChat switched its signing certificate
    with server:
        charged = adapter.charge(order(), None, 5)
        assert isinstance(charged, Pending) and charged.qr_code, charged
        again = adapter.query(order().payment_id, 5, order())
        assert isinstance(again, Pending), again
    assert certificate_downloads(platform) == 1


def test_a_serial_no_one_lists_is_refused_and_looked_up_at_most_once_a_minute(wx_keys, rotated):
    # The platform does not hold ``rotated``: a notification under it is a forgery as far as anyone can tell.
    platform, server, adapter = platform_and_adapter(
        wx_keys, (wx_keys.cert_key, wx_keys.pub_key), (wx_keys.cert_key, wx_keys.pub_key)
    )
    start = adapter.clock()
    adapter.clock = lambda: start
    with server:

        def forged():  # noqa: ANN202
            body, headers = notification(wx_keys, transaction("pay_01HWXYZFORGED0000001"), signer=rotated)
            with pytest.raises(SignatureInvalid) as refused:
                adapter.parse_callback(body, headers, now=adapter.clock())
            assert refused.value.code == "unknown_serial"

        for _ in range(3):
            forged()
        assert certificate_downloads(platform) == 1
        later = start + wechatpay.CERTIFICATE_FETCH_INTERVAL_SECONDS + 1
        adapter.clock = lambda: later
        forged()
        assert certificate_downloads(platform) == 2
    assert adapter.platform_keys.get(rotated.key_id) is None


def test_certificates_that_do_not_decrypt_with_our_apiv3_key_are_not_trusted(wx_keys, rotated):
    # Someone answering for WeChat without our APIv3 key cannot make us trust their certificate.
    platform, server, adapter = platform_and_adapter(
        wx_keys,
        (wx_keys.cert_key, rotated),
        (wx_keys.cert_key, wx_keys.pub_key),
        apiv3_key=secrets.token_hex(16).encode(),
    )
    platform.active_key = rotated.key_id
    with server:
        body, headers = notification(wx_keys, transaction("pay_01HWXYZSEALED0000001"), signer=rotated)
        with pytest.raises(SignatureInvalid):
            adapter.parse_callback(body, headers, now=adapter.clock())
        outcome = adapter.charge(order("pay_01HWXYZSEALED0000001"), None, 5)  # its 200 signed under that serial
    assert isinstance(outcome, Unknown) and outcome.reason == "response_unknown_serial"
    assert certificate_downloads(platform) == 1
    assert adapter.platform_keys.get(rotated.key_id) is None


def test_the_gateway_accepts_a_rotated_certificates_notification_and_processing_applies_it(engine, wx_keys, rotated):
    # Stored, verified after the download, acknowledged 204; processing (another adapter: another process) verifies
    # it again the same way, and the payment moves once.
    platform = fake.FakeWechatPay(fake_config(wx_keys, signing=(wx_keys.cert_key, rotated)))
    with FakeServer(platform) as server:
        settings = wx_settings(wx_keys, api_base=server.url, database_url=db_url(engine), callback_process_inline=False)
        client = create_app(settings, engine=engine).test_client()
        payment_id = create_payment(engine, payment_id="pay_01HWXYZGATEWAYROTATED01", provider="wechatpay")
        body, headers = notification(wx_keys, transaction(payment_id), signer=rotated)
        answer = client.post("/callbacks/wechatpay", data=body, headers=headers)
        assert answer.status_code == 204, answer.get_data()
        (row,) = callback_rows(engine)
        assert row.status == CallbackStatus.PENDING
        assert process_callback(engine, build_providers(settings), row.id, POLICY) == CallbackResult.APPLIED
        assert payment_status(engine, payment_id) == "Succeeded"
    assert certificate_downloads(platform) == 2  # the gateway's adapter and the processing one, once each
