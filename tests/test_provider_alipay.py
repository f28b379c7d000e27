"""The Alipay adapter: notify verification to the published rules, and every openapi call against the fake gateway.

The fake gateway (``sandbox.fakes.alipay``) checks our RSA2 request signatures with its own implementation of
the rules and signs its answers with the platform key; ambiguous answers (timeouts, 20000, 10003,
ACQ.SYSTEM_ERROR, a 502, a bad answer signature) must come out Unknown or Pending, never Failed, and a query
must then find out what happened.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support
from __future__ import annotations

import io
import time
import urllib.parse
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from payments.errors import ConfigError, MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.infra.settings import load_settings
from payments.infra.sources import source_allowed
from payments.providers import build_providers
from payments.providers.alipay import sign as sig
from payments.providers.alipay.adapter import NOTIFY_RETRY_WINDOW_SECONDS, parse_form, read_notify
from payments.providers.alipay.adapter import validate as check_alipay_settings
from payments.providers.alipay.bill import read_settlement, refund_reference
from payments.providers.base import (
    AMOUNT_MISMATCH,
    Capabilities,
    ChargeRequest,
    Dedupe,
    Failed,
    Mismatch,
    NotFound,
    Pending,
    RefundRequest,
    Succeeded,
    Unknown,
)
from payments.providers.settlement import CHARGE, INFO, REFUND
from payments.states import PaymentStatus
from sandbox.fakes.alipay import rsa2_sign, sign_string
from tests.alipay_support import (  # noqa: F401
    APP_ID,
    fake_alipay,
    keys,
    notify_fields,
    provider_for,
    signed_notify,
)
from tests.support import make_settings

# --------------------------------------------------------------------------------------------- notify


def test_a_valid_notify_is_read_with_yuan_as_fen_and_notify_id_as_event_id(keys):
    provider = provider_for(keys)
    fields = notify_fields("pay_abc", total_amount="12.34")
    event = provider.parse_callback(signed_notify(fields, keys.alipay), {}, now=time.time())
    assert event.event_id == fields["notify_id"]
    assert event.report == PaymentStatus.SUCCEEDED and event.target == "payment"
    assert (event.merchant_reference, event.provider_reference) == ("pay_abc", fields["trade_no"])
    assert (event.amount_minor, event.currency) == (1234, "CNY")


def test_each_refusal_is_its_documented_error(keys):
    provider = provider_for(keys)
    now = time.time()
    good = notify_fields("pay_abc")
    tampered = signed_notify(good, keys.alipay).replace(b"total_amount=10.00", b"total_amount=1.00")
    cases = {
        "wrong key": (signed_notify(good, keys.stranger), SignatureInvalid),
        "tampered field": (tampered, SignatureInvalid),
        "missing sign": (urllib.parse.urlencode(good).encode(), SignatureInvalid),
        "stale notify_time": (
            signed_notify(notify_fields("pay_abc", notify_time=sig.format_beijing(now - 26 * 3600)), keys.alipay),
            TimestampOutOfTolerance,
        ),
        "notify_time from the future": (
            signed_notify(notify_fields("pay_abc", notify_time=sig.format_beijing(now + 600)), keys.alipay),
            TimestampOutOfTolerance,
        ),
        "foreign app_id": (
            signed_notify(notify_fields("pay_abc", app_id="2021999999999999"), keys.alipay),
            SignatureInvalid,
        ),
        "malformed body": (b"%E4%B8&&=total_amount", MalformedCallback),
        "non-ascii body": ("total_amount=10.00&subject=测试".encode(), MalformedCallback),
        "repeated key": (signed_notify(good, keys.alipay) + b"&total_amount=99.00", MalformedCallback),
        "empty body": (b"", MalformedCallback),
        "unknown trade_status": (
            signed_notify(notify_fields("pay_abc", trade_status="EXPLODED"), keys.alipay),
            MalformedCallback,
        ),
        "unreadable amount": (
            signed_notify(notify_fields("pay_abc", total_amount="1e3"), keys.alipay),
            MalformedCallback,
        ),
    }
    for name, (body, error) in cases.items():
        with pytest.raises(error):
            provider.parse_callback(body, {}, now=now)
        assert provider.reject(error("x")).body == "fail", name
    assert provider.ack().body == "success"


def test_a_retry_within_alipays_25_hour_window_still_verifies(keys):
    provider = provider_for(keys)
    now = time.time()
    fields = notify_fields("pay_abc", notify_time=sig.format_beijing(now - NOTIFY_RETRY_WINDOW_SECONDS + 60))
    assert provider.parse_callback(signed_notify(fields, keys.alipay), {}, now=now).merchant_reference == "pay_abc"


def test_rsa_sha1_is_refused_even_when_it_verifies(keys):
    import base64

    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    fields = notify_fields("pay_abc", sign_type="RSA")
    content = sign_string(fields, ["sign", "sign_type"]).encode()
    sha1 = base64.b64encode(keys.alipay.sign(content, padding.PKCS1v15(), hashes.SHA1())).decode()  # noqa: S303
    body = urllib.parse.urlencode({**fields, "sign": sha1}).encode()
    with pytest.raises(SignatureInvalid, match="RSA2"):
        provider_for(keys).parse_callback(body, {}, now=time.time())


def test_empty_values_are_left_out_of_the_signed_string_as_alipays_sdk_does(keys):
    fields = notify_fields("pay_abc", body="", passback_params="")
    # Signed over a string that kept the empty values (what some third-party SDKs do): refused.
    wrong_content = "&".join(f"{k}={fields[k]}" for k in sorted(fields) if k not in ("sign", "sign_type"))
    assert "body=&" in wrong_content
    wrong = urllib.parse.urlencode({**fields, "sign": rsa2_sign(keys.alipay, wrong_content)}).encode()
    provider = provider_for(keys)
    with pytest.raises(SignatureInvalid):
        provider.parse_callback(wrong, {}, now=time.time())
    assert provider.parse_callback(signed_notify(fields, keys.alipay), {}, now=time.time())


def test_a_gbk_notify_is_verified_over_its_gbk_bytes(keys):
    fields = notify_fields("pay_abc", charset="gbk", subject="中文商品")
    event = provider_for(keys).parse_callback(signed_notify(fields, keys.alipay, charset="gbk"), {}, now=time.time())
    assert event.amount_minor == 1000


def test_key_rotation_accepts_old_and_new_alipay_keys_during_the_overlap(keys):
    both = provider_for(keys, public_keys=[keys.alipay.public_key(), keys.alipay_next.public_key()])
    only_new = provider_for(keys, public_keys=[keys.alipay_next.public_key()])
    old_body = signed_notify(notify_fields("pay_abc"), keys.alipay)
    new_body = signed_notify(notify_fields("pay_abc"), keys.alipay_next)
    assert both.parse_callback(old_body, {}, now=time.time())
    assert both.parse_callback(new_body, {}, now=time.time())
    assert only_new.parse_callback(new_body, {}, now=time.time())
    with pytest.raises(SignatureInvalid):
        only_new.parse_callback(old_body, {}, now=time.time())


def test_trade_closed_is_failed_only_when_nothing_was_paid(keys):
    provider = provider_for(keys)
    unpaid = notify_fields("pay_abc", trade_status="TRADE_CLOSED", gmt_payment=None, receipt_amount=None)
    event = provider.parse_callback(signed_notify(unpaid, keys.alipay), {}, now=time.time())
    assert (event.report, event.failure_code) == (PaymentStatus.FAILED, "TRADE_CLOSED")
    refunded = notify_fields(
        "pay_abc",
        trade_status="TRADE_CLOSED",
        refund_fee="10.00",
        gmt_refund=sig.format_beijing(time.time()),
        out_biz_no="re_1",
    )
    event = provider.parse_callback(signed_notify(refunded, keys.alipay), {}, now=time.time())
    assert event.report == PaymentStatus.SUCCEEDED and event.event_type == "TRADE_CLOSED.refund"
    finished = notify_fields("pay_abc", trade_status="TRADE_FINISHED")
    assert provider.parse_callback(signed_notify(finished, keys.alipay), {}, now=time.time()).report == "Succeeded"


def test_peek_reads_the_index_fields_of_even_a_forged_notify(keys):
    provider = provider_for(keys)
    forged = signed_notify(notify_fields("pay_forged"), keys.stranger)
    peeked = provider.peek_callback(forged)
    assert peeked["order_no"] == "pay_forged" and peeked["event_type"] == "TRADE_SUCCESS"
    assert provider.peek_callback(b"\xff\xfe") == {}


_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)


@settings(max_examples=40, deadline=None)
@given(extra=st.dictionaries(st.from_regex(r"[a-z_]{1,10}", fullmatch=True), _values, max_size=6))
def test_any_notify_signed_by_the_rules_verifies_and_any_changed_value_does_not(keys, extra):
    extra = {k: v for k, v in extra.items() if k not in notify_fields("x")}
    fields = {**notify_fields("pay_prop"), **extra}
    body = signed_notify(fields, keys.alipay)
    params, encoding = parse_form(body)
    assert params == {**fields, "sign": params["sign"]}
    options = dict(keys=[keys.alipay.public_key()], app_id=APP_ID, now=time.time(), tolerance_seconds=300)
    assert read_notify(params, encoding=encoding, **options).merchant_reference == "pay_prop"
    for key in extra:
        changed = {**params, key: params[key] + "x"}
        with pytest.raises(SignatureInvalid):
            read_notify(changed, encoding=encoding, **options)


@given(st.integers(min_value=1, max_value=10**12))
def test_yuan_and_fen_convert_exactly_both_ways(amount):
    text = sig.minor_to_yuan(amount)
    assert sig.yuan_to_minor(text) == amount and Decimal(text) * 100 == amount


@pytest.mark.parametrize("text", ["1.234", "-1.00", "1e2", " 1.00", "1,00", "NaN", "", None, 12])
def test_anything_but_a_plain_yuan_amount_is_refused(text):
    with pytest.raises(ValueError):
        sig.yuan_to_minor(text)


def test_the_response_node_is_verified_over_its_exact_text(keys):
    node = '{"code":"10000","msg":"Success","qr_code":"https:\\/\\/qr.alipay.com\\/x","out_trade_no":"p"}'
    body = f'{{"alipay_trade_precreate_response":{node},"sign":"{rsa2_sign(keys.alipay, node)}"}}'
    read = sig.read_response(body, "alipay.trade.precreate", [keys.alipay.public_key()])
    assert read.verified and read.node["qr_code"] == "https://qr.alipay.com/x"
    respaced = body.replace('"code":"10000"', '"code": "10000"')  # same JSON, other bytes: not what was signed
    assert not sig.read_response(respaced, "alipay.trade.precreate", [keys.alipay.public_key()]).verified
    with pytest.raises(ValueError):
        sig.read_response('{"other_response":{}}', "alipay.trade.precreate", [])


def test_source_check_honours_the_allow_list():
    assert source_allowed("1.2.3.4", ())
    assert source_allowed("110.75.1.2", ("110.75.0.0/16",))
    assert source_allowed("::ffff:110.75.1.2", ("110.75.0.0/16",))
    assert not source_allowed("10.0.0.1", ("110.75.0.0/16",))
    assert not source_allowed("not-an-ip", ("110.75.0.0/16",))
    assert load_settings({"ALIPAY_SOURCE_CIDRS": "110.75.0.0/16, 2001:db8::/32"}).alipay_source_cidrs == (
        "110.75.0.0/16",
        "2001:db8::/32",
    )
    with pytest.raises(ConfigError, match="ALIPAY_SOURCE_CIDRS"):
        load_settings({"ALIPAY_SOURCE_CIDRS": "110.75.0.0/33"})


def test_settings_name_the_missing_variable_and_the_unreadable_file(keys, tmp_path):
    with pytest.raises(ConfigError, match="ALIPAY_APP_PRIVATE_KEY_FILE"):
        load_settings({"ALIPAY_APP_ID": APP_ID})
    missing = tmp_path / "nope.pem"
    settings = make_settings(
        alipay_app_id=APP_ID,
        alipay_app_private_key_file=str(missing),
        alipay_public_key_files=(keys.files["alipay.pub"],),
    )
    with pytest.raises(ConfigError, match=f"ALIPAY_APP_PRIVATE_KEY_FILE: cannot read {missing}"):
        check_alipay_settings(settings)
    with pytest.raises(ConfigError, match="ALIPAY_APP_PRIVATE_KEY_FILE"):
        build_providers(settings)
    weak = tmp_path / "weak.pem"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    small = rsa.generate_private_key(65537, 1024)
    weak.write_bytes(
        small.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    bad = make_settings(
        alipay_app_id=APP_ID, alipay_app_private_key_file=keys.files["app"], alipay_public_key_files=(str(weak),)
    )
    with pytest.raises(ConfigError, match=f"ALIPAY_PUBLIC_KEY_FILES: {weak} is a 1024-bit key"):
        check_alipay_settings(bad)
    good = make_settings(
        alipay_app_id=APP_ID,
        alipay_app_private_key_file=keys.files["app"],
        alipay_public_key_files=(keys.files["alipay.pub"], keys.files["alipay_next.pub"]),
    )
    check_alipay_settings(good)
    assert "alipay" in build_providers(good) and "alipay" not in build_providers(make_settings())
    adapter = build_providers(good)["alipay"]
    # out_trade_no dedupes a re-sent precreate and finds the trade; callbacks come from the alipay platform.
    assert adapter.capabilities == Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True, payer_scans=True)
    assert adapter.platform == "alipay"
    assert load_settings({}).alipay_gateway_url == "https://openapi.alipay.com/gateway.do"


# --------------------------------------------------------------------------------------------- outbound


def charge(payment_id="pay_fake_1", amount=1234):
    return ChargeRequest(payment_id, amount, "CNY")


def verified_calls(fake_alipay, method):
    return [r for r in fake_alipay.fake.requests if r["method"] == method and r["verified"]]


def test_precreate_is_signed_pending_with_the_qr_code_and_a_second_one_makes_no_second_trade(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    first = provider.charge(charge(), None, timeout=5)
    second = provider.charge(charge(), None, timeout=5)
    assert isinstance(first, Pending) and first.qr_code.startswith("https://qr.alipay.com/")
    assert isinstance(second, Pending) and second.qr_code == first.qr_code
    assert len(verified_calls(fake_alipay, "alipay.trade.precreate")) == 2
    assert verified_calls(fake_alipay, "alipay.trade.precreate")[0]["biz"]["total_amount"] == "12.34"
    assert list(fake_alipay.fake.trades) == ["pay_fake_1"]
    # The raw signature is not kept as evidence (stripped by the adapter, and the scrubber redacts it too).
    assert '"sign":"[REDACTED]"' in first.evidence.response


def test_a_request_signed_with_a_key_alipay_does_not_know_is_refused_and_not_definitive(keys, fake_alipay):
    outcome = provider_for(keys, fake_alipay, app=keys.stranger).charge(charge(), None, timeout=5)
    assert isinstance(outcome, Failed) and not outcome.definitive and "isv.invalid-signature" in outcome.code
    assert fake_alipay.fake.trades == {}
    # The next app key (rotation on Alipay's side) is accepted.
    assert isinstance(provider_for(keys, fake_alipay, app=keys.app_next).charge(charge(), None, 5), Pending)


def test_query_is_not_found_until_the_buyer_scans_then_pending_then_succeeded(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    provider.charge(charge(), None, timeout=5)
    assert isinstance(provider.query("pay_fake_1", 5, charge()), NotFound)
    fake_alipay.control("scan", {"out_trade_no": "pay_fake_1"})
    waiting = provider.query("pay_fake_1", 5, charge())
    assert isinstance(waiting, Pending) and waiting.provider_transaction_id
    fake_alipay.control("pay", {"out_trade_no": "pay_fake_1"})
    paid = provider.query("pay_fake_1", 5, charge())
    assert isinstance(paid, Succeeded) and paid.provider_transaction_id == waiting.provider_transaction_id
    other_amount = provider.query("pay_fake_1", 5, charge(amount=999))
    assert isinstance(other_amount, Mismatch) and other_amount.reason == AMOUNT_MISMATCH
    assert other_amount.provider_transaction_id == paid.provider_transaction_id
    assert all(r["verified"] for r in fake_alipay.fake.requests)


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("system_error", Unknown),
        ("acq_system_error", Unknown),
        ("http_502", Unknown),
        ("bad_sign", Unknown),
        ("timeout_after_commit", Unknown),
        ("processing", Pending),
    ],
)
def test_ambiguous_precreate_answers_are_never_failed_and_a_query_then_tells(keys, fake_alipay, fault, expected):
    fake_alipay.control("faults", {"script": [{"fault": fault}], "hang_seconds": 1.5})
    provider = provider_for(keys, fake_alipay)
    outcome = provider.charge(charge(), None, timeout=0.5)
    assert type(outcome) is expected, outcome
    assert verified_calls(fake_alipay, "alipay.trade.precreate"), "the fake checked our signature"
    made = "pay_fake_1" in fake_alipay.fake.trades
    assert made == (fault in ("timeout_after_commit", "bad_sign"))
    if made:
        fake_alipay.control("pay", {"out_trade_no": "pay_fake_1"})
        assert isinstance(provider.query("pay_fake_1", 5, charge()), Succeeded)
    else:  # nothing made: the query says so, and re-sending the same number is safe
        assert isinstance(provider.query("pay_fake_1", 5, charge()), NotFound)
        assert isinstance(provider.charge(charge(), None, timeout=5), Pending)


def test_a_query_that_times_out_or_meets_20000_is_unknown(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    fake_alipay.control("faults", {"script": [{"fault": "hang"}, {"fault": "system_error"}], "hang_seconds": 1.5})
    assert isinstance(provider.query("pay_x", 0.5), Unknown)
    outcome = provider.query("pay_x", 5)
    assert isinstance(outcome, Unknown) and outcome.reason.startswith("20000")


def test_business_refusals_are_definitive_failures(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    provider.charge(charge(), None, 5)
    fake_alipay.control("pay", {"out_trade_no": "pay_fake_1"})
    paid_again = provider.charge(charge(), None, 5)  # ACQ.TRADE_HAS_SUCCESS: the query will confirm, not a decline
    assert isinstance(paid_again, Unknown) and paid_again.reason == "trade_has_success"
    changed = provider.charge(charge(amount=1), None, 5)
    assert isinstance(changed, Unknown)  # ACQ.TRADE_HAS_SUCCESS comes first for a paid trade
    provider.charge(charge("pay_fake_2"), None, 5)
    other = provider.charge(charge("pay_fake_2", amount=1), None, 5)
    assert isinstance(other, Mismatch) and other.reason == AMOUNT_MISMATCH  # ACQ.CONTEXT_INCONSISTENT
    assert isinstance(provider.close("pay_fake_2", 5), NotFound)  # never scanned
    closed = provider.charge(charge("pay_fake_2"), None, 5)
    assert isinstance(closed, Failed) and closed.definitive and closed.code == "ACQ.TRADE_HAS_CLOSE"
    assert closed.refusal, "Alipay refuses the request: on a re-send that says nothing about the first order"
    assert isinstance(provider.charge(ChargeRequest("pay_usd", 100, "USD"), None, 5), Failed)


def refund(amount=500, refund_id="re_fake_1"):
    return RefundRequest(refund_id, "pay_fake_1", "", amount, "CNY")


def paid_trade(provider, fake_alipay):
    provider.charge(charge(amount=1000), None, 5)
    fake_alipay.control("pay", {"out_trade_no": "pay_fake_1"})


def test_refund_succeeds_once_per_out_request_no_and_the_refund_query_confirms(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    paid_trade(provider, fake_alipay)
    assert isinstance(provider.query_refund(refund().refund_id, 5, refund()), NotFound)
    first = provider.refund(refund(), None, 5)
    assert isinstance(first, Succeeded) and first.provider_transaction_id.endswith(":re_fake_1")
    again = provider.refund(refund(), None, 5)  # same out_request_no: no money moves twice
    assert isinstance(again, Unknown) and again.reason == "fund_change_not_y"
    assert fake_alipay.control("trades/pay_fake_1")["refunds"] == {"re_fake_1": "5.00"}
    confirmed = provider.query_refund(refund().refund_id, 5, refund())
    assert isinstance(confirmed, Succeeded) and confirmed.provider_transaction_id == first.provider_transaction_id
    assert isinstance(provider.query_refund(refund(amount=400).refund_id, 5, refund(amount=400)), Mismatch)
    too_much = provider.refund(refund(amount=600, refund_id="re_fake_2"), None, 5)
    assert isinstance(too_much, Failed) and too_much.definitive and too_much.refusal
    assert len(verified_calls(fake_alipay, "alipay.trade.refund")) == 3


def test_a_refund_whose_answer_is_lost_is_unknown_and_the_refund_query_finds_it(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    paid_trade(provider, fake_alipay)
    fake_alipay.control("faults", {"script": [{"fault": "timeout_after_commit"}], "hang_seconds": 1.5})
    assert isinstance(provider.refund(refund(), None, 0.5), Unknown)
    assert isinstance(provider.query_refund(refund().refund_id, 5, refund()), Succeeded)
    fake_alipay.control("faults", {"script": [{"fault": "system_error", "method": "alipay.trade.refund"}]})
    lost = provider.refund(refund(300, "re_fake_3"), None, 5)
    assert isinstance(lost, Unknown) and lost.reason.startswith("20000")
    third = refund(300, "re_fake_3")
    assert isinstance(provider.query_refund(third.refund_id, 5, third), NotFound)  # re-send the same number
    assert isinstance(provider.refund(refund(300, "re_fake_3"), None, 5), Succeeded)


def test_close_closes_a_waiting_trade_and_refuses_a_paid_one(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    provider.charge(charge(), None, 5)
    fake_alipay.control("scan", {"out_trade_no": "pay_fake_1"})
    closed = provider.close("pay_fake_1", 5)
    assert isinstance(closed, Failed) and closed.definitive and closed.code == "TRADE_CLOSED"
    assert isinstance(provider.query("pay_fake_1", 5, charge()), Failed)
    provider.charge(charge("pay_fake_2"), None, 5)
    fake_alipay.control("pay", {"out_trade_no": "pay_fake_2"})
    refused = provider.close("pay_fake_2", 5)
    assert isinstance(refused, Unknown) and "TRADE_STATUS_ERROR" in refused.reason
    fake_alipay.control("faults", {"script": [{"fault": "system_error"}]})
    assert isinstance(provider.close("pay_fake_2", 5), Unknown)


def test_the_bill_downloads_through_the_bill_api_and_parses(keys, fake_alipay):
    provider = provider_for(keys, fake_alipay)
    paid_trade(provider, fake_alipay)
    provider.refund(refund(), None, 5)
    day = time.strftime("%Y-%m-%d", time.gmtime(time.time() + 8 * 3600))
    lines = list(provider.settlement_lines(day, 5))
    assert [(line.kind, line.merchant_reference, line.amount_minor) for line in lines] == [
        ("charge", "pay_fake_1", 1000),
        ("refund", "pay_fake_1", 500),
    ]
    assert lines[1].refund_reference == "re_fake_1" and lines[0].fee_minor == 6 and lines[1].fee_minor == -3
    settled = list(read_settlement(io.BytesIO(b"".join(provider.settlement(day, 5)))))
    assert [(x.kind, x.merchant_reference, x.amount_minor, x.fee_minor) for x in settled if x.kind != INFO] == [
        (CHARGE, "pay_fake_1", 1000, 6),
        (REFUND, "re_fake_1", 500, -3),
    ]
    refunded = next(x for x in settled if x.kind == REFUND)
    assert refunded.provider_reference == refund_reference(lines[1].provider_transaction_id, "re_fake_1")
    assert verified_calls(fake_alipay, "alipay.data.dataservice.bill.downloadurl.query")


def test_the_fake_runs_as_its_own_process_and_stops_on_sigterm(keys):
    import subprocess
    import sys

    from tests.support import ROOT, env_for

    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox.fakes.alipay", "--port", "0", "--app-id", APP_ID],
        cwd=ROOT,
        env=env_for(
            {
                "PAYSYNC_ENV": "development",
                "FAKE_ALIPAY_APP_PUBLIC_KEYS": keys.files["app.pub"],
                "FAKE_ALIPAY_PRIVATE_KEY": keys.files["alipay"],
                "FAKE_ALIPAY_FAULTS": '{"script": [{"fault": "system_error"}]}',
            }
        ),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        banner = process.stdout.readline()
        url = banner.split(" on ")[1].strip()
        provider = provider_for(keys, gateway=url)
        assert isinstance(provider.charge(charge(), None, 5), Unknown)  # the scripted 20000
        assert isinstance(provider.charge(charge(), None, 5), Pending)
    finally:
        process.terminate()
        assert process.wait(10) == 0
