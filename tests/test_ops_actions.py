"""payments/ops/actions.py: every action the console and ``compensator review`` share, on both databases."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select, update
from sqlalchemy.exc import DBAPIError

from payments.inbound.callbacks import CallbackResult, process_callback, store_callback
from payments.infra.db import utcnow
from payments.infra.schema import (
    alert,
    ledger_event,
    manual_review,
    ops_action,
    payment,
    payment_callback_log,
    provider_call,
)
from payments.money import ledger
from payments.ops import actions as ops_actions
from payments.ops.actions import Actor, CallbackSearch, OpsRefused
from payments.outbound.protocol import review
from payments.providers.base import Capabilities, Dedupe, Failed, Pending, Succeeded
from payments.states import CallbackStatus
from tests.fake_provider import FakeProvider
from tests.ops_support import GIVE_UP_AT_ONCE, given_up_callback, providers, review_for, settled_review
from tests.support import create_payment, sandbox_event, signed

ALICE = Actor("alice")


def _one(engine, table, **where):
    with engine.connect() as conn:
        query = select(table)
        for name, value in where.items():
            query = query.where(table.c[name] == value)
        return conn.execute(query).mappings().one()


def _actions(engine):
    with engine.connect() as conn:
        return conn.execute(select(ops_action).order_by(ops_action.c.id)).mappings().all()


def _status(engine, payment_id):
    return _one(engine, payment, payment_id=payment_id)


# --- replay ------------------------------------------------------------------------------------------------


def test_replaying_a_given_up_callback_sends_it_back_to_0_resolves_its_review_and_alert_and_records_who(engine):
    payment_id = "pay_replay00000000001"
    log_id = given_up_callback(engine, payment_id)
    review_id = review_for(engine, callback_log_id=log_id)
    assert _one(engine, alert, rule="callback_gave_up")["status"] == "firing"

    [result] = ops_actions.replay_callbacks(engine, [log_id], actor=ALICE, note="payment row restored")

    row = _one(engine, payment_callback_log, id=log_id)
    assert (row["status"], row["retry_count"]) == (CallbackStatus.PENDING, 0)
    assert "replayed by alice (console)" in row["result"] and "payment row restored" in row["result"]
    assert "was 4 gave_up" in row["result"]
    assert _one(engine, manual_review, id=review_id)["status"] == "resolved"
    assert _one(engine, alert, rule="callback_gave_up")["status"] == "resolved"
    [action] = _actions(engine)
    assert (action["action"], action["actor"], action["via"], action["subject"]) == (
        "replay",
        "alice",
        "console",
        f"callback:{log_id}",
    )
    assert action["reason"] == "payment row restored" and action["manual_review_id"] == review_id
    assert result.ops_action_id == action["id"]

    # The payment exists now: the replayed row applies like any new delivery.
    create_payment(engine, payment_id=payment_id)
    assert process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE) == CallbackResult.APPLIED
    assert _status(engine, payment_id)["status"] == "Succeeded"


def test_a_replayed_row_that_gives_up_again_opens_a_fresh_review(engine):
    log_id = given_up_callback(engine, "pay_replay00000000002")
    first = review_for(engine, callback_log_id=log_id)
    ops_actions.replay_callbacks(engine, [log_id], actor=ALICE, note="try again")
    assert process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE) == CallbackResult.GAVE_UP
    second = review_for(engine, callback_log_id=log_id)
    assert second is not None and second != first


def test_replay_leaves_processed_and_pending_rows_alone_and_records_nothing(engine):
    payment_id = create_payment(engine)
    log_id = given_up_callback(engine, "pay_replay00000000003")
    body, headers = signed(sandbox_event(payment_id))
    fresh = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
    done = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
    assert process_callback(engine, providers(), done, GIVE_UP_AT_ONCE) == CallbackResult.APPLIED

    results = ops_actions.replay_callbacks(engine, [fresh, done, log_id, 999999], actor=ALICE, note="selection")

    assert [r.outcome.split(":")[0] for r in results] == ["skipped", "skipped", "replayed", "skipped"]
    assert _one(engine, payment_callback_log, id=done)["status"] == CallbackStatus.PROCESSED
    assert len(_actions(engine)) == 1


def test_replay_leaves_a_row_refused_for_its_source_refused(engine):
    from gateway import create_app
    from tests.support import make_settings

    payment_id = create_payment(engine)
    settings = make_settings(database_url=str(engine.url), sandbox_source_cidrs=("10.0.0.0/8",))
    client = create_app(settings, engine=engine).test_client()
    body, headers = signed(sandbox_event(payment_id))  # a good signature, from where the provider does not send
    answer = client.post("/callbacks/sandbox", data=body, headers=headers, environ_base={"REMOTE_ADDR": "203.0.113.9"})
    assert answer.status_code == 403
    log_id = _one(engine, payment_callback_log, provider="sandbox")["id"]
    with engine.connect() as conn:
        assert not ops_actions.callback(conn, log_id)["replayable"]  # no button to press

    [result] = ops_actions.replay_callbacks(engine, [log_id], actor=ALICE, note="provider says it sent it")

    assert result.outcome.startswith("skipped: refused for its source")
    assert _one(engine, payment_callback_log, id=log_id)["status"] == CallbackStatus.REJECTED
    assert process_callback(engine, providers(), log_id, GIVE_UP_AT_ONCE) == CallbackResult.SKIPPED
    assert _status(engine, payment_id)["status"] == "Pending" and _actions(engine) == []


@pytest.mark.parametrize("note", ["", "   ", "x" * 501])
def test_replay_needs_a_note_and_changes_nothing_without_one(engine, note):
    log_id = given_up_callback(engine, "pay_replay00000000004")
    with pytest.raises(OpsRefused):
        ops_actions.replay_callbacks(engine, [log_id], actor=ALICE, note=note)
    assert _one(engine, payment_callback_log, id=log_id)["status"] == CallbackStatus.GAVE_UP
    assert _actions(engine) == []


def test_ops_action_refuses_update_and_delete(engine):
    log_id = given_up_callback(engine, "pay_replay00000000005")
    ops_actions.replay_callbacks(engine, [log_id], actor=ALICE, note="append only")
    for statement in (update(ops_action).values(reason="rewritten"), ops_action.delete()):
        with pytest.raises(DBAPIError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(statement)
    assert _actions(engine)[0]["reason"] == "append only"


# --- the callback log --------------------------------------------------------------------------------------


def test_callback_search_filters_and_pages(engine):
    target = create_payment(engine)
    other = create_payment(engine)
    ids = []
    for pid in (target, other, target):
        event = sandbox_event(pid)
        body, headers = signed(event)
        index = {"order_no": pid, "provider_event_id": event["id"]}
        ids.append(
            store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None, index=index)
        )
    with engine.connect() as conn:
        order_no = conn.execute(select(payment.c.order_no).where(payment.c.payment_id == target)).scalar_one()
        by_payment, _ = ops_actions.search_callbacks(conn, CallbackSearch(payment_id=target))
        by_order, _ = ops_actions.search_callbacks(conn, CallbackSearch(order_no=order_no))
        event_id = conn.execute(
            select(payment_callback_log.c.provider_event_id).where(payment_callback_log.c.id == ids[1])
        ).scalar()
        by_event, _ = ops_actions.search_callbacks(conn, CallbackSearch(provider_event_id=event_id))
        by_status, _ = ops_actions.search_callbacks(conn, CallbackSearch(status=1))
        page1, after = ops_actions.search_callbacks(conn, CallbackSearch(limit=2))
        page2, last = ops_actions.search_callbacks(conn, CallbackSearch(limit=2, before_id=after))
        future, _ = ops_actions.search_callbacks(conn, CallbackSearch(since=utcnow()))
    assert [r["id"] for r in by_payment] == [ids[2], ids[0]] == [r["id"] for r in by_order]
    assert [r["id"] for r in by_event] == [ids[1]]
    assert by_status == [] and future == []
    assert [r["id"] for r in page1 + page2] == ids[::-1] and last is None


def test_a_callback_is_shown_with_its_secrets_redacted(engine):
    payment_id = create_payment(engine)
    event = sandbox_event(payment_id, card_number="4111 1111 1111 1111", api_secret="s3cr3t-value-here")
    body, headers = signed(event)
    headers["Authorization"] = "Bearer abcdef0123456789"
    log_id = store_callback(engine, provider="sandbox", body=body, headers=headers, remote_addr=None)
    with engine.connect() as conn:
        shown = ops_actions.callback(conn, log_id)
    text_shown = shown["body"] + json.dumps(shown["headers"])
    for secret in ("4111 1111 1111 1111", "s3cr3t-value-here", "abcdef0123456789"):
        assert secret not in text_shown
    assert "[REDACTED" in shown["body"] and shown["headers"]["Authorization"] == "[REDACTED]"
    assert payment_id in shown["body"]


# --- the manual queue --------------------------------------------------------------------------------------


def test_apply_takes_the_verdict_of_the_settlement_line_through_the_state_machine(engine):
    payment_id = create_payment(engine, status="Unknown")
    review_id, item_id = settled_review(engine, payment_id, line_status="succeeded", category="resolved")

    result = ops_actions.apply_verdict(engine, {}, review_id, actor=ALICE, note="the file says settled")

    row = _status(engine, payment_id)
    assert (row["status"], row["status_source"]) == ("Succeeded", f"reconciliation:{item_id}")
    with engine.connect() as conn:
        assert [e["event_type"] for e in ledger.history(conn, payment_id)] == ["PaymentConfirmed"]
    assert _one(engine, manual_review, id=review_id)["resolved_by"] == "alice"
    [action] = _actions(engine)
    assert action["action"] == "apply" and "Unknown -> Succeeded" in action["outcome"]
    assert result.details["evidence"] == f"reconciliation:{item_id}"


def test_apply_refuses_what_the_state_machine_refuses_and_leaves_the_review_open(engine):
    payment_id = create_payment(engine, status="Failed")
    review_id, _ = settled_review(engine, payment_id, line_status="succeeded")
    with pytest.raises(OpsRefused, match="state machine refuses"):
        ops_actions.apply_verdict(engine, {}, review_id, actor=ALICE, note="try")
    assert _status(engine, payment_id)["status"] == "Failed"
    assert _one(engine, manual_review, id=review_id)["status"] == "open"
    assert _actions(engine) == []


def test_apply_queries_the_provider_when_no_line_names_the_payment(engine):
    payment_id = create_payment(engine, status="Unknown", provider="fake")
    current = dict(_status(engine, payment_id))
    with engine.begin() as conn:
        review(conn, current, "unresolved_payment", "still Unknown at its deadline", utcnow())
    review_id = review_for(engine, payment_id=payment_id)
    fake = FakeProvider(
        Capabilities(Dedupe.KEY, query_by_merchant_id=True),
        queries=[Pending(), Failed("card_declined")],
    )

    with pytest.raises(OpsRefused, match="no final verdict"):
        ops_actions.apply_verdict(engine, {"fake": fake}, review_id, actor=ALICE, note="ask them")
    assert _one(engine, manual_review, id=review_id)["status"] == "open"
    ops_actions.apply_verdict(engine, {"fake": fake}, review_id, actor=ALICE, note="ask again")

    row = _status(engine, payment_id)
    with engine.connect() as conn:
        calls = conn.execute(select(provider_call).order_by(provider_call.c.id)).mappings().all()
    assert [c["outcome"] for c in calls] == ["Pending", "Failed"] and fake.queries == [payment_id] * 2
    assert (row["status"], row["error_code"], row["status_source"]) == (
        "Failed",
        "card_declined",
        f"query:{calls[1]['id']}",
    )
    assert _one(engine, manual_review, id=review_id)["status"] == "resolved"


def test_apply_when_already_in_the_verdicts_state_resolves_and_moves_nothing(engine):
    payment_id = create_payment(engine, status="Succeeded", provider="fake", provider_transaction_id="ch_1")
    current = dict(_status(engine, payment_id))
    with engine.begin() as conn:
        review(conn, current, "provider_answer_needs_review", "look", utcnow())
    review_id = review_for(engine, payment_id=payment_id)
    fake = FakeProvider(Capabilities(Dedupe.KEY, query_by_merchant_id=True), queries=[Succeeded("ch_1")])
    result = ops_actions.apply_verdict(engine, {"fake": fake}, review_id, actor=ALICE, note="confirm")
    assert "already Succeeded" in result.outcome
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ledger_event)).scalar_one() == 0


def test_apply_without_any_verdict_is_refused(engine):
    payment_id = create_payment(engine, status="Unknown", provider="nobody")
    current = dict(_status(engine, payment_id))
    with engine.begin() as conn:
        review(conn, current, "unknown_provider", "no adapter", utcnow())
    with pytest.raises(OpsRefused, match="no verdict"):
        ops_actions.apply_verdict(engine, {}, review_for(engine, payment_id=payment_id), actor=ALICE, note="n")


def test_an_adjustment_books_reconciliation_adjusted_into_suspense_once(engine):
    payment_id = create_payment(engine, status="Failed", amount=2500)
    review_id, _ = settled_review(engine, payment_id, line_status="succeeded", amount=2500)

    result = ops_actions.book_adjustment(engine, review_id, amount_minor=2500, actor=ALICE, note="provider kept it")

    with engine.connect() as conn:
        [event] = ledger.history(conn, payment_id)
        suspense = ops_actions.suspense_balances(conn)
        assert ledger.unbalanced_events(conn) == []
    assert event["event_type"] == "ReconciliationAdjusted" and event["source"] == f"ops:review:{review_id}"
    assert {(e["account"], e["amount"]) for e in event["entries"]} == {
        ("assets:provider:sandbox", 2500),
        ("suspense:reconciliation", -2500),
    }
    assert suspense == {"CNY": -2500}
    assert result.details["ledger_event_id"] and _status(engine, payment_id)["status"] == "Failed"
    with pytest.raises(OpsRefused, match="already resolved"):
        ops_actions.book_adjustment(engine, review_id, amount_minor=1, actor=ALICE, note="again")


@pytest.mark.parametrize("amount", [0, 2**63, True, 1.5])
def test_an_adjustment_needs_a_whole_non_zero_amount(engine, amount):
    payment_id = create_payment(engine, status="Failed")
    review_id, _ = settled_review(engine, payment_id)
    with pytest.raises(OpsRefused):
        ops_actions.book_adjustment(engine, review_id, amount_minor=amount, actor=ALICE, note="n")
    assert _one(engine, manual_review, id=review_id)["status"] == "open"


def test_close_resolves_with_the_note_once(engine):
    log_id = given_up_callback(engine, "pay_close000000000001")
    review_id = review_for(engine, callback_log_id=log_id)
    outcome = ops_actions.close_review(engine, review_id, actor=Actor("bob", "cli"), note="duplicate of 41")
    row = _one(engine, manual_review, id=review_id)
    assert (row["status"], row["resolved_by"], row["resolution"]) == ("resolved", "bob", "close: duplicate of 41")
    assert outcome.ops_action_id == _actions(engine)[0]["id"] and _actions(engine)[0]["via"] == "cli"
    with pytest.raises(OpsRefused, match="already resolved"):
        ops_actions.close_review(engine, review_id, actor=ALICE, note="again")
    assert len(_actions(engine)) == 1


def test_review_detail_shows_each_kind_of_evidence(engine):
    payment_id = create_payment(engine, status="Failed")
    log_id = given_up_callback(engine, "pay_other00000000001")  # then named as this payment's, as a peek would
    with engine.begin() as conn:
        conn.execute(
            update(payment_callback_log).where(payment_callback_log.c.id == log_id).values(order_no=payment_id)
        )
    review_id, item_id = settled_review(engine, payment_id, line_status="succeeded")
    with engine.connect() as conn:
        item = ops_actions.review_detail(conn, review_id)
    evidence = item["evidence"]
    assert [c["id"] for c in evidence["callbacks"]] == [log_id]
    assert [i["id"] for i in evidence["reconciliation_items"]] == [item_id]
    line = evidence["reconciliation_items"][0]["settlement_line"]
    assert line["status"] == "succeeded" and "abc123secret" not in line["raw"]
    assert item["payment"]["payment_id"] == payment_id


def test_overview_counts_backlog_alerts_and_unknown_payments_by_age(engine):
    create_payment(engine, status="Unknown", amount=700)
    given_up_callback(engine, "pay_over000000000001")
    with engine.connect() as conn:
        data = ops_actions.overview(conn, utcnow())
    assert data["callbacks_by_status"]["gave_up"] == 1 and data["manual_review_open"] == 1
    assert data["unknown_payments_by_age"]["<1h"] == {"count": 1, "amounts": {"CNY": 700}}
    assert [a["rule"] for a in data["alerts"]] == ["callback_gave_up"]
    assert data["rates"]["callbacks_received"] == 1 and data["rates"]["callbacks_failed"] == 1


def test_an_actor_needs_a_printable_name():
    for name in ("", "  ", "x" * 65, "a\x00b"):
        with pytest.raises(OpsRefused):
            Actor(name)
    assert Actor("  Ada   Lovelace ").name == "Ada Lovelace"
