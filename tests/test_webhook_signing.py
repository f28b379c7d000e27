"""Standard Webhooks signing and verification, and the settings that carry the merchant's secret."""

from __future__ import annotations

import base64
import os

import pytest

from payments.errors import ConfigError, SignatureInvalid, TimestampOutOfTolerance
from payments.infra import webhook_signing as ws
from payments.infra.settings import load_settings

# The reference test vector of the Standard Webhooks libraries
# (standard-webhooks/standard-webhooks, libraries/python/tests/test_webhooks.py::test_sign_function).
SPEC_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SPEC_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SPEC_TIMESTAMP = 1614265330
SPEC_BODY = b'{"test": 2432232314}'
SPEC_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()


def test_signing_matches_the_standard_webhooks_test_vector():
    assert ws.sign(SPEC_SECRET, SPEC_ID, SPEC_TIMESTAMP, SPEC_BODY) == SPEC_SIGNATURE


def test_the_test_vector_verifies_at_its_own_time():
    received = {"webhook-id": SPEC_ID, "webhook-timestamp": str(SPEC_TIMESTAMP), "webhook-signature": SPEC_SIGNATURE}
    assert ws.verify(SPEC_SECRET, SPEC_BODY, received, now=SPEC_TIMESTAMP + 10) == SPEC_ID


def test_headers_carry_id_timestamp_and_a_v1_signature_that_verifies():
    body = b'{"id":"evt_1","type":"PaymentSucceeded"}'
    sent = ws.headers(SECRET, "evt_1", body, timestamp=1_700_000_000)
    assert sent["webhook-id"] == "evt_1"
    assert sent["webhook-timestamp"] == "1700000000"
    assert sent["webhook-signature"].startswith("v1,")
    # Header names are case-insensitive on the wire.
    received = {k.title(): v for k, v in sent.items()}
    assert ws.verify(SECRET, body, received, now=1_700_000_030) == "evt_1"


def test_a_changed_body_id_or_timestamp_fails_verification():
    body = b'{"amount":1000}'
    sent = ws.headers(SECRET, "evt_1", body, timestamp=1_700_000_000)
    with pytest.raises(SignatureInvalid):
        ws.verify(SECRET, b'{"amount":1001}', sent, now=1_700_000_000)
    with pytest.raises(SignatureInvalid):
        ws.verify(SECRET, body, {**sent, "webhook-id": "evt_2"}, now=1_700_000_000)
    with pytest.raises(SignatureInvalid):
        ws.verify(SECRET, body, {**sent, "webhook-timestamp": "1700000001"}, now=1_700_000_000)


def test_the_wrong_secret_fails_verification():
    sent = ws.headers(SECRET, "evt_1", b"{}", timestamp=1_700_000_000)
    with pytest.raises(SignatureInvalid):
        ws.verify(OTHER_SECRET, b"{}", sent, now=1_700_000_000)


def test_timestamps_outside_the_tolerance_are_refused_both_ways():
    sent = ws.headers(SECRET, "evt_1", b"{}", timestamp=1_700_000_000)
    assert ws.verify(SECRET, b"{}", sent, now=1_700_000_300, tolerance_seconds=300) == "evt_1"
    with pytest.raises(TimestampOutOfTolerance):
        ws.verify(SECRET, b"{}", sent, now=1_700_000_301, tolerance_seconds=300)
    with pytest.raises(TimestampOutOfTolerance):
        ws.verify(SECRET, b"{}", sent, now=1_699_999_699, tolerance_seconds=300)


def test_one_matching_signature_among_several_is_enough_for_secret_rotation():
    body = b"{}"
    new = ws.sign(SECRET, "evt_1", 1_700_000_000, body)
    old = ws.sign(OTHER_SECRET, "evt_1", 1_700_000_000, body)
    received = {
        "webhook-id": "evt_1",
        "webhook-timestamp": "1700000000",
        "webhook-signature": f"v1a,bm90LWVkMjU1MTk= {old} v1,!!notbase64 {new}",
    }
    assert ws.verify(SECRET, body, received, now=1_700_000_000) == "evt_1"
    # A receiver mid-rotation may also hold both secrets and accept either.
    only_old = {**received, "webhook-signature": old}
    assert ws.verify([SECRET, OTHER_SECRET], body, only_old, now=1_700_000_000) == "evt_1"


@pytest.mark.parametrize(
    "broken",
    [
        {"webhook-id": ""},
        {"webhook-timestamp": ""},
        {"webhook-signature": ""},
        {"webhook-timestamp": "1700000000.5"},
        {"webhook-timestamp": "soon"},
        {"webhook-signature": "v2," + "A" * 44},
    ],
)
def test_missing_or_malformed_headers_are_refused(broken):
    sent = ws.headers(SECRET, "evt_1", b"{}", timestamp=1_700_000_000)
    with pytest.raises(SignatureInvalid):
        ws.verify(SECRET, b"{}", {**sent, **broken}, now=1_700_000_000)


def test_an_id_with_a_dot_cannot_be_signed():
    with pytest.raises(ValueError):
        ws.sign(SECRET, "evt.1", 1, b"{}")


@pytest.mark.parametrize(
    "secret",
    ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_" + base64.b64encode(b"short").decode()],
)
def test_settings_refuse_a_webhook_secret_that_is_not_whsec_base64_of_enough_bytes(secret):
    with pytest.raises(ConfigError, match="MERCHANT_WEBHOOK_SECRET") as caught:
        load_settings({"MERCHANT_WEBHOOK_SECRET": secret})
    assert secret.removeprefix("whsec_") not in str(caught.value)  # the message never echoes the secret


def test_settings_need_a_secret_when_the_webhook_url_is_set():
    with pytest.raises(ConfigError, match="MERCHANT_WEBHOOK_SECRET"):
        load_settings({"MERCHANT_WEBHOOK_URL": "https://orders.example.com/hooks"})
    with pytest.raises(ConfigError, match="MERCHANT_WEBHOOK_URL"):
        load_settings({"MERCHANT_WEBHOOK_URL": "ftp://orders.example.com", "MERCHANT_WEBHOOK_SECRET": SECRET})
    settings = load_settings(
        {"MERCHANT_WEBHOOK_URL": "https://orders.example.com/hooks", "MERCHANT_WEBHOOK_SECRET": SPEC_SECRET}
    )
    assert settings.merchant_webhook_secret == (SPEC_SECRET,)
    assert settings.events_exchange == "paysync.events"


def test_settings_default_to_no_webhook():
    settings = load_settings({})
    assert settings.merchant_webhook_url == "" and settings.merchant_webhook_secret == ()
