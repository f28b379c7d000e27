"""Stripe-Signature verification (pure): the documented scheme, both tolerance sides, rotation, hostile headers.

The reference signer is the fake platform's (``sandbox.fakes.stripe``), an
implementation independent of ``payments.providers.stripe.sign``.
"""

from __future__ import annotations

import hashlib
import hmac
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.providers.stripe import sign as stripe_sign
from sandbox.fakes.stripe import signature_header
from tests.stripe_support import NEW_SECRET, OLD_SECRET, STRANGER_SECRET

BODY = b'{\n  "id": "evt_1",\n  "object": "event"\n}'
NOW = 1_714_557_600


def test_a_signature_made_the_documented_way_verifies():
    # https://docs.stripe.com/webhooks#verify-manually: HMAC-SHA256, key = the endpoint secret, message = "t.body".
    expected = hmac.new(OLD_SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert stripe_sign.verify([OLD_SECRET], BODY, f"t={NOW},v1={expected}", now=NOW) == NOW


def test_the_whole_whsec_string_is_the_key_not_its_tail_nor_a_decoding_of_it():
    tail = OLD_SECRET.removeprefix("whsec_")
    wrong = hmac.new(tail.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    with pytest.raises(stripe_sign.SignatureError):
        stripe_sign.verify([OLD_SECRET], BODY, f"t={NOW},v1={wrong}", now=NOW)


def test_the_fake_platforms_signer_and_ours_agree():
    header = signature_header([OLD_SECRET], BODY, NOW)
    assert header == stripe_sign.sign([OLD_SECRET], BODY, NOW)
    assert stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW) == NOW


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, "missing"),
        ("", "missing"),
        ("v1=" + "0" * 64, "exactly one numeric t="),
        (f"t={NOW}", "no v1"),
        (f"t={NOW},v0=" + "0" * 64, "no v1"),
        (f"t=abc,v1={'0' * 64}", "exactly one numeric t="),
        (f"t={NOW},t={NOW},v1={'0' * 64}", "exactly one numeric t="),
        (f"t={NOW},v1", "without '='"),
        ("t=1,v1=" + "ä" * 10, "not a Stripe signature header"),
        ("t=1," + ",".join(["v1=" + "0" * 64] * 9), "more than 8"),
        ("t=1,v1=" + "0" * 5000, "not a Stripe signature header"),
    ],
)
def test_missing_or_malformed_headers_are_refused_before_any_signature_is_computed(header, message):
    with pytest.raises(stripe_sign.SignatureError, match=message):
        stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW)


def test_a_wrong_key_or_a_tampered_body_is_refused():
    header = signature_header([STRANGER_SECRET], BODY, NOW)
    with pytest.raises(stripe_sign.SignatureError, match="no signature matches"):
        stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW)
    good = signature_header([OLD_SECRET], BODY, NOW)
    with pytest.raises(stripe_sign.SignatureError, match="no signature matches"):
        stripe_sign.verify([OLD_SECRET], BODY.replace(b"evt_1", b"evt_2"), good, now=NOW)


def test_a_signature_for_another_timestamp_does_not_verify_with_this_one():
    header = signature_header([OLD_SECRET], BODY, NOW)
    forged = header.replace(f"t={NOW}", f"t={NOW + 1}")
    with pytest.raises(stripe_sign.SignatureError):
        stripe_sign.verify([OLD_SECRET], BODY, forged, now=NOW)


@pytest.mark.parametrize("offset", [-301, -86400, -(10**6)])
def test_timestamps_more_than_300_s_old_are_refused(offset):
    header = signature_header([OLD_SECRET], BODY, NOW + offset)
    with pytest.raises(stripe_sign.TimestampError, match="old"):
        stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW)


@pytest.mark.parametrize("offset", [-300, 0, 300, 301, 3600, 86400])
def test_timestamps_ahead_of_our_clock_are_accepted_as_stripes_libraries_do(offset):
    # Stripe's libraries refuse only old timestamps: a host whose clock runs behind must not refuse every webhook.
    header = signature_header([OLD_SECRET], BODY, NOW + offset)
    assert stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW) == NOW + offset


def test_during_rotation_either_secret_verifies_and_a_header_with_both_signatures_too():
    both = [OLD_SECRET, NEW_SECRET]
    for signer in ([OLD_SECRET], [NEW_SECRET], [OLD_SECRET, NEW_SECRET], [STRANGER_SECRET, NEW_SECRET]):
        assert stripe_sign.verify(both, BODY, signature_header(signer, BODY, NOW), now=NOW) == NOW
    with pytest.raises(stripe_sign.SignatureError):
        stripe_sign.verify([NEW_SECRET], BODY, signature_header([OLD_SECRET], BODY, NOW), now=NOW)


def test_no_configured_secret_verifies_nothing():
    with pytest.raises(stripe_sign.SignatureError, match="no webhook secret"):
        stripe_sign.verify([], BODY, signature_header([OLD_SECRET], BODY, NOW), now=NOW)


def test_an_unsigned_header_with_a_stale_time_is_reported_as_unsigned():
    header = signature_header([STRANGER_SECRET], BODY, NOW - 10_000)
    with pytest.raises(stripe_sign.SignatureError) as info:
        stripe_sign.verify([OLD_SECRET], BODY, header, now=NOW)
    assert not isinstance(info.value, stripe_sign.TimestampError)


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=2000), offset=st.integers(-300, 300), flip=st.integers(min_value=0))
def test_any_body_signed_by_the_platform_verifies_and_any_single_changed_byte_does_not(body, offset, flip):
    header = signature_header([NEW_SECRET], body, NOW + offset)
    assert stripe_sign.verify([OLD_SECRET, NEW_SECRET], body, header, now=NOW) == NOW + offset
    if body:
        i = flip % len(body)
        changed = body[:i] + bytes([body[i] ^ 0x01]) + body[i + 1 :]
        with pytest.raises(stripe_sign.SignatureError):
            stripe_sign.verify([OLD_SECRET, NEW_SECRET], changed, header, now=NOW)


@settings(max_examples=300, deadline=None)
@given(header=st.text(max_size=300))
def test_arbitrary_header_text_is_refused_with_a_signature_error_never_anything_else(header):
    with pytest.raises(stripe_sign.SignatureError):
        stripe_sign.verify([OLD_SECRET], BODY, header, now=time.time())
