"""Two independent implementations of the Sandbox-Signature scheme, checked against each other.

The platform signs (``sandbox.signing``); paysync's adapter verifies with its
own code (``payments.providers.sandbox.adapter.verify_signature``), as it would for a
real provider. A bug in either shows up as a disagreement here: whatever
header and body arrive, both must accept the same ones and refuse the same
ones for the same reason.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from payments.errors import SignatureInvalid, TimestampOutOfTolerance
from payments.infra.settings import load_settings
from payments.providers.sandbox import adapter
from sandbox import config, signing

secrets_ = st.text(min_size=1, max_size=40)
bodies = st.binary(max_size=300)
timestamps = st.integers(min_value=0, max_value=10**11)


def platform_verdict(secret: str, body: bytes, header: str | None, now: float) -> str:
    try:
        signing.verify(secret, body, header, now=now)
    except signing.TimestampError:
        return "stale"
    except signing.SignatureError:
        return "invalid"
    return "ok"


def adapter_verdict(secret: str, body: bytes, header: str | None, now: float) -> str:
    try:
        adapter.verify_signature([secret], body, header, now)
    except TimestampOutOfTolerance:
        return "stale"
    except SignatureInvalid:
        return "invalid"
    return "ok"


def test_both_sides_name_the_same_header_and_tolerance():
    assert adapter.SIGNATURE_HEADER == signing.HEADER
    assert adapter.DEFAULT_TOLERANCE_SECONDS == signing.DEFAULT_TOLERANCE_SECONDS


def test_paysyncs_development_defaults_match_the_platforms():
    # `make run` sets neither variable: both sides must fall back to the same values.
    settings = load_settings({"PAYSYNC_ENV": "development"})
    assert settings.sandbox_webhook_secret == (config.DEV_WEBHOOK_SECRET,)
    assert settings.sandbox_api_key == (config.DEV_API_KEY,)


@given(secret=secrets_, body=bodies, t=timestamps, skew=st.integers(min_value=-299, max_value=299))
def test_what_the_platform_signs_the_adapter_accepts(secret, body, t, skew):
    header = signing.sign(secret, body, t)
    assert adapter.verify_signature([secret], body, header, now=t + skew) == t


@given(secret=secrets_, other=secrets_, body=bodies, t=timestamps)
def test_a_wrong_secret_or_a_changed_body_is_refused_by_both(secret, other, body, t):
    header = signing.sign(secret, body, t)
    if other != secret:
        assert platform_verdict(other, body, header, t) == adapter_verdict(other, body, header, t) == "invalid"
    changed = body + b" "
    assert platform_verdict(secret, changed, header, t) == adapter_verdict(secret, changed, header, t) == "invalid"


@given(secret=secrets_, body=bodies, t=timestamps, skew=st.integers(min_value=301, max_value=10**6))
def test_a_stale_timestamp_is_refused_by_both_only_after_the_signature_matched(secret, body, t, skew):
    header = signing.sign(secret, body, t)
    for now in (t + skew, t - skew):
        assert platform_verdict(secret, body, header, now) == adapter_verdict(secret, body, header, now) == "stale"
    forged = header.replace("v1=", "v1=0")
    assert adapter_verdict(secret, body, forged, t + skew) == "invalid", "a forgery must not learn about the clock"


# Headers built from the scheme's own parts, broken in every way a sender (or an attacker) might.
_part = st.one_of(
    st.builds(lambda t: f"t={t}", st.one_of(timestamps, st.text(max_size=14))),
    st.builds(lambda v: f"v1={v}", st.text(alphabet="0123456789abcdef", max_size=64)),
    st.builds(lambda v: f"v1={v}", st.text(max_size=8)),
    st.text(max_size=10),
    st.just("t=²"),
    st.just("v0=abc"),
)
_headers = st.one_of(st.none(), st.just(""), st.lists(_part, max_size=5).map(",".join), st.text(max_size=40))


@settings(max_examples=400)
@given(secret=secrets_, body=bodies, header=_headers, now=timestamps)
@example(secret="k", body=b"{}", header="t=1,v1=", now=1)
@example(secret="k", body=b"{}", header="t= 1,v1=x", now=1)
@example(secret="k", body=b"{}", header="t=0001,v1=x", now=1)
@example(secret="k", body=b"{}", header="t=1,v1=é", now=1)
def test_for_any_header_both_implementations_reach_the_same_verdict(secret, body, header, now):
    assert platform_verdict(secret, body, header, now) == adapter_verdict(secret, body, header, now)


@given(body=bodies, t=timestamps)
def test_a_real_signature_hidden_among_others_is_found_by_both(body, t):
    good = signing.compute("whsec_k", body, t)
    header = f"t={t},v1={'0' * 64},v1={good},v1=zz"
    assert platform_verdict("whsec_k", body, header, t) == adapter_verdict("whsec_k", body, header, t) == "ok"


def test_the_adapter_accepts_any_of_its_listed_secrets():
    body = b'{"id": "evt_1"}'
    header = signing.sign("whsec_old", body, 1000)
    assert adapter.verify_signature(["whsec_new", "whsec_old"], body, header, now=1000) == 1000
    with pytest.raises(SignatureInvalid):
        adapter.verify_signature(["whsec_new"], body, header, now=1000)
