"""The pure pieces around a status change: what an outcome reports, what the ledger books, what the merchant hears."""

from __future__ import annotations

from datetime import datetime

from hypothesis import given
from hypothesis import strategies as st

from payments.lifecycle import events
from payments.money import ledger
from payments.providers.base import Failed, Mismatch, NotFound, Pending, Succeeded, Unknown, is_answer, reported_status
from payments.states import PaymentStatus, StatusChange

S = PaymentStatus


def test_only_a_definitive_decline_reports_failed_and_anything_unclear_reports_unknown():
    assert reported_status(Succeeded("ch_1")) == S.SUCCEEDED
    assert reported_status(Failed("card_declined")) == S.FAILED
    assert reported_status(Failed("http_401", definitive=False)) == S.UNKNOWN
    assert reported_status(Pending("ch_1")) == S.PENDING
    assert reported_status(Unknown("timeout")) == S.UNKNOWN
    assert reported_status(NotFound()) is None
    refused = Failed("duplicate_order", refusal=True)
    assert reported_status(refused) == S.FAILED, "the first attempt's refusal is a decline"
    assert reported_status(refused, resend=True) == S.UNKNOWN, "a re-send's refusal says nothing about the first"
    assert reported_status(Failed("card_declined"), resend=True) == S.FAILED, "a declined charge is a decline"
    assert reported_status(Mismatch(provider_transaction_id="ch_1")) is None, "never applied as ours"


def test_every_answer_but_unknown_is_healthy_for_the_breaker():
    answers = [Succeeded("c"), Failed("x"), Failed("y", definitive=False), Pending(), NotFound(), Mismatch()]
    assert all(is_answer(o) for o in answers)
    assert not is_answer(Unknown("timeout"))


def change(kind: str, target: PaymentStatus, amount: int = 1000) -> StatusChange:
    return StatusChange(
        kind=kind,
        reference="re_1" if kind == "refund" else "pay_1",
        payment_id="pay_1",
        provider="sandbox",
        amount_minor=amount,
        currency="CNY",
        previous=S.PENDING,
        target=target,
        path=(target,),
        source="callback:7",
    )


@given(
    kind=st.sampled_from(["payment", "refund"]),
    target=st.sampled_from(list(PaymentStatus)),
    amount=st.integers(1, 2**62),
)
def test_a_status_change_books_balanced_lines_for_terminal_states_only(kind, target, amount):
    postings = ledger.status_change_postings(change(kind, target, amount))
    if target not in (S.SUCCEEDED, S.FAILED):
        assert postings is None
        return
    event_type, entries = postings
    assert sum(a for _, a in entries) == 0
    if target == S.SUCCEEDED:
        assert event_type == ledger.CONFIRMED_EVENTS[kind] and len(entries) == 2
        assert ("assets:provider:sandbox", amount if kind == "payment" else -amount) in entries
    else:
        assert (event_type, entries) == (ledger.FAILED_EVENTS[kind], [])


def test_a_refund_event_names_its_refund_and_its_payment():
    event_type, payload = events.status_change_event(
        change("refund", S.SUCCEEDED),
        datetime(2026, 1, 2, 3, 4, 5),
        order_no="order-1",
        provider_reference="rf_9",
        failure_code=None,
    )
    assert event_type == "RefundSucceeded"
    assert payload == {
        "type": "RefundSucceeded",
        "payment_id": "pay_1",
        "refund_id": "re_1",
        "order_no": "order-1",
        "amount": 1000,
        "currency": "CNY",
        "status": "Succeeded",
        "provider": "sandbox",
        "provider_transaction_id": "rf_9",
        "failure_code": None,
        "source": "callback:7",
        "occurred_at": "2026-01-02T03:04:05Z",
    }
