"""Rule evaluators, keyed by rule name: what ``evaluate_alerts`` checks against the database each run.

An evaluator reads the database and returns the conditions that hold now, as
``Finding`` s (one per alert key: a rule about providers finds one per sick
provider). ``evaluate`` then keeps the alert table in step: every finding is
observed (it fires after the rule's ``sustain_seconds``), and every open alert
of the rule whose key was not found again is resolved. A rule that is
disabled, or absent from the rules file, finds nothing, so its open alerts
resolve.

Alerts raised where the event happens (a callback giving up, a conflicting
report, a breaker opening, …) are listed in ``EVALUATED_ELSEWHERE``: the
rules file may route them (severity, channels, cooldown) but nothing here
evaluates them. A new rule either adds an entry to ``EVALUATORS`` (a query
on its own table) or raises its alert where it happens and goes in
``EVALUATED_ELSEWHERE``; ``validate`` refuses a rules file naming a rule that
is in neither, so no rule is silently dead.

A rule about something outside the database (RabbitMQ's reachability) reads a
*probe* the caller passes in (``evaluate(..., probes={"broker": fn})``): this
package imports no broker client, so the compensator builds the probe in
``broker/``. A probe returns None when all is well, else why not; a probe the
caller does not pass (no AMQP_URL: embedded mode) finds nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, String, and_, case, cast, func, literal, or_, select

from payments.errors import ConfigError
from payments.escalation import alerts
from payments.escalation import rules as rules_module
from payments.escalation.rules import Rule, RuleSet
from payments.infra.retention import refused_clause
from payments.infra.schema import (
    RECON_UNREADABLE,
    UNEXPLAINED,
    alert,
    ledger_event,
    ledger_seal,
    ledger_seal_gap,
    manual_review,
    payment,
    payment_callback_log,
    provider_breaker,
    reconciliation_item,
    reconciliation_run,
    refund,
)
from payments.states import (
    CALLBACK_RETRYABLE,
    TERMINAL,
    AlertStatus,
    BreakerState,
    CallbackStatus,
    PaymentStatus,
    ReconciliationRunStatus,
    ReviewStatus,
)

log = logging.getLogger("paysync.alerts.rules")

OPEN_STATUSES = tuple(s.value for s in PaymentStatus if s not in TERMINAL)
"""Payment and refund statuses that are not final (named, so the count is an index range on status)."""


@dataclass(frozen=True)
class Finding:
    """A condition that holds now: one alert key, its message and details."""

    key: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


Probe = Callable[[], str | None]
"""A check of something outside the database: None when it is fine, else why not (no secrets in the text)."""


@dataclass(frozen=True)
class Evaluator:
    """How one rule is checked."""

    check: Callable[..., list[Finding]]
    """``check(conn, rule, now)``; with ``probe`` set, ``check(conn, rule, now, result)`` with the probe's result."""
    needs: tuple[str, ...] = ()
    """Rule fields that must be set in the rules file for this evaluator."""
    probe: str | None = None
    """Name of the probe (``evaluate``'s ``probes``) this rule reads; a probe not passed in finds nothing."""


def callback_backlog(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` callback rows waiting (status 0 or 2)."""
    t = payment_callback_log
    waiting = conn.execute(select(func.count()).select_from(t).where(t.c.status.in_(CALLBACK_RETRYABLE))).scalar_one()
    if waiting <= rule.threshold:
        return []
    return [Finding(rule.name, f"{waiting} callbacks waiting (threshold {rule.threshold:g})", {"backlog": waiting})]


def callback_failure_counts(conn: Connection, since: datetime) -> tuple[int, int]:
    """(failed, total) callbacks received since ``since``: failed = rejected, retried or given up."""
    t = payment_callback_log
    failed = or_(
        t.c.status.in_((CallbackStatus.FAILED, CallbackStatus.REJECTED, CallbackStatus.GAVE_UP)), t.c.retry_count > 0
    )
    row = conn.execute(
        select(func.count(), func.coalesce(func.sum(case((failed, 1), else_=0)), 0)).where(t.c.create_time >= since)
    ).one()
    return int(row[1]), int(row[0])


def callback_failure_rate(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` (a fraction) of the callbacks of the last ``window_seconds`` failed."""
    failed, total = callback_failure_counts(conn, now - timedelta(seconds=rule.window_seconds))
    rate = failed / total if total else 0.0
    if total < (rule.min_sample or 1) or rate <= rule.threshold:
        return []
    message = (
        f"{rate:.1%} of {total} callbacks failed in the last {rule.window_seconds} s (threshold {rule.threshold:.1%})"
    )
    return [Finding(rule.name, message, {"failed": failed, "total": total, "rate": round(rate, 4)})]


def compensation_success_rate(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """Of the callbacks received in the window that needed a retry, fewer than ``threshold`` were applied.

    Read from the retry columns: a row with ``retry_count > 0`` went through
    the compensator; it succeeded if it is processed (status 1) now, and it is
    failing if it is still failed (2) or gave up (4).
    """
    t = payment_callback_log
    since = now - timedelta(seconds=rule.window_seconds)
    row = conn.execute(
        select(
            func.coalesce(func.sum(case((t.c.status == CallbackStatus.PROCESSED, 1), else_=0)), 0),
            func.coalesce(
                func.sum(case((t.c.status.in_((CallbackStatus.FAILED, CallbackStatus.GAVE_UP)), 1), else_=0)), 0
            ),
        ).where(t.c.create_time >= since, t.c.retry_count > 0)
    ).one()
    succeeded, failing = int(row[0]), int(row[1])
    total = succeeded + failing
    if total < (rule.min_sample or 1) or succeeded / total >= rule.threshold:
        return []
    rate = succeeded / total
    message = (
        f"compensation applied {rate:.1%} of {total} retried callbacks in the last {rule.window_seconds} s "
        f"(threshold {rule.threshold:.1%})"
    )
    return [Finding(rule.name, message, {"succeeded": succeeded, "failing": failing, "rate": round(rate, 4)})]


def past_deadline(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` payments (one alert) or refunds (another) still not final after their deadline."""
    findings = []
    for what, table, id_column in (("payment", payment, "payment_id"), ("refund", refund, "refund_id")):
        count, oldest = conn.execute(
            select(func.count(), func.min(table.c.deadline_at)).where(
                table.c.status.in_(OPEN_STATUSES), table.c.deadline_at < now
            )
        ).one()
        if count > rule.threshold:
            overdue = int((now - oldest).total_seconds())
            example = conn.execute(
                select(table.c[id_column])
                .where(table.c.status.in_(OPEN_STATUSES), table.c.deadline_at == oldest)
                .limit(1)
            ).scalar()
            findings.append(
                Finding(
                    f"{rule.name}:{what}",
                    f"{count} {what}s not final past their deadline (oldest {example}, {overdue} s over)",
                    {"count": count, "oldest": example, "overdue_seconds": overdue},
                )
            )
    return findings


def signature_failures(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` rejected callbacks (status 3) from one provider in the window: attack or key mistake."""
    t = payment_callback_log
    since = now - timedelta(seconds=rule.window_seconds)
    # Deliveries refused for their source never reached verification: refused_sources counts them.
    not_refused = or_(t.c.result.is_(None), ~refused_clause())
    rows = conn.execute(
        select(t.c.provider, func.count())
        .where(t.c.create_time >= since, t.c.status == CallbackStatus.REJECTED, not_refused)
        .group_by(t.c.provider)
        .having(func.count() > rule.threshold)
        .order_by(t.c.provider)
    ).all()
    return [
        Finding(
            f"{rule.name}:{provider}",
            f"{count} callbacks from {provider} rejected (signature or parse) in the last {rule.window_seconds} s",
            {"provider": provider, "rejected": count},
        )
        for provider, count in rows
    ]


def refused_sources(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` deliveries to one provider's route refused for their source in the window.

    Counts the stored ones; past REFUSED_SOURCE_RATE a source is answered 429
    and nothing is stored (``paysync_callbacks_refused_total`` counts those),
    so the count here is at most that rate a worker: a threshold well under it
    still fires during any sustained flood.
    """
    t = payment_callback_log
    since = now - timedelta(seconds=rule.window_seconds)
    rows = conn.execute(
        select(t.c.provider, func.count(), func.count(func.distinct(t.c.remote_addr)))
        .where(t.c.create_time >= since, t.c.status == CallbackStatus.REJECTED, refused_clause())
        .group_by(t.c.provider)
        .having(func.count() > rule.threshold)
        .order_by(t.c.provider)
    ).all()
    return [
        Finding(
            f"{rule.name}:{provider}",
            f"{count} deliveries to /callbacks/{provider} from {sources} source(s) outside its allow-list "
            f"in the last {rule.window_seconds} s",
            {"provider": provider, "refused": count, "sources": sources},
        )
        for provider, count, sources in rows
    ]


def provider_circuit_open(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """A provider's circuit breaker is open (payments/outbound/breaker.py also raises this the moment it opens)."""
    t = provider_breaker
    rows = conn.execute(
        select(t.c.provider, t.c.opened_at, t.c.consecutive_failures, t.c.retry_at)
        .where(t.c.state == BreakerState.OPEN)
        .order_by(t.c.provider)
    ).all()
    return [
        Finding(
            alerts.breaker_alert_key(r.provider),
            f"provider {r.provider} circuit open since {r.opened_at} ({r.consecutive_failures} failed calls)",
            {"provider": r.provider, "consecutive_failures": r.consecutive_failures, "retry_at": str(r.retry_at)},
        )
        for r in rows
    ]


def reconciliation_unexplained(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """More than ``threshold`` unexplained items in a provider's latest completed run whose review is still open.

    Reconciliation links each escalated item to its manual review
    (``manual_review_id``); once a person resolves the review the item no
    longer counts. An unreadable line re-read by a re-run of its file is not
    escalated again and has no link: it counts while the file's review
    (``reconciliation_unreadable:<provider>:file:<id>``) is open. An item with
    neither (never handed to a person) counts. A later clean run of the
    provider resolves the alert too: only the latest run is read.
    """
    rows = [(p, run_id, n) for p, (run_id, n) in unexplained_by_provider(conn).items() if n > rule.threshold]
    return [
        Finding(
            f"{rule.name}:{provider}",
            f"the latest reconciliation of {provider} (run {run_id}) left {count} items unexplained "
            f"(threshold {rule.threshold:g})",
            {"provider": provider, "run_id": run_id, "unexplained": count},
        )
        for provider, run_id, count in rows
    ]


def ledger_chain_stale(conn: Connection, rule: Rule, now: datetime) -> list[Finding]:
    """Ledger events committed more than ``window_seconds`` ago that the sealer has not chained: it is not running.

    Reads what the sealer would seal next, so the query stays an index range
    however long the ledger: the events above the head's ``max_event_id`` and
    those inside the gaps it is watching. Stragglers past their gap are found
    by the sealer's own hourly scan and by ``verify-ledger``.
    """
    cutoff = now - timedelta(seconds=rule.window_seconds)
    head = conn.execute(select(ledger_seal.c.max_event_id).order_by(ledger_seal.c.seq.desc()).limit(1)).scalar()
    e = ledger_event
    count, oldest, first = conn.execute(
        select(func.count(), func.min(e.c.created_at), func.min(e.c.id)).where(
            e.c.id > (head or 0), e.c.created_at < cutoff
        )
    ).one()
    in_gaps, gap_oldest = conn.execute(
        select(func.count(), func.min(e.c.created_at))
        .select_from(ledger_seal_gap)
        .join(e, e.c.id.between(ledger_seal_gap.c.from_event_id, ledger_seal_gap.c.to_event_id))
        .outerjoin(ledger_seal, ledger_seal.c.ledger_event_id == e.c.id)
        .where(ledger_seal.c.seq.is_(None), e.c.created_at < cutoff)
    ).one()
    total = count + in_gaps
    if not total:
        return []
    oldest = min(t for t in (oldest, gap_oldest) if t is not None)
    lag = int((now - oldest).total_seconds())
    message = (
        f"{total} ledger events unsealed for more than {rule.window_seconds} s (oldest {lag} s): "
        "seal_ledger is not keeping the chain"
    )
    return [Finding(rule.name, message, {"unsealed": total, "oldest_seconds": lag, "first_unsealed_id": first})]


def broker_unreachable(conn: Connection, rule: Rule, now: datetime, why: str | None) -> list[Finding]:
    """The broker probe (a connection to AMQP_URL, opened and closed) failed; None: it connected."""
    if why is None:
        return []
    return [Finding(rule.name, f"RabbitMQ unreachable: {why}", {"error": why[:200]})]


EVALUATORS: dict[str, Evaluator] = {
    "callback_backlog": Evaluator(callback_backlog, needs=("threshold",)),
    "callback_failure_rate": Evaluator(callback_failure_rate, needs=("threshold", "window_seconds")),
    "compensation_success_rate": Evaluator(compensation_success_rate, needs=("threshold", "window_seconds")),
    "past_deadline": Evaluator(past_deadline, needs=("threshold",)),
    "signature_failures": Evaluator(signature_failures, needs=("threshold", "window_seconds")),
    "refused_sources": Evaluator(refused_sources, needs=("threshold", "window_seconds")),
    "provider_circuit_open": Evaluator(provider_circuit_open),
    "reconciliation_unexplained": Evaluator(reconciliation_unexplained, needs=("threshold",)),
    "ledger_chain_stale": Evaluator(ledger_chain_stale, needs=("window_seconds",)),
    "broker_unreachable": Evaluator(broker_unreachable, probe="broker"),
}
"""Rules ``evaluate_alerts`` checks, by the name they have in the rules file."""

EVALUATED_ELSEWHERE: dict[str, str] = {
    "callback_gave_up": "payments/inbound/callbacks.py (review.escalate), one per callback that exhausted its retries",
    "conflicting_report": "payments/inbound/callbacks.py and payments/outbound/protocol.py (review.escalate), one "
    "per subject",
    "unresolved_payment": "payments/outbound/protocol.py (review.escalate), one per payment at its deadline",
    "unresolved_refund": "payments/outbound/protocol.py (review.escalate), one per refund at its deadline",
    "unresolved_not_resendable": "payments/outbound/protocol.py (review.escalate), one per payment that may be neither "
    "re-sent nor queried",
    "provider_answer_needs_review": "payments/outbound/protocol.py (review.escalate), one per payment whose provider "
    "answer needs a person",
    "unknown_provider": "payments/outbound/protocol.py (review.escalate), one per payment whose provider has no "
    "adapter",
    "event_delivery_gave_up": "payments/lifecycle/events.py (review.escalate), one per event and destination that "
    "gave up",
    "event_delivery_failing": "payments/lifecycle/events.py (publish_events), while a destination keeps failing",
    "alert_channel_failing": "compensator/notify_alerts.py, when a notification gives up on a channel",
    "settlement_too_large": "compensator/reconcile.py, one per provider and day whose settlement file is past its "
    "size cap",
}
"""Rules whose alerts are raised where the event happens; the rules file only routes them."""


def validate(rules: RuleSet) -> None:
    """ConfigError naming the rule and field if the file has a rule nobody evaluates or lacks a needed field."""
    for name, rule in rules.rules.items():
        if name not in EVALUATORS and name not in EVALUATED_ELSEWHERE:
            known = ", ".join(sorted([*EVALUATORS, *EVALUATED_ELSEWHERE]))
            raise ConfigError(f"alert rules {rules.source}: rule {name}: no evaluator knows this rule (known: {known})")
        evaluator = EVALUATORS.get(name)
        for needed in evaluator.needs if evaluator and rule.enabled else ():
            if getattr(rule, needed) is None:
                raise ConfigError(f"alert rules {rules.source}: rule {name}: {needed} is required")


def check_alerting(settings: Any) -> None:
    """The alert channels' settings hold together and ALERT_RULES_FILE is a valid rules file (ConfigError if not).

    Part of the start-up step ``payments.runtime.check_deployment``.
    """
    from payments.escalation.notify import channels

    channels.validate(settings)
    rules_for(settings)


def rules_for(settings: Any) -> RuleSet:
    """The rules file ``settings`` name, parsed and checked against this registry (cached while unchanged)."""
    return rules_module.for_settings(settings, validate)


def evaluate(conn: Connection, rules: RuleSet, now: datetime, *, probes: Mapping[str, Probe] | None = None) -> int:
    """Run every evaluator against ``conn`` (inside the caller's transaction); return how many alerts fire.

    ``probes`` (name → probe) feed the rules about things outside the
    database; they run first, before any query, so a slow probe holds no
    snapshot or row lock.
    """
    probes = probes or {}
    results: dict[str, str | None] = {}
    for name, evaluator in EVALUATORS.items():
        rule = rules.get(name)
        if evaluator.probe in probes and rule is not None and rule.enabled:
            results[name] = probes[evaluator.probe]()
    firing = 0
    for name, evaluator in EVALUATORS.items():
        rule = rules.get(name)
        if rule is None or not rule.enabled or (evaluator.probe is not None and name not in results):
            findings = []
        elif evaluator.probe is not None:
            findings = evaluator.check(conn, rule, now, results[name])
        else:
            findings = evaluator.check(conn, rule, now)
        for finding in findings:
            status = alerts.observe(
                conn,
                rule=name,
                key=finding.key,
                message=finding.message,
                now=now,
                sustain_seconds=rule.sustain_seconds,
                details=finding.details,
                severity=rule.severity,
            )
            firing += status == AlertStatus.FIRING
        found = {f.key for f in findings}
        still_open = conn.execute(
            select(alert.c.open_key).where(and_(alert.c.rule == name, alert.c.open_key.is_not(None)))
        ).scalars()
        for key in [k for k in still_open if k not in found]:
            if alerts.clear(conn, key=key, now=now):
                log.info("alert %s resolved", key, extra={"rule": name})
    return firing


def unexplained_by_provider(conn: Connection) -> dict[str, tuple[int, int]]:
    """provider -> (its latest completed run, unexplained items of it a person has not yet resolved).

    Reconciliation links each escalated item to its manual review
    (``manual_review_id``); once a person resolves the review the item no
    longer counts. An unreadable line re-read by a re-run of its file is not
    escalated again and has no link: it counts while the file's review
    (``reconciliation_unreadable:<provider>:file:<id>``) is open. An item with
    neither (never handed to a person) counts. Only the latest run is read, so
    a later clean run of the provider counts nothing. Both the
    ``reconciliation_unexplained`` rule and ``/metrics`` read this.
    """
    run, item = reconciliation_run, reconciliation_item
    linked, file_review = manual_review.alias("linked"), manual_review.alias("file_review")
    latest = (
        select(run.c.provider, func.max(run.c.id).label("run_id"))
        .where(run.c.status == ReconciliationRunStatus.COMPLETED)
        .group_by(run.c.provider)
        .subquery()
    )
    file_review_key = (
        literal(f"reconciliation_{RECON_UNREADABLE}:")
        + latest.c.provider
        + literal(":file:")
        + cast(item.c.settlement_file_id, String)
    )
    # Two joins, each on a unique key (the review's id; its open_key, NULL once resolved), rather than one OR.
    still_unexplained = or_(
        linked.c.status == ReviewStatus.OPEN,
        file_review.c.id.is_not(None),
        and_(item.c.manual_review_id.is_(None), item.c.category != RECON_UNREADABLE),
    )
    rows = conn.execute(
        select(latest.c.provider, latest.c.run_id, func.count())
        .select_from(latest)
        .join(item, item.c.run_id == latest.c.run_id)
        .outerjoin(linked, linked.c.id == item.c.manual_review_id)
        .outerjoin(
            file_review,
            and_(
                item.c.manual_review_id.is_(None),
                item.c.category == RECON_UNREADABLE,
                file_review.c.open_key == file_review_key,
            ),
        )
        .where(item.c.category.in_(UNEXPLAINED), still_unexplained)
        .group_by(latest.c.provider, latest.c.run_id)
        .order_by(latest.c.provider)
    ).all()
    return {provider: (run_id, count) for provider, run_id, count in rows}
