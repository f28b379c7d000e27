"""The WeChat Pay adapter's outbound calls against the fake platform over real HTTP.

Every call is checked by the fake the way WeChat checks it (Authorization
scheme, merchant number, serial, five-minute timestamp, unused nonce,
SHA256withRSA over method, path and query, timestamp, nonce and body), and
every answer the adapter trusts is signed by the fake's platform key.
Ambiguous answers (SYSTEM_ERROR, FREQUENCY_LIMITED, 5xx, timeouts before and
after the work) must be Unknown, and the query must then tell what happened,
without ever creating a second order.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.wechatpay_support

from __future__ import annotations

import io
import time
from dataclasses import replace
from datetime import datetime, timedelta

import pytest

from payments.providers.base import (
    AMOUNT_MISMATCH,
    Capabilities,
    ChargeRequest,
    Dedupe,
    Evidence,
    Failed,
    Mismatch,
    NotFound,
    Pending,
    ProviderUnavailable,
    RefundRequest,
    Succeeded,
    Unknown,
)
from payments.providers.settlement import CHARGE, INFO, SUCCEEDED
from payments.providers.settlement import REFUND as REFUND_KIND
from payments.providers.wechatpay import sign
from payments.providers.wechatpay.adapter import Reply, WechatPayProvider, error_outcome, read_reply, read_transaction
from payments.providers.wechatpay.bill import read_settlement
from sandbox.fakes import wechatpay as fake
from tests.wechatpay_support import FakeServer, fake_config, wx_keys, wx_settings  # noqa: F401

PAYMENT = "pay_01HWXYZABCDEFGHJKMNPQRSTVW"
REFUND = "re_01HWXYZABCDEFGHJKMNPQRSTV"
CREATED = datetime(2024, 5, 1, 2, 0, 0)  # naive UTC, as payment.created_at is stored


def order(payment_id: str = PAYMENT, amount: int = 1000, **kw) -> ChargeRequest:  # noqa: ANN003
    return ChargeRequest(payment_id, amount, "CNY", description="测试商品", created_at=CREATED, **kw)


@pytest.fixture
def wx(wx_keys):  # noqa: ANN001, ANN201
    """(platform, adapter) with the fake serving on a free port."""
    platform = fake.FakeWechatPay(fake_config(wx_keys))
    with FakeServer(platform) as server:
        adapter = WechatPayProvider.from_settings(wx_settings(wx_keys, api_base=server.url))
        yield platform, adapter


def all_verified(platform: fake.FakeWechatPay) -> bool:
    return bool(platform.auth_log) and all(entry["ok"] for entry in platform.auth_log)


# --------------------------------------------------------------------------------------------- orders


def test_a_native_order_is_pending_with_its_code_url_and_our_signature_was_checked(wx):
    platform, adapter = wx
    outcome = adapter.charge(order(), "ignored-key", 5)
    assert isinstance(outcome, Pending) and outcome.qr_code.startswith("weixin://wxpay/bizpayurl?pr=")
    assert outcome.provider_transaction_id is None  # WeChat assigns one when the payer pays
    assert all_verified(platform)
    sent = platform.orders[PAYMENT].request
    assert sent["amount"] == {"total": 1000, "currency": "CNY"} and sent["description"] == "测试商品"
    assert sent["time_expire"] == "2024-05-01T12:00:00+08:00"  # created 10:00 Beijing + 2 hours
    assert sent["notify_url"].endswith("/callbacks/wechatpay")


def test_a_resent_order_gets_the_same_code_url_and_the_platform_holds_one_order(wx):
    platform, adapter = wx
    assert adapter.capabilities == Capabilities(dedupe=Dedupe.MERCHANT_ID, query_by_merchant_id=True, payer_scans=True)
    first, second = adapter.charge(order(), None, 5), adapter.charge(order(), None, 5)
    assert first.qr_code == second.qr_code
    assert len(platform.orders) == 1 and platform.order_requests[PAYMENT] == 2


def test_orderpaid_is_answered_by_a_query_never_a_second_order(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    paid = platform.pay(PAYMENT, notify=False)
    outcome = adapter.charge(order(), None, 5)
    assert isinstance(outcome, Succeeded) and outcome.provider_transaction_id == paid.transaction_id
    assert "ORDERPAID" in outcome.evidence.response
    assert len(platform.orders) == 1


def test_out_trade_no_used_is_answered_by_a_query(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    changed = adapter.charge(replace(order(), description="另一个描述"), None, 5)
    assert isinstance(changed, Pending) and changed.qr_code is None
    assert "OUT_TRADE_NO_USED" in changed.evidence.response
    other_amount = adapter.charge(order(amount=999), None, 5)
    assert isinstance(other_amount, Mismatch) and other_amount.reason == AMOUNT_MISMATCH
    assert len(platform.orders) == 1 and platform.orders[PAYMENT].total == 1000


def test_a_closed_order_is_failed_through_the_query(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    platform.orders[PAYMENT].trade_state = "CLOSED"
    outcome = adapter.charge(order(), None, 5)
    assert isinstance(outcome, Failed) and outcome.code == "CLOSED" and outcome.definitive


@pytest.mark.parametrize("fault", ["SYSTEM_ERROR", "SYSTEMERROR", "FREQUENCY_LIMITED", "5xx", "timeout_before"])
def test_an_ambiguous_order_answer_is_unknown_and_the_query_finds_nothing_so_it_is_resent(wx, fault):
    platform, adapter = wx
    platform.set_faults(fake.Faults(script=[fault], hang_seconds=1.0))
    outcome = adapter.charge(order(), None, 0.3)
    assert isinstance(outcome, Unknown), outcome
    assert isinstance(adapter.query(PAYMENT, 5, order()), NotFound)
    again = adapter.charge(order(), None, 5)
    assert isinstance(again, Pending) and again.qr_code
    assert all_verified(platform) and len(platform.orders) == 1


def test_an_order_whose_answer_times_out_after_it_was_made_is_found_by_the_query(wx):
    platform, adapter = wx
    platform.set_faults(fake.Faults(script=["timeout_after"], hang_seconds=1.0))
    outcome = adapter.charge(order(), None, 0.3)
    assert isinstance(outcome, Unknown) and outcome.reason == "timeout"
    assert isinstance(adapter.query(PAYMENT, 5, order()), Pending)  # made, not paid yet
    platform.pay(PAYMENT, notify=False)
    found = adapter.query(PAYMENT, 5, order())
    assert isinstance(found, Succeeded) and found.provider_transaction_id == platform.orders[PAYMENT].transaction_id
    assert len(platform.orders) == 1


def test_a_query_of_a_never_made_order_is_not_found(wx):
    _, adapter = wx
    assert isinstance(adapter.query("pay_NEVERMADE00000000000000000", 5), NotFound)


def test_a_query_failure_is_unknown_never_a_decline(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    for fault in ("SYSTEM_ERROR", "FREQUENCY_LIMITED", "5xx"):
        platform.set_faults(fake.Faults(script=[fault]))
        assert isinstance(adapter.query(PAYMENT, 5, order()), Unknown), fault


# --------------------------------------------------------------------------------------------- answer signatures


def test_an_answer_signed_with_a_wrong_key_or_not_signed_is_unknown_even_when_it_says_paid(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    platform.pay(PAYMENT, notify=False)
    platform.set_faults(fake.Faults(bad_signature_rate=1.0))
    forged = adapter.query(PAYMENT, 5, order())
    assert isinstance(forged, Unknown) and forged.reason == "response_invalid_signature"
    platform.set_faults(fake.Faults(unsigned_rate=1.0))
    unsigned = adapter.query(PAYMENT, 5, order())
    assert isinstance(unsigned, Unknown) and unsigned.reason == "response_missing_header"


def test_answers_verify_with_either_configured_key_and_not_with_an_unknown_one(wx, wx_keys):
    platform, adapter = wx
    platform.active_key = wx_keys.pub_key.key_id
    assert isinstance(adapter.charge(order(), None, 5), Pending)
    platform.active_key = wx_keys.cert_key.key_id
    assert isinstance(adapter.query(PAYMENT, 5), Pending)
    platform.active_key = wx_keys.stranger.key_id
    outcome = adapter.query(PAYMENT, 5)
    assert isinstance(outcome, Unknown) and outcome.reason == "response_unknown_serial"


def test_an_answer_signed_more_than_five_minutes_ago_is_not_trusted(wx_keys):
    body = b'{"trade_state":"SUCCESS"}'
    keys = sign.PlatformKeys([sign.load_platform_key(wx_keys.cert_key.key_id, wx_keys.cert_key.pem_path.read_bytes())])
    now = time.time()
    for skew, problem in [(-400, "response_stale_timestamp"), (400, "response_stale_timestamp"), (-200, None)]:
        headers = fake.signature_headers(wx_keys.cert_key.key_id, wx_keys.cert_key.private_key, body, now + skew)
        assert read_reply(200, headers, body, keys, now, Evidence(200)).problem == problem


def test_a_request_the_platform_cannot_verify_is_refused_and_is_not_a_decline(wx, wx_keys):
    platform, adapter = wx
    wrong_key = replace(adapter.config, merchant_key=wx_keys.stranger.private_key)
    impostor = WechatPayProvider(wrong_key)
    outcome = impostor.charge(order(), None, 5)
    assert isinstance(outcome, Failed) and outcome.code == "SIGN_ERROR" and not outcome.definitive
    assert platform.auth_log[-1]["reason"] == "签名错误" and not platform.orders
    skewed = WechatPayProvider(adapter.config)
    skewed.clock = lambda: time.time() - 301
    assert isinstance(skewed.charge(order(), None, 5), Failed)
    assert "5分钟" in platform.auth_log[-1]["reason"]
    wrong_serial = WechatPayProvider(replace(adapter.config, merchant_serial="ABCDEF"))
    assert isinstance(wrong_serial.charge(order(), None, 5), Failed)
    assert platform.auth_log[-1]["reason"] == "商户证书序列号有误"


def test_a_currency_wechat_does_not_take_is_refused_without_a_call(wx):
    platform, adapter = wx
    outcome = adapter.charge(ChargeRequest(PAYMENT, 1000, "USD"), None, 5)
    assert isinstance(outcome, Failed) and outcome.code == "currency_not_supported"
    assert not platform.auth_log


# --------------------------------------------------------------------------------------------- close


def test_an_expired_unpaid_order_is_closed_and_failed_only_once_the_query_says_closed(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    assert not adapter.order_expired(CREATED, CREATED + timedelta(seconds=7199))
    assert adapter.order_expired(CREATED, CREATED + timedelta(seconds=7200))
    outcome = adapter.close_expired(PAYMENT, 5, order())
    assert isinstance(outcome, Failed) and outcome.code == "CLOSED" and outcome.definitive
    assert platform.orders[PAYMENT].trade_state == "CLOSED" and all_verified(platform)


def test_closing_an_order_paid_meanwhile_finds_it_succeeded(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    platform.pay(PAYMENT, notify=False)
    assert isinstance(adapter.close(PAYMENT, 5), Unknown)  # ORDERPAID: the close did not happen
    assert isinstance(adapter.close_expired(PAYMENT, 5, order()), Succeeded)


def test_a_close_whose_answer_is_lost_is_resolved_by_the_query(wx):
    platform, adapter = wx
    adapter.charge(order(), None, 5)
    platform.set_faults(fake.Faults(script=["timeout_after"], hang_seconds=1.0))
    outcome = adapter.close_expired(PAYMENT, 0.3, order())
    assert isinstance(outcome, Failed) and outcome.code == "CLOSED"


# --------------------------------------------------------------------------------------------- refunds


def paid(platform: fake.FakeWechatPay, adapter: WechatPayProvider) -> str:
    adapter.charge(order(), None, 5)
    return platform.pay(PAYMENT, notify=False).transaction_id


def refund_request(transaction_id: str, amount: int = 400, total: int | None = 1000) -> RefundRequest:
    return RefundRequest(REFUND, PAYMENT, transaction_id, amount, "CNY", payment_amount_minor=total)


def test_a_refund_is_pending_then_its_query_says_succeeded(wx):
    platform, adapter = wx
    request = refund_request(paid(platform, adapter))
    outcome = adapter.refund(request, None, 5)
    assert isinstance(outcome, Pending) and outcome.provider_transaction_id == platform.refunds[REFUND].refund_id
    platform.finish_refund(REFUND)
    found = adapter.query_refund(REFUND, 5, request)
    assert isinstance(found, Succeeded) and found.provider_transaction_id == outcome.provider_transaction_id
    assert all_verified(platform)


def test_a_resent_refund_is_the_same_refund(wx):
    platform, adapter = wx
    request = refund_request(paid(platform, adapter))
    first, second = adapter.refund(request, None, 5), adapter.refund(request, None, 5)
    assert first.provider_transaction_id == second.provider_transaction_id and len(platform.refunds) == 1
    assert platform.orders[PAYMENT].refunded == 400


def test_a_refund_without_the_order_total_asks_the_order_for_it(wx):
    platform, adapter = wx
    outcome = adapter.refund(refund_request(paid(platform, adapter), total=None), None, 5)
    assert isinstance(outcome, Pending)


@pytest.mark.parametrize("fault", ["SYSTEM_ERROR", "FREQUENCY_LIMITED", "5xx", "timeout_before"])
def test_an_ambiguous_refund_is_unknown_and_its_query_finds_nothing_so_it_is_resent(wx, fault):
    platform, adapter = wx
    request = refund_request(paid(platform, adapter))
    platform.set_faults(fake.Faults(script=[fault], hang_seconds=1.0))
    assert isinstance(adapter.refund(request, None, 0.3), Unknown)
    assert isinstance(adapter.query_refund(REFUND, 5, request), NotFound)
    assert isinstance(adapter.refund(request, None, 5), Pending) and len(platform.refunds) == 1


def test_a_refund_whose_answer_times_out_after_it_was_made_is_found_by_its_query(wx):
    platform, adapter = wx
    request = refund_request(paid(platform, adapter))
    platform.set_faults(fake.Faults(script=["timeout_after"], hang_seconds=1.0, refund_seconds=30))
    assert isinstance(adapter.refund(request, None, 0.3), Unknown)
    assert isinstance(adapter.query_refund(REFUND, 5, request), Pending)
    platform.finish_refund(REFUND)
    assert isinstance(adapter.query_refund(REFUND, 5, request), Succeeded)


def test_a_refund_refused_by_the_platform_is_failed_and_an_abnormal_one_is_unknown(wx):
    platform, adapter = wx
    transaction_id = paid(platform, adapter)
    too_much = adapter.refund(refund_request(transaction_id, amount=5000), None, 5)
    assert isinstance(too_much, Failed) and too_much.code == "INVALID_REQUEST" and too_much.definitive
    request = refund_request(transaction_id)
    platform.set_faults(fake.Faults(refund_seconds=30))
    adapter.refund(request, None, 5)
    platform.finish_refund(REFUND, "ABNORMAL")
    abnormal = adapter.query_refund(REFUND, 5, request)
    assert isinstance(abnormal, Unknown) and abnormal.reason == "refund_abnormal"


# --------------------------------------------------------------------------------------------- bills


def today() -> str:
    return datetime.now(fake.BEIJING).strftime("%Y-%m-%d")


def test_the_trade_bill_is_downloaded_checked_against_its_hash_and_parsed(wx):
    platform, adapter = wx
    request = refund_request(paid(platform, adapter))
    adapter.refund(request, None, 5)
    lines = list(adapter.settlement_lines(today(), 5))
    assert [(line.kind, line.amount_minor) for line in lines] == [("charge", 1000), ("refund", 400)]
    assert lines[0].description == "测试商品" and lines[1].merchant_refund_id == REFUND
    assert lines[1].status == "PROCESSING"

    def settled() -> list:
        return [x for x in read_settlement(io.BytesIO(b"".join(adapter.settlement(today(), 5)))) if x.kind != INFO]

    # A refund still processing is not a settlement line yet; once it succeeded it is.
    assert [(x.kind, x.merchant_reference, x.status, x.fee_minor) for x in settled()] == [
        (CHARGE, PAYMENT, SUCCEEDED, 6)
    ]
    platform.finish_refund(REFUND, "SUCCESS")
    charge, refunded = settled()
    assert (refunded.kind, refunded.merchant_reference, refunded.status) == (REFUND_KIND, REFUND, SUCCEEDED)
    assert refunded.provider_reference == lines[1].provider_refund_id and refunded.amount_minor == 400
    assert all_verified(platform)


def test_a_day_without_a_bill_is_empty_and_a_bill_off_its_hash_is_refused(wx):
    platform, adapter = wx
    assert list(adapter.settlement_lines("2020-01-01", 5)) == []
    assert list(read_settlement(io.BytesIO(b"".join(adapter.settlement("2020-01-01", 5))))) == []
    paid(platform, adapter)
    platform.set_faults(fake.Faults(corrupt_bill=True))
    with pytest.raises(ProviderUnavailable, match="hash"):
        adapter.settlement_lines(today(), 5)
    with pytest.raises(ProviderUnavailable, match="hash"):
        adapter.settlement(today(), 5)  # before a byte is passed on
    platform.set_faults(fake.Faults(script=["SYSTEM_ERROR"]))
    with pytest.raises(ProviderUnavailable):
        adapter.settlement_lines(today(), 5)


def test_a_download_url_off_the_api_host_is_never_called_with_our_signature(wx):
    _, adapter = wx
    with pytest.raises(ProviderUnavailable, match="not on"):
        adapter._download("https://evil.example/v3/billdownload/file?token=x", "00", 5)


# --------------------------------------------------------------------------------------------- classification


def reply(status: int, code: str | None = None, problem: str | None = None) -> Reply:
    return Reply(status, {"code": code} if code else None, code, problem, Evidence(status))


@pytest.mark.parametrize(
    ("status", "code", "kind", "definitive"),
    [
        (500, "SYSTEM_ERROR", Unknown, None),
        (500, "SYSTEMERROR", Unknown, None),
        (429, "FREQUENCY_LIMITED", Unknown, None),
        (429, "RATELIMIT_EXCEEDED", Unknown, None),
        (503, None, Unknown, None),
        (502, "SERVICE_UNAVAILABLE", Unknown, None),
        (202, None, Unknown, None),
        (404, None, Unknown, None),
        (401, "SIGN_ERROR", Failed, False),
        (403, "NO_AUTH", Failed, False),
        (400, "APPID_MCHID_NOT_MATCH", Failed, False),
        (400, "PARAM_ERROR", Failed, True),
        (403, "USER_ACCOUNT_ABNORMAL", Failed, True),
    ],
)
def test_error_answers_are_classified_by_status_and_code(status, code, kind, definitive):
    outcome = error_outcome(reply(status, code))
    assert isinstance(outcome, kind), outcome
    if definitive is not None:
        # WeChat refusing the request itself: on a re-send that says nothing about the first one.
        assert outcome.definitive is definitive and outcome.refusal


def test_a_refusal_with_a_broken_signature_is_unknown():
    assert isinstance(error_outcome(reply(400, "PARAM_ERROR", problem="response_invalid_signature")), Unknown)


def test_a_transaction_for_another_order_or_merchant_is_unknown():
    body = {"out_trade_no": "pay_other000", "mchid": "1900000109", "trade_state": "SUCCESS", "transaction_id": "42"}
    assert read_transaction(body, PAYMENT, "1900000109").reason == "answer_for_another_payment"
    mine = {**body, "out_trade_no": PAYMENT, "mchid": "1230000109", "amount": {"total": 1000}}
    assert read_transaction(mine, PAYMENT, "1900000109").reason == "answer_for_another_payment"
    unknown_state = {**mine, "mchid": "1900000109", "trade_state": "EXPLODED"}
    assert read_transaction(unknown_state, PAYMENT, "1900000109").reason == "unknown_trade_state"


@pytest.mark.slow
def test_the_fake_runs_as_a_process_with_a_generated_key_set(tmp_path):
    """``python -m sandbox.fakes.wechatpay --keygen`` then ``--port``: what ``make chaos`` would start."""
    import os
    import signal
    import subprocess
    import sys

    import requests

    from payments.infra.settings import load_settings
    from tests.support import ROOT, free_port, wait_for_port

    out = subprocess.run(
        [sys.executable, "-m", "sandbox.fakes.wechatpay", "--keygen", str(tmp_path / "keys")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    env = dict(line.split("=", 1) for line in out.stdout.splitlines())
    port = free_port()
    fake_env = {k: v for k, v in env.items() if k.startswith("WECHATPAY_FAKE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.fakes.wechatpay", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, **fake_env, "WECHATPAY_FAKE_SEED": "7"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        ours = {k: v for k, v in env.items() if not k.startswith("WECHATPAY_FAKE_")}
        settings = load_settings(
            {
                **ours,
                "WECHATPAY_API_BASE": f"http://127.0.0.1:{port}",
                "WECHATPAY_NOTIFY_URL": f"http://127.0.0.1:{free_port()}/callbacks/wechatpay",
            }
        )
        adapter = WechatPayProvider.from_settings(settings)
        assert isinstance(adapter.charge(order(), None, 5), Pending)
        requests.post(f"http://127.0.0.1:{port}/_fake/orders/{PAYMENT}/pay", json={"notify": False}, timeout=5)
        assert isinstance(adapter.query(PAYMENT, 5, order()), Succeeded)
        requests.post(
            f"http://127.0.0.1:{port}/_fake/keys/active",
            json={"key_id": settings.wechatpay_platform_keys[1][0]},
            timeout=5,
        )
        assert isinstance(adapter.query(PAYMENT, 5, order()), Succeeded)  # the PUB_KEY_ID key signs now
        state = requests.get(f"http://127.0.0.1:{port}/_fake/state", timeout=5).json()
        assert state["auth"]["refused"] == [] and state["auth"]["ok"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
