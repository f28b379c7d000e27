"""Job ``evaluate_alerts``: every rule of the rules file that has an evaluator, plus telling the log channel.

The rules and their thresholds, windows and channels come from
ALERT_RULES_FILE (default ``ops/alert_rules.toml``); the evaluators, keyed by
rule name, are in ``payments/escalation/evaluators.py`` (the seed's two rules:
``callback_backlog``, more than 100 rows with status 0/2 for 5 minutes, and
``callback_failure_rate``, more than 5 % of the callbacks of the last 10
minutes failed, plus compensation success, deadlines, signature failures and
open breakers, unexplained reconciliation items, an unsealed ledger and
RabbitMQ's reachability). Give-ups and conflicting reports fire their own
alerts where they happen. People are told by ``notify_alerts``.

The broker rule needs a connection attempt, which ``payments`` cannot make
(no pika there): this job passes ``broker.connection.unreachable`` in as the
``broker`` probe when AMQP_URL is set; without it (embedded mode) the rule
finds nothing.
"""

from __future__ import annotations

import logging
from datetime import datetime
from functools import partial

from sqlalchemy import Connection

from broker import connection
from payments.escalation import alerts
from payments.escalation import evaluators as alert_evaluators
from payments.infra.db import utcnow
from payments.infra.locks import lock_name, named_lock
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.alerts")

BACKLOG_KEY = "callback_backlog"
FAILURE_RATE_KEY = "callback_failure_rate"


BROKER_PROBE_TIMEOUT_SECONDS = 2.0
"""Socket timeout of the broker probe (the whole connection gets ``connection.connect_bound`` of it)."""

LOCK_NAME = "paysync.evaluate_alerts"
"""Named database lock (``payments.infra.locks``): one evaluation at a time across every compensator."""


def run_once(runtime: Runtime, *, now: datetime | None = None) -> int:
    """Evaluate every rule and deliver new alerts; return how many alerts are firing (0 if another evaluator runs).

    Evaluators on several compensators would otherwise race on the same alert
    rows (INSERT IGNORE then UPDATE of one open key), which InnoDB answers with
    deadlocks; evaluating twice at once gains nothing, so the second one skips.
    """
    with named_lock(runtime.engine, LOCK_NAME) as locked:
        if not locked:
            log.debug("another evaluator holds %s; skipping this run", lock_name(runtime.engine, LOCK_NAME))
            return 0
        with runtime.engine.connect() as conn:
            return _evaluate(conn, runtime, now or utcnow())


def _evaluate(conn: Connection, runtime: Runtime, now: datetime) -> int:
    rules = alert_evaluators.rules_for(runtime.settings)
    with conn.begin():
        firing = alert_evaluators.evaluate(conn, rules, now, probes=probes(runtime))
    with conn.begin():
        alerts.deliver(conn, now)
    return firing


def probes(runtime: Runtime) -> dict[str, alert_evaluators.Probe]:
    """The probes of the rules about things outside the database: RabbitMQ, when AMQP_URL is set."""
    if not runtime.settings.has_broker:
        return {}
    return {"broker": partial(connection.unreachable, runtime.settings.amqp_url, BROKER_PROBE_TIMEOUT_SECONDS)}
