"""seal_ledger and verify-ledger: every committed event sealed, in commit order, and any edit behind our back caught."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import timedelta

import pytest
from sqlalchemy import func, insert, select, text

from compensator import seal_ledger
from payments.infra.db import init_db, utcnow
from payments.infra.schema import APPEND_ONLY_TABLES, ledger_seal, ledger_seal_gap
from payments.money import ledger
from payments.runtime import build_runtime
from tests.support import ROOT, env_for, make_settings


def append_event(conn, *, amount: int = 100, created_at=None) -> int:
    """One balanced ledger event in ``conn``'s transaction."""
    return ledger.append(
        conn,
        event_type="PaymentConfirmed",
        dedupe_key=f"PaymentConfirmed:{uuid.uuid4().hex}",
        amount_minor=amount,
        currency="CNY",
        source_type="test",
        source_id=None,
        now=created_at or utcnow(),
        entries=ledger.payment_confirmed_entries("sandbox", amount),
        payment_id=f"pay_{uuid.uuid4().hex[:20]}",
    )


def write_events(engine, n: int, **kwargs) -> list[int]:
    with engine.begin() as conn:
        return [append_event(conn, amount=100 + i, **kwargs) for i in range(n)]


def seals(engine) -> list[tuple[int, int]]:
    with engine.connect() as conn:
        rows = conn.execute(select(ledger_seal.c.seq, ledger_seal.c.ledger_event_id).order_by(ledger_seal.c.seq))
        return [tuple(r) for r in rows]


def runtime_for(engine):
    return build_runtime(make_settings(database_url=engine.url.render_as_string(hide_password=False)), engine=engine)


@pytest.fixture
def runtime(engine):
    return runtime_for(engine)


@pytest.fixture
def triggers_dropped(engine):
    """The append-only triggers dropped, as someone editing the database behind paysync's back would; put back after."""
    with engine.begin() as conn:
        for table in APPEND_ONLY_TABLES:
            for op in ("update", "delete"):
                conn.execute(text(f"DROP TRIGGER IF EXISTS {table}_no_{op}"))
    yield engine
    init_db(engine)


def test_it_no_ops_on_an_empty_ledger(runtime):
    assert seal_ledger.run_once(runtime) == 0
    result = seal_ledger.verify(runtime.engine)
    assert result.ok and result.verified == 0 and result.head_hash == seal_ledger.GENESIS


def test_every_event_is_sealed_once_and_the_chain_verifies(runtime):
    ids = write_events(runtime.engine, 5)
    assert seal_ledger.run_once(runtime) == 5
    assert seal_ledger.run_once(runtime) == 0
    more = write_events(runtime.engine, 3)
    assert seal_ledger.run_once(runtime, full_scan=False) == 3
    assert seals(runtime.engine) == list(enumerate(ids + more, start=1))
    result = seal_ledger.verify(runtime.engine)
    assert result.ok, seal_ledger.describe(result)
    assert result.verified == 8 and result.head_seq == 8


def test_batches_link_on_from_each_other(runtime):
    write_events(runtime.engine, 7)
    assert seal_ledger.seal(runtime.engine, batch=3) == 7
    assert seal_ledger.verify(runtime.engine, batch=2).verified == 7


def test_a_changed_line_is_caught(runtime, triggers_dropped):
    ids = write_events(runtime.engine, 4)
    seal_ledger.run_once(runtime)
    with runtime.engine.begin() as conn:
        conn.execute(
            text("UPDATE ledger_entry SET amount_minor = amount_minor + 1 WHERE ledger_event_id = :id"),
            {"id": ids[2]},
        )
    result = seal_ledger.verify(runtime.engine)
    assert not result.ok
    assert result.first_break["seq"] == 3 and result.first_break["ledger_event_id"] == ids[2]
    assert "changed" in result.first_break["reason"]
    assert result.verified == 2


@pytest.mark.parametrize(
    ("statement", "reason"),
    [
        ("UPDATE ledger_event SET amount_minor = 1 WHERE id = :id", "changed"),
        ("UPDATE ledger_event SET created_at = created_at WHERE id = :id", None),  # a no-op edit is no break
        ("DELETE FROM ledger_entry WHERE ledger_event_id = :id", "changed"),
        (
            "INSERT INTO ledger_entry (ledger_event_id, account, amount_minor, currency)"
            " VALUES (:id, 'income:payments', 0, 'CNY')",
            "changed",
        ),
        ("DELETE FROM ledger_event WHERE id = :id", "gone"),
        ("UPDATE ledger_seal SET event_digest = :digest WHERE ledger_event_id = :id", "chain_hash"),
        ("DELETE FROM ledger_seal WHERE ledger_event_id = :id", "missing"),
    ],
)
def test_edits_behind_the_applications_back_are_caught(runtime, triggers_dropped, statement, reason):
    ids = write_events(runtime.engine, 3)
    seal_ledger.run_once(runtime)
    with runtime.engine.begin() as conn:
        conn.execute(text(statement), {"id": ids[1], "digest": "f" * 64})
    result = seal_ledger.verify(runtime.engine)
    if reason is None:
        assert result.ok
        return
    assert result.first_break is not None and reason in result.first_break["reason"]
    assert result.verified == 1


def test_rewritten_seals_break_the_links_after_them(runtime, triggers_dropped):
    ids = write_events(runtime.engine, 3)
    seal_ledger.run_once(runtime)
    # A forger recomputes seal 2 for an edited event but cannot make seal 3 link to it.
    with runtime.engine.begin() as conn:
        conn.execute(text("UPDATE ledger_event SET amount_minor = 7 WHERE id = :id"), {"id": ids[1]})
        event = conn.execute(select(*(c for c in ledger.ledger_event.c)).where(ledger.ledger_event.c.id == ids[1]))
        event = event.mappings().one()
        lines = conn.execute(select(ledger.ledger_entry).where(ledger.ledger_entry.c.ledger_event_id == ids[1]))
        digest = seal_ledger.event_digest(event, list(lines.mappings()))
        prev = conn.execute(select(ledger_seal.c.chain_hash).where(ledger_seal.c.seq == 1)).scalar_one()
        conn.execute(
            text("UPDATE ledger_seal SET event_digest = :d, chain_hash = :h WHERE seq = 2"),
            {"d": digest, "h": seal_ledger.chain_hash(prev, 2, ids[1], digest)},
        )
    result = seal_ledger.verify(runtime.engine)
    assert result.first_break["seq"] == 3 and "prev_hash" in result.first_break["reason"]


@pytest.mark.mariadb
def test_an_event_that_commits_after_a_later_one_was_sealed_is_sealed_next(mariadb):
    runtime = runtime_for(mariadb)
    slow = mariadb.connect()
    transaction = slow.begin()
    early = append_event(slow)  # id N, not committed yet
    (late,) = write_events(mariadb, 1)  # id N + 1, committed
    assert early < late
    assert seal_ledger.run_once(runtime, full_scan=False) == 1
    transaction.commit()
    slow.close()
    assert seal_ledger.run_once(runtime, full_scan=False) == 1
    assert seals(mariadb) == [(1, late), (2, early)]  # commit order, not id order
    assert seal_ledger.verify(mariadb).ok


@pytest.mark.mariadb
def test_a_straggler_past_its_gap_is_reported_until_a_full_scan_seals_it(mariadb, monkeypatch):
    runtime = runtime_for(mariadb)
    monkeypatch.setattr(seal_ledger, "LATE_COMMIT_SECONDS", 0.0)  # as if the transaction stayed open for ages
    slow = mariadb.connect()
    transaction = slow.begin()
    straggler = append_event(slow, created_at=utcnow() - timedelta(minutes=5))
    write_events(mariadb, 2)
    assert seal_ledger.run_once(runtime, full_scan=False) == 2
    assert seal_ledger.run_once(runtime, full_scan=False) == 0  # its gap looked into one last time, then dropped
    assert count_gaps(mariadb) == 0
    transaction.commit()
    slow.close()
    assert seal_ledger.run_once(runtime, full_scan=False) == 0
    result = seal_ledger.verify(mariadb)
    assert not result.ok and result.first_break is None
    assert result.stale_unsealed == 1 and result.stale_examples == [straggler]
    assert "unsealed for more than 60 s" in seal_ledger.describe(result)
    assert seal_ledger.run_once(runtime, full_scan=True) == 1
    assert seal_ledger.verify(mariadb).ok


def test_the_ids_stepped_over_are_the_holes_between_the_head_and_each_new_id():
    assert seal_ledger.holes(0, [1, 2, 3]) == []
    assert seal_ledger.holes(0, [3, 4, 7]) == [(1, 2), (5, 6)]
    assert seal_ledger.holes(10, [12]) == [(11, 11)]


@pytest.mark.mariadb
def test_a_rolled_back_id_is_watched_for_a_minute_then_dropped(mariadb, monkeypatch):
    runtime = runtime_for(mariadb)
    with mariadb.connect() as conn:
        transaction = conn.begin()
        append_event(conn)
        transaction.rollback()  # its id is burnt for good
    write_events(mariadb, 2)
    assert seal_ledger.run_once(runtime, full_scan=False) == 2
    assert count_gaps(mariadb) == 1
    assert seal_ledger.run_once(runtime, full_scan=False) == 0
    assert count_gaps(mariadb) == 1  # still watched: it might yet commit
    monkeypatch.setattr(seal_ledger, "LATE_COMMIT_SECONDS", 0.0)
    seal_ledger.run_once(runtime, full_scan=False)
    assert count_gaps(mariadb) == 0
    assert seal_ledger.verify(mariadb).ok


def count_gaps(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(ledger_seal_gap)).scalar_one()


def _late_commit_in_a_gap(mariadb):  # noqa: ANN001, ANN202
    """An event that committed after a later one was sealed: its gap recorded, the event unsealed; return its id."""
    runtime = runtime_for(mariadb)
    slow = mariadb.connect()
    transaction = slow.begin()
    early = append_event(slow)
    write_events(mariadb, 1)
    assert seal_ledger.run_once(runtime, full_scan=False) == 1
    transaction.commit()
    slow.close()
    return early


@pytest.mark.mariadb
def test_a_gap_past_its_watch_is_looked_into_once_more_before_it_is_dropped(mariadb):
    early = _late_commit_in_a_gap(mariadb)
    # The sealer did not run for two minutes (every compensator restarting): the gap is past its minute.
    with mariadb.begin() as conn:
        conn.execute(ledger_seal_gap.update().values(noticed_at=utcnow() - timedelta(minutes=2)))

    assert seal_ledger.run_once(runtime_for(mariadb), full_scan=False) == 1
    assert seals(mariadb)[-1][1] == early and count_gaps(mariadb) == 0
    assert seal_ledger.verify(mariadb).ok


@pytest.mark.mariadb
def test_every_gap_is_looked_into_in_one_run_however_many_there_are(mariadb):
    # Thousands of ids burnt by rolled-back transactions, recorded before the one that matters.
    burnt = 2 * seal_ledger.MAX_GAP_RANGES + 500
    with mariadb.begin() as conn:
        conn.execute(text(f"ALTER TABLE ledger_event AUTO_INCREMENT = {burnt + 1}"))
    write_events(mariadb, 1)
    assert seal_ledger.run_once(runtime_for(mariadb), full_scan=False) == 1
    with mariadb.begin() as conn:
        conn.execute(ledger_seal_gap.delete())  # the one gap below it, replaced by as many as there were ids
        conn.execute(
            insert(ledger_seal_gap),
            [{"from_event_id": i, "to_event_id": i, "noticed_at": utcnow()} for i in range(1, burnt + 1)],
        )
    early = _late_commit_in_a_gap(mariadb)
    assert early > burnt and count_gaps(mariadb) == burnt + 1

    assert seal_ledger.run_once(runtime_for(mariadb), full_scan=False) == 1
    assert seals(mariadb)[-1][1] == early
    assert count_gaps(mariadb) == burnt + 1, "none is dropped before its minute is up"
    assert seal_ledger.verify(mariadb).ok

    # Once past their minute, each is looked into and dropped: all of them, in one run.
    with mariadb.begin() as conn:
        conn.execute(ledger_seal_gap.update().values(noticed_at=utcnow() - timedelta(minutes=2)))
    assert seal_ledger.run_once(runtime_for(mariadb), full_scan=False) == 0
    assert count_gaps(mariadb) == 0


def test_a_fresh_unsealed_event_is_not_yet_a_problem_but_an_old_one_is(runtime):
    write_events(runtime.engine, 1)
    assert seal_ledger.verify(runtime.engine).ok
    assert seal_ledger.verify(runtime.engine, now=utcnow() + timedelta(seconds=61)).stale_unsealed == 1


@pytest.mark.mariadb
def test_a_second_sealer_waits_its_turn(mariadb):
    from payments.infra.locks import named_lock

    runtime = runtime_for(mariadb)
    write_events(mariadb, 2)
    with named_lock(mariadb, seal_ledger.LOCK_NAME) as held:
        assert held
        assert seal_ledger.run_once(runtime) == 0
    assert seal_ledger.run_once(runtime) == 2


def test_verify_ledger_command_exits_0_when_whole_and_1_at_the_first_break(runtime, triggers_dropped):
    ids = write_events(runtime.engine, 3)
    seal_ledger.run_once(runtime)
    env = env_for(
        {"DATABASE_URL": runtime.engine.url.render_as_string(hide_password=False), "PAYSYNC_ENV": "development"}
    )

    def verify_ledger(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "compensator", "verify-ledger", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    whole = verify_ledger()
    assert whole.returncode == 0, whole.stderr
    assert "ledger chain verified: 3 seals" in whole.stdout
    with runtime.engine.begin() as conn:
        forged = text("UPDATE ledger_entry SET account = 'income:other' WHERE ledger_event_id = :id")
        conn.execute(forged, {"id": ids[0]})
    broken = verify_ledger("--format", "json")
    assert broken.returncode == 1
    body = json.loads(broken.stdout)
    assert body["ok"] is False and body["first_break"]["seq"] == 1 and body["verified"] == 0
    with runtime.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ledger_seal)).scalar() == 3
