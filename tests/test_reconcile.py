"""Reconciliation against settlement files: every line in its category, effects once, nothing overwritten."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import tracemalloc
import uuid
from datetime import date, datetime, time, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, insert, select

from compensator import reconcile as reconcile_job
from payments.infra.db import init_db, make_engine, utcnow
from payments.infra.locks import named_lock
from payments.infra.schema import (
    RECON_AMOUNT_MISMATCH,
    RECON_FEE,
    RECON_IGNORED,
    RECON_LOCAL_ONLY,
    RECON_MATCHED,
    RECON_PROVIDER_ONLY,
    RECON_RESOLVED,
    RECON_STATUS_MISMATCH,
    RECON_UNREADABLE,
    alert,
    ledger_event,
    manual_review,
    payment,
    payment_callback_log,
    reconciliation_item,
    reconciliation_run,
    settlement_file,
    settlement_line,
)
from payments.money import ledger
from payments.providers.base import ProviderUnavailable
from payments.providers.settlement import CHARGE, FEE, INVALID, REFUND, SettlementFormatError, SettlementLine, checked
from payments.reconciliation import aging, reconcile
from payments.reconciliation.reconcile import Finding, Local, classify, differences, provider_view
from payments.runtime import build_runtime
from payments.states import PaymentStatus
from tests.support import ROOT, create_payment, env_for, make_settings
from tests.test_ledger import confirm, create_refund

HEADER = "provider_transaction_id,merchant_transaction_id,type,amount,fee,currency,status,created_at"
DAY = date(2024, 3, 1)


def csv_line(ref, ours, amount, *, kind="charge", fee=0, currency="CNY", status="succeeded", day=DAY) -> str:
    return f"{ref},{ours},{kind},{amount},{fee},{currency},{status},{day.isoformat()}T10:00:00Z"


def settlement(tmp_path, *lines: str, name: str | None = None):
    path = tmp_path / (name or f"{uuid.uuid4().hex}.csv")
    path.write_text("\n".join([HEADER, *lines]) + "\n")
    return path


def run(engine, path, day=DAY, provider="sandbox") -> reconcile.Report:
    source = reconcile.open_file(path)
    try:
        return reconcile.reconcile(engine, provider, day, source)
    finally:
        source.close()


def confirmed_payment(engine, amount: int, *, ref: str | None = None, on: date = DAY, currency: str = "CNY") -> str:
    """A payment Succeeded through the state machine (PaymentConfirmed posted) at noon of day ``on``."""
    payment_id = create_payment(engine, amount=amount, status="Pending", currency=currency, provider_transaction_id=ref)
    confirm(engine, "payment", payment_id, now=datetime.combine(on, time(12)))
    return payment_id


def items(engine, run_id: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    with engine.connect() as conn:
        for row in conn.execute(select(reconciliation_item).where(reconciliation_item.c.run_id == run_id)).mappings():
            out.setdefault(row["category"], []).append(dict(row))
    return out


def count(engine, table, *where) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table).where(*where)).scalar_one()


def adjustments(engine) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(ledger_event).where(ledger_event.c.event_type == ledger.RECONCILIATION_ADJUSTED).order_by("id")
        ).mappings()
        return [dict(r) | {"details": json.loads(r["details"])} for r in rows]


def status_of(engine, payment_id: str) -> tuple[str, str | None]:
    with engine.connect() as conn:
        row = conn.execute(
            select(payment.c.status, payment.c.status_source).where(payment.c.payment_id == payment_id)
        ).one()
        return row.status, row.status_source


def assert_balanced(engine) -> None:
    with engine.connect() as conn:
        assert ledger.unbalanced_events(conn) == []
        totals: dict[str, int] = {}
        for (_, currency), amount in ledger.balances(conn).items():
            totals[currency] = totals.get(currency, 0) + amount
        assert all(v == 0 for v in totals.values()), totals


# --- the pure part ------------------------------------------------------------------------------------


def local(status: str, amount: int = 1000, currency: str = "CNY", ref: str | None = "ch_1", provider: str = "sandbox"):
    return Local(
        "payment",
        {
            "id": 1,
            "payment_id": "pay_1",
            "amount_minor": amount,
            "currency": currency,
            "provider": provider,
            "provider_transaction_id": ref,
            "status": status,
        },
    )


def line(status: str = "succeeded", amount: int = 1000, currency: str = "CNY", ref: str = "ch_1", kind=CHARGE):
    return SettlementLine(2, "raw", kind, status, ref, "pay_1", amount, 0, currency)


ACCOUNTS = ("sandbox", "sandbox_legacy")


@pytest.mark.parametrize(
    ("the_line", "ours", "expected"),
    [
        (line(), local("Succeeded"), Finding(RECON_MATCHED)),
        (line("failed"), local("Failed"), Finding(RECON_MATCHED)),
        (line(), local("Unknown", ref=None), Finding(RECON_RESOLVED, resolve_to=PaymentStatus.SUCCEEDED)),
        (line(), local("Pending"), Finding(RECON_RESOLVED, resolve_to=PaymentStatus.SUCCEEDED)),
        (line(), local("Created", ref=None), Finding(RECON_RESOLVED, resolve_to=PaymentStatus.SUCCEEDED)),
        (line("failed"), local("Unknown"), Finding(RECON_RESOLVED, resolve_to=PaymentStatus.FAILED)),
        (line(), local("Failed"), Finding(RECON_STATUS_MISMATCH, adjust=True, escalate=True)),
        (line("failed"), local("Succeeded"), Finding(RECON_STATUS_MISMATCH, adjust=True, escalate=True)),
        (line(amount=1100), local("Succeeded"), Finding(RECON_AMOUNT_MISMATCH, adjust=True, escalate=True)),
        (line(currency="USD"), local("Unknown"), Finding(RECON_AMOUNT_MISMATCH, adjust=True, escalate=True)),
        (line(), None, Finding(RECON_PROVIDER_ONLY, adjust=True, escalate=True)),
        (line(ref="ch_2"), local("Succeeded"), Finding(RECON_PROVIDER_ONLY, adjust=True, escalate=True)),
        (line(), local("Succeeded", provider="alipay"), Finding(RECON_PROVIDER_ONLY, adjust=True, escalate=True)),
        (line(), local("Unknown", provider="sandbox_legacy"), Finding(RECON_RESOLVED, PaymentStatus.SUCCEEDED)),
        (line("failed"), None, Finding(RECON_IGNORED)),
        (SettlementLine(3, "r", FEE, fee_minor=5, currency="CNY"), None, Finding(RECON_FEE)),
        (SettlementLine(3, "r", INVALID, error="bad"), None, Finding(RECON_UNREADABLE, escalate=True)),
    ],
)
def test_each_kind_of_line_is_classified(the_line, ours, expected):
    found = classify(the_line, ours, ACCOUNTS)
    assert (found.category, found.resolve_to, found.adjust, found.escalate) == (
        expected.category,
        expected.resolve_to,
        expected.adjust,
        expected.escalate,
    )


def converted(amount: int = 10000, settled: int = 10850, kind=CHARGE, status: str = "succeeded") -> SettlementLine:
    """A EUR charge (or refund) Stripe settled in USD at 1.085."""
    return SettlementLine(2, "raw", kind, status, "pi_1", None, amount, 345, "EUR", None, None, settled, "USD", "1.085")


def test_a_line_settled_in_another_currency_is_matched_on_the_charges_own_money():
    ours = local("Succeeded", amount=10000, currency="EUR", ref="pi_1", provider="stripe")
    assert classify(converted(), ours, ("stripe",)).category == RECON_MATCHED
    assert classify(converted(amount=9000), ours, ("stripe",)).category == RECON_AMOUNT_MISMATCH
    assert converted().fee_currency == "USD" and line().fee_currency == "CNY"


def test_a_conversion_moves_the_receivable_out_of_the_charges_currency_into_the_settlements():
    assert reconcile.conversion_view(converted()) == {"EUR": -10000, "USD": 10850}
    assert reconcile.conversion_view(converted(3000, 3255, kind=REFUND)) == {"EUR": 3000, "USD": -3255}
    assert reconcile.conversion_view(converted(status="failed")) == {}, "a failed line moved no money"
    assert reconcile.conversion_view(line()) == {}, "nothing converted"


def test_a_settlement_side_that_does_not_hold_together_makes_the_line_invalid():
    base = converted()
    for settled, currency, rate in (
        (0, "USD", "1.085"),
        (10850, "EUR", "1.085"),
        (10850, "USD", "-1"),
        (10850, None, "1"),
    ):
        bad = SettlementLine(
            2, "raw", CHARGE, "succeeded", "pi_1", None, 10000, 0, "EUR", None, None, settled, currency, rate
        )
        assert checked(bad).kind == INVALID, (settled, currency, rate)
    assert checked(base) == base


@given(
    st.dictionaries(st.sampled_from(["CNY", "USD", "EUR"]), st.integers(-(10**9), 10**9)),
    st.dictionaries(st.sampled_from(["CNY", "USD", "EUR"]), st.integers(-(10**9), 10**9)),
)
def test_posting_the_differences_brings_our_books_to_the_providers(theirs, ours):
    deltas = differences(theirs, ours)
    after = {c: ours.get(c, 0) + deltas.get(c, 0) for c in set(ours) | set(deltas)}
    assert {c: v for c, v in after.items() if v} == {c: v for c, v in theirs.items() if v}
    assert 0 not in deltas.values()
    assert differences(theirs, after) == {}


def test_a_refund_line_says_the_provider_holds_less_and_a_failed_line_says_nothing():
    assert provider_view(line(kind=REFUND, amount=300)) == {"CNY": -300}
    assert provider_view(line()) == {"CNY": 1000}
    assert provider_view(line("failed")) == {}


# --- runs against the database -------------------------------------------------------------------------


def test_it_no_ops_on_a_file_with_only_its_header(engine, tmp_path):
    report = run(engine, settlement(tmp_path))
    assert report.status == "completed" and report.line_count == 1 and report.unexplained == 0
    assert count(engine, reconciliation_item) == 0
    assert count(engine, ledger_event) == 0
    assert count(engine, settlement_line) == 1  # the header is kept too


def test_matching_is_by_the_providers_id_first_then_by_our_number(engine, tmp_path):
    by_ref = confirmed_payment(engine, 1000, ref="ch_known")
    by_number = create_payment(engine, amount=2000, status="Unknown")
    report = run(
        engine,
        settlement(
            tmp_path,
            csv_line("ch_known", "pay_something_else", 1000),
            csv_line("ch_new", by_number, 2000),
        ),
    )
    found = items(engine, report.run_id)
    assert [i["payment_id"] for i in found[RECON_MATCHED]] == [by_ref]
    assert [i["payment_id"] for i in found[RECON_RESOLVED]] == [by_number]
    with engine.connect() as conn:
        assert (
            conn.execute(select(payment.c.provider_transaction_id).where(payment.c.payment_id == by_number)).scalar()
            == "ch_new"
        )


def test_a_dropped_webhook_is_resolved_through_the_state_machine_with_the_item_as_its_source(engine, tmp_path):
    payment_id = create_payment(engine, amount=1500, status="Unknown")
    report = run(engine, settlement(tmp_path, csv_line("ch_x", payment_id, 1500, fee=9)))
    (item,) = items(engine, report.run_id)[RECON_RESOLVED]
    assert status_of(engine, payment_id) == ("Succeeded", f"reconciliation:{item['id']}")
    with engine.connect() as conn:
        event = (
            conn.execute(select(ledger_event).where(ledger_event.c.event_type == "PaymentConfirmed")).mappings().one()
        )
        assert (event["source_type"], event["source_id"]) == ("reconciliation", str(item["id"]))
        domain = conn.execute(select(func.count()).where(payment.c.payment_id == payment_id)).scalar()
        assert domain == 1
    assert report.tally.resolved == 1 and report.unexplained == 0
    assert adjustments(engine) == []


def test_a_declined_line_resolves_an_unknown_payment_to_failed(engine, tmp_path):
    payment_id = create_payment(engine, amount=700, status="Pending")
    run(engine, settlement(tmp_path, csv_line("ch_d", payment_id, 700, status="failed")))
    assert status_of(engine, payment_id)[0] == "Failed"
    with engine.connect() as conn:
        code = conn.execute(select(payment.c.error_code).where(payment.c.payment_id == payment_id)).scalar()
    assert code == "failed_per_settlement"


def test_differences_are_adjusted_into_suspense_reviewed_and_alerted_never_overwritten(engine, tmp_path):
    more = confirmed_payment(engine, 1000, ref="ch_more")
    failed = create_payment(engine, amount=400, status="Pending", provider_transaction_id="ch_failed")
    confirm(engine, "payment", failed, PaymentStatus.FAILED)
    unsettled = confirmed_payment(engine, 250, ref="ch_unsettled")
    report = run(
        engine,
        settlement(
            tmp_path,
            csv_line("ch_more", more, 1200),  # the provider took 200 more than we asked for
            csv_line("ch_failed", failed, 400),  # a Failed payment the provider settled
            csv_line("ch_unsettled", unsettled, 250, status="failed"),  # a success the provider failed
            csv_line("ch_stranger", "pay_nobody", 999),  # money we have no record of
        ),
    )
    found = items(engine, report.run_id)
    assert [i["payment_id"] for i in found[RECON_AMOUNT_MISMATCH]] == [more]
    assert sorted(i["payment_id"] for i in found[RECON_STATUS_MISMATCH]) == sorted([failed, unsettled])
    assert [i["provider_reference"] for i in found[RECON_PROVIDER_ONLY]] == ["ch_stranger"]
    # Never an overwrite: our records keep what they said.
    assert status_of(engine, more)[0] == "Succeeded" and status_of(engine, failed)[0] == "Failed"
    assert status_of(engine, unsettled)[0] == "Succeeded"
    with engine.connect() as conn:
        assert conn.execute(select(payment.c.amount_minor).where(payment.c.payment_id == more)).scalar() == 1000
    posted = {a["details"]["subject"]: a["details"]["delta"] for a in adjustments(engine)}
    assert posted == {
        "sandbox:charge:ch_more": 200,
        "sandbox:charge:ch_failed": 400,
        "sandbox:charge:ch_unsettled": -250,
        "sandbox:charge:ch_stranger": 999,
    }
    with engine.connect() as conn:
        suspense = ledger.balances(conn)[(ledger.SUSPENSE_RECONCILIATION, "CNY")]
    assert suspense == -(200 + 400 - 250 + 999)
    assert count(engine, manual_review) == 4 == report.tally.reviews
    assert count(engine, alert, alert.c.status == "firing") == 4
    assert {i["action"] for c in found.values() for i in c} == {"review"}
    assert_balanced(engine)


def test_importing_the_same_file_twice_adds_nothing_and_a_rerun_adds_no_second_adjustment(engine, tmp_path):
    more = confirmed_payment(engine, 1000, ref="ch_more")
    unknown = create_payment(engine, amount=300, status="Unknown")
    path = settlement(tmp_path, csv_line("ch_more", more, 1300, fee=8), csv_line("ch_u", unknown, 300, fee=2), "bad")
    first = run(engine, path)
    lines, files, events = count(engine, settlement_line), count(engine, settlement_file), count(engine, ledger_event)
    reviews, alerts_ = count(engine, manual_review), count(engine, alert)
    second = run(engine, path)
    assert second.file_id == first.file_id and second.file_seen_before and second.new_lines == 0
    assert (count(engine, settlement_line), count(engine, settlement_file)) == (lines, files)
    assert count(engine, ledger_event) == events  # no second adjustment, confirmation or fee
    assert (count(engine, manual_review), count(engine, alert)) == (reviews, alerts_)
    assert second.tally.count(RECON_AMOUNT_MISMATCH) == 1 and second.tally.count(RECON_MATCHED) == 1
    assert second.tally.adjustments == 0 and second.tally.reviews == 0 and second.tally.fees_booked == {}
    assert first.tally.fees_booked == {"CNY": 10}
    assert count(engine, reconciliation_run, reconciliation_run.c.status == "completed") == 2


def test_a_corrected_file_supersedes_the_first_and_posts_only_the_correction(engine, tmp_path):
    more = confirmed_payment(engine, 1000, ref="ch_more")
    first = run(engine, settlement(tmp_path, csv_line("ch_more", more, 1100, fee=6)))
    second = run(engine, settlement(tmp_path, csv_line("ch_more", more, 1150, fee=7)))
    assert second.file_id != first.file_id and not second.file_seen_before
    assert [a["details"]["delta"] for a in adjustments(engine)] == [100, 50]
    with engine.connect() as conn:
        fees = conn.execute(
            select(ledger_event.c.amount_minor).where(ledger_event.c.event_type == ledger.FEE_CHARGED).order_by("id")
        ).scalars()
        assert list(fees) == [6, 1]
        superseded = conn.execute(select(settlement_file.c.id).where(settlement_file.c.superseded_at.is_not(None)))
        assert list(superseded.scalars()) == [first.file_id]
    assert count(engine, manual_review) == 1  # the same difference on the same transaction: escalated once


def test_a_success_no_settlement_file_names_is_local_only_but_one_settled_the_next_day_is_not(engine, tmp_path):
    alone = confirmed_payment(engine, 500)
    late = confirmed_payment(engine, 600)
    settled = confirmed_payment(engine, 700, ref="ch_settled")
    other_day = confirmed_payment(engine, 800, on=DAY - timedelta(days=1))
    run(engine, settlement(tmp_path, csv_line("ch_late", late, 600, day=DAY + timedelta(days=1))), DAY + timedelta(1))
    report = run(engine, settlement(tmp_path, csv_line("ch_settled", settled, 700)))
    found = items(engine, report.run_id)
    assert [i["payment_id"] for i in found[RECON_LOCAL_ONLY]] == [alone]
    assert other_day not in {i["payment_id"] for c in found.values() for i in c}
    (review,) = conn_rows(engine, manual_review)
    assert review["payment_id"] == alone and review["kind"] == "reconciliation_local_only"
    run(engine, settlement(tmp_path, csv_line("ch_settled", settled, 700), name="again.csv"))
    assert count(engine, manual_review) == 1  # once per payment
    assert adjustments(engine) == []


def test_local_only_pages_through_the_days_confirmations_a_range_at_a_time(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "BATCH_LINES", 2)
    ids = [confirmed_payment(engine, 100 + n, ref=f"ch_page_{n}") for n in range(7)]
    settled = [0, 2, 3, 6]
    report = run(engine, settlement(tmp_path, *(csv_line(f"ch_page_{n}", ids[n], 100 + n) for n in settled)))
    found = items(engine, report.run_id)
    assert sorted(i["payment_id"] for i in found[RECON_LOCAL_ONLY]) == sorted([ids[1], ids[4], ids[5]])
    assert len(found[RECON_MATCHED]) == 4


def conn_rows(engine, table) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(table)).mappings()]


def test_refund_lines_match_refunds_by_their_ids(engine, tmp_path):
    paid = confirmed_payment(engine, 1000, ref="ch_paid")
    pending = create_refund(engine, paid, 300)
    done = create_refund(engine, paid, 200)
    confirm(engine, "refund", done)
    report = run(
        engine,
        settlement(
            tmp_path,
            csv_line("ch_paid", paid, 1000, fee=6),
            csv_line("re_a", pending, 300, kind="refund"),
            csv_line("re_b", done, 200, kind="refund"),
            csv_line("re_c", "re_nobody", 50, kind="refund"),
        ),
    )
    found = items(engine, report.run_id)
    assert [i["refund_id"] for i in found[RECON_RESOLVED]] == [pending]
    assert [i["refund_id"] for i in found[RECON_MATCHED] if i["refund_id"]] == [done]
    assert [i["provider_reference"] for i in found[RECON_PROVIDER_ONLY]] == ["re_c"]
    assert [a["details"]["delta"] for a in adjustments(engine)] == [-50]
    with engine.connect() as conn:
        assert ledger.payment_balance(conn, paid) == {"CNY": 500}
    assert_balanced(engine)


def test_fee_lines_and_fee_columns_are_booked_as_the_days_fee_charged(engine, tmp_path):
    paid = confirmed_payment(engine, 1000, ref="ch_paid")
    report = run(
        engine,
        settlement(tmp_path, csv_line("ch_paid", paid, 1000, fee=6), csv_line("ch_usd", "pay_x", 10, currency="USD")),
    )
    assert report.tally.fees == {"CNY": 6}
    with engine.connect() as conn:
        balances = ledger.balances(conn)
    assert balances[(ledger.EXPENSE_FEES, "CNY")] == 6
    assert balances[(ledger.provider_account("sandbox"), "CNY")] == 1000 - 6


def test_a_fee_line_of_a_plug_in_parser_is_a_fee_item(engine, tmp_path, monkeypatch):
    def parser(stream):
        yield SettlementLine(1, "fees", FEE, fee_minor=42, currency="CNY")
        yield SettlementLine(2, "rebate", FEE, fee_minor=-2, currency="CNY")

    monkeypatch.setitem(reconcile.PARSERS, "other", ("other_bill", parser))
    report = run(engine, settlement(tmp_path), provider="other")
    assert report.tally.count(RECON_FEE) == 2 and report.tally.fees_booked == {"CNY": 40}


def test_an_unreadable_line_is_kept_and_escalated_once(engine, tmp_path):
    path = settlement(tmp_path, "this,is,not,a,line")
    run(engine, path)
    run(engine, path)
    with engine.connect() as conn:
        raw = conn.execute(select(settlement_line.c.raw).where(settlement_line.c.kind == INVALID)).scalar_one()
    assert raw == "this,is,not,a,line"
    assert count(engine, manual_review, manual_review.c.kind == "reconciliation_unreadable") == 1


def test_a_file_in_another_format_fails_the_run_and_says_why(engine, tmp_path):
    path = tmp_path / "wrong.csv"
    path.write_text("date,amount\n2024-03-01,5\n")
    with pytest.raises(SettlementFormatError):
        run(engine, path)
    with engine.connect() as conn:
        status, error = conn.execute(select(reconciliation_run.c.status, reconciliation_run.c.error)).one()
    assert status == "failed" and "not a sandbox settlement header" in error


# --- a property: whatever the books and the file, two runs leave the same, balanced books ---------------

LOCAL_STATES = st.sampled_from(["none", "Created", "Pending", "Unknown", "Succeeded", "Failed"])
SCENARIO = st.lists(
    st.tuples(
        LOCAL_STATES,
        st.sampled_from(["succeeded", "failed", "absent"]),
        st.integers(1, 5000),
        st.integers(-2, 2),
        st.integers(0, 30),
        st.sampled_from(["CNY", "CNY", "USD"]),
    ),
    min_size=1,
    max_size=12,
)


@pytest.fixture(scope="module")
def property_db(tmp_path_factory):
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('recon') / 'recon.db'}")
    init_db(engine)
    yield engine
    engine.dispose()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SCENARIO, st.integers(0, 10**6))
def test_any_books_and_file_reconcile_to_the_same_balanced_books_on_a_second_run(property_db, tmp_path, rows, seed):
    engine = property_db
    day = DAY + timedelta(days=seed)  # a day of this example's own
    lines = seed_books(engine, rows, seed, day)
    path = settlement(tmp_path, *lines)
    first = run(engine, path, day)
    events = count(engine, ledger_event)
    second = run(engine, path, day)
    assert count(engine, ledger_event) == events
    assert second.tally.adjustments == 0 and second.tally.reviews == 0 and second.tally.resolved == 0
    for report in (first, second):
        assert sum(c["count"] for c in report.tally.as_dict()["categories"].values() if c) >= len(lines)
        assert count(engine, reconciliation_item, reconciliation_item.c.run_id == report.run_id) == sum(
            c["count"] for c in report.tally.as_dict()["categories"].values()
        )
    assert_balanced(engine)
    # After reconciliation our receivable for each of the file's transactions is what the provider says.
    for text in lines:
        ref, _, kind, amount, _, currency, status, _ = text.split(",")
        entry = ledger.ledger_entry
        with engine.connect() as conn:
            held = conn.execute(
                select(entry.c.currency, func.sum(entry.c.amount_minor))
                .join(ledger_event, ledger_event.c.id == entry.c.ledger_event_id)
                .join(payment, payment.c.payment_id == ledger_event.c.payment_id, isouter=True)
                .where(
                    entry.c.account == ledger.provider_account("sandbox"),
                    ledger_event.c.event_type.in_(["PaymentConfirmed", ledger.RECONCILIATION_ADJUSTED]),
                    (ledger_event.c.dedupe_key.startswith(f"ReconciliationAdjusted:sandbox:charge:{ref}:"))
                    | ((payment.c.provider_transaction_id == ref) & (ledger_event.c.event_type == "PaymentConfirmed")),
                )
                .group_by(entry.c.currency)
            ).all()
        assert {c: int(v) for c, v in held if v} == ({currency: int(amount)} if status == "succeeded" else {}), text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(SCENARIO, st.integers(0, 10**6))
def test_the_databases_fast_path_takes_exactly_the_lines_classify_calls_matched(
    property_db, tmp_path, monkeypatch, rows, seed
):
    engine = property_db
    day = DAY + timedelta(days=seed)
    lines = seed_books(engine, rows, seed, day)
    original = reconcile._Run._write_agreeing
    checked_batches = []

    def compare(self, conn, batch, now):
        found = self._match(conn, [line for line in batch if line.kind in (CHARGE, REFUND)])
        expected = {
            line.line_no
            for line in batch
            if (local := found.get(line.line_no)) is not None
            and local.provider_reference == line.provider_reference
            and classify(line, local, self.accounts).category == RECON_MATCHED
        }
        taken = original(self, conn, batch, now)
        assert taken == expected
        checked_batches.append(len(batch))
        return taken

    monkeypatch.setattr(reconcile._Run, "_write_agreeing", compare)
    run(engine, settlement(tmp_path, *lines), day)
    assert checked_batches


def seed_books(engine, rows, seed, day) -> list[str]:
    """Local records in the given states and the provider's lines about them; returns the lines."""
    lines = []
    for n, (state, provider_status, amount, drift, fee, currency) in enumerate(rows):
        ref = f"ch_{seed}_{n}_{uuid.uuid4().hex[:6]}"
        ours = f"pay_{uuid.uuid4().hex[:20]}"
        if state == "Succeeded":
            ours = confirmed_payment(engine, amount, ref=ref, on=day)
        elif state == "Failed":
            ours = create_payment(engine, amount=amount, status="Pending", provider_transaction_id=ref)
            confirm(engine, "payment", ours, PaymentStatus.FAILED)
        elif state != "none":
            known = ref if amount % 2 else None  # some unresolved payments already know the provider's id
            ours = create_payment(engine, amount=amount, status=state, provider_transaction_id=known)
        if provider_status != "absent":
            the_fee = fee if provider_status == "succeeded" else 0
            amount = max(1, amount + drift)
            lines.append(csv_line(ref, ours, amount, fee=the_fee, status=provider_status, day=day, currency=currency))
    return lines


def runtime_for(engine):
    return build_runtime(make_settings(database_url=engine.url.render_as_string(hide_password=False)), engine=engine)


# --- the compensator job, the lock, the command ---------------------------------------------------------


class FileProvider:
    """A provider adapter at the network edge: serves prepared settlement files, or is unreachable."""

    name = "sandbox"

    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.asked: list[str] = []

    def settlement(self, day: str, timeout: float):
        self.asked.append(day)
        if day not in self.files:
            raise ProviderUnavailable(f"no file for {day}")
        data = self.files[day]
        return iter([data[: len(data) // 2], data[len(data) // 2 :]])


def test_the_daily_job_reconciles_the_last_days_and_skips_a_file_it_already_reconciled(engine, tmp_path):
    settings_ = make_settings(database_url=engine.url.render_as_string(hide_password=False), reconcile_days_back=3)
    runtime = build_runtime(settings_, engine=engine)
    unknown = create_payment(engine, amount=900, status="Unknown")
    today = DAY + timedelta(days=3)
    files = {
        DAY.isoformat(): (HEADER + "\n" + csv_line("ch_u", unknown, 900) + "\n").encode(),
        (DAY + timedelta(days=1)).isoformat(): (HEADER + "\n").encode(),
    }
    provider = FileProvider(files)
    runtime.providers["sandbox"] = provider
    assert reconcile_job.run_once(runtime, today=today) == 2  # the third day has no file yet
    assert provider.asked == [(DAY + timedelta(days=n)).isoformat() for n in range(3)]
    assert status_of(engine, unknown)[0] == "Succeeded"
    assert reconcile_job.run_once(runtime, today=today) == 0  # nothing changed since
    files[(DAY + timedelta(days=2)).isoformat()] = (HEADER + "\n").encode()
    assert reconcile_job.run_once(runtime, today=today) == 1
    assert count(engine, reconciliation_run) == 3


def test_a_broken_download_imports_nothing(engine):
    class Broken(FileProvider):
        def settlement(self, day, timeout):
            yield (HEADER + "\n").encode()
            raise ProviderUnavailable("connection reset after 90 bytes")

    with pytest.raises(ProviderUnavailable):
        reconcile.download(Broken({}), DAY, 1.0)
    assert count(engine, settlement_file) == 0


@pytest.mark.mariadb
def test_one_reconciliation_at_a_time(mariadb, tmp_path):
    runtime = runtime_for(mariadb)
    path = settlement(tmp_path)
    with named_lock(mariadb, reconcile.LOCK_NAME) as held:
        assert held
        assert reconcile_job.run_once(runtime, today=DAY) == 0
        with pytest.raises(reconcile.ReconcileError, match="holds the lock"):
            reconcile_job.reconcile_command(runtime, DAY, ["sandbox"], str(path), wait_seconds=0)
    (report,) = reconcile_job.reconcile_command(runtime, DAY, ["sandbox"], str(path), wait_seconds=0)
    assert report.status == "completed"


@pytest.mark.mariadb
def test_a_reconciliation_runs_on_connections_that_wait_for_a_long_statement(mariadb, tmp_path, monkeypatch):
    """The request paths' 10 s read timeout failed a 1,000,000-line day in its local-only pass on a cold database."""
    runtime = runtime_for(mariadb)
    timeouts = []
    original = reconcile_job.reconcile

    def spy(engine, *args, **kwargs):
        with engine.connect() as conn:
            timeouts.append(conn.connection.dbapi_connection._read_timeout)
        return original(engine, *args, **kwargs)

    monkeypatch.setattr(reconcile_job, "reconcile", spy)
    (report,) = reconcile_job.reconcile_command(runtime, DAY, ["sandbox"], str(settlement(tmp_path)), wait_seconds=0)
    assert report.status == "completed"
    with mariadb.connect() as conn:
        assert conn.connection.dbapi_connection._read_timeout == 10  # the request paths keep theirs
    assert timeouts == [reconcile_job.STATEMENT_TIMEOUT_SECONDS]


def compensator_command(engine, *args: str) -> subprocess.CompletedProcess:
    env = env_for({"DATABASE_URL": engine.url.render_as_string(hide_password=False), "PAYSYNC_ENV": "development"})
    return subprocess.run(
        [sys.executable, "-m", "compensator", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_reconcile_command_reads_a_given_file_and_prints_the_run_as_json(engine, tmp_path):
    unknown = create_payment(engine, amount=900, status="Unknown")
    path = settlement(tmp_path, csv_line("ch_u", unknown, 900, fee=5), csv_line("ch_x", "pay_x", 10))
    result = compensator_command(
        engine, "reconcile", "--date", DAY.isoformat(), "--provider", "sandbox", "--file", str(path), "--format", "json"
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["status"] == "completed" and body["file"]["lines"] == 3 and body["file"]["new_lines"] == 3
    assert body["categories"][RECON_RESOLVED]["count"] == 1
    assert body["categories"][RECON_PROVIDER_ONLY] == {"count": 1, "amounts": {"CNY": {"provider": 10, "local": 0}}}
    assert body["fees_booked"] == {"CNY": 5} and body["unexplained"] == 1
    text = compensator_command(engine, "reconcile", "--date", DAY.isoformat(), "--provider", "sandbox", "--file", path)
    assert text.returncode == 0 and "imported before: no new lines" in text.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["reconcile"], "--date"),
        (["reconcile", "--date", "2024-02-30"], "real day"),
        (["reconcile", "--date", "20240301"], "real day"),
        (["reconcile", "--date", "2024-03-01", "--file", "x.csv"], "--provider"),
    ],
)
def test_the_reconcile_command_refuses_bad_arguments(sqlite, args, message):
    result = compensator_command(sqlite, *args)
    assert result.returncode == 2 and message in result.stderr


def test_the_reconcile_command_says_why_a_file_cannot_be_had(sqlite, tmp_path):
    result = compensator_command(
        sqlite, "reconcile", "--date", "2024-03-01", "--provider", "sandbox", "--file", str(tmp_path / "none.csv")
    )
    assert result.returncode == 1 and "No such file" in result.stderr
    result = compensator_command(sqlite, "reconcile", "--date", "2024-03-01", "--provider", "nowhere")
    assert result.returncode == 1 and "not configured" in result.stderr


# --- flat memory -----------------------------------------------------------------------------------------


def test_memory_stays_flat_however_long_the_file(sqlite, tmp_path, monkeypatch):
    monkeypatch.setattr(reconcile, "BATCH_LINES", 500)  # both files span many batches

    def peak(n: int, day: date) -> int:
        now = utcnow()
        rows = [
            {
                "payment_id": f"pay_{n}_{i}",
                "order_no": f"o{i}",
                "amount_minor": 100 + i,
                "currency": "CNY",
                "provider": "sandbox",
                "provider_transaction_id": f"ch_{n}_{i}",
                "status": "Succeeded",
                "query_attempts": 0,
                "created_at": now,
                "updated_at": now,
            }
            for i in range(n)
        ]
        with sqlite.begin() as conn:
            conn.execute(insert(payment), rows)
        del rows
        path = tmp_path / f"{n}.csv"
        with path.open("w") as f:
            f.write(HEADER + "\n")
            for i in range(n):
                f.write(csv_line(f"ch_{n}_{i}", f"pay_{n}_{i}", 100 + i, fee=1, day=day) + "\n")
        tracemalloc.start()
        report = run(sqlite, path, day)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert report.line_count == n + 1 and report.tally.count(RECON_MATCHED) == n
        return top

    small = peak(2_000, DAY)
    large = peak(20_000, DAY + timedelta(days=1))
    assert large < small * 1.5 + 1_000_000, (small, large)


# --- aging -----------------------------------------------------------------------------------------------


def test_aging_shows_where_each_payment_stands_across_the_three_records_by_age(engine, tmp_path):
    now = utcnow()
    today = now.date()
    # The report is read at the end of today; the undelivered callback is 5 hours old then, whatever the hour now
    # (5 hours before now would be over a day old at 23:59 when the test runs before 05:00 UTC).
    report_at = now.replace(hour=23, minute=59)
    settled_unknown = create_payment(engine, amount=100, status="Unknown")
    confirmed_payment(engine, 200, ref="ch_unsettled", on=today)
    old = confirmed_payment(engine, 300, ref="ch_old", on=today - timedelta(days=2))
    paid = confirmed_payment(engine, 400, ref="ch_paid", on=today)
    refund_id = create_refund(engine, paid, 50)
    with engine.begin() as conn:
        conn.execute(
            insert(payment_callback_log).values(
                provider="sandbox",
                callback_data=b"{}",
                headers="{}",
                status=0,
                retry_count=0,
                next_retry_at=now,
                create_time=report_at - timedelta(hours=5),
                update_time=now,
            )
        )
    path = settlement(
        tmp_path,
        csv_line("ch_paid", paid, 400, day=today),
        csv_line("ch_s", settled_unknown, 100, status="succeeded", day=today),
    )
    # Import only (the file as the provider has it), without resolving: the aging report reads the three records.
    with engine.begin() as conn:
        conn.execute(
            insert(settlement_file).values(
                provider="sandbox",
                settlement_date=today,
                format="sandbox_csv",
                source="test",
                sha256="b" * 64,
                size_bytes=1,
                status="imported",
                created_at=now,
                imported_at=now,
            )
        )
        file_id = conn.execute(select(settlement_file.c.id)).scalar_one()
        for n, text in enumerate(path.read_text().splitlines()[1:], start=2):
            from payments.providers.sandbox.bill import read_line

            parsed = read_line(n, text, text.split(","))
            conn.execute(insert(settlement_line).values(**reconcile._line_row(file_id, parsed)))
    report = aging.aging(engine, now=report_at)
    by = report["categories"]
    assert by["callback_not_applied"]["<1d"]["count"] == 1
    assert sum(b["count"] for b in by["succeeded_not_settled"].values()) == 2
    assert by["succeeded_not_settled"]["<3d"]["amounts"] == {"CNY": 300}, old
    assert sum(b["count"] for b in by["settled_not_succeeded"].values()) == 1
    assert sum(b["amounts"].get("CNY", 0) for b in by["settled_not_succeeded"].values()) == 100
    assert sum(b["count"] for b in by["refunds_pending"].values()) == 1, refund_id
    assert "succeeded_not_settled" in aging.describe(report)
    result = compensator_command(engine, "aging", "--format", "json")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(result.stdout)["categories"]) == set(aging.CATEGORIES)


def test_read_ahead_yields_every_item_in_order_and_raises_the_producers_error_where_it_was_reached():
    assert list(reconcile.read_ahead(iter(range(100)), depth=2)) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise SettlementFormatError("line 3: not a sandbox settlement file")

    got = []
    with pytest.raises(SettlementFormatError, match="line 3"):
        for item in reconcile.read_ahead(failing()):
            got.append(item)
    assert got == [1, 2]


def test_read_ahead_stays_at_most_depth_ahead_and_a_caller_that_stops_stops_its_thread():
    produced = []

    def counting():
        for n in range(1000):
            produced.append(n)
            yield n

    items = reconcile.read_ahead(counting(), depth=1)
    assert next(items) == 0
    threading.Event().wait(0.3)  # time for the producer to run ahead if it would
    assert len(produced) <= 3  # the one handed over, one queued, one waiting to be queued: bounded memory
    items.close()  # the caller's loop ended (an exception in its batch, say)
    assert not any(t.name == "reconcile-read-ahead" for t in threading.enumerate())
    assert len(produced) <= 3


def test_batches_start_small_and_grow_to_the_batch_size_every_line_once_in_order():
    from itertools import islice

    assert list(islice(reconcile.batch_sizes(5000), 6)) == [625, 1250, 2500, 5000, 5000, 5000]
    assert list(islice(reconcile.batch_sizes(1), 2)) == [1, 1]
    lines = [SettlementLine(n, f"line {n}", "info") for n in range(1, 12_001)]
    batches = list(reconcile._checked_batches(lines, 5000))
    assert [len(b) for b in batches] == [625, 1250, 2500, 5000, 2625]
    assert [line for batch in batches for line in batch] == lines


def test_ordered_map_keeps_order_bounds_what_waits_and_raises_where_the_error_was_due():
    import time as clock

    running, most = [0], [0]
    lock = threading.Lock()

    def slow(n: int) -> int:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        clock.sleep(0.01 * (n % 3))
        with lock:
            running[0] -= 1
        if n == 7:
            raise ValueError("seven")
        return n * n

    got = []
    with pytest.raises(ValueError, match="seven"):
        for value in reconcile.ordered_map(slow, range(10), 2):
            got.append(value)
    assert got == [n * n for n in range(7)]
    assert most[0] <= 2
    assert list(reconcile.ordered_map(slow, range(5), 1)) == [n * n for n in range(5)]
