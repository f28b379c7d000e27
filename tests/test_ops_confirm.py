"""Dangerous actions ask first, and an adjustment is bounded by its payment.

Adjust, apply, close and a bulk replay show what they will do and act only
when confirmed; an adjustment larger than its payment, or in another
currency, is refused by ``ops_actions`` itself, so the console and
``review resolve`` refuse it alike.
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import select

from compensator import review_cli
from payments.infra.schema import ledger_event, manual_review, ops_action, payment_callback_log
from payments.money import ledger
from payments.ops import actions as ops_actions
from payments.ops.actions import Actor, OpsRefused
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.ops_console_support import console_app, csrf, flashes, login
from tests.ops_support import given_up_callback, settled_review
from tests.stack import db_url
from tests.support import create_payment, make_settings

ALICE = Actor("alice", "cli")


def _review_status(engine, review_id: int) -> str:
    with engine.connect() as conn:
        return conn.execute(select(manual_review.c.status).where(manual_review.c.id == review_id)).scalar()


def _nothing_written(engine, review_id: int) -> None:
    with engine.connect() as conn:
        assert conn.execute(select(ops_action)).first() is None
        assert (
            conn.execute(
                select(ledger_event).where(ledger_event.c.event_type == ledger.RECONCILIATION_ADJUSTED)
            ).first()
            is None
        )
    assert _review_status(engine, review_id) == "open"


def _adjustable(engine, amount: int = 5000) -> tuple[str, int]:
    payment_id = create_payment(engine, status="Failed", amount=amount)
    review_id, _ = settled_review(engine, payment_id, line_status="succeeded", amount=amount)
    return payment_id, review_id


@pytest.mark.parametrize("amount", [-500000, 5001, -5001])
def test_an_adjustment_larger_than_its_payment_is_refused_and_writes_nothing(engine, amount):
    _, review_id = _adjustable(engine)
    with pytest.raises(OpsRefused, match="more than payment"):
        ops_actions.book_adjustment(engine, review_id, amount_minor=amount, actor=ALICE, note="n")
    _nothing_written(engine, review_id)


def test_an_adjustment_in_another_currency_is_refused(engine):
    _, review_id = _adjustable(engine)
    with pytest.raises(OpsRefused, match="in USD but payment"):
        ops_actions.book_adjustment(engine, review_id, amount_minor=100, currency="USD", actor=ALICE, note="n")
    _nothing_written(engine, review_id)


def test_an_adjustment_up_to_the_payment_amount_is_booked(engine):
    _, review_id = _adjustable(engine)
    result = ops_actions.book_adjustment(engine, review_id, amount_minor=-5000, actor=ALICE, note="provider kept none")
    assert result.details["delta"] == -5000 and _review_status(engine, review_id) == "resolved"


def test_review_resolve_refuses_an_oversized_adjustment_on_the_command_line(engine, capsys):
    runtime = build_runtime(make_settings(database_url=db_url(engine)), engine=engine)
    _, review_id = _adjustable(engine)
    argv = ["resolve", str(review_id), "--action", "adjust", "--amount", "-500000", "--note", "n", "--actor", "ci"]
    assert review_cli.main(argv, runtime) == 1
    assert "-5,000.00 CNY (-500000 minor units) is more than payment" in capsys.readouterr().err
    _nothing_written(engine, review_id)


# --- the console asks first ----------------------------------------------------------------------------------


def _client(engine):
    client = console_app(engine).test_client()
    login(client, name="carol")
    return client


def test_the_console_adjustment_shows_what_it_books_and_acts_only_when_confirmed(engine):
    _, review_id = _adjustable(engine)
    client = _client(engine)
    token = csrf(client.get(f"/ops/reviews/{review_id}").text)
    form = {"csrf": token, "action": "adjust", "amount_minor": "-2500", "note": "provider kept half"}
    page = client.post(f"/ops/reviews/{review_id}/resolve", data=form)
    assert page.status_code == 200 and 'id="confirm-form"' in page.text
    assert "-25.00 CNY (-2500 minor units) on assets:provider:sandbox" in page.text
    assert "50.00 CNY (5000 minor units)" in page.text  # the payment's amount, beside it
    _nothing_written(engine, review_id)
    # The confirmation form carries the same fields, and confirmed=yes.
    assert 'name="amount_minor" value="-2500"' in page.text and 'name="confirmed" value="yes"' in page.text
    done = client.post(f"/ops/reviews/{review_id}/resolve", data={**form, "csrf": csrf(page.text), "confirmed": "yes"})
    assert done.status_code == 302 and _review_status(engine, review_id) == "resolved"
    with engine.connect() as conn:
        [row] = conn.execute(select(ops_action)).mappings().all()
    assert (row["action"], row["actor"]) == ("adjust", "carol")


def test_the_console_refuses_an_oversized_adjustment_before_asking(engine):
    _, review_id = _adjustable(engine)
    client = _client(engine)
    token = csrf(client.get(f"/ops/reviews/{review_id}").text)
    form = {"csrf": token, "action": "adjust", "amount_minor": "-500000", "note": "n", "confirmed": "yes"}
    for data in (form, {k: v for k, v in form.items() if k != "confirmed"}):
        assert client.post(f"/ops/reviews/{review_id}/resolve", data=data).status_code == 302
        [(category, text)] = flashes(client.get(f"/ops/reviews/{review_id}").text)
        assert category == "error" and "more than payment" in text
    _nothing_written(engine, review_id)


@pytest.mark.parametrize("action", ["apply", "close"])
def test_apply_and_close_ask_for_confirmation_first(engine, action):
    _, review_id = _adjustable(engine)
    client = _client(engine)
    token = csrf(client.get(f"/ops/reviews/{review_id}").text)
    page = client.post(f"/ops/reviews/{review_id}/resolve", data={"csrf": token, "action": action, "note": "n"})
    assert page.status_code == 200 and f"Confirm: {action} review {review_id}" in page.text
    _nothing_written(engine, review_id)


def test_a_bulk_replay_lists_the_rows_and_replays_only_when_confirmed(engine):
    ids = [given_up_callback(engine, f"pay_bulkreplay00000{i}") for i in range(3)]
    client = _client(engine)
    token = csrf(client.get("/ops/callbacks").text)
    form = {"csrf": token, "note": "provider outage over", "id": [str(i) for i in ids]}
    page = client.post("/ops/callbacks/replay", data=form)
    assert page.status_code == 200 and "Confirm: replay 3 callbacks" in page.text
    for log_id in ids:
        assert f"callback {log_id}: sandbox" in page.text and f'name="id" value="{log_id}"' in page.text
    with engine.connect() as conn:
        assert set(conn.execute(select(payment_callback_log.c.status)).scalars()) == {CallbackStatus.GAVE_UP}
        assert conn.execute(select(ops_action)).first() is None
    client.post("/ops/callbacks/replay", data={**form, "csrf": csrf(page.text), "confirmed": "yes"})
    with engine.connect() as conn:
        assert set(conn.execute(select(payment_callback_log.c.status)).scalars()) != {CallbackStatus.GAVE_UP}
        assert conn.execute(select(ops_action.c.action)).scalars().all().count("replay") == 6


# --- over the payment's amount: a second operator approves ---------------------------------------------------------


def _adjustments(engine) -> list:
    with engine.connect() as conn:
        return conn.execute(
            select(ledger_event.c.amount_minor, ledger_event.c.details).where(
                ledger_event.c.event_type == ledger.RECONCILIATION_ADJUSTED
            )
        ).all()


def test_an_oversized_adjustment_is_booked_only_once_another_operator_approves_it(engine):
    _, review_id = _adjustable(engine)
    asked = ops_actions.request_adjustment(engine, review_id, amount_minor=-500000, actor=ALICE, note="refund twice")
    assert "approval requested" in asked.outcome and asked.details["approval"] == "requested"
    assert _review_status(engine, review_id) == "open" and _adjustments(engine) == []
    with pytest.raises(OpsRefused, match="already has an adjustment awaiting approval"):
        ops_actions.request_adjustment(engine, review_id, amount_minor=-600000, actor=ALICE, note="again")
    with pytest.raises(OpsRefused, match="another operator must approve it"):
        ops_actions.approve_adjustment(engine, review_id, actor=Actor("Alice", "console"), note="self")
    with pytest.raises(OpsRefused, match="no such adjustment"):
        ops_actions.approve_adjustment(engine, review_id, actor=Actor("bob", "cli"), note="ok", request_id=999)
    assert _review_status(engine, review_id) == "open" and _adjustments(engine) == []

    done = ops_actions.approve_adjustment(
        engine, review_id, actor=Actor("bob", "cli", identity="os user bob"), note="checked the bank statement"
    )
    assert "requested by alice, approved by bob" in done.outcome
    assert _review_status(engine, review_id) == "resolved"
    [(amount, details)] = _adjustments(engine)
    assert amount == 500000 and '"requested_by": "alice"' in details
    with engine.connect() as conn:
        audit = conn.execute(select(ops_action.c.action, ops_action.c.actor).order_by(ops_action.c.id)).all()
    assert [tuple(a) for a in audit] == [("adjust", "alice"), ("adjust", "bob")]
    with pytest.raises(OpsRefused, match="already resolved"):
        ops_actions.approve_adjustment(engine, review_id, actor=Actor("carol", "cli"), note="again")


def test_a_request_within_the_bound_or_in_another_currency_is_refused_and_a_declined_one_books_nothing(engine):
    _, review_id = _adjustable(engine)
    with pytest.raises(OpsRefused, match="needs no approval"):
        ops_actions.request_adjustment(engine, review_id, amount_minor=-5000, actor=ALICE, note="n")
    with pytest.raises(OpsRefused, match="in USD but payment"):
        ops_actions.request_adjustment(engine, review_id, amount_minor=-9000, currency="USD", actor=ALICE, note="n")
    _nothing_written(engine, review_id)
    ops_actions.request_adjustment(engine, review_id, amount_minor=9000, actor=ALICE, note="n")
    bob = Actor("bob", "cli", identity="os user bob")  # another OS user: the same one would be the same person
    declined = ops_actions.decline_adjustment(engine, review_id, actor=bob, note="no evidence")
    assert "declined" in declined.outcome and _review_status(engine, review_id) == "open"
    with pytest.raises(OpsRefused, match="no such adjustment"):
        ops_actions.approve_adjustment(engine, review_id, actor=Actor("bob", "cli"), note="changed my mind")
    assert _adjustments(engine) == []


def test_the_console_asks_a_second_operator_and_books_when_they_approve(engine):
    _, review_id = _adjustable(engine)
    carol = _client(engine)
    token = csrf(carol.get(f"/ops/reviews/{review_id}").text)
    form = {"csrf": token, "action": "adjust", "amount_minor": "-500000", "note": "n", "approval": "request"}
    page = carol.post(f"/ops/reviews/{review_id}/resolve", data=form)
    assert page.status_code == 200 and "another operator (not you) must approve it" in page.text
    carol.post(f"/ops/reviews/{review_id}/resolve", data={**form, "csrf": csrf(page.text), "confirmed": "yes"})
    page = carol.get(f"/ops/reviews/{review_id}").text
    assert 'id="pending-adjustment"' in page and 'id="approve"' not in page  # not for the one who asked
    request_id = re.search(r'name="request_id" value="(\d+)"', page).group(1)
    own = {"csrf": csrf(page), "decision": "approve", "request_id": request_id, "note": "mine", "confirmed": "yes"}
    carol.post(f"/ops/reviews/{review_id}/approval", data=own)
    [(category, text)] = flashes(carol.get(f"/ops/reviews/{review_id}").text)
    assert category == "error" and "another operator must approve it" in text and _adjustments(engine) == []

    dave = console_app(engine).test_client()
    login(dave, name="dave")
    page = dave.get(f"/ops/reviews/{review_id}").text
    assert 'id="approve"' in page
    ask = {"csrf": csrf(page), "decision": "approve", "request_id": request_id, "note": "bank statement checked"}
    confirm = dave.post(f"/ops/reviews/{review_id}/approval", data=ask)
    assert confirm.status_code == 200 and "Confirm: approve the adjustment" in confirm.text
    assert _adjustments(engine) == []
    dave.post(f"/ops/reviews/{review_id}/approval", data={**ask, "csrf": csrf(confirm.text), "confirmed": "yes"})
    assert _review_status(engine, review_id) == "resolved" and len(_adjustments(engine)) == 1
    with engine.connect() as conn:
        audit = conn.execute(select(ops_action.c.actor, ops_action.c.outcome).order_by(ops_action.c.id)).all()
    assert [a for a, _ in audit] == ["carol", "dave"] and "approved by dave" in audit[1][1]


# --- retry all matching ---------------------------------------------------------------------------------------


def test_retry_all_matching_shows_the_count_and_filter_then_replays_in_bounded_batches_audited(engine):
    ids = [given_up_callback(engine, f"pay_retryall0000000{i}") for i in range(5)]
    client = _client(engine)
    listing = client.get("/ops/callbacks?status=4")
    assert '<span id="matching-count">5</span>' in listing.text
    form = {"csrf": csrf(listing.text), "status": "4", "note": "provider outage over"}
    page = client.post("/ops/callbacks/replay-matching", data=form)
    assert page.status_code == 200 and "Confirm: replay all 5 matching callbacks" in page.text
    assert "5 callbacks match status 4 gave_up (5 gave_up)" in page.text
    assert 'name="expected" value="5"' in page.text and f'name="upto_id" value="{ids[-1]}"' in page.text
    with engine.connect() as conn:
        assert set(conn.execute(select(payment_callback_log.c.status)).scalars()) == {CallbackStatus.GAVE_UP}
        assert conn.execute(select(ops_action)).first() is None
    later = given_up_callback(engine, "pay_retryall00000009")  # after the count was confirmed: not taken
    done = client.post(
        "/ops/callbacks/replay-matching",
        data={**form, "csrf": csrf(page.text), "confirmed": "yes", "expected": "5", "upto_id": str(ids[-1])},
    )
    assert done.status_code == 302 and "status=4" in done.headers["Location"]
    with engine.connect() as conn:
        status = dict(conn.execute(select(payment_callback_log.c.id, payment_callback_log.c.status)).all())
        audit = conn.execute(select(ops_action.c.subject, ops_action.c.details).order_by(ops_action.c.id)).all()
    assert [status[i] for i in ids] == [CallbackStatus.PENDING] * 5 and status[later] == CallbackStatus.GAVE_UP
    assert [a.subject for a in audit] == [*(f"callback:{i}" for i in ids), "callbacks matching status 4 gave_up"]
    assert '"replayed": 5' in audit[-1].details and '"confirmed": 5' in audit[-1].details


def test_replay_matching_takes_at_most_what_was_confirmed_in_batches_of_the_given_size(engine):
    from payments.ops.actions import CallbackSearch

    ids = [given_up_callback(engine, f"pay_retrybatch00000{i}") for i in range(5)]
    search = CallbackSearch(status=int(CallbackStatus.GAVE_UP))
    done = ops_actions.replay_matching(engine, search, actor=ALICE, note="n", expected=4, upto_id=ids[-1], batch_size=3)
    assert (done.replayed, done.skipped, done.batches) == (4, 0, 2)
    with engine.connect() as conn:
        left = conn.execute(select(payment_callback_log.c.id).where(payment_callback_log.c.status == 4)).scalars()
        assert list(left) == [ids[-1]]  # oldest first: the fifth was not confirmed
    with pytest.raises(OpsRefused, match="no failed, rejected or given-up callback matches"):
        with engine.connect() as conn:
            ops_actions.preview_replay_matching(conn, CallbackSearch(status=1))


def test_the_command_line_asks_and_another_os_user_approves(engine, capsys, monkeypatch):
    runtime = build_runtime(make_settings(database_url=db_url(engine)), engine=engine)
    _, review_id = _adjustable(engine)
    ask = ["request-adjustment", str(review_id), "--amount", "-500000", "--note", "refunded twice", "--actor", "ci"]
    assert review_cli.main(ask, runtime) == 0 and "approval requested" in capsys.readouterr().out
    approve = ["approve", str(review_id), "--note", "ok", "--actor", "ops2"]
    # Same OS user as the one who asked: the same person, whatever name is typed.
    assert review_cli.main(approve, runtime) == 1 and "another operator must approve" in capsys.readouterr().err
    monkeypatch.setattr(ops_actions, "process_identity", lambda: "os user ops2 (uid 1002) on host")
    assert review_cli.main(approve, runtime) == 0 and "approved by ops2" in capsys.readouterr().out
    assert _review_status(engine, review_id) == "resolved" and len(_adjustments(engine)) == 1
