"""The ledger: the chart of accounts as postings, balanced whatever happens, append-only in the database itself."""

from __future__ import annotations

import uuid
from datetime import date

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.exc import DatabaseError

from payments.infra.db import init_db, make_engine, utcnow
from payments.infra.schema import (
    APPEND_ONLY_TABLES,
    ledger_entry,
    ledger_event,
    ledger_seal,
    payment,
    refund,
    settlement_file,
    settlement_line,
)
from payments.lifecycle.transitions import apply_decision
from payments.money import ledger
from payments.states import PaymentStatus, decide
from tests.support import create_payment


def confirm(engine, kind: str, row_id: str, target: PaymentStatus = PaymentStatus.SUCCEEDED, now=None) -> None:
    """Move a Pending payment or refund through the state machine, as a provider's answer would (at ``now``)."""
    table, key = (payment, payment.c.payment_id) if kind == "payment" else (refund, refund.c.refund_id)
    with engine.begin() as conn:
        current = conn.execute(select(table).where(key == row_id)).mappings().one()
        decision = decide(PaymentStatus(current["status"]), target)
        apply_decision(conn, kind, current, decision, source="call:1", now=now or utcnow(), provider_reference=None)


def create_refund(engine, payment_id: str, amount: int, *, status: str = "Pending", currency: str = "CNY") -> str:
    """A refund row as the (coming) refund API would write it."""
    refund_id = f"re_{uuid.uuid4().hex[:20]}"
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(refund).values(
                refund_id=refund_id,
                payment_id=payment_id,
                amount_minor=amount,
                currency=currency,
                provider="sandbox",
                status=status,
                idempotency_key=f"key-{refund_id}",
                created_at=now,
                updated_at=now,
            )
        )
    return refund_id


# --- postings ------------------------------------------------------------------------------------


@given(st.integers(-(10**12), 10**12), st.sampled_from(["sandbox", "alipay", "stripe"]))
def test_every_posting_of_the_chart_balances(amount, provider):
    for entries in (
        ledger.payment_confirmed_entries(provider, amount),
        ledger.refund_confirmed_entries(provider, amount),
        ledger.fee_entries(provider, amount),
        ledger.adjustment_entries(provider, amount),
    ):
        assert sum(a for _, a in entries) == 0
        assert all(isinstance(a, int) for _, a in entries)


def test_unbalanced_lines_are_refused_before_anything_is_written(sqlite):
    with sqlite.begin() as conn, pytest.raises(ledger.UnbalancedEntries):
        ledger.append(
            conn,
            event_type="FeeCharged",
            dedupe_key="x",
            amount_minor=5,
            currency="CNY",
            source_type="test",
            source_id=None,
            now=utcnow(),
            entries=[(ledger.EXPENSE_FEES, 5), (ledger.provider_account("sandbox"), -4)],
        )
    with sqlite.connect() as conn:
        assert conn.execute(select(ledger_event.c.id)).first() is None


def test_append_many_writes_what_append_writes_and_refuses_an_unbalanced_event_before_writing_any(engine):
    now = utcnow()

    def record(n: int, entries: list) -> dict:
        return {
            "event_type": "FeeCharged",
            "dedupe_key": f"fee:{n}",
            "amount_minor": 5,
            "currency": "CNY",
            "source_type": "test",
            "source_id": str(n),
            "now": now,
            "entries": entries,
            "details": {"n": n},
        }

    fee = [(ledger.EXPENSE_FEES, 5), (ledger.provider_account("sandbox"), -5)]
    with engine.begin() as conn, pytest.raises(ledger.UnbalancedEntries):
        ledger.append_many(conn, [record(1, fee), record(2, fee[:1])])
    with engine.connect() as conn:
        assert conn.execute(select(ledger_event.c.id)).first() is None
    with engine.begin() as conn:
        ids = ledger.append_many(conn, [record(1, fee), record(2, []), record(3, list(reversed(fee)))])
        single = ledger.append(conn, **{**record(4, fee), "dedupe_key": "fee:4"})
    with engine.connect() as conn:
        lines = conn.execute(
            select(ledger_entry.c.ledger_event_id, ledger_entry.c.account, ledger_entry.c.amount_minor).order_by(
                ledger_entry.c.id
            )
        ).all()
        keys = dict(conn.execute(select(ledger_event.c.id, ledger_event.c.dedupe_key)).all())
    assert [keys[i] for i in ids] == ["fee:1", "fee:2", "fee:3"]
    # Each event's lines in the order given, under its own id: what the seal digests.
    assert [tuple(line) for line in lines] == [
        (ids[0], ledger.EXPENSE_FEES, 5),
        (ids[0], ledger.provider_account("sandbox"), -5),
        (ids[2], ledger.provider_account("sandbox"), -5),
        (ids[2], ledger.EXPENSE_FEES, 5),
        (single, ledger.EXPENSE_FEES, 5),
        (single, ledger.provider_account("sandbox"), -5),
    ]


# --- property: any sequence of charges, refunds, fees and adjustments ---------------------------------

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("charge"), st.integers(1, 100_000)),
        st.tuples(st.just("decline"), st.integers(1, 100_000)),
        st.tuples(st.just("refund"), st.integers(0, 9), st.integers(1, 100_000), st.booleans()),
        st.tuples(st.just("fee"), st.integers(0, 9), st.integers(-500, 5_000).filter(bool)),
        st.tuples(st.just("adjust"), st.integers(0, 9), st.integers(-100_000, 100_000).filter(bool)),
    ),
    max_size=25,
)


@pytest.fixture(scope="module")
def property_db(tmp_path_factory):
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('ledger') / 'ledger.db'}")
    init_db(engine)
    yield engine
    engine.dispose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPERATIONS)
def test_any_sequence_leaves_every_event_balanced_and_each_payment_at_confirmed_minus_refunded(property_db, ops):
    engine = property_db
    payments: list[str] = []  # confirmed payments of this example, in order
    confirmed: dict[str, int] = {}
    refunded: dict[str, int] = {}
    receivable = 0  # what the provider account must hold for this example's events
    events_before = _count_events(engine)
    for op in ops:
        if op[0] == "charge":
            payment_id = create_payment(engine, amount=op[1], status="Pending")
            confirm(engine, "payment", payment_id)
            payments.append(payment_id)
            confirmed[payment_id] = op[1]
            receivable += op[1]
        elif op[0] == "decline":
            confirm(engine, "payment", create_payment(engine, amount=op[1], status="Pending"), PaymentStatus.FAILED)
        elif not payments:
            continue
        elif op[0] == "refund":
            payment_id = payments[op[1] % len(payments)]
            amount = min(op[2], confirmed[payment_id] - refunded.get(payment_id, 0))
            if amount <= 0:
                continue
            succeeds = op[3]
            confirm(
                engine,
                "refund",
                create_refund(engine, payment_id, amount),
                PaymentStatus.SUCCEEDED if succeeds else PaymentStatus.FAILED,
            )
            if succeeds:
                refunded[payment_id] = refunded.get(payment_id, 0) + amount
                receivable -= amount
        else:
            payment_id = payments[op[1] % len(payments)]
            kind, amount = op[0], op[2]
            entries = (ledger.fee_entries if kind == "fee" else ledger.adjustment_entries)("sandbox", amount)
            with engine.begin() as conn:
                ledger.append(
                    conn,
                    event_type=ledger.FEE_CHARGED if kind == "fee" else ledger.RECONCILIATION_ADJUSTED,
                    dedupe_key=f"{kind}:{uuid.uuid4().hex}",
                    amount_minor=abs(amount),
                    currency="CNY",
                    source_type="test",
                    source_id=None,
                    now=utcnow(),
                    entries=entries,
                    payment_id=payment_id,
                )
            receivable += amount if kind == "adjust" else -amount
    with engine.connect() as conn:
        assert ledger.unbalanced_events(conn) == []
        for payment_id in payments:
            expected = confirmed[payment_id] - refunded.get(payment_id, 0)
            assert ledger.payment_balance(conn, payment_id) == ({"CNY": expected} if expected else {})
        held = conn.execute(
            select(ledger_entry.c.amount_minor)
            .join(ledger_event, ledger_event.c.id == ledger_entry.c.ledger_event_id)
            .where(ledger_event.c.id > events_before, ledger_entry.c.account == ledger.provider_account("sandbox"))
        ).scalars()
        assert sum(held) == receivable
        totals: dict[str, int] = {}
        for (_, currency), amount in ledger.balances(conn).items():
            totals[currency] = totals.get(currency, 0) + amount
        assert all(v == 0 for v in totals.values())


def _count_events(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(ledger_event.c.id).order_by(ledger_event.c.id.desc()).limit(1)).scalar() or 0


# --- append-only, enforced by the database -----------------------------------------------------------


def _rows(now) -> dict[str, dict]:
    return {
        "ledger_event": {
            "event_type": "PaymentRequested",
            "amount_minor": 1,
            "currency": "CNY",
            "source_type": "test",
            "dedupe_key": f"t:{uuid.uuid4().hex}",
            "created_at": now,
        },
        "ledger_entry": {"ledger_event_id": 1, "account": "income:payments", "amount_minor": 0, "currency": "CNY"},
        "ledger_seal": {
            "seq": 1,
            "ledger_event_id": 1,
            "event_digest": "0" * 64,
            "prev_hash": "0" * 64,
            "chain_hash": "0" * 64,
            "max_event_id": 1,
            "sealed_at": now,
        },
        "settlement_line": {
            "settlement_file_id": 1,
            "line_no": 1,
            "kind": "info",
            "raw": "header",
        },
    }


TABLES = {t.name: t for t in (ledger_event, ledger_entry, ledger_seal, settlement_line)}


def test_the_append_only_tables_are_the_ledger_its_seals_the_settlement_lines_and_the_ops_record():
    # ops_action's triggers are exercised with its own rows in tests/test_ops_actions.py.
    assert set(APPEND_ONLY_TABLES) == set(TABLES) | {"ops_action"}


@pytest.mark.parametrize("table_name", sorted(TABLES))
def test_update_and_delete_are_refused_by_the_database(engine, table_name):
    table = TABLES[table_name]
    with engine.begin() as conn:
        conn.execute(insert(table).values(**_rows(utcnow())[table_name]))
    column = next(c for c in table.c if not c.primary_key and c.name not in ("id",))
    for statement in (update(table).values({column.name: column.type.python_type()}), delete(table)):
        with pytest.raises(DatabaseError, match="append-only"), engine.begin() as conn:
            conn.execute(statement)
    with engine.connect() as conn:
        assert len(conn.execute(select(table)).all()) == 1


def test_settlement_files_may_be_marked_imported_while_their_lines_may_not_change(engine):
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            insert(settlement_file).values(
                provider="sandbox",
                settlement_date=date(2024, 3, 1),
                format="sandbox_csv",
                source="download",
                sha256="a" * 64,
                size_bytes=10,
                status="importing",
                created_at=now,
            )
        )
        conn.execute(update(settlement_file).values(status="imported", imported_at=now))
        conn.execute(insert(settlement_line).values(**_rows(now)["settlement_line"]))
    with pytest.raises(DatabaseError, match="append-only"), engine.begin() as conn:
        conn.execute(text("UPDATE settlement_line SET raw = 'forged'"))
