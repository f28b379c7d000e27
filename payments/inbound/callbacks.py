"""Inbound callbacks: store the raw delivery first, then process it idempotently.

``store_callback`` is the gateway's step 1 (the row is the truth; nothing is
acknowledged before it commits). ``process_callback`` is shared by the
consumer and the compensator: one transaction that locks the row, dedupes the
provider event, applies the state machine with a guarded UPDATE, appends to
the ledger and marks the row processed. Anything it raises is rolled back and
recorded on the row (retry count, backoff), and after ``max_retries`` the row
gives up into the manual queue.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, insert, select, update

from payments.errors import (
    CallbackRejected,
    EventIgnored,
    PaysyncError,
    SourceNotAllowed,
    TargetNotFound,
    UnsupportedContentType,
)
from payments.escalation.review import escalate
from payments.inbound.hints import HintLimits, hint_query
from payments.infra import metrics
from payments.infra.backoff import RetryPolicy
from payments.infra.db import driver_statement, insert_ignore, insert_one, retry_on_disconnect, update_each, utcnow
from payments.infra.logs import REQUEST_ID, process_name
from payments.infra.schema import SOURCE_API, SOURCE_WEBHOOK, callback_attempt, payment_callback_log, processed_event
from payments.lifecycle.transitions import TARGETS, Target, apply_decision, apply_planned, plan_decision
from payments.providers import get_provider
from payments.providers.base import CallbackEvent, Provider
from payments.states import CALLBACK_RETRYABLE, CallbackStatus, PaymentStatus, Verdict, decide

log = logging.getLogger("paysync.callbacks")


class CallbackResult(StrEnum):
    """What one ``process_callback`` call did."""

    APPLIED = "applied"
    NOOP = "noop"
    DUPLICATE = "duplicate"
    CONFLICT = "conflict"
    REJECTED = "rejected"
    RETRY = "retry"
    GAVE_UP = "gave_up"
    SKIPPED = "skipped"
    """Row already processed, rejected or given up (or taken by someone else)."""
    MISSING = "missing"
    """No row with that id (or, when a digest was expected, the row holds another delivery)."""


# The statements every callback runs, built once. Building a Core statement and computing its
# cache key on each call cost about a quarter of the Python time per callback (bench/drain.py);
# column values are passed as parameters at execute time instead (SET/VALUES follow their keys).
_STORE = insert(payment_callback_log)
_LOCK_ROW = (
    # Only what processing reads: PyMySQL parses a descriptor per column, and the row has seventeen.
    select(
        payment_callback_log.c.status,
        payment_callback_log.c.provider,
        payment_callback_log.c.callback_data,
        payment_callback_log.c.headers,
        payment_callback_log.c.create_time,
        payment_callback_log.c.source,
        payment_callback_log.c.request_id,
    )
    .where(payment_callback_log.c.id == bindparam("log_id"))
    .with_for_update()
)
INDEX_COLUMNS = ("order_no", "payment_order_no", "provider_event_id", "event_type")
"""The columns of a callback row that index it, written again from the verified event when it is processed."""
_LOCK_ROWS = (
    # A batch's rows in one statement, in id order (two consumers lock overlapping batches in the same order).
    # With their index columns: the batch path rewrites only those the verified event says differently.
    select(
        payment_callback_log.c.id,
        *_LOCK_ROW.selected_columns,
        *(payment_callback_log.c[name] for name in INDEX_COLUMNS),
    )
    .where(payment_callback_log.c.id.in_(bindparam("log_ids", expanding=True)))
    .order_by(payment_callback_log.c.id)
    .with_for_update()
)
_UPDATE_ROW = update(payment_callback_log).where(payment_callback_log.c.id == bindparam("log_id"))
_CLAIM_EVENT = insert_ignore(processed_event)
_LOCK_TARGET = {
    kind: select(spec.table).where(spec.key == bindparam("reference")).with_for_update()
    for kind, spec in TARGETS.items()
}
_TARGET_COLUMNS = ("id", "payment_id", "order_no", "provider", "amount_minor", "currency", "status")
"""What deciding and writing a report reads of its payment or refund (with its key and provider reference)."""
_LOCK_TARGETS = {
    # A batch's payments (or refunds) in one statement, in id order, like the callback rows.
    kind: select(*(c for c in spec.table.c if c.name in (*_TARGET_COLUMNS, spec.key.name, spec.provider_ref.name)))
    .where(spec.key.in_(bindparam("references", expanding=True)))
    .order_by(spec.table.c.id)
    .with_for_update()
    for kind, spec in TARGETS.items()
}
_ATTEMPT = insert(callback_attempt)
ATTEMPT_BY: ContextVar[str | None] = ContextVar("paysync_attempt_by", default=None)
"""Who processes callbacks here, for ``callback_attempt.attempt_by`` (a replay sets it); else the process's name."""
REPLAYED = "replayed"
"""``callback_attempt.outcome`` of a person's replay (the row back to 0), beside the CallbackResult values."""
BATCH_SAVEPOINT = "paysync_batch"
"""The savepoint the set-wise path writes under: rolled back to when the batch turns out unusual."""


class _NotUsual(Exception):
    """The set-wise path met something the per-row path must handle (module-internal)."""


def refused_for_source(result: str | None) -> bool:
    """True when a row's ``result`` says the gateway refused it for its source (``store_callback(rejected=…)``).

    Such a row stays refused: re-verifying (``reverify``) or replaying it must
    not let a good signature in from where the provider does not send.
    """
    return (result or "").startswith(f"rejected: {SourceNotAllowed.code}")


def store_callback(
    engine: Engine,
    *,
    provider: str,
    body: bytes,
    headers: Mapping[str, str],
    remote_addr: str | None,
    index: Mapping[str, str | None] | None = None,
    now: datetime | None = None,
    source: str = SOURCE_WEBHOOK,
    rejected: str | None = None,
    request_id: str | None = None,
) -> int:
    """INSERT the raw delivery with status 0 and COMMIT; return its id. Raises if the database is unavailable.

    ``source`` is ``webhook`` for what the gateway received and ``api`` for an
    event a paysync job fetched from the provider itself (never set from a request).
    ``rejected``: refused before it was stored (its source is not allowed): stored
    with status 3 and this reason in the same INSERT, so no sweep can ever take it for pending.
    """
    now = now or utcnow()
    index = index or {}
    values = {
        "provider": provider,
        "callback_data": body,
        # Not \u-escaped: latin-1 header text would take 6 bytes a character and overflow the column.
        "headers": json.dumps(dict(headers), sort_keys=True, ensure_ascii=False),
        "remote_addr": (remote_addr or "")[:64] or None,
        "source": source,
        "order_no": index.get("order_no"),
        "payment_order_no": index.get("payment_order_no"),
        "provider_event_id": index.get("provider_event_id"),
        "event_type": index.get("event_type"),
        "status": CallbackStatus.PENDING if rejected is None else CallbackStatus.REJECTED,
        "result": None if rejected is None else f"rejected: {rejected}"[:500],
        "retry_count": 0,
        "next_retry_at": now,
        "create_time": now,
        "update_time": now,
        "request_id": request_id,
    }

    # No ping before the INSERT (payments.infra.db): a pooled connection the database dropped fails here once,
    # and the delivery is stored on a fresh one. Repeating is safe: if the lost reply was to a COMMIT that
    # did commit, the second row is the same delivery stored twice, as a provider's own retry would.
    return insert_one(engine, driver_statement(_STORE, engine.dialect, tuple(values)), values)


def verify_callback(provider: Provider, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
    """The checks every delivery passes, at the gateway and again when processed: content type, then the adapter's.

    Raises CallbackRejected (status 3) when the delivery is not genuine or not readable.
    """
    given = next((v for k, v in headers.items() if k.lower() == "content-type"), None)
    # A missing Content-Type is left to the adapter's parser; one that names another format is refused.
    if provider.callback_content_types and given is not None:
        media_type = given.split(";", 1)[0].strip().lower()
        if media_type not in provider.callback_content_types:
            raise UnsupportedContentType(
                f"Content-Type must be {' or '.join(provider.callback_content_types)}, got {media_type[:64]!r}"
            )
    return provider.parse_callback(body, headers, now=now)


def lock_rows(conn: Connection, log_ids: list[int]) -> dict[int, Any]:
    """Lock and read the rows ``log_ids`` for ``process_locked`` in one statement; missing ids are left out."""
    return {row.id: row for row in conn.execute(_LOCK_ROWS, {"log_ids": log_ids})}


def reject_callback(
    engine: Engine,
    log_id: int,
    reason: str,
    now: datetime | None = None,
    *,
    providers: Mapping[str, Provider] | None = None,
    hints: HintLimits | None = None,
) -> bool:
    """Mark a stored row as rejected (status 3) with the reason; True if it was still pending.

    With ``providers``, the payment the row names (unverified) gets its query
    brought forward in the same transaction (``payments.inbound.hints``).
    """
    now = now or utcnow()
    with engine.begin() as conn:
        result = conn.execute(
            update(payment_callback_log)
            .where(payment_callback_log.c.id == log_id, payment_callback_log.c.status == CallbackStatus.PENDING)
            .values(status=CallbackStatus.REJECTED, result=f"rejected: {reason}"[:500], update_time=now)
        )
        if result.rowcount == 1:
            record_attempts(
                conn, [(log_id, CallbackResult.REJECTED, CallbackStatus.REJECTED, f"rejected: {reason}")], now
            )
        if result.rowcount == 1 and providers is not None:
            _hint(conn, providers, log_id, now, hints or HintLimits())
        return result.rowcount == 1


def hint_rejected(
    engine: Engine, providers: Mapping[str, Provider], log_id: int, hints: HintLimits, now: datetime | None = None
) -> None:
    """The hint of a row stored already rejected (``store_callback(rejected=…)``), in its own transaction."""
    with engine.begin() as conn:
        _hint(conn, providers, log_id, now or utcnow(), hints)


def _hint(conn: Connection, providers: Mapping[str, Provider], log_id: int, now: datetime, hints: HintLimits) -> None:
    """A refused delivery is a hint: bring the query of the payment it names forward (rate-limited)."""
    row = conn.execute(
        select(payment_callback_log.c.provider, payment_callback_log.c.order_no).where(
            payment_callback_log.c.id == log_id
        )
    ).first()
    if row is not None:
        hint_query(conn, providers, row.provider, row.order_no, now, hints, callback_log_id=log_id)


def process_callback(
    engine: Engine,
    providers: dict[str, Provider],
    log_id: int,
    policy: RetryPolicy,
    *,
    now: datetime | None = None,
    expect: tuple[str, datetime] | None = None,
    hints: HintLimits | None = None,
) -> CallbackResult:
    """Process one stored callback in ONE transaction; on any error record a retry (or give up).

    Only rows with status 0 or 2 proceed; calling it again for a processed row
    is a no-op, so redeliveries and concurrent workers are harmless. With
    ``expect`` (the body digest and receipt time the broker's copy names), a
    row holding another delivery is MISSING: this one was lost and its id
    handed out again. A row rejected here is a hint like one the gateway
    rejected (``hints``: its rate limits). Raises
    only when even recording the failure is impossible (database down).
    """
    now = now or utcnow()
    # The row's request id is bound while it is processed (process_locked), so every log line of this
    # callback names the gateway request that stored it; restored afterwards for whatever runs next.
    token = REQUEST_ID.set(REQUEST_ID.get())
    limits = hints or HintLimits()

    def attempt() -> CallbackResult:
        with engine.begin() as conn:
            return process_locked(conn, providers, log_id, now, expect, limits)

    try:
        try:
            # A dead pooled connection is not the callback's fault: run again on a fresh one (idempotent).
            outcome = retry_on_disconnect(attempt)
        except Exception as exc:  # noqa: BLE001 - every failure is recorded on the row, then retried
            outcome = record_failure(engine, log_id, exc, policy, now)
    finally:
        REQUEST_ID.reset(token)
    metrics.callback_processed(outcome)
    return outcome


def process_locked(
    conn: Connection,
    providers: dict[str, Provider],
    log_id: int,
    now: datetime,
    expect: tuple[str, datetime] | None,
    hints: HintLimits | None = None,
    locked: Mapping[int, Any] | None = None,
) -> CallbackResult:
    """``process_callback``'s work inside the caller's transaction; raises on a failure the caller records.

    ``locked`` holds rows the caller already read with their lock (``lock_rows``), by id.
    """
    row = locked.get(log_id) if locked is not None else conn.execute(_LOCK_ROW, {"log_id": log_id}).first()
    if row is None:
        return CallbackResult.MISSING
    if expect is not None and (hashlib.sha256(row.callback_data).hexdigest(), row.create_time) != expect:
        return CallbackResult.MISSING
    if row.status not in CALLBACK_RETRYABLE:
        return CallbackResult.SKIPPED
    if row.request_id:
        REQUEST_ID.set(row.request_id)
    try:
        event = _verified_event(providers, row)
    except EventIgnored as exc:
        # Genuine, but about nothing we apply (another integration's object, an event type we do not act on).
        _finish(conn, log_id, CallbackStatus.PROCESSED, f"ignored: {exc}", now, outcome=CallbackResult.NOOP)
        return CallbackResult.NOOP
    except (CallbackRejected, PaysyncError) as exc:
        if not exc.permanent:
            raise
        _finish(
            conn, log_id, CallbackStatus.REJECTED, f"rejected: {exc.code}: {exc}", now, outcome=CallbackResult.REJECTED
        )
        if isinstance(exc, CallbackRejected):
            _hint(conn, providers, log_id, now, hints or HintLimits())
        return CallbackResult.REJECTED

    indexed = _indexed(event)
    fresh = conn.execute(
        _CLAIM_EVENT,
        {
            "provider": event.provider,
            "provider_event_id": event.event_id,
            "callback_log_id": log_id,
            "processed_at": now,
        },
    ).rowcount
    if not fresh:
        first = conn.execute(
            select(processed_event.c.callback_log_id).where(
                processed_event.c.provider == event.provider, processed_event.c.provider_event_id == event.event_id
            )
        ).scalar()
        _finish(
            conn,
            log_id,
            CallbackStatus.PROCESSED,
            f"duplicate: event {event.event_id} applied by callback {first}",
            now,
            indexed,
            outcome=CallbackResult.DUPLICATE,
        )
        return CallbackResult.DUPLICATE

    outcome, result = _apply_event(conn, providers, event, log_id, now)
    _finish(conn, log_id, CallbackStatus.PROCESSED, result, now, indexed, outcome=outcome)
    if outcome is CallbackResult.APPLIED:
        metrics.callback_applied(row.provider, row.create_time, now)
    return outcome


def _verified_event(providers: dict[str, Provider], row: Any) -> CallbackEvent:
    """The event a locked callback row carries, verified; raises what ``verify_callback`` raises."""
    provider = get_provider(providers, row.provider)
    if row.source == SOURCE_API:
        # Written by our own fetch job from an authenticated API answer: there is no delivery signature.
        return provider.parse_fetched(bytes(row.callback_data))
    # Verified against the time it was received, so a row retried hours later still verifies.
    received = (row.create_time - datetime(1970, 1, 1)).total_seconds()
    return verify_callback(provider, bytes(row.callback_data), json.loads(row.headers), now=received)


def process_locked_batch(
    conn: Connection,
    providers: dict[str, Provider],
    items: Sequence[tuple[int, tuple[str, datetime] | None]],
    now: datetime,
    locked: Mapping[int, Any],
) -> list[CallbackResult] | None:
    """``process_locked`` for several rows at once, set-wise; None when this batch needs the per-row path.

    ``items`` are (log id, expect) pairs, each pair once, all locked by the
    caller (``lock_rows``); one log id may come with two expects (a lost row's
    id reused), and each item gets its own outcome, in its own place. The common case, every row a fresh verified report
    that moves its payment or refund on or finds it already there (a NOOP: the
    provider call's answer got there first), costs the same few statements
    whatever the batch size: one multi-row INSERT into ``processed_event`` (the inbox),
    one SELECT … FOR UPDATE of the targets, the guarded UPDATEs, ledger and
    outbox rows of ``transitions.apply_planned``, and one guarded UPDATE of
    the callback rows. Every row gets exactly the effects ``process_locked``
    would give it. Rows that are missing or no longer pending are simply
    MISSING or SKIPPED, as there.

    Anything else (a row rejected, ignored or failing verification, a
    duplicate event, two rows for one payment, a target not found, a
    conflict, a row changed under us, any error while writing) makes it return None with nothing written (rolled
    back to its savepoint); the caller then processes the rows one by one, so
    an unusual row gets its own outcome and never undoes the others.
    """
    outcomes: list[CallbackResult] = []
    fresh: list[tuple[int, Any, CallbackEvent]] = []
    # Each fresh row's own position: one log id can come twice (a lost row's id handed out again, its
    # broker copy beside the new row's), and the copy's MISSING must not take the other's outcome.
    places: list[int] = []
    for log_id, expect in items:
        row = locked.get(log_id)
        if row is None or (
            expect is not None and (hashlib.sha256(row.callback_data).hexdigest(), row.create_time) != expect
        ):
            outcomes.append(CallbackResult.MISSING)
            continue
        if row.status not in CALLBACK_RETRYABLE:
            outcomes.append(CallbackResult.SKIPPED)
            continue
        try:
            event = _verified_event(providers, row)
        except Exception:  # noqa: BLE001 - rejected, ignored or failing: the per-row path records which
            return None
        places.append(len(outcomes))
        outcomes.append(CallbackResult.APPLIED)  # or NOOP: _apply_batch says which
        fresh.append((log_id, row, event))
    if not fresh:
        return outcomes
    if len({(e.provider, e.event_id) for _, _, e in fresh}) < len(fresh) or len(
        {(e.target, e.merchant_reference) for _, _, e in fresh}
    ) < len(fresh):
        return None  # one event twice, or two reports for one payment: their order matters, one by one
    conn.exec_driver_sql(f"SAVEPOINT {BATCH_SAVEPOINT}")
    try:
        noops = _apply_batch(conn, providers, fresh, now)
    except Exception as exc:  # noqa: BLE001 - _NotUsual or a write that failed: undone, then row by row
        # Raises if the server already rolled everything back (a deadlock): the caller redoes the batch.
        conn.exec_driver_sql(f"ROLLBACK TO SAVEPOINT {BATCH_SAVEPOINT}")
        log.debug("batch of %s goes row by row: %s", len(fresh), exc)
        return None
    for place, (log_id, row, _) in zip(places, fresh, strict=True):
        if log_id in noops:
            outcomes[place] = CallbackResult.NOOP
        else:
            metrics.callback_applied(row.provider, row.create_time, now)
    return outcomes


def _apply_batch(
    conn: Connection, providers: dict[str, Provider], fresh: list[tuple[int, Any, CallbackEvent]], now: datetime
) -> set[int]:
    """The writes of ``process_locked_batch``; return the ids of the NOOP rows.

    Raises _NotUsual (or a database error) to send the batch row by row.
    """
    claimed = conn.execute(
        _CLAIM_EVENT,
        [
            {"provider": e.provider, "provider_event_id": e.event_id, "callback_log_id": log_id, "processed_at": now}
            for log_id, _, e in fresh
        ],
    ).rowcount
    if claimed != len(fresh):
        raise _NotUsual(f"{len(fresh) - claimed} events already processed")
    currents: dict[tuple[str, str], Mapping[str, Any]] = {}
    for kind in sorted({e.target for _, _, e in fresh}):
        spec = TARGETS[kind]
        references = [e.merchant_reference for _, _, e in fresh if e.target == kind]
        for current in conn.execute(_LOCK_TARGETS[kind], {"references": references}).mappings():
            currents[kind, current[spec.key.name]] = current
    plans = []
    noops: set[int] = set()
    finished: dict[int, dict[str, Any]] = {}
    for log_id, _, event in fresh:
        current = currents.get((event.target, event.merchant_reference))
        if current is None:
            raise _NotUsual(f"no {event.target} {event.merchant_reference!r}")
        if _mismatch(event, current, TARGETS[event.target], providers):
            raise _NotUsual("a report that does not fit its target")
        decision = decide(PaymentStatus(current["status"]), event.report)
        if decision.verdict == Verdict.NOOP:  # as _apply_event: nothing to change, the row is processed
            noops.add(log_id)
            finished[log_id] = {
                "status": CallbackStatus.PROCESSED,
                "result": f"noop: {decision.reason}"[:500],
                "update_time": now,
                **_indexed(event),
            }
            continue
        if decision.verdict != Verdict.APPLY:
            raise _NotUsual(f"a {decision.verdict} report")
        plans.append(
            plan_decision(
                event.target,
                current,
                decision,
                source=f"callback:{log_id}",
                now=now,
                provider_reference=event.provider_reference,
                failure_code=event.failure_code,
                details={"event_id": event.event_id},
            )
        )
        finished[log_id] = {
            "status": CallbackStatus.PROCESSED,
            "result": f"applied: {decision.reason}"[:500],
            "update_time": now,
            **_indexed(event),
        }
    apply_planned(conn, plans, now)
    # The index columns are rewritten from the verified event, as _finish does, but only when some row's differ.
    stale = {name for _, row, event in fresh for name in INDEX_COLUMNS if getattr(row, name) != _indexed(event)[name]}
    for values in finished.values():
        for name in set(INDEX_COLUMNS) - stale:
            del values[name]
    retryable = [int(status) for status in CALLBACK_RETRYABLE]
    if update_each(conn, payment_callback_log, finished, payment_callback_log.c.status, retryable) != len(finished):
        raise _NotUsual("a callback row changed under its lock")
    record_attempts(
        conn,
        [
            (log_id, CallbackResult.NOOP if log_id in noops else CallbackResult.APPLIED, v["status"], v["result"])
            for log_id, v in finished.items()
        ],
        now,
    )
    return noops


def _indexed(event: CallbackEvent) -> dict[str, str | None]:
    """The index columns of a callback row, as its verified event gives them."""
    return {
        "order_no": event.merchant_reference,
        "payment_order_no": event.provider_reference,
        "provider_event_id": event.event_id,
        "event_type": event.event_type,
    }


def _apply_event(
    conn: Connection, providers: dict[str, Provider], event: CallbackEvent, log_id: int, now: datetime
) -> tuple[CallbackResult, str]:
    spec = TARGETS[event.target]
    current = conn.execute(_LOCK_TARGET[event.target], {"reference": event.merchant_reference}).first()
    if current is None:
        raise TargetNotFound(f"no {event.target} {event.merchant_reference!r} (yet)")
    current = current._mapping
    source = f"callback:{log_id}"

    mismatch = _mismatch(event, current, spec, providers)
    decision = decide(PaymentStatus(current["status"]), event.report)
    if mismatch or decision.verdict == Verdict.CONFLICT:
        reason = mismatch or decision.reason
        _open_conflict(conn, event, current, log_id, reason, now)
        return CallbackResult.CONFLICT, f"conflict: {reason}; manual review opened"
    if decision.verdict == Verdict.NOOP:
        return CallbackResult.NOOP, f"noop: {decision.reason}"

    apply_decision(
        conn,
        event.target,
        current,
        decision,
        source=source,
        now=now,
        provider_reference=event.provider_reference,
        failure_code=event.failure_code,
        details={"event_id": event.event_id},
    )
    return CallbackResult.APPLIED, f"applied: {decision.reason}"


def _mismatch(
    event: CallbackEvent, current: Mapping[str, Any], spec: Target, providers: dict[str, Provider]
) -> str | None:
    """Why a report cannot be about this row at all, or None."""
    adapter = providers.get(current["provider"])
    # The callback names its platform; the row names the adapter it was made through, which belongs to one.
    if event.provider != (adapter.platform if adapter else current["provider"]):
        return f"callback from {event.provider} for a {current['provider']} {event.target}"
    if event.amount_minor != current["amount_minor"] or event.currency != current["currency"]:
        return (
            f"provider reports {event.amount_minor} {event.currency}, "
            f"we have {current['amount_minor']} {current['currency']}"
        )
    known = current[spec.provider_ref.name]
    if event.provider_reference and known and event.provider_reference != known:
        return f"provider reference {event.provider_reference} differs from ours {known}"
    if event.target == "refund" and event.payment_reference and event.payment_reference != current["payment_id"]:
        return f"refund names payment {event.payment_reference}, ours belongs to {current['payment_id']}"
    return None


def _open_conflict(
    conn: Connection, event: CallbackEvent, current: Mapping[str, Any], log_id: int, reason: str, now: datetime
) -> None:
    escalate(
        conn,
        kind="conflicting_report",
        subject=f"{event.target}:{event.merchant_reference}",
        reason=f"conflicting report for {event.target} {event.merchant_reference}: {reason}",
        now=now,
        severity="critical",
        payment_id=current["payment_id"],
        refund_id=event.merchant_reference if event.target == "refund" else None,
        callback_log_id=log_id,
        details={
            "callback_log_id": log_id,
            "event_id": event.event_id,
            "event_type": event.event_type,
            "our_status": current["status"],
        },
    )
    log.warning(
        "conflicting report, sent to manual review",
        extra={"callback_log_id": log_id, "reference": event.merchant_reference, "reason": reason},
    )


def _finish(
    conn: Connection,
    log_id: int,
    status: CallbackStatus,
    result: str,
    now: datetime,
    indexed: Mapping[str, str | None] | None = None,
    *,
    outcome: CallbackResult,
) -> None:
    conn.execute(
        _UPDATE_ROW, {"log_id": log_id, "status": status, "result": result[:500], "update_time": now, **(indexed or {})}
    )
    record_attempts(conn, [(log_id, outcome, status, result)], now)


def record_attempts(
    conn: Connection, attempts: Sequence[tuple[int, str, int, str | None]], now: datetime, by: str | None = None
) -> None:
    """Append (log id, outcome, status after, result) rows to ``callback_attempt`` in one INSERT, in the caller's tx.

    Written beside the status change it describes, so an attempt rolled back
    (a savepoint, a deadlock) leaves no row, and one that committed always has its row.
    """
    if not attempts:
        return
    who = (by or ATTEMPT_BY.get() or process_name() or "")[:64] or None
    conn.execute(
        _ATTEMPT,
        [
            {
                "callback_log_id": log_id,
                "outcome": str(outcome)[:16],
                "status": int(status),
                "result": (result or "")[:500] or None,
                "attempt_by": who,
                "created_at": now,
            }
            for log_id, outcome, status, result in attempts
        ],
    )


def record_failure(
    engine: Engine,
    log_id: int,
    exc: Exception,
    policy: RetryPolicy,
    now: datetime,
) -> CallbackResult:
    """Count one failed attempt in its own transaction: back off, or give up into the manual queue."""
    first: list[bool] = []
    outcome = _record_failure(engine, log_id, exc, policy, now, first)
    if first:  # after the commit: a row's first failure, counted once however often it is retried
        metrics.callback_failed_first()
    return outcome


def _record_failure(
    engine: Engine, log_id: int, exc: Exception, policy: RetryPolicy, now: datetime, first: list[bool]
) -> CallbackResult:
    reason = f"{getattr(exc, 'code', type(exc).__name__)}: {exc}"[:480]
    if isinstance(exc, PaysyncError):
        log.info("callback %s not processed: %s", log_id, reason)
    else:
        log.error("callback %s failed", log_id, exc_info=exc)
    with engine.begin() as conn:
        row = conn.execute(
            select(payment_callback_log.c.status, payment_callback_log.c.retry_count, payment_callback_log.c.order_no)
            .where(payment_callback_log.c.id == log_id)
            .with_for_update()
        ).first()
        if row is None or row.status not in CALLBACK_RETRYABLE:
            return CallbackResult.SKIPPED
        attempts = row.retry_count + 1
        if attempts == 1:
            first.append(True)
        guard = (payment_callback_log.c.id == log_id, payment_callback_log.c.status.in_(CALLBACK_RETRYABLE))
        if policy.exhausted(attempts):
            conn.execute(
                update(payment_callback_log)
                .where(*guard)
                .values(
                    status=CallbackStatus.GAVE_UP,
                    result=f"gave up after {attempts} attempts: {reason}"[:500],
                    retry_count=attempts,
                    last_retry_time=now,
                    update_time=now,
                )
            )
            escalate(
                conn,
                kind="callback_gave_up",
                subject=f"callback:{log_id}",
                alert_key=f"callback_gave_up:{log_id}",
                reason=f"callback {log_id} gave up after {attempts} attempts: {reason}",
                now=now,
                payment_id=row.order_no if row.order_no and row.order_no.startswith("pay_") else None,
                callback_log_id=log_id,
                details={"callback_log_id": log_id},
            )
            record_attempts(
                conn,
                [
                    (
                        log_id,
                        CallbackResult.GAVE_UP,
                        CallbackStatus.GAVE_UP,
                        f"gave up after {attempts} attempts: {reason}",
                    )
                ],
                now,
            )
            log.warning("callback %s gave up after %s attempts", log_id, attempts)
            return CallbackResult.GAVE_UP
        delay = policy.delay(attempts)
        conn.execute(
            update(payment_callback_log)
            .where(*guard)
            .values(
                status=CallbackStatus.FAILED,
                result=reason,
                retry_count=attempts,
                last_retry_time=now,
                next_retry_at=now + timedelta(seconds=delay),
                update_time=now,
            )
        )
        record_attempts(conn, [(log_id, CallbackResult.RETRY, CallbackStatus.FAILED, reason)], now)
        return CallbackResult.RETRY
