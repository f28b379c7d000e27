"""A replay says what processing did: in the console's banner, in the action record, and from the command line.

Console and ``python -m compensator review replay`` share
``ops_actions.replay_and_process``: the reset is one ops_action row, what
processing then did is a second one, and only a processed row is shown as done.
"""

from __future__ import annotations

import json

from sqlalchemy import select

from compensator import review_cli
from payments.infra.schema import ops_action, payment_callback_log
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.ops_console_support import console_app, csrf, flashes, login
from tests.ops_support import given_up_callback, settled_review
from tests.stack import db_url
from tests.support import create_payment, make_settings


def _actions(engine) -> list[dict]:
    with engine.connect() as conn:
        return [dict(r) for r in conn.execute(select(ops_action).order_by(ops_action.c.id)).mappings()]


def _status(engine, log_id: int) -> int:
    with engine.connect() as conn:
        return conn.execute(select(payment_callback_log.c.status).where(payment_callback_log.c.id == log_id)).scalar()


def _replay_in_console(engine, log_id: int) -> list[tuple[str, str]]:
    client = console_app(engine).test_client()
    login(client, name="carol")
    page = client.get(f"/ops/callbacks/{log_id}")
    client.post("/ops/callbacks/replay", data={"csrf": csrf(page.text), "id": str(log_id), "note": "try again"})
    return flashes(client.get("/ops/").text)


def test_a_console_replay_that_fails_again_shows_a_failure_and_records_it(engine):
    log_id = given_up_callback(engine, "pay_replayfail000001")  # its payment still does not exist: fails again
    [(category, text)] = _replay_in_console(engine, log_id)
    assert category == "error" and "processing FAILED" in text and "retry" in text
    assert _status(engine, log_id) == CallbackStatus.FAILED
    reset, processing = _actions(engine)
    assert reset["outcome"].startswith("replayed: status 4 -> 0")
    assert processing["action"] == "replay" and processing["callback_log_id"] == log_id
    assert processing["outcome"].startswith(f"processing FAILED after replay (ops_action {reset['id']}): retry")
    assert json.loads(processing["details"])["status"] == CallbackStatus.FAILED
    assert (processing["actor"], processing["via"], processing["ops_session_id"]) == (
        "carol",
        "console",
        reset["ops_session_id"],
    )


def test_a_console_replay_that_applies_shows_ok_and_records_it(engine):
    payment_id = "pay_replayok00000001"
    log_id = given_up_callback(engine, payment_id)
    create_payment(engine, payment_id=payment_id)
    [(category, text)] = _replay_in_console(engine, log_id)
    assert category == "ok" and "processed after replay" in text and "applied" in text
    assert _status(engine, log_id) == CallbackStatus.PROCESSED
    assert [a["outcome"].split(" (")[0] for a in _actions(engine)][1] == "processed after replay"


def test_review_replay_on_the_command_line_processes_and_records_the_os_user(engine, capsys):
    runtime = build_runtime(make_settings(database_url=db_url(engine)), engine=engine)
    ok_payment = "pay_clireplay0000001"
    applied = given_up_callback(engine, ok_payment)
    create_payment(engine, payment_id=ok_payment)
    failing = given_up_callback(engine, "pay_clireplay0000002")
    argv = ["replay", str(applied), str(failing), "--note", "key fixed", "--actor", "dave"]
    assert review_cli.main(argv, runtime) == 1  # one of the two failed again
    out, err = capsys.readouterr()
    assert f"callback:{applied}: replayed" in out and "processed after replay" in out
    assert f"callback:{failing}: replayed" in err and "processing FAILED" in err
    assert _status(engine, applied) == CallbackStatus.PROCESSED and _status(engine, failing) == CallbackStatus.FAILED
    rows = _actions(engine)
    assert len(rows) == 4 and {(r["actor"], r["via"], r["action"]) for r in rows} == {("dave", "cli", "replay")}
    assert all(r["identity"].startswith("os user ") for r in rows)  # as `review resolve` records it


def test_review_apply_and_close_on_the_command_line(engine, capsys):
    runtime = build_runtime(make_settings(database_url=db_url(engine)), engine=engine)
    failed = create_payment(engine, status="Failed")
    review_id, _ = settled_review(engine, failed)
    assert review_cli.main(["apply", str(review_id), "--note", "n", "--actor", "erin"], runtime) == 1
    assert "state machine refuses" in capsys.readouterr().err
    assert review_cli.main(["close", str(review_id), "--note", "explained", "--actor", "erin"], runtime) == 0
    assert f"review {review_id}: close: closed with a note" in capsys.readouterr().out
    [row] = _actions(engine)
    assert (row["action"], row["actor"], row["via"], row["manual_review_id"]) == ("close", "erin", "cli", review_id)
    assert row["identity"].startswith("os user ")
