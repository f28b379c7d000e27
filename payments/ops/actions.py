"""What an operator can see and do, for the ops console (``gateway/ops``) and ``python -m compensator review``.

Framework-free, so the console and the command line share one set of actions
and one set of checks. Reads return plain dicts (secrets scrubbed where raw
text is shown); each action runs in one transaction that does the work and
appends its ``ops_action`` row (who, when, why, what), or changes nothing:

- ``replay_callbacks``: a failed, rejected or given-up callback row back to
  status 0 (a guarded UPDATE, retry count reset, the reason in ``result``),
  where the consumer's ``process_callback`` and the compensator's sweep take it
  like a new delivery; its ``callback_gave_up`` review is resolved with it;
- ``apply_verdict``: the provider's final answer for a review's payment or
  refund, from the evidence (a settlement line reconciliation matched) or by
  querying the provider through its adapter, applied through the state
  machine (``states.decide`` and ``transitions.apply_decision``, never a
  status written directly). A verdict the state machine refuses (a terminal
  state contradicted) is refused here too: book an adjustment instead;
- ``book_adjustment``: a ``ReconciliationAdjusted`` ledger event moving the
  provider receivable by the amount given, the other side in
  ``suspense:reconciliation`` (``ledger.adjustment_entries``, as
  reconciliation books its own);
- ``close_review``: resolve with a note;
- ``replay_matching``: every replayable row a callback search matches (a
  count the person confirmed, ids up to a bound), back to 0 in batches;
- ``request_adjustment`` / ``approve_adjustment`` / ``decline_adjustment``:
  an adjustment over the payment's amount, asked by one person and booked
  only when another approves (the request lives in the action log).
- ack, silence and assign of an alert or review are ``payments/ops/alert_actions.py``'s, recorded here too.

Every action on a review resolves it (``review.resolve``, which also resolves
its alert); an action that cannot be done raises ``OpsRefused`` and writes
nothing but, for a query, the provider_call row that records the query.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, func, insert, literal, or_, select, update

from payments.errors import PaysyncError
from payments.escalation import review
from payments.escalation.evaluators import callback_failure_counts
from payments.inbound.callbacks import (
    ATTEMPT_BY,
    REPLAYED,
    CallbackResult,
    process_callback,
    record_attempts,
    refused_for_source,
)
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.logs import scrub, scrub_value
from payments.infra.retention import REFUSED_RESULT_PREFIX
from payments.infra.schema import (
    alert,
    callback_attempt,
    ledger_entry,
    ledger_event,
    manual_review,
    ops_action,
    payment,
    payment_callback_log,
    provider_call,
    reconciliation_item,
    reconciliation_run,
    refund,
    settlement_line,
)
from payments.lifecycle.transitions import TARGETS, apply_decision
from payments.money import ledger
from payments.ops import monitoring
from payments.outbound import provider_calls
from payments.outbound.protocol import last_charge_send
from payments.providers.base import ChargeRequest, Mismatch, Provider, reported_status
from payments.providers.settlement import FAILED as LINE_FAILED
from payments.providers.settlement import SUCCEEDED as LINE_SUCCEEDED
from payments.providers.stripe.money import iso_exponent
from payments.states import TERMINAL, AlertStatus, CallbackStatus, PaymentStatus, ReviewStatus, Verdict, decide

log = logging.getLogger("paysync.ops")

ACTIONS = ("replay", "apply", "adjust", "close", "ack", "silence", "assign")
"""ops_action.action values."""
REVIEW_ACTIONS = ("apply", "adjust", "close")
"""What ``review resolve --action`` and the manual queue's buttons do."""
VIA_CONSOLE = "console"
VIA_CLI = "cli"
REPLAYABLE = (CallbackStatus.FAILED, CallbackStatus.REJECTED, CallbackStatus.GAVE_UP)
"""Callback statuses a person may send back to 0: retrying, rejected (re-verified when processed), gave up."""
PAGE_SIZE = 50
MAX_REPLAY = 200
"""Most rows one replay takes (a selection, not a bulk migration)."""
BUCKETS = ("<1h", "<1d", "<3d", "older")
"""Age buckets, as in the aging report (payments/reconciliation/aging.py)."""
MAX_ADJUSTMENT = 2**62
"""What the form's number may be at all (BIGINT); the real bound is the payment's amount (``adjustment_bound``)."""
CONFIRMED = "yes"
"""The console's ``confirmed`` field after a person saw what an action will do (``preview``)."""
MAX_BODY_DEPTH = 64
"""A callback body nested deeper than this is shown as text, not parsed (``show_body``)."""


class OpsRefused(PaysyncError):
    """The action cannot be done as asked; nothing was changed."""

    code = "ops_refused"
    permanent = True


@dataclass(frozen=True)
class Actor:
    """Who acts, and through what: the console (its login name) or the command line (``--actor``).

    ``name`` is what the person typed; ``identity`` is what vouches for it,
    recorded beside it: the console passes its session's
    (``payments.ops.sessions.OpsSession.identity``); anything else is the
    operating-system user running this process (``process_identity``).
    """

    name: str
    via: str = VIA_CONSOLE
    identity: str | None = None
    ops_session_id: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", clean_actor(self.name))
        if not self.identity:
            object.__setattr__(self, "identity", process_identity())


def process_identity() -> str:
    """The operating-system user this process runs as, by the kernel's uid (not $USER, which anyone sets), and host."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no passwd entry (some containers): the number is the identity
        name = "?"
    return f"os user {name} (uid {uid}) on {socket.gethostname()}"[:160]


def clean_actor(name: str) -> str:
    """An actor's name as recorded: 1-64 printable characters; OpsRefused otherwise."""
    value = " ".join(str(name or "").split())
    if not value or len(value) > 64 or not value.isprintable():
        raise OpsRefused("the actor must be a name of 1 to 64 printable characters")
    return value


def clean_note(note: str) -> str:
    """The why of an action: required, at most 500 characters; OpsRefused otherwise."""
    value = " ".join(str(note or "").split())
    if not value:
        raise OpsRefused("a note saying why is required")
    if len(value) > 500:
        raise OpsRefused(f"the note is {len(value)} characters; at most 500")
    return value


@dataclass
class Outcome:
    """What one action did (the ops_action row's outcome, plus the ids it touched)."""

    action: str
    subject: str
    outcome: str
    ops_action_id: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    """False when the action was skipped or its effect failed (a replay whose processing did not succeed)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "action": self.action,
            "subject": self.subject,
            "outcome": self.outcome,
            "ok": self.ok,
            "ops_action_id": self.ops_action_id,
            "details": self.details,
        }


def _iso(value: Any) -> Any:
    return value.isoformat() + "Z" if isinstance(value, datetime) else value


def _row(mapping: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _iso(v) for k, v in mapping.items()}


def _json(text: str | None) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def record(
    conn: Connection,
    *,
    action: str,
    actor: Actor,
    subject: str,
    reason: str,
    outcome: str,
    now: datetime,
    manual_review_id: int | None = None,
    callback_log_id: int | None = None,
    payment_id: str | None = None,
    refund_id: str | None = None,
    details: dict[str, Any] | None = None,
    alert_id: int | None = None,
) -> int:
    """Append one ops_action row in the caller's transaction; return its id."""
    result = conn.execute(
        insert(ops_action).values(
            action=action,
            actor=actor.name,
            identity=actor.identity,
            ops_session_id=actor.ops_session_id,
            via=actor.via,
            subject=subject[:150],
            manual_review_id=manual_review_id,
            callback_log_id=callback_log_id,
            payment_id=payment_id,
            refund_id=refund_id,
            reason=reason[:500],
            outcome=outcome[:500],
            details=json.dumps(details, sort_keys=True, default=str) if details else None,
            created_at=now,
            alert_id=alert_id,
        )
    )
    return int(result.inserted_primary_key[0])


def actions(
    conn: Connection,
    *,
    manual_review_id: int | None = None,
    callback_log_id: int | None = None,
    payment_id: str | None = None,
    limit: int = PAGE_SIZE,
    alert_id: int | None = None,
) -> list[dict[str, Any]]:
    """The ops_action rows about a review, a callback, a payment or an alert (or the latest of all), newest first."""
    t = ops_action
    query = select(t).order_by(t.c.id.desc()).limit(limit)
    if manual_review_id is not None:
        query = query.where(t.c.manual_review_id == manual_review_id)
    if callback_log_id is not None:
        query = query.where(t.c.callback_log_id == callback_log_id)
    if payment_id is not None:
        query = query.where(t.c.payment_id == payment_id)
    if alert_id is not None:
        query = query.where(t.c.alert_id == alert_id)
    return [{**_row(r), "details": _json(r["details"])} for r in conn.execute(query).mappings()]


# ------------------------------------------------------------------------------------------- overview


def _bucket(column: Any, now: datetime) -> Any:
    return case(
        (column >= now - timedelta(hours=1), literal("<1h")),
        (column >= now - timedelta(days=1), literal("<1d")),
        (column >= now - timedelta(days=3), literal("<3d")),
        else_=literal("older"),
    )


def unknown_by_age(conn: Connection, now: datetime) -> dict[str, dict[str, Any]]:
    """Unknown payments by how long ago they were created: bucket -> {count, amounts by currency}."""
    bucket = _bucket(payment.c.created_at, now).label("bucket")
    rows = conn.execute(
        select(bucket, payment.c.currency, func.count(), func.sum(payment.c.amount_minor))
        .where(payment.c.status == PaymentStatus.UNKNOWN.value)
        .group_by(bucket, payment.c.currency)
    ).all()
    out: dict[str, dict[str, Any]] = {b: {"count": 0, "amounts": {}} for b in BUCKETS}
    for name, currency, count, amount in rows:
        out[name]["count"] += int(count)
        out[name]["amounts"][currency] = out[name]["amounts"].get(currency, 0) + int(amount or 0)
    return out


def overview(conn: Connection, now: datetime, window_seconds: int = 600) -> dict[str, Any]:
    """Backlog by status, the last window's rates, open alerts, Unknown payments by age."""
    snap = monitoring.snapshot(conn, now)
    since = now - timedelta(seconds=window_seconds)
    failed, total = callback_failure_counts(conn, since)
    t = payment_callback_log
    retried = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(case((t.c.status == CallbackStatus.PROCESSED, 1), else_=0)), 0),
        ).where(t.c.create_time >= since, t.c.retry_count > 0)
    ).one()
    open_alerts = conn.execute(
        select(alert).where(alert.c.open_key.is_not(None)).order_by(alert.c.severity, alert.c.first_seen_at)
    ).mappings()
    return {
        "generated_at": _iso(now),
        "callbacks_by_status": {
            CallbackStatus(s).name.lower(): snap.callbacks_by_status.get(int(s), 0) for s in CallbackStatus
        },
        "oldest_waiting_callback_seconds": round(snap.oldest_waiting_callback_seconds, 1),
        "payments_by_status": {s.value: snap.payments_by_status.get(s.value, 0) for s in PaymentStatus},
        "refunds_by_status": {s.value: snap.refunds_by_status.get(s.value, 0) for s in PaymentStatus},
        "outbox_pending": sum(snap.outbox_pending_by_type.values()),
        "manual_review_open": snap.manual_review_open,
        "open_breakers": snap.open_breakers,
        "rates": {
            "window_seconds": window_seconds,
            "callbacks_received": total,
            "callbacks_failed": failed,
            "callback_failure_rate": round(failed / total, 4) if total else 0.0,
            "compensated": int(retried[1]),
            "retried": int(retried[0]),
            "compensation_success_rate": round(int(retried[1]) / int(retried[0]), 4) if retried[0] else None,
        },
        "alerts": [
            {**_row(a), "details": _json(a["details"]), "subject": alert_subject({**a, "details": _json(a["details"])})}
            for a in open_alerts
            if a["status"] in (AlertStatus.FIRING, AlertStatus.PENDING)
        ],
        "unknown_payments_by_age": unknown_by_age(conn, now),
    }


def alert_subject(row: Mapping[str, Any]) -> dict[str, Any]:
    """What an alert is about, for a link: the review, callback, payment, refund or run it names, or a filtered list.

    From its details (what ``review.escalate`` and the evaluators put there),
    most specific first; ``kind`` is one of review, callback, payment, refund,
    reconciliation_run, callbacks (a filtered list: ``args``), payments, or
    None (nothing narrower than the overview).
    """
    details = row.get("details")
    details = _json(details) if isinstance(details, str) else (details or {})
    if not isinstance(details, dict):
        details = {}
    rule = str(row.get("rule") or "")
    for key, kind in (
        ("manual_review_id", "review"),
        ("callback_log_id", "callback"),
        ("refund_id", "refund"),
        ("payment_id", "payment"),
        ("run_id", "reconciliation_run"),
    ):
        value = details.get(key)
        if value not in (None, ""):
            return {"kind": kind, "ref": value, "label": f"{kind.replace('_', ' ')} {value}", "args": {}}
    if rule in ("callback_backlog", "callback_failure_rate", "compensation_success_rate"):
        status = int(CallbackStatus.FAILED)
        return {"kind": "callbacks", "ref": None, "label": "failed callbacks", "args": {"status": status}}
    if rule in ("signature_failures", "refused_sources"):
        args: dict[str, Any] = {"status": int(CallbackStatus.REJECTED)}
        if details.get("provider"):
            args["provider"] = details["provider"]
        return {"kind": "callbacks", "ref": None, "label": "rejected callbacks", "args": args}
    if rule.startswith("past_deadline") or rule.startswith("unresolved_payment"):
        return {"kind": "payments", "ref": None, "label": "Unknown payments", "args": {"status": "Unknown"}}
    return {"kind": None, "ref": None, "label": "", "args": {}}


# ------------------------------------------------------------------------------------------- callbacks


@dataclass(frozen=True)
class CallbackSearch:
    """Filters of the callback log; every one optional, all given ones must hold."""

    order_no: str | None = None
    """The merchant's order number (payment.order_no): its payment's and refunds' callbacks."""
    payment_id: str | None = None
    """Our payment_id: callbacks naming it or one of its refunds."""
    provider_event_id: str | None = None
    status: int | None = None
    provider: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    before_id: int | None = None
    """Keyset pagination: only rows with a smaller id (the previous page's last id)."""
    limit: int = PAGE_SIZE


def _references(conn: Connection, payment_ids: list[str]) -> list[str]:
    """The payment ids and every refund id of those payments: what callback_log.order_no may hold."""
    if not payment_ids:
        return []
    refunds = conn.execute(select(refund.c.refund_id).where(refund.c.payment_id.in_(payment_ids))).scalars()
    return [*payment_ids, *refunds]


def search_callbacks(conn: Connection, search: CallbackSearch) -> tuple[list[dict[str, Any]], int | None]:
    """One page of the callback log, newest first, and the ``before_id`` of the next page (None: last page)."""
    t = payment_callback_log
    where = _callback_filters(conn, search)
    limit = max(1, min(int(search.limit), 500))
    columns = [c for c in t.c if c.name not in ("callback_data", "headers")]
    rows = conn.execute(select(*columns).where(*where).order_by(t.c.id.desc()).limit(limit + 1)).mappings().all()
    page = with_subjects(conn, [_callback_summary(r) for r in rows[:limit]])
    return page, (rows[limit - 1]["id"] if len(rows) > limit else None)


MAX_MATCHING = 5000
"""Most rows one "replay all matching" takes (in batches of MAX_REPLAY); past it, run it again for the rest."""


def describe_search(search: CallbackSearch) -> str:
    """The filter as a person reads it, for the confirmation page and the audit row."""
    parts = []
    if search.status is not None:
        parts.append(f"status {int(search.status)} {CallbackStatus(search.status).name.lower()}")
    for name in ("provider", "order_no", "payment_id", "provider_event_id"):
        if getattr(search, name):
            parts.append(f"{name} {getattr(search, name)}")
    if search.since is not None:
        parts.append(f"received from {search.since.isoformat(timespec='seconds')}Z")
    if search.until is not None:
        parts.append(f"received before {search.until.isoformat(timespec='seconds')}Z")
    return ", ".join(parts) or "every callback"


def _replayable_where(conn: Connection, search: CallbackSearch, upto_id: int | None) -> list[Any]:
    t = payment_callback_log
    where = [*_callback_filters(conn, replace(search, before_id=None)), t.c.status.in_([int(s) for s in REPLAYABLE])]
    # Refused for its source: never replayed (replay_callbacks says why), so never counted either.
    where.append(or_(t.c.result.is_(None), ~t.c.result.startswith(REFUSED_RESULT_PREFIX, autoescape=True)))
    if upto_id is not None:
        where.append(t.c.id <= upto_id)
    return where


def count_replayable(conn: Connection, search: CallbackSearch, upto_id: int | None = None) -> dict[str, Any]:
    """What "replay all matching" would take: the count by status, the total and the newest id (its bound)."""
    t = payment_callback_log
    rows = conn.execute(
        select(t.c.status, func.count(), func.max(t.c.id))
        .where(*_replayable_where(conn, search, upto_id))
        .group_by(t.c.status)
    ).all()
    by_status = {CallbackStatus(s).name.lower(): int(n) for s, n, _ in rows}
    newest = max((int(m) for _, _, m in rows), default=None)
    return {"total": sum(by_status.values()), "by_status": by_status, "upto_id": newest}


def preview_replay_matching(conn: Connection, search: CallbackSearch) -> tuple[list[str], dict[str, Any]]:
    """The confirmation of "replay all matching": lines to show, and the count and id bound the person confirms."""
    found = count_replayable(conn, search)
    if not found["total"]:
        raise OpsRefused(f"no failed, rejected or given-up callback matches {describe_search(search)}")
    statuses = ", ".join(f"{n} {name}" for name, n in sorted(found["by_status"].items()))
    taken = min(found["total"], MAX_MATCHING)
    lines = [
        f"{found['total']} callbacks match {describe_search(search)} ({statuses}), up to callback {found['upto_id']}.",
        f"{taken} of them go back to status 0 (oldest first, {MAX_REPLAY} a batch, each row audited); "
        "the consumer's sweep and the compensator process them on their usual round.",
    ]
    if found["total"] > MAX_MATCHING:
        lines.append(f"Only {MAX_MATCHING} are taken at once: run it again for the rest.")
    lines.append("Rows that match but arrive or change after this page are not included.")
    return lines, {"expected": taken, "upto_id": found["upto_id"]}


@dataclass
class MatchingOutcome:
    """What "replay all matching" did: how many rows it sent back, skipped, in how many batches, and its audit row."""

    replayed: int
    skipped: int
    batches: int
    ops_action_id: int
    outcome: str


def replay_matching(
    engine: Engine,
    search: CallbackSearch,
    *,
    actor: Actor,
    note: str,
    expected: int,
    upto_id: int,
    batch_size: int = MAX_REPLAY,
) -> MatchingOutcome:
    """Send every replayable row matching ``search`` (ids up to ``upto_id``) back to 0, in bounded batches.

    At most ``expected`` rows (what the person confirmed, itself at most
    MAX_MATCHING), oldest first, ``batch_size`` a batch through
    ``replay_callbacks``: each row in its own guarded transaction with its own
    audit row, so a row the sweep finished meanwhile is skipped, and a crash
    half-way leaves every row either replayed or untouched. The rows are not
    processed here (a web request is no place for thousands of callbacks):
    the sweep takes them. One more audit row records the whole: filter, count, batches.
    """
    note = clean_note(note)
    expected = max(0, min(int(expected), MAX_MATCHING))
    if expected == 0:
        raise OpsRefused("nothing confirmed to replay")
    batch_size = max(1, min(int(batch_size), MAX_REPLAY))
    t = payment_callback_log
    replayed = skipped = batches = 0
    after = 0
    while replayed + skipped < expected:
        with engine.connect() as conn:
            ids = list(
                conn.execute(
                    select(t.c.id)
                    .where(*_replayable_where(conn, search, upto_id), t.c.id > after)
                    .order_by(t.c.id)
                    .limit(min(batch_size, expected - replayed - skipped))
                ).scalars()
            )
        if not ids:
            break
        batches += 1
        after = ids[-1]
        for result in replay_callbacks(engine, ids, actor=actor, note=note):
            if result.ops_action_id is None:
                skipped += 1
            else:
                replayed += 1
    described = describe_search(search)
    outcome = (
        f"replay all matching {described}: {replayed} callbacks back to status 0 in {batches} batches"
        + (f", {skipped} skipped (changed meanwhile)" if skipped else "")
        + f"; {expected} confirmed, up to callback {upto_id}"
    )
    with engine.begin() as conn:
        action_id = record(
            conn,
            action="replay",
            actor=actor,
            subject=f"callbacks matching {described}",
            reason=note,
            outcome=outcome,
            now=utcnow(),
            details={
                "filter": described,
                "confirmed": expected,
                "upto_id": upto_id,
                "replayed": replayed,
                "skipped": skipped,
                "batches": batches,
            },
        )
    log.info("replay all matching by %s: %s", actor.name, outcome, extra={"ops_action_id": action_id})
    return MatchingOutcome(replayed, skipped, batches, action_id, outcome)


def _callback_filters(conn: Connection, search: CallbackSearch) -> list[Any]:
    """The WHERE clauses of a callback search (every given filter must hold)."""
    t = payment_callback_log
    where = []
    if search.order_no:
        ids = list(conn.execute(select(payment.c.payment_id).where(payment.c.order_no == search.order_no)).scalars())
        where.append(t.c.order_no.in_(_references(conn, ids) or [""]))
    if search.payment_id:
        where.append(t.c.order_no.in_(_references(conn, [search.payment_id])))
    if search.provider_event_id:
        where.append(t.c.provider_event_id == search.provider_event_id)
    if search.status is not None:
        where.append(t.c.status == int(search.status))
    if search.provider:
        where.append(t.c.provider == search.provider)
    if search.since is not None:
        where.append(t.c.create_time >= search.since)
    if search.until is not None:
        where.append(t.c.create_time < search.until)
    if search.before_id is not None:
        where.append(t.c.id < search.before_id)
    return where


def _callback_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    out = _row(row)
    out["status_name"] = CallbackStatus(row["status"]).name.lower()
    out["result"] = scrub(row["result"]) if row["result"] else None
    # A gave-up, rejected or processed row is not retried by the sweep: its next_retry_at is history, not a plan.
    out["retries_next"] = row["status"] in (CallbackStatus.PENDING, CallbackStatus.FAILED)
    return out


def with_subjects(conn: Connection, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Callback summaries with what their ``order_no`` names, if it exists: our payment or refund, the merchant's order.

    ``payment_callback_log.order_no`` holds our reference as the delivery gave
    it (``pay_…`` or a refund id), unverified on a rejected row: a row is
    linked to a payment (``payment_id``) or refund (``refund_id``) only when
    that row exists, and ``merchant_order_no`` is the payment's ``order_no``
    (what the merchant calls it). Two queries for the whole page.
    """
    refs = sorted({r["order_no"] for r in rows if r.get("order_no")})
    if not refs:
        for r in rows:
            r.update(payment_id=None, refund_id=None, merchant_order_no=None)
        return rows
    refunds = dict(
        conn.execute(select(refund.c.refund_id, refund.c.payment_id).where(refund.c.refund_id.in_(refs))).all()
    )
    wanted = sorted({*refs, *refunds.values()})
    orders = dict(
        conn.execute(select(payment.c.payment_id, payment.c.order_no).where(payment.c.payment_id.in_(wanted))).all()
    )
    for r in rows:
        ref = r.get("order_no")
        pay = refunds.get(ref) if ref in refunds else ref
        known = pay in orders
        r.update(
            payment_id=pay if known else None,
            refund_id=ref if ref in refunds else None,
            merchant_order_no=orders.get(pay) if known else None,
        )
    return rows


_JSON_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"?|[\[\]{}]')


def nests_deeper_than(text: str, limit: int) -> bool:
    """True when ``text`` opens more than ``limit`` JSON arrays or objects at once (brackets in strings do not count).

    One pass, no recursion and no parse: what decides whether a body may be parsed at all.
    """
    depth = 0
    for match in _JSON_STRING_OR_BRACKET.finditer(text):
        part = match.group()
        if part in ("[", "{"):
            depth += 1
            if depth > limit:
                return True
        elif part in ("]", "}"):
            depth = max(depth - 1, 0)
    return False


def show_body(body: bytes) -> str:
    """A raw callback body for a person to read: JSON pretty-printed, secrets and card numbers redacted.

    JSON nested deeper than MAX_BODY_DEPTH is shown as (scrubbed) text: parsing,
    scrubbing and printing it would each recurse once a level, and anyone can
    send such a body (the gateway stores it, rejected).
    """
    text = body.decode("utf-8", "replace")
    if nests_deeper_than(text, MAX_BODY_DEPTH):
        return f"[nested deeper than {MAX_BODY_DEPTH} levels: shown as text, not parsed]\n" + scrub(text)
    try:
        parsed = json.loads(text)
    except ValueError:
        return scrub(text)
    # Scrubbed as a structure (a key named like a secret loses its value) and again as text.
    return scrub(json.dumps(scrub_value(parsed), indent=2, ensure_ascii=False, sort_keys=True))


def callback(conn: Connection, log_id: int) -> dict[str, Any] | None:
    """One callback row with its body and headers redacted, and the actions taken on it."""
    row = conn.execute(select(payment_callback_log).where(payment_callback_log.c.id == log_id)).mappings().first()
    if row is None:
        return None
    out = with_subjects(
        conn, [_callback_summary({k: v for k, v in row.items() if k not in ("callback_data", "headers")})]
    )[0]
    out["body"] = show_body(bytes(row["callback_data"]))
    headers = _json(row["headers"])
    out["headers"] = scrub_value(headers) if isinstance(headers, dict) else scrub(str(headers or ""))
    out["actions"] = actions(conn, callback_log_id=log_id)
    out["attempts"] = attempts(conn, log_id)
    out["replayable"] = row["status"] in REPLAYABLE and not refused_for_source(row["result"])
    return out


def attempts(conn: Connection, log_id: int, limit: int = 500) -> list[dict[str, Any]]:
    """Every processing attempt of a callback, oldest first, and what processing said each time (scrubbed)."""
    t = callback_attempt
    rows = conn.execute(select(t).where(t.c.callback_log_id == log_id).order_by(t.c.id).limit(limit)).mappings()
    return [
        {
            **_row(r),
            "status_name": CallbackStatus(r["status"]).name.lower(),
            "result": scrub(r["result"]) if r["result"] else None,
        }
        for r in rows
    ]


def replay_callbacks(
    engine: Engine, ids: Iterable[int], *, actor: Actor, note: str, now: datetime | None = None
) -> list[Outcome]:
    """Send each row back to status 0, each in its own transaction; rows not replayable are reported, not touched.

    The UPDATE is guarded by the status read under the row lock, so a row the
    sweep finished meanwhile is left alone. The row's open ``callback_gave_up``
    review is resolved with the replay: if the row gives up again, a fresh one opens.
    """
    note = clean_note(note)
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise OpsRefused("no callback rows selected")
    if len(ids) > MAX_REPLAY:
        raise OpsRefused(f"{len(ids)} rows selected; replay at most {MAX_REPLAY} at a time")
    return [_replay_one(engine, log_id, actor, note, now or utcnow()) for log_id in ids]


def _replay_one(engine: Engine, log_id: int, actor: Actor, note: str, now: datetime) -> Outcome:
    t = payment_callback_log
    subject = f"callback:{log_id}"
    with engine.begin() as conn:
        row = conn.execute(
            select(t.c.status, t.c.result, t.c.retry_count, t.c.order_no).where(t.c.id == log_id).with_for_update()
        ).first()
        if row is None:
            return Outcome("replay", subject, "skipped: no such callback row", ok=False)
        status = CallbackStatus(row.status)
        if status not in REPLAYABLE:
            skipped = f"skipped: status {int(status)} ({status.name.lower()}) is not replayed"
            return Outcome("replay", subject, skipped, ok=False)
        if refused_for_source(row.result):
            # Processing re-checks the signature, not the source: a replay would let a leaked key in from anywhere.
            return Outcome(
                "replay",
                subject,
                "skipped: refused for its source; a replay would re-check only its signature",
                ok=False,
            )
        was = f"was {int(status)} {status.name.lower()} after {row.retry_count} attempts: {row.result or ''}"
        moved = conn.execute(
            update(t)
            .where(t.c.id == log_id, t.c.status == status)
            .values(
                status=CallbackStatus.PENDING,
                result=f"replayed by {actor.name} ({actor.via}) at {now.isoformat(timespec='seconds')}Z: {note}; {was}"[
                    :500
                ],
                retry_count=0,
                next_retry_at=now,
                update_time=now,
            )
        ).rowcount
        if moved != 1:  # cannot happen under the row lock; the guard is the rule, not the lock
            return Outcome("replay", subject, "skipped: the row changed under us", ok=False)
        record_attempts(
            conn, [(log_id, REPLAYED, CallbackStatus.PENDING, f"replayed: {note}; {was}")], now, by=_replayer(actor)
        )
        resolved = _resolve_open(conn, f"callback_gave_up:{subject}", f"replayed: {note}", actor, now)
        outcome = f"replayed: status {int(status)} -> 0" + (f"; review {resolved} resolved" if resolved else "")
        details = {"previous_status": int(status), "previous_result": row.result, "manual_review_id": resolved}
        action_id = record(
            conn,
            action="replay",
            actor=actor,
            subject=subject,
            reason=note,
            outcome=outcome,
            now=now,
            manual_review_id=resolved,
            callback_log_id=log_id,
            payment_id=row.order_no if row.order_no and row.order_no.startswith("pay_") else None,
            details=details,
        )
    log.info("callback %s replayed by %s", log_id, actor.name, extra={"ops_action_id": action_id, "via": actor.via})
    return Outcome("replay", subject, outcome, action_id, details)


PROCESSED_OK = frozenset({CallbackResult.APPLIED, CallbackResult.NOOP, CallbackResult.DUPLICATE})
"""What processing a replayed row may do for the replay to count as done (anything else is shown as a failure)."""


def replay_and_process(
    engine: Engine,
    providers: Mapping[str, Provider],
    policy: RetryPolicy,
    ids: Iterable[int],
    *,
    actor: Actor,
    note: str,
) -> list[Outcome]:
    """``replay_callbacks``, then process each replayed row at once, as the console and ``review replay`` do.

    The reset is recorded in its own transaction (``replay_callbacks``), so a
    second ``ops_action`` row records what processing then did: the
    CallbackResult, the row's status and result after it. Its Outcome is
    ``ok`` only when processing applied the callback (or found it a
    duplicate or nothing to apply); a row that failed again, gave up, was
    rejected or opened a conflict review is reported as a failure.
    """
    out = []
    for replayed in replay_callbacks(engine, ids, actor=actor, note=note):
        if replayed.ops_action_id is None:
            out.append(replayed)
            continue
        log_id = int(replayed.subject.split(":")[1])
        # The row is status 0 now, committed: processing it here only saves waiting for the consumer or the sweep.
        token = ATTEMPT_BY.set(_replayer(actor))
        try:
            done = process_callback(engine, dict(providers), log_id, policy)
        finally:
            ATTEMPT_BY.reset(token)
        out.append(_record_processing(engine, log_id, replayed, done, actor, note))
    return out


def _replayer(actor: Actor) -> str:
    return f"replay by {actor.name} ({actor.via})"[:64]


def _record_processing(
    engine: Engine, log_id: int, replayed: Outcome, done: CallbackResult, actor: Actor, note: str
) -> Outcome:
    t = payment_callback_log
    now = utcnow()
    with engine.begin() as conn:
        row = conn.execute(select(t.c.status, t.c.result, t.c.order_no).where(t.c.id == log_id)).first()
        status = CallbackStatus(row.status) if row is not None else None
        # SKIPPED: the consumer or the sweep processed it first; the row says how that went.
        ok = done in PROCESSED_OK or (done == CallbackResult.SKIPPED and status == CallbackStatus.PROCESSED)
        now_is = f"status {int(status)} {status.name.lower()}" if status is not None else "row gone"
        said = scrub(row.result or "")[:200] if row is not None else ""
        verdict = "processed" if ok else "processing FAILED"
        outcome = f"{verdict} after replay (ops_action {replayed.ops_action_id}): {done.value}; {now_is}: {said}"
        if not ok and status in (CallbackStatus.PENDING, CallbackStatus.FAILED):
            outcome += "; retried on the usual backoff"
        details = {
            "replay_ops_action_id": replayed.ops_action_id,
            "processing": done.value,
            "status": int(status) if status is not None else None,
            "result": said,
        }
        action_id = record(
            conn,
            action="replay",
            actor=actor,
            subject=replayed.subject,
            reason=note,
            outcome=outcome,
            now=now,
            callback_log_id=log_id,
            payment_id=row.order_no if row is not None and (row.order_no or "").startswith("pay_") else None,
            details=details,
        )
    return Outcome("replay", replayed.subject, f"{replayed.outcome}; {outcome}", action_id, details, ok=ok)


def _resolve_open(conn: Connection, open_key: str, resolution: str, actor: Actor, now: datetime) -> int | None:
    review_id = conn.execute(
        select(manual_review.c.id).where(manual_review.c.open_key == open_key).with_for_update()
    ).scalar()
    if review_id is None:
        return None
    review.resolve(conn, review_id, resolution=resolution, resolved_by=actor.name, now=now)
    return int(review_id)


# ------------------------------------------------------------------------------------------- the manual queue


def list_reviews(
    conn: Connection,
    *,
    status: str | None = ReviewStatus.OPEN.value,
    kind: str | None = None,
    before_id: int | None = None,
    limit: int = PAGE_SIZE,
) -> tuple[list[dict[str, Any]], int | None]:
    """One page of the manual queue, newest first (``status`` None: every status), and the next page's before_id."""
    t = manual_review
    query = select(t).order_by(t.c.id.desc()).limit(max(1, min(limit, 500)) + 1)
    if status:
        query = query.where(t.c.status == ReviewStatus(status).value)
    if kind:
        query = query.where(t.c.kind == kind)
    if before_id is not None:
        query = query.where(t.c.id < before_id)
    rows = conn.execute(query).mappings().all()
    page = [{**_row(r), "details": _json(r["details"])} for r in rows[:limit]]
    return page, (rows[limit - 1]["id"] if len(rows) > limit else None)


def _review_items(conn: Connection, row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Reconciliation items linked to the review (or named in its details), each with its settlement line."""
    details = _json(row["details"]) or {}
    named = details.get("reconciliation_item_id") if isinstance(details, dict) else None
    items = reconciliation_item
    where = [items.c.manual_review_id == row["id"]]
    if named:
        where.append(items.c.id == int(named))
    out = []
    for item in conn.execute(select(items).where(or_(*where)).order_by(items.c.id)).mappings():
        line = None
        if item["settlement_file_id"] is not None and item["line_no"] is not None:
            line = (
                conn.execute(
                    select(settlement_line).where(
                        settlement_line.c.settlement_file_id == item["settlement_file_id"],
                        settlement_line.c.line_no == item["line_no"],
                    )
                )
                .mappings()
                .first()
            )
        out.append(
            {
                **_row(item),
                "details": _json(item["details"]),
                "settlement_line": {**_row(line), "raw": scrub(line["raw"])} if line else None,
            }
        )
    return out


def review_detail(conn: Connection, review_id: int) -> dict[str, Any] | None:
    """A review with its evidence: callbacks, provider calls and queries, ledger events, reconciliation items."""
    row = conn.execute(select(manual_review).where(manual_review.c.id == review_id)).mappings().first()
    if row is None:
        return None
    payment_id = row["payment_id"]
    if payment_id is None and row["refund_id"]:
        payment_id = conn.execute(select(refund.c.payment_id).where(refund.c.refund_id == row["refund_id"])).scalar()
    cb = payment_callback_log
    cb_where = []
    if row["callback_log_id"] is not None:
        cb_where.append(cb.c.id == row["callback_log_id"])
    if payment_id:
        cb_where.append(cb.c.order_no.in_(_references(conn, [payment_id])))
    callbacks = []
    if cb_where:
        columns = [c for c in cb.c if c.name not in ("callback_data", "headers")]
        found = conn.execute(select(*columns).where(or_(*cb_where)).order_by(cb.c.id).limit(100)).mappings()
        callbacks = with_subjects(conn, [_callback_summary(r) for r in found])
    calls = _calls(conn, payment_id, row["refund_id"]) if payment_id or row["refund_id"] else []
    return {
        **_row(row),
        "details": _json(row["details"]),
        "payment": _target(conn, "payment", payment_id) if payment_id else None,
        "refund": _target(conn, "refund", row["refund_id"]) if row["refund_id"] else None,
        "evidence": {
            "callbacks": callbacks,
            "provider_calls": [c for c in calls if c["operation"] != "query"],
            "queries": [c for c in calls if c["operation"] == "query"],
            "ledger_events": ledger.history(conn, payment_id) if payment_id else [],
            "reconciliation_items": _review_items(conn, row),
        },
        "actions": actions(conn, manual_review_id=review_id),
        "pending_adjustment": (p.as_dict() if (p := pending_adjustment(conn, review_id)) else None),
    }


def _calls(conn: Connection, payment_id: str | None, refund_id: str | None) -> list[dict[str, Any]]:
    t = provider_call
    where = []
    if payment_id:
        where.append(t.c.payment_id == payment_id)
    if refund_id:
        where.append(t.c.refund_id == refund_id)
    rows = conn.execute(select(t).where(or_(*where)).order_by(t.c.id).limit(200)).mappings()
    # Responses were scrubbed when stored (provider adapters); scrubbed again, as anything shown is.
    return [{**_row(r), "response": scrub(r["response"]) if r["response"] else None} for r in rows]


def _target(conn: Connection, kind: str, reference: str) -> dict[str, Any] | None:
    spec = TARGETS[kind]
    row = conn.execute(select(spec.table).where(spec.key == reference)).mappings().first()
    return _row(row) if row is not None else None


def _lock_open_review(conn: Connection, review_id: int, *, lock: bool = True) -> dict[str, Any]:
    query = select(manual_review).where(manual_review.c.id == review_id)
    row = conn.execute(query.with_for_update() if lock else query).mappings().first()
    if row is None:
        raise OpsRefused(f"no manual review {review_id}")
    if row["status"] != ReviewStatus.OPEN:
        raise OpsRefused(f"review {review_id} is already {row['status']} ({row['resolution'] or ''})")
    return dict(row)


def _subject_of(conn: Connection, row: Mapping[str, Any]) -> tuple[str, str] | None:
    """(kind, reference) of the payment or refund a review is about, or None."""
    if row["refund_id"]:
        return "refund", row["refund_id"]
    if row["payment_id"]:
        return "payment", row["payment_id"]
    return None


def _finish_review(
    conn: Connection, row: Mapping[str, Any], action: str, actor: Actor, note: str, outcome: str, now: datetime, **kw
) -> Outcome:
    review.resolve(conn, row["id"], resolution=f"{action}: {note}", resolved_by=actor.name, now=now)
    details = kw.pop("details", {})
    action_id = record(
        conn,
        action=action,
        actor=actor,
        subject=f"review:{row['id']}",
        reason=note,
        outcome=outcome,
        now=now,
        manual_review_id=row["id"],
        callback_log_id=row["callback_log_id"],
        payment_id=row["payment_id"],
        refund_id=row["refund_id"],
        details=details,
    )
    log.info("review %s: %s by %s", row["id"], action, actor.name, extra={"ops_action_id": action_id})
    return Outcome(action, f"review:{row['id']}", outcome, action_id, details)


def close_review(engine: Engine, review_id: int, *, actor: Actor, note: str, now: datetime | None = None) -> Outcome:
    """Resolve a review with a note and nothing else."""
    note, now = clean_note(note), now or utcnow()
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        return _finish_review(conn, row, "close", actor, note, "closed with a note", now)


def _adjustable_target(conn: Connection, row: Mapping[str, Any], currency: str | None) -> tuple[str, str, dict, str]:
    """(kind, reference, target row, currency) of the review's subject an adjustment would be booked on."""
    review_id = row["id"]
    subject = _subject_of(conn, row)
    if subject is None:
        raise OpsRefused(f"review {review_id} names no payment or refund to adjust; close it with a note")
    kind, reference = subject
    target = _target(conn, kind, reference)
    if target is None:
        raise OpsRefused(f"review {review_id} names {kind} {reference}, which does not exist")
    code = (currency or target["currency"]).strip().upper()
    if len(code) != 3 or not code.isalpha() or not code.isascii():
        raise OpsRefused("the currency must be a three-letter code such as CNY")
    return kind, reference, target, code


def _check_amount(amount_minor: Any) -> None:
    if isinstance(amount_minor, bool) or not isinstance(amount_minor, int):
        raise OpsRefused("the amount must be a whole number of minor units")
    if amount_minor == 0 or abs(amount_minor) > MAX_ADJUSTMENT:
        raise OpsRefused("the amount must be a non-zero number of minor units")


def _book(
    conn: Connection,
    row: Mapping[str, Any],
    kind: str,
    reference: str,
    target: Mapping[str, Any],
    amount_minor: int,
    currency: str,
    actor: Actor,
    note: str,
    now: datetime,
    *,
    approval: dict[str, Any] | None = None,
) -> Outcome:
    """The ledger event of an adjustment and the review resolved with it, in the caller's transaction."""
    review_id = row["id"]
    event_id = ledger.append(
        conn,
        event_type=ledger.RECONCILIATION_ADJUSTED,
        # One adjustment per review: the review is resolved in this transaction, and the key is UNIQUE.
        dedupe_key=f"{ledger.RECONCILIATION_ADJUSTED}:ops:review:{review_id}",
        amount_minor=abs(amount_minor),
        currency=currency,
        source_type="ops",
        source_id=f"review:{review_id}",
        now=now,
        entries=ledger.adjustment_entries(target["provider"], amount_minor),
        payment_id=target["payment_id"],
        refund_id=reference if kind == "refund" else None,
        details={
            "manual_review_id": review_id,
            "delta": amount_minor,
            "actor": actor.name,
            "note": note,
            **({"approval": approval} if approval else {}),
        },
    )
    outcome = (
        f"ReconciliationAdjusted {amount_minor:+d} {currency} on {ledger.provider_account(target['provider'])}, "
        f"{-amount_minor:+d} on {ledger.SUSPENSE_RECONCILIATION} (ledger event {event_id})"
    )
    details: dict[str, Any] = {"ledger_event_id": event_id, "delta": amount_minor, "currency": currency}
    if approval:
        outcome += f"; over the payment's amount, requested by {approval['requested_by']}, approved by {actor.name}"
        details.update(approval=APPROVED, request_ops_action_id=approval["request_ops_action_id"])
    return _finish_review(conn, row, "adjust", actor, note, outcome, now, details=details)


def book_adjustment(
    engine: Engine,
    review_id: int,
    *,
    amount_minor: int,
    actor: Actor,
    note: str,
    currency: str | None = None,
    now: datetime | None = None,
) -> Outcome:
    """Post a ReconciliationAdjusted of ``amount_minor`` for the review's payment (or refund) and resolve the review.

    Positive: the provider holds that much more for us than our ledger says
    (its receivable is debited); negative: less. The other side goes to
    ``suspense:reconciliation``, as reconciliation's own adjustments do. The
    currency is the payment's unless given. More than the payment's amount is
    refused here: that takes ``request_adjustment`` and a second operator's
    ``approve_adjustment``.
    """
    note, now = clean_note(note), now or utcnow()
    _check_amount(amount_minor)
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        kind, reference, target, currency = _adjustable_target(conn, row, currency)
        check_adjustment(conn, target, amount_minor, currency)
        return _book(conn, row, kind, reference, target, amount_minor, currency, actor, note, now)


REQUESTED, APPROVED, DECLINED = "requested", "approved", "declined"
"""``ops_action.details["approval"]`` of an adjustment over its payment's amount: asked, then approved or declined."""


@dataclass(frozen=True)
class PendingAdjustment:
    """An adjustment over its payment's amount, asked for and not yet approved or declined (its ops_action row)."""

    ops_action_id: int
    review_id: int
    amount_minor: int
    currency: str
    requested_by: str
    identity: str | None
    requested_at: str
    reason: str

    def as_dict(self) -> dict[str, Any]:
        """For pages and JSON."""
        return {**self.__dict__, "shown": money(self.amount_minor, self.currency)}


def pending_adjustment(conn: Connection, review_id: int) -> PendingAdjustment | None:
    """The review's open request for an oversized adjustment, from the append-only action log, or None.

    A request is open until a later ``adjust`` row of the review approves or
    declines it (or the review is resolved some other way, which ends it too).
    """
    rows = actions(conn, manual_review_id=review_id, limit=200)  # newest first
    ended: set[int] = set()
    for r in rows:
        details = r["details"] if isinstance(r["details"], dict) else {}
        approval = details.get("approval")
        if r["action"] != "adjust" or approval is None:
            if r["action"] in ("apply", "close", "adjust"):
                return None  # resolved after (or instead of) any request: nothing is pending
            continue
        if approval in (APPROVED, DECLINED):
            ended.add(int(details.get("request_ops_action_id") or 0))
            continue
        if approval == REQUESTED and r["id"] not in ended:
            return PendingAdjustment(
                r["id"],
                review_id,
                int(details["delta"]),
                str(details["currency"]),
                r["actor"],
                r["identity"],
                r["created_at"],
                r["reason"],
            )
        if approval == REQUESTED:
            return None  # the newest request was answered: nothing is pending
    return None


def request_adjustment(
    engine: Engine,
    review_id: int,
    *,
    amount_minor: int,
    actor: Actor,
    note: str,
    currency: str | None = None,
    now: datetime | None = None,
) -> Outcome:
    """Ask a second operator to approve an adjustment over the payment's amount; nothing is booked yet.

    Records an ``adjust`` action whose details say ``approval: requested``;
    the review stays open until another person ``approve_adjustment``s it
    (or anyone declines it). An amount within the bound needs no approval:
    book it with ``book_adjustment``.
    """
    note, now = clean_note(note), now or utcnow()
    _check_amount(amount_minor)
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        _, _, target, currency = _adjustable_target(conn, row, currency)
        pay = _payment_of(conn, target)
        if currency != pay["currency"]:
            check_adjustment(conn, target, amount_minor, currency)  # raises: another currency is never approved
        if abs(amount_minor) <= int(pay["amount_minor"]):
            raise OpsRefused(
                f"{money(amount_minor, currency)} is within payment {pay['payment_id']}'s "
                f"{money(int(pay['amount_minor']), currency)}: book it, it needs no approval"
            )
        pending = pending_adjustment(conn, review_id)
        if pending is not None:
            raise OpsRefused(
                f"review {review_id} already has an adjustment awaiting approval (ops_action {pending.ops_action_id}, "
                f"{pending.as_dict()['shown']} by {pending.requested_by}): approve or decline it first"
            )
        outcome = (
            f"approval requested: {money(amount_minor, currency)} is more than payment {pay['payment_id']}'s "
            f"{money(int(pay['amount_minor']), currency)}; nothing booked until another operator approves"
        )
        details = {"approval": REQUESTED, "delta": amount_minor, "currency": currency}
        action_id = record(
            conn,
            action="adjust",
            actor=actor,
            subject=f"review:{review_id}",
            reason=note,
            outcome=outcome,
            now=now,
            manual_review_id=review_id,
            callback_log_id=row["callback_log_id"],
            payment_id=row["payment_id"],
            refund_id=row["refund_id"],
            details=details,
        )
    log.info(
        "review %s: oversized adjustment requested by %s", review_id, actor.name, extra={"ops_action_id": action_id}
    )
    return Outcome("adjust", f"review:{review_id}", outcome, action_id, details)


def _same_person(actor: Actor, pending: PendingAdjustment) -> bool:
    """True when ``actor`` is (or logged in as) whoever asked: the same name, or the same vouched identity."""
    same_name = actor.name.casefold() == pending.requested_by.casefold()
    return same_name or (bool(pending.identity) and actor.identity == pending.identity)


def approve_adjustment(
    engine: Engine,
    review_id: int,
    *,
    actor: Actor,
    note: str,
    request_id: int | None = None,
    now: datetime | None = None,
) -> Outcome:
    """A second operator approves the pending oversized adjustment: it is booked and the review resolved.

    Refused for the person who asked (by name or by the identity that vouched
    for them), for a request that is no longer the pending one (``request_id``
    names what the approver saw), and for a review no longer open. The review
    row is locked first, so two approvals cannot both book (and the ledger's
    dedupe key allows one adjustment per review anyway).
    """
    note, now = clean_note(note), now or utcnow()
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        pending = pending_adjustment(conn, review_id)
        if pending is None or (request_id is not None and pending.ops_action_id != request_id):
            raise OpsRefused(f"review {review_id} has no such adjustment awaiting approval")
        if _same_person(actor, pending):
            raise OpsRefused(
                f"{actor.name} asked for this adjustment (ops_action {pending.ops_action_id}): "
                "another operator must approve it"
            )
        kind, reference, target, currency = _adjustable_target(conn, row, pending.currency)
        approval = {"request_ops_action_id": pending.ops_action_id, "requested_by": pending.requested_by}
        return _book(
            conn, row, kind, reference, target, pending.amount_minor, currency, actor, note, now, approval=approval
        )


def decline_adjustment(
    engine: Engine,
    review_id: int,
    *,
    actor: Actor,
    note: str,
    request_id: int | None = None,
    now: datetime | None = None,
) -> Outcome:
    """Decline (or, for whoever asked, withdraw) the pending oversized adjustment; the review stays open."""
    note, now = clean_note(note), now or utcnow()
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        pending = pending_adjustment(conn, review_id)
        if pending is None or (request_id is not None and pending.ops_action_id != request_id):
            raise OpsRefused(f"review {review_id} has no such adjustment awaiting approval")
        verb = "withdrawn" if _same_person(actor, pending) else "declined"
        outcome = f"adjustment request ops_action {pending.ops_action_id} {verb}; nothing booked, the review stays open"
        details = {"approval": DECLINED, "request_ops_action_id": pending.ops_action_id}
        action_id = record(
            conn,
            action="adjust",
            actor=actor,
            subject=f"review:{review_id}",
            reason=note,
            outcome=outcome,
            now=now,
            manual_review_id=review_id,
            callback_log_id=row["callback_log_id"],
            payment_id=row["payment_id"],
            refund_id=row["refund_id"],
            details=details,
        )
    return Outcome("adjust", f"review:{review_id}", outcome, action_id, details)


def _payment_of(conn: Connection, target: Mapping[str, Any]) -> dict[str, Any]:
    """The payment a payment or refund target belongs to."""
    return _target(conn, "payment", target["payment_id"]) or dict(target)


def money(amount_minor: int, currency: str) -> str:
    """``amount_minor`` as people read it: ``-5,000.00 CNY (-500000 minor units)``."""
    exponent = iso_exponent(currency) if len(currency) == 3 and currency.isalpha() else 2
    sign = "-" if amount_minor < 0 else ""
    whole, part = divmod(abs(amount_minor), 10**exponent)
    major = f"{whole:,}" + (f".{part:0{exponent}d}" if exponent else "")
    return f"{sign}{major} {currency} ({amount_minor} minor units)"


def check_adjustment(conn: Connection, target: Mapping[str, Any], amount_minor: int, currency: str) -> None:
    """Refuse an adjustment larger than its payment, or in another currency (OpsRefused).

    A difference with the provider about one payment cannot exceed what that
    payment moved; a bigger number is a typo (a unit slip, an extra zero) or
    something that is not this payment's, which a one-click ledger entry must
    not absorb into suspense.
    """
    pay = _payment_of(conn, target)
    if currency != pay["currency"]:
        raise OpsRefused(
            f"the adjustment is in {currency} but payment {pay['payment_id']} is in {pay['currency']}: "
            "an adjustment is bounded by its payment, so it is booked in the payment's currency"
        )
    if abs(amount_minor) > int(pay["amount_minor"]):
        raise OpsRefused(
            f"an adjustment of {money(amount_minor, currency)} is more than payment {pay['payment_id']}'s "
            f"{money(int(pay['amount_minor']), currency)}; at most the payment's amount either way, "
            "unless a second operator approves it (request approval)"
        )


def preview(
    conn: Connection,
    review_id: int,
    action: str,
    *,
    amount_minor: int | None = None,
    currency: str | None = None,
) -> list[str]:
    """What ``resolve`` would do, in lines for a person to confirm; OpsRefused for what it would refuse anyway.

    Reads only: the action itself checks everything again under its locks.
    """
    row = _lock_open_review(conn, review_id, lock=False)
    subject = _subject_of(conn, row)
    target = _target(conn, *subject) if subject else None
    about = f"{subject[0]} {subject[1]}" if subject else "no payment or refund"
    lines = [f"Review {review_id} ({row['kind']}) about {about} will be resolved."]
    if target is not None:
        lines.append(
            f"{subject[0].capitalize()} {subject[1]} is {target['status']}, "
            f"{money(int(target['amount_minor']), target['currency'])} at {target['provider']}."
        )
    if action == "close":
        lines.append("Nothing else changes: no status, no ledger entry.")
    elif action == "apply":
        if target is None:
            raise OpsRefused(f"review {review_id} names no payment or refund: there is no verdict to apply")
        verdict = _verdict_from_evidence(conn, row, *subject)
        if verdict is not None:
            lines.append(
                f"The verdict: {verdict.says}; {subject[0]} -> {verdict.report.value} if the state machine allows."
            )
        else:
            lines.append(
                f"The provider {target['provider']} is queried now; its final answer is applied "
                "if the state machine allows."
            )
    elif action == "request_adjustment":
        if target is None:
            raise OpsRefused(f"review {review_id} names no payment or refund to adjust; close it with a note")
        _check_amount(amount_minor)
        code = (currency or target["currency"]).strip().upper()
        pay = _payment_of(conn, target)
        if code != pay["currency"] or abs(int(amount_minor)) <= int(pay["amount_minor"]):
            check_adjustment(conn, target, amount_minor, code)  # another currency: refused
            raise OpsRefused(f"{money(amount_minor, code)} is within the payment's amount: book it, no approval needed")
        lines[0] = f"Review {review_id} stays open: nothing is booked now."
        lines.append(
            f"A request to book {money(amount_minor, code)}, more than the payment's "
            f"{money(int(pay['amount_minor']), code)}, is recorded; another operator (not you) must approve it, "
            "and then it is booked as a ReconciliationAdjusted ledger event."
        )
    elif action == "adjust":
        if target is None:
            raise OpsRefused(f"review {review_id} names no payment or refund to adjust; close it with a note")
        if isinstance(amount_minor, bool) or not isinstance(amount_minor, int) or amount_minor == 0:
            raise OpsRefused("an adjustment needs a non-zero whole number of minor units")
        code = (currency or target["currency"]).strip().upper()
        check_adjustment(conn, target, amount_minor, code)
        provider = ledger.provider_account(target["provider"])
        lines.append(
            f"A ReconciliationAdjusted ledger event is booked: {money(amount_minor, code)} on {provider}, "
            f"{money(-amount_minor, code)} on {ledger.SUSPENSE_RECONCILIATION}. The ledger is append-only: "
            "undoing it is another adjustment."
        )
    else:
        raise OpsRefused(f"unknown action {action[:16]!r}: one of {', '.join(REVIEW_ACTIONS)}")
    return lines


def preview_replay(conn: Connection, ids: Iterable[int]) -> list[str]:
    """What replaying ``ids`` would do, one line a row, for a person to confirm; OpsRefused past MAX_REPLAY."""
    ids = list(dict.fromkeys(int(i) for i in ids))
    if not ids:
        raise OpsRefused("no callback rows selected")
    if len(ids) > MAX_REPLAY:
        raise OpsRefused(f"{len(ids)} rows selected; replay at most {MAX_REPLAY} at a time")
    t = payment_callback_log
    rows = {
        r.id: r
        for r in conn.execute(
            select(t.c.id, t.c.status, t.c.provider, t.c.order_no, t.c.event_type, t.c.result).where(t.c.id.in_(ids))
        )
    }
    lines = []
    for log_id in ids:
        r = rows.get(log_id)
        if r is None:
            lines.append(f"callback {log_id}: no such row; skipped")
            continue
        status = CallbackStatus(r.status)
        if status not in REPLAYABLE or refused_for_source(r.result):
            lines.append(f"callback {log_id}: status {int(status)} {status.name.lower()}; skipped, not replayed")
            continue
        lines.append(
            f"callback {log_id}: {r.provider} {r.event_type or ''} for {r.order_no or '?'}, status {int(status)} "
            f"{status.name.lower()} -> 0, then processed now (its payment may change state and the ledger move)"
        )
    return lines


@dataclass(frozen=True)
class _Verdict:
    report: PaymentStatus
    source: str
    """status_source of the change: reconciliation:<item id> or query:<provider_call id>."""
    says: str
    provider_reference: str | None = None
    failure_code: str | None = None


def _verdict_from_evidence(conn: Connection, row: Mapping[str, Any], kind: str, reference: str) -> _Verdict | None:
    """The latest reconciliation item about this subject whose settlement line is final, as a verdict."""
    for item in reversed(_review_items(conn, row)):
        line = item["settlement_line"]
        status = (line or {}).get("status") or item["provider_status"]
        ours = item["refund_id"] == reference if kind == "refund" else item["payment_id"] == reference
        if not ours or status not in (LINE_SUCCEEDED, LINE_FAILED):
            continue
        report = PaymentStatus.SUCCEEDED if status == LINE_SUCCEEDED else PaymentStatus.FAILED
        return _Verdict(
            report,
            f"reconciliation:{item['id']}",
            f"settlement line {item['settlement_file_id']}:{item['line_no']} says {status}",
            provider_reference=item["provider_reference"],
            failure_code="failed_per_settlement" if report == PaymentStatus.FAILED else None,
        )
    return None


def _verdict_from_query(engine: Engine, providers: Mapping[str, Provider], current: Mapping[str, Any], timeout: float):  # noqa: ANN202
    """Ask the provider, recording the query as a provider_call row like the query job does."""
    adapter = providers.get(current["provider"])
    if adapter is None or not adapter.capabilities.query_by_merchant_id:
        raise OpsRefused(
            f"no verdict: provider {current['provider']} cannot be queried by our number here and no settlement "
            "line names this payment; book an adjustment or close with a note"
        )
    payment_id = current["payment_id"]
    with engine.begin() as conn:
        sent = last_charge_send(conn, payment_id)  # a send turned away with a 429 made nothing
        call_id = provider_calls.start(
            conn,
            provider=adapter.name,
            operation="query",
            params={"merchant_transaction_id": payment_id},
            now=utcnow(),
            payment_id=payment_id,
        )
    expected = ChargeRequest(
        payment_id,
        int(current["amount_minor"]),
        current["currency"],
        created_at=current["created_at"],
        provider_transaction_id=current["provider_transaction_id"],
        sent_before=sent.started_at if sent is not None else None,
    )
    outcome = adapter.query(payment_id, timeout, expected)  # outside any transaction: no lock held on a slow call
    with engine.begin() as conn:
        provider_calls.finish(conn, call_id, outcome, utcnow())
    name = type(outcome).__name__
    if isinstance(outcome, Mismatch):
        raise OpsRefused(f"the provider's charge for {payment_id} is another one ({outcome.reason}); nothing applied")
    report = reported_status(outcome)
    if report not in TERMINAL:
        raise OpsRefused(f"the provider gives no final verdict for {payment_id} (query:{call_id} answered {name})")
    return _Verdict(
        report,
        f"query:{call_id}",
        f"query:{call_id} answered {name}",
        provider_reference=getattr(outcome, "provider_transaction_id", None),
        failure_code=getattr(outcome, "code", None) if report == PaymentStatus.FAILED else None,
    )


def apply_verdict(
    engine: Engine,
    providers: Mapping[str, Provider],
    review_id: int,
    *,
    actor: Actor,
    note: str,
    timeout: float = 10.0,
    now: datetime | None = None,
) -> Outcome:
    """Apply the provider's final answer to the review's payment or refund through the state machine; resolve it.

    The answer is the settlement line reconciliation matched to the subject,
    if there is one; otherwise, for a payment, a query of the provider
    through its adapter (recorded as a provider_call). Already in that state:
    the review is resolved, nothing moves. A terminal state the answer
    contradicts, or no final answer: OpsRefused, the review stays open.
    """
    note = clean_note(note)
    with engine.connect() as conn:
        row = _lock_open_review(conn, review_id, lock=False)  # checked again under the lock below
        subject = _subject_of(conn, row)
        if subject is None:
            raise OpsRefused(f"review {review_id} names no payment or refund: there is no verdict to apply")
        kind, reference = subject
        current = _target(conn, kind, reference)
        if current is None:
            raise OpsRefused(f"review {review_id} names {kind} {reference}, which does not exist")
        verdict = _verdict_from_evidence(conn, row, kind, reference)
    if verdict is None:
        if kind != "payment":
            raise OpsRefused(
                f"no verdict for refund {reference}: no settlement line names it; book an adjustment or close"
            )
        with engine.connect() as conn:
            current = dict(conn.execute(select(payment).where(payment.c.payment_id == reference)).mappings().one())
        verdict = _verdict_from_query(engine, providers, current, timeout)
    now = now or utcnow()
    spec = TARGETS[kind]
    with engine.begin() as conn:
        row = _lock_open_review(conn, review_id)
        locked = conn.execute(select(spec.table).where(spec.key == reference).with_for_update()).mappings().one()
        status = PaymentStatus(locked["status"])
        known = locked[spec.provider_ref.name]
        if verdict.provider_reference and known and verdict.provider_reference != known:
            raise OpsRefused(
                f"{verdict.says}, but for transaction {verdict.provider_reference}; we hold {known}: "
                "book an adjustment or close"
            )
        decision = decide(status, verdict.report)
        details = {"verdict": verdict.report.value, "from": status.value, "evidence": verdict.source}
        if decision.verdict == Verdict.CONFLICT:
            raise OpsRefused(
                f"{verdict.says}: the state machine refuses ({decision.reason}); book an adjustment or close"
            )
        if decision.verdict == Verdict.NOOP:
            if status != verdict.report:
                raise OpsRefused(f"{verdict.says}: nothing to apply ({decision.reason})")
            outcome = f"{kind} {reference} already {status.value} ({verdict.says}); nothing moved"
            return _finish_review(conn, row, "apply", actor, note, outcome, now, details=details)
        apply_decision(
            conn,
            kind,  # type: ignore[arg-type]
            dict(locked),
            decision,
            source=verdict.source,
            now=now,
            provider_reference=verdict.provider_reference,
            failure_code=verdict.failure_code,
            details={"manual_review_id": review_id, "ops_actor": actor.name},
        )
        outcome = f"{kind} {reference}: {decision.reason} ({verdict.says})"
        return _finish_review(conn, row, "apply", actor, note, outcome, now, details=details)


def resolve(
    engine: Engine,
    providers: Mapping[str, Provider],
    review_id: int,
    action: str,
    *,
    actor: Actor,
    note: str,
    amount_minor: int | None = None,
    currency: str | None = None,
    timeout: float = 10.0,
) -> Outcome:
    """One of REVIEW_ACTIONS on a review (what the console's buttons and ``review resolve`` call)."""
    if action == "apply":
        return apply_verdict(engine, providers, review_id, actor=actor, note=note, timeout=timeout)
    if action == "adjust":
        if amount_minor is None:
            raise OpsRefused("an adjustment needs an amount in minor units")
        return book_adjustment(engine, review_id, amount_minor=amount_minor, currency=currency, actor=actor, note=note)
    if action == "close":
        return close_review(engine, review_id, actor=actor, note=note)
    raise OpsRefused(f"unknown action {action[:16]!r}: one of {', '.join(REVIEW_ACTIONS)}")


# ------------------------------------------------------------------------------------------- payments, refunds, recon


def list_targets(
    conn: Connection, kind: str, *, status: str | None = None, query: str | None = None, before_id: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """A page of payments or refunds, newest first: by status, or by business number / order number."""
    spec = TARGETS[kind]
    t = spec.table
    where = []
    if status:
        where.append(t.c.status == PaymentStatus(status).value)
    if query:
        names = [spec.key == query, spec.provider_ref == query, t.c.payment_id == query]
        if kind == "payment":
            names.append(t.c.order_no == query)
        where.append(or_(*names))
    if before_id is not None:
        where.append(t.c.id < before_id)
    rows = conn.execute(select(t).where(*where).order_by(t.c.id.desc()).limit(PAGE_SIZE + 1)).mappings().all()
    return [_row(r) for r in rows[:PAGE_SIZE]], (rows[PAGE_SIZE - 1]["id"] if len(rows) > PAGE_SIZE else None)


def payment_detail(conn: Connection, payment_id: str) -> dict[str, Any] | None:
    """A payment with its refunds, ledger history, provider calls, callbacks, reviews and actions."""
    row = _target(conn, "payment", payment_id)
    if row is None:
        return None
    cb = payment_callback_log
    columns = [c for c in cb.c if c.name not in ("callback_data", "headers")]
    callbacks = conn.execute(
        select(*columns).where(cb.c.order_no.in_(_references(conn, [payment_id]))).order_by(cb.c.id).limit(100)
    ).mappings()
    reviews = conn.execute(
        select(manual_review).where(manual_review.c.payment_id == payment_id).order_by(manual_review.c.id)
    ).mappings()
    refunds = conn.execute(select(refund).where(refund.c.payment_id == payment_id).order_by(refund.c.id)).mappings()
    return {
        "payment": row,
        "refunds": [_row(r) for r in refunds],
        "ledger": ledger.history(conn, payment_id),
        "balance": ledger.payment_balance(conn, payment_id),
        "provider_calls": _calls(conn, payment_id, None),
        "callbacks": with_subjects(conn, [_callback_summary(r) for r in callbacks]),
        "reviews": [_row(r) for r in reviews],
        "actions": actions(conn, payment_id=payment_id),
    }


def refund_detail(conn: Connection, refund_id: str) -> dict[str, Any] | None:
    """A refund with its ledger events and provider calls."""
    row = _target(conn, "refund", refund_id)
    if row is None:
        return None
    events = [e for e in ledger.history(conn, row["payment_id"]) if e["refund_id"] == refund_id]
    return {"refund": row, "ledger": events, "provider_calls": _calls(conn, None, refund_id)}


def reconciliation_runs(conn: Connection, *, before_id: int | None = None) -> tuple[list[dict[str, Any]], int | None]:
    """A page of reconciliation runs, newest first."""
    t = reconciliation_run
    query = select(t).order_by(t.c.id.desc()).limit(PAGE_SIZE + 1)
    if before_id is not None:
        query = query.where(t.c.id < before_id)
    rows = conn.execute(query).mappings().all()
    page = [{**_row(r), "summary": _json(r["summary"])} for r in rows[:PAGE_SIZE]]
    return page, (rows[PAGE_SIZE - 1]["id"] if len(rows) > PAGE_SIZE else None)


def reconciliation_run_detail(
    conn: Connection, run_id: int, *, category: str | None = None, after_id: int | None = None, limit: int = 200
) -> dict[str, Any] | None:
    """One run with a page of its items (by category), oldest first."""
    run = conn.execute(select(reconciliation_run).where(reconciliation_run.c.id == run_id)).mappings().first()
    if run is None:
        return None
    t = reconciliation_item
    where = [t.c.run_id == run_id]
    if category:
        where.append(t.c.category == category)
    if after_id is not None:
        where.append(t.c.id > after_id)
    rows = conn.execute(select(t).where(*where).order_by(t.c.id).limit(limit + 1)).mappings().all()
    counts = dict(
        conn.execute(select(t.c.category, func.count()).where(t.c.run_id == run_id).group_by(t.c.category)).all()
    )
    return {
        "run": {**_row(run), "summary": _json(run["summary"])},
        "counts": counts,
        "items": [{**_row(r), "details": _json(r["details"])} for r in rows[:limit]],
        "next_after_id": rows[limit - 1]["id"] if len(rows) > limit else None,
    }


def suspense_balances(conn: Connection) -> dict[str, int]:
    """What ``suspense:reconciliation`` holds, by currency (what people still have to explain)."""
    rows = conn.execute(
        select(ledger_entry.c.currency, func.sum(ledger_entry.c.amount_minor))
        .join(ledger_event, and_(ledger_event.c.id == ledger_entry.c.ledger_event_id))
        .where(ledger_entry.c.account == ledger.SUSPENSE_RECONCILIATION)
        .group_by(ledger_entry.c.currency)
    ).all()
    return {currency: int(total) for currency, total in rows if total}
