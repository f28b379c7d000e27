"""Job ``evaluate_alerts``: every rule of the rules file that has an evaluator, plus telling the log channel.

The rules and their thresholds, windows and channels come from
ALERT_RULES_FILE (default ``ops/alert_rules.toml``); the evaluators, keyed by
rule name, are in ``payments/alert_evaluators.py`` (the seed's two rules:
``callback_backlog``, more than 100 rows with status 0/2 for 5 minutes, and
``callback_failure_rate``, more than 5 % of the callbacks of the last 10
minutes failed, plus compensation success, deadlines, signature failures and
open breakers). Give-ups and conflicting reports fire their own alerts where
they happen. People are told by ``notify_alerts``.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime

from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError

from payments import alert_evaluators, alert_rules, alerts
from payments.db import utcnow
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.alerts")

BACKLOG_KEY = "callback_backlog"
FAILURE_RATE_KEY = "callback_failure_rate"


LOCK_NAME = "paysync.evaluate_alerts"
"""Named database lock: one evaluation at a time across every compensator (see ``lock_name``)."""


def lock_name(conn: Connection) -> str:
    """LOCK_NAME for this database: GET_LOCK names are server-wide, and one server may hold several paysyncs."""
    return f"{LOCK_NAME}:{conn.engine.url.database}"[:64]


def run_once(runtime: Runtime, *, now: datetime | None = None) -> int:
    """Evaluate every rule and deliver new alerts; return how many alerts are firing (0 if another evaluator runs).

    Evaluators on several compensators would otherwise race on the same alert
    rows (INSERT IGNORE then UPDATE of one open key), which InnoDB answers with
    deadlocks; evaluating twice at once gains nothing, so the second one skips.
    """
    with runtime.engine.connect() as conn:
        if not _try_lock(conn):
            log.debug("another evaluator holds %s; skipping this run", lock_name(conn))
            return 0
        try:
            return _evaluate(conn, runtime, now or utcnow())
        finally:
            _unlock(conn)


def _try_lock(conn: Connection) -> bool:
    if conn.dialect.name == "sqlite":  # one writer at a time already (BEGIN IMMEDIATE)
        return True
    got = conn.execute(text("SELECT GET_LOCK(:name, 0)"), {"name": lock_name(conn)}).scalar()
    conn.commit()
    return got == 1


def _unlock(conn: Connection) -> None:
    if conn.dialect.name == "sqlite":
        return
    # A connection that died took its lock with it, and must not hide the error that killed it.
    with contextlib.suppress(SQLAlchemyError):
        conn.rollback()
        conn.execute(text("SELECT RELEASE_LOCK(:name)"), {"name": lock_name(conn)})
        conn.commit()


def _evaluate(conn: Connection, runtime: Runtime, now: datetime) -> int:
    rules = alert_rules.for_settings(runtime.settings)
    with conn.begin():
        firing = alert_evaluators.evaluate(conn, rules, now)
    with conn.begin():
        alerts.deliver(conn, now)
    return firing
