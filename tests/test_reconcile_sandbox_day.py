"""A seeded day at the real sandbox platform, reconciled from the file its adapter downloads.

The day holds: a matched charge, a dropped webhook (local Unknown, provider
settled), a decline we never heard of (local Pending, provider failed), an
amount mismatch, a Failed payment the provider settled, a provider-only
charge, a local-only success, two refunds (one we know succeeded, one still
Pending locally) and the fees. Then the same file again (duplicate import),
and a re-run. Every line lands in its category, the ledger stays balanced and
the seal chain verifies.
"""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process
from __future__ import annotations

import socket
import threading
import time
import uuid
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from sqlalchemy import func, select

from compensator import reconcile as reconcile_job
from compensator import seal_ledger
from payments.infra.db import utcnow
from payments.infra.schema import (
    RECON_AMOUNT_MISMATCH,
    RECON_LOCAL_ONLY,
    RECON_MATCHED,
    RECON_PROVIDER_ONLY,
    RECON_RESOLVED,
    RECON_STATUS_MISMATCH,
    alert,
    ledger_event,
    manual_review,
    payment,
    refund,
    settlement_file,
    settlement_line,
)
from payments.money import ledger
from payments.providers.base import ChargeRequest, Failed, ProviderUnavailable, RefundRequest, Succeeded
from payments.providers.sandbox.adapter import SandboxProvider
from payments.runtime import build_runtime
from payments.states import PaymentStatus
from tests.support import API_KEY, SECRET, create_payment, free_port, make_settings
from tests.test_ledger import confirm, create_refund
from tests.test_reconcile import assert_balanced, count, items, status_of


def fee(amount: int) -> int:
    return int((Decimal(amount) * Decimal("0.006")).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def charge(adapter: SandboxProvider, payment_id: str, amount: int) -> str:
    outcome = adapter.charge(ChargeRequest(payment_id, amount, "CNY"), f"key-{payment_id}", timeout=10)
    assert isinstance(outcome, Succeeded | Failed), outcome
    return outcome.provider_transaction_id


def set_reference(engine, payment_id: str, reference: str) -> None:
    """What a callback or call answer would have stored (the provider's id), without a status change."""
    with engine.begin() as conn:
        conn.execute(
            payment.update().where(payment.c.payment_id == payment_id).values(provider_transaction_id=reference)
        )


def away_from_midnight() -> None:
    """The sandbox files charges under the UTC day they were made: keep the seeded day from straddling two."""
    now = utcnow()
    midnight = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    if midnight - now < timedelta(seconds=60):
        time.sleep((midnight - now).total_seconds() + 1)


def test_a_seeded_sandbox_day_lands_every_line_in_its_category(engine, sandbox):
    away_from_midnight()
    runtime = build_runtime(
        make_settings(database_url=engine.url.render_as_string(hide_password=False), sandbox_api_url=sandbox.url),
        engine=engine,
    )
    adapter = runtime.providers["sandbox"]
    day = utcnow().date()

    matched = create_payment(engine, amount=1000, status="Pending")
    set_reference(engine, matched, charge(adapter, matched, 1000))
    confirm(engine, "payment", matched)

    dropped = create_payment(engine, amount=2000, status="Unknown")  # the webhook never came
    dropped_ref = charge(adapter, dropped, 2000)

    sandbox.faults(decline_rate=1.0)
    declined = create_payment(engine, amount=2500, status="Pending")
    charge(adapter, declined, 2500)
    sandbox.faults()

    more = create_payment(engine, amount=3000, status="Pending")  # we asked 3000; the platform took 3300
    set_reference(engine, more, charge(adapter, more, 3300))
    confirm(engine, "payment", more)

    failed = create_payment(engine, amount=4000, status="Pending")  # we think it failed; it was settled
    set_reference(engine, failed, charge(adapter, failed, 4000))
    confirm(engine, "payment", failed, PaymentStatus.FAILED)

    stranger = f"pay_{uuid.uuid4().hex[:20]}"  # charged under a number we have no payment for
    stranger_ref = charge(adapter, stranger, 5000)

    local_only = create_payment(engine, amount=6000, status="Pending")  # confirmed here, never charged there
    confirm(engine, "payment", local_only)

    refunded = create_payment(engine, amount=7000, status="Pending")
    refunded_ref = charge(adapter, refunded, 7000)
    set_reference(engine, refunded, refunded_ref)
    confirm(engine, "payment", refunded)
    known = create_refund(engine, refunded, 1000)
    pending = create_refund(engine, refunded, 500)
    for refund_id, amount in ((known, 1000), (pending, 500)):
        outcome = adapter.refund(
            RefundRequest(refund_id, refunded, refunded_ref, amount, "CNY"), f"key-{refund_id}", timeout=10
        )
        assert isinstance(outcome, Succeeded), outcome
        if refund_id == known:
            with engine.begin() as conn:
                conn.execute(
                    refund.update()
                    .where(refund.c.refund_id == known)
                    .values(provider_refund_id=outcome.provider_transaction_id)
                )
            confirm(engine, "refund", known)

    (first,) = reconcile_job.reconcile_command(runtime, day, ["sandbox"], None)
    found = items(engine, first.run_id)
    by_category = {c: sorted(i["payment_id"] or i["merchant_reference"] for i in rows) for c, rows in found.items()}
    assert sorted(by_category[RECON_MATCHED]) == sorted([matched, refunded, refunded])  # the charge and one refund
    assert sorted(by_category[RECON_RESOLVED]) == sorted([dropped, declined, refunded])  # two payments, one refund
    assert by_category[RECON_AMOUNT_MISMATCH] == [more]
    assert by_category[RECON_STATUS_MISMATCH] == [failed]
    assert by_category[RECON_PROVIDER_ONLY] == [stranger]
    assert by_category[RECON_LOCAL_ONLY] == [local_only]
    assert first.unexplained == 4

    # The dropped webhook and the unheard decline went through the state machine, sourced by their items.
    resolved = {i["payment_id"] or i["refund_id"]: i for i in found[RECON_RESOLVED] if not i["refund_id"]}
    assert status_of(engine, dropped) == ("Succeeded", f"reconciliation:{resolved[dropped]['id']}")
    assert status_of(engine, declined)[0] == "Failed"
    with engine.connect() as conn:
        assert conn.execute(select(refund.c.status).where(refund.c.refund_id == pending)).scalar() == "Succeeded"
        assert (
            conn.execute(select(payment.c.provider_transaction_id).where(payment.c.payment_id == dropped)).scalar()
            == dropped_ref
        )
    # Nothing the state machine cannot take was overwritten: adjustments into suspense, reviews, alerts.
    assert status_of(engine, failed)[0] == "Failed" and status_of(engine, more)[0] == "Succeeded"
    with engine.connect() as conn:
        adjusted = dict(
            conn.execute(
                select(ledger_event.c.payment_id, ledger_event.c.amount_minor).where(
                    ledger_event.c.event_type == ledger.RECONCILIATION_ADJUSTED
                )
            ).all()
        )
        assert adjusted == {more: 300, failed: 4000, None: 5000}
        balances = ledger.balances(conn)
        assert balances[(ledger.SUSPENSE_RECONCILIATION, "CNY")] == -(300 + 4000 + 5000)
        expected_fees = sum(fee(a) for a in (1000, 2000, 3300, 4000, 5000, 7000))
        assert balances[(ledger.EXPENSE_FEES, "CNY")] == expected_fees
        assert ledger.payment_balance(conn, refunded) == {"CNY": 7000 - 1500}
    reviews = {r.payment_id or r.details for r in _reviews(engine)}
    assert {more, failed, local_only} <= reviews and len(reviews) == 4
    assert count(engine, alert, alert.c.status == "firing") == 4
    assert_balanced(engine)
    assert stranger_ref

    # The same file again: nothing new stored, no second adjustment, review or fee; the resolved ones now match.
    lines = count(engine, settlement_line)
    events = count(engine, ledger_event)
    (again,) = reconcile_job.reconcile_command(runtime, day, ["sandbox"], None)
    assert again.file_id == first.file_id and again.file_seen_before and again.new_lines == 0
    assert count(engine, settlement_line) == lines and count(engine, settlement_file) == 1
    assert count(engine, ledger_event) == events
    assert count(engine, manual_review) == 4 and again.tally.reviews == 0 and again.tally.adjustments == 0
    assert again.tally.count(RECON_MATCHED) == first.tally.count(RECON_MATCHED) + first.tally.count(RECON_RESOLVED)
    assert again.unexplained == first.unexplained

    # The daily job sees a reconciled, unchanged file and leaves it alone.
    runtime_daily = build_runtime(
        make_settings(
            database_url=engine.url.render_as_string(hide_password=False),
            sandbox_api_url=sandbox.url,
            reconcile_days_back=1,
        ),
        engine=engine,
    )
    assert reconcile_job.run_once(runtime_daily, today=day + timedelta(days=1)) == 0

    assert_balanced(engine)
    assert seal_ledger.run_once(runtime) == count(engine, ledger_event)
    result = seal_ledger.verify(engine)
    assert result.ok and result.verified == count(engine, ledger_event), seal_ledger.describe(result)


def _reviews(engine):
    with engine.connect() as conn:
        return conn.execute(select(manual_review.c.payment_id, manual_review.c.details)).all()


# --- the adapter's streaming download -------------------------------------------------------------------


def test_the_adapter_streams_the_settlement_file_in_chunks_and_says_when_there_is_none(sandbox):
    adapter = SandboxProvider(SECRET, api_url=sandbox.url, api_key=API_KEY)
    for n in range(3):
        charge(adapter, f"pay_stream_{n}", 100 + n)
    chunks = adapter.settlement(utcnow().date().isoformat(), timeout=10)
    assert not isinstance(chunks, list | bytes)
    text = b"".join(chunks).decode()
    assert text.startswith("provider_transaction_id,") and text.count("\n") == 4
    with pytest.raises(ProviderUnavailable, match="http_400"):
        adapter.settlement("2024-02-30", timeout=5)


def test_a_refused_connection_or_a_transfer_cut_short_is_unavailable_not_a_short_file():
    adapter = SandboxProvider(SECRET, api_url=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(ProviderUnavailable, match="ConnectionError"):
        adapter.settlement("2024-03-01", timeout=1)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve_half():
        conn, _ = listener.accept()
        conn.recv(65536)
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/csv\r\nContent-Length: 1000\r\n\r\n"
        conn.sendall(head + b"provider_transaction_id,")  # 24 of the 1000 bytes announced
        conn.close()

    threading.Thread(target=serve_half, daemon=True).start()
    adapter = SandboxProvider(SECRET, api_url=f"http://127.0.0.1:{listener.getsockname()[1]}")
    with pytest.raises(ProviderUnavailable):
        b"".join(adapter.settlement("2024-03-01", timeout=5))
    listener.close()


def test_a_provider_that_cannot_serve_the_file_fails_the_command_without_importing(engine):
    url = f"http://127.0.0.1:{free_port()}"  # the platform is down
    runtime = build_runtime(
        make_settings(database_url=engine.url.render_as_string(hide_password=False), sandbox_api_url=url),
        engine=engine,
    )
    with pytest.raises(ProviderUnavailable):
        reconcile_job.reconcile_command(runtime, utcnow().date(), ["sandbox"], None)
    assert reconcile_job.run_once(runtime) == 0  # the daily job logs it and tries again tomorrow
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(settlement_file)).scalar() == 0
