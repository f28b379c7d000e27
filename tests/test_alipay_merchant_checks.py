"""Alipay notifies for another seller are refused, and a trade bill past its size cap stops with an alert.

Alipay signs every merchant's notifies with the same platform key, so the
signature alone does not say a notify is ours: ``app_id`` (always) and
``seller_id`` (when ALIPAY_SELLER_ID is set) must be. The bill download is
counted as it streams; past ALIPAY_BILL_MAX_BYTES it stops, nothing of the
day is imported, and the reconcile job raises ``settlement_too_large``.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.alipay_support
from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select

from compensator import reconcile as reconcile_job
from gateway import create_app
from payments.errors import ConfigError, SignatureInvalid
from payments.inbound.callbacks import process_callback
from payments.infra.schema import alert, reconciliation_run
from payments.infra.settings import load_settings
from payments.providers.base import ChargeRequest, ProviderUnavailable, Succeeded
from payments.providers.wechatpay.bill import BEIJING
from payments.runtime import build_runtime
from payments.states import AlertStatus, CallbackStatus
from tests.alipay_support import APP_ID, fake_alipay, keys, notify_fields, provider_for, signed_notify  # noqa: F401
from tests.stack import callback_rows, db_url, payment_status
from tests.support import create_payment, make_settings
from tests.test_alipay_gateway import POLICY, alipay_settings, post

OURS = "2088101106499364"
"""The seller_id tests.alipay_support's notifies carry."""
THEIRS = "2088999999999999"


def test_a_notify_for_another_seller_is_refused_when_alipay_seller_id_is_set(keys):
    ours = provider_for(keys, seller_id=OURS)
    now = time.time()
    assert (
        ours.parse_callback(signed_notify(notify_fields("pay_a"), keys.alipay), {}, now).merchant_reference == "pay_a"
    )
    for fields in (notify_fields("pay_a", seller_id=THEIRS), notify_fields("pay_a", seller_id=None)):
        with pytest.raises(SignatureInvalid, match="seller_id") as refused:
            ours.parse_callback(signed_notify(fields, keys.alipay), {}, now)
        assert refused.value.code == "wrong_merchant"
    # Unset, any seller of our app_id is accepted (the app_id check alone, as before).
    anyone = provider_for(keys)
    assert anyone.parse_callback(signed_notify(notify_fields("pay_a", seller_id=THEIRS), keys.alipay), {}, now)
    with pytest.raises(SignatureInvalid, match="app_id"):
        anyone.parse_callback(signed_notify(notify_fields("pay_a", app_id="2021999999999999"), keys.alipay), {}, now)


def test_alipay_seller_id_is_read_and_checked_from_the_environment():
    assert load_settings({"PAYSYNC_ENV": "development", "ALIPAY_SELLER_ID": OURS}).alipay_seller_id == OURS
    with pytest.raises(ConfigError, match="ALIPAY_SELLER_ID"):
        load_settings({"PAYSYNC_ENV": "development", "ALIPAY_SELLER_ID": "2021000000000001"})
    with pytest.raises(ConfigError, match="ALIPAY_BILL_MAX_BYTES"):
        load_settings({"PAYSYNC_ENV": "development", "ALIPAY_BILL_MAX_BYTES": "1000"})


def test_the_gateway_stores_a_foreign_sellers_notify_as_rejected_and_the_payment_is_unchanged(engine, keys):
    app = create_app(alipay_settings(engine, keys, alipay_seller_id=OURS), engine=engine)
    client = app.test_client()
    payment_id = create_payment(engine, provider="alipay", amount=1000)
    foreign = signed_notify(notify_fields(payment_id, seller_id=THEIRS), keys.alipay)
    answer = post(client, foreign)
    assert answer.get_data() == b"fail"
    (row,) = callback_rows(engine)
    assert row.status == CallbackStatus.REJECTED and row.result.startswith("rejected: wrong_merchant"), row.result
    assert payment_status(engine, payment_id) == "Pending"
    # Ours goes through and is applied.
    assert post(client, signed_notify(notify_fields(payment_id), keys.alipay)).get_data() == b"success"
    process_callback(engine, app.extensions["paysync"]["providers"], callback_rows(engine)[-1].id, POLICY)
    assert payment_status(engine, payment_id) == "Succeeded"


def _paid_at_the_fake(engine, adapter, fake) -> None:
    payment_id = create_payment(engine, provider="alipay", amount=1000, currency="CNY")
    request = ChargeRequest(payment_id, 1000, "CNY")
    adapter.charge(request, None, 5)
    fake.control("pay", {"out_trade_no": payment_id})
    assert isinstance(adapter.query(payment_id, 5, request), Succeeded)


def test_a_bill_past_the_cap_stops_the_download_at_the_cap_and_one_byte_less_is_refused(keys, fake_alipay):
    adapter = provider_for(keys, fake_alipay)
    day = datetime.now(BEIJING).date().isoformat()
    size = sum(len(chunk) for chunk in adapter.settlement(day, 5))
    assert size > 0
    assert sum(len(c) for c in provider_for(keys, fake_alipay, bill_max_bytes=size).settlement(day, 5)) == size
    capped = provider_for(keys, fake_alipay, bill_max_bytes=size - 1)
    with pytest.raises(ProviderUnavailable, match="ALIPAY_BILL_MAX_BYTES") as refused:
        list(capped.settlement(day, 5))
    assert refused.value.code == "settlement_too_large"
    with pytest.raises(ProviderUnavailable, match="ALIPAY_BILL_MAX_BYTES"):
        capped.download_bill(day, 5)


def test_the_reconcile_job_raises_one_alert_for_a_bill_past_the_cap_and_resolves_it_once_it_fits(
    engine, keys, fake_alipay
):
    runtime = build_runtime(make_settings(database_url=db_url(engine), reconcile_days_back=1), engine=engine)
    _paid_at_the_fake(engine, provider_for(keys, fake_alipay), fake_alipay)
    today = datetime.now(BEIJING).date()
    runtime.providers["alipay"] = provider_for(keys, fake_alipay, bill_max_bytes=64)
    tomorrow = today + timedelta(days=1)  # the job reconciles yesterday's file: today's, seen from tomorrow
    assert reconcile_job.run_once(runtime, today=tomorrow) == 0
    assert reconcile_job.run_once(runtime, today=tomorrow) == 0  # tried again: still the one alert

    def alerts_of_the_rule():
        with engine.connect() as conn:
            return conn.execute(select(alert).where(alert.c.rule == "settlement_too_large")).mappings().all()

    (raised,) = alerts_of_the_rule()
    assert raised["status"] == AlertStatus.FIRING and raised["severity"] == "critical"
    assert raised["dedupe_key"] == f"settlement_too_large:alipay:{today.isoformat()}"
    assert "ALIPAY_BILL_MAX_BYTES (64 bytes)" in raised["message"]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(reconciliation_run)).scalar() == 0  # nothing imported

    runtime.providers["alipay"] = provider_for(keys, fake_alipay)
    assert reconcile_job.run_once(runtime, today=tomorrow) == 1
    (resolved,) = alerts_of_the_rule()
    assert resolved["status"] == AlertStatus.RESOLVED and resolved["open_key"] is None
