"""The console's pages and actions: each a thin view over ``payments.ops.actions`` (the CLI's module too)."""

from __future__ import annotations

import logging
import re
import time
from datetime import UTC, datetime
from typing import Any

from flask import abort, flash, g, redirect, render_template, request, session, url_for
from sqlalchemy.exc import IntegrityError

from gateway import ext
from gateway.ops import ROLE_OPERATOR, SESSION_SECONDS, bp, client_addr, match_token, safe_next, throttle
from payments.escalation.notify import links
from payments.infra.db import utcnow
from payments.infra.logs import scrub
from payments.infra.schema import RECON_CATEGORIES
from payments.ops import actions as ops_actions
from payments.ops import alert_actions
from payments.ops import sessions as ops_sessions
from payments.ops.actions import Actor, CallbackSearch, OpsRefused
from payments.reconciliation import aging
from payments.states import CallbackStatus, PaymentStatus, ReviewStatus

log = logging.getLogger("paysync.gateway.ops")
RULE_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _engine() -> Any:
    return ext("engine")


def _actor() -> Actor:
    """The typed name, with the session that vouches for it (ops_action.identity)."""
    user = g.ops_user
    return Actor(user["actor"], ops_actions.VIA_CONSOLE, identity=user["identity"], ops_session_id=user["session_id"])


def _int_arg(name: str, *, minimum: int | None = None, maximum: int | None = None) -> int | None:
    raw = request.values.get(name, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        abort(400, description=f"{name} must be a whole number, got {raw[:32]!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        abort(400, description=f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def _time_arg(name: str) -> datetime | None:
    raw = request.values.get(name, "").strip()
    if not raw:
        return None
    try:
        value = datetime.fromisoformat(raw)
    except ValueError:
        abort(400, description=f"{name} must be an ISO time such as 2026-12-01T09:30 (UTC), got {raw[:40]!r}")
    # Stored times are naive UTC: a time with an offset is converted, one without is taken as UTC.
    return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value


def _text_arg(name: str, limit: int = 128) -> str | None:
    value = request.values.get(name, "").strip()
    return value[:limit] or None


def _confirmed() -> bool:
    """The person saw the confirmation page for this action and confirmed it."""
    return request.form.get("confirmed") == ops_actions.CONFIRMED


def _confirm(title: str, lines: list[str], action_url: str, back: str, extra: dict[str, Any] | None = None) -> Any:
    """A page saying what the action will do, with a form that posts the same fields again, confirmed.

    A misclick or a stray Enter on adjust, apply, close or a bulk replay shows
    this page instead of acting: what it guards against is a slip, not an
    attacker (every POST needs the session and its CSRF token already).
    """
    fields = [(k, v) for k, v in request.form.items(multi=True) if k not in ("csrf", "confirmed", *(extra or {}))]
    fields += [(k, str(v)) for k, v in (extra or {}).items()]
    return render_template(
        "ops/confirm.html", title=title, lines=lines, fields=fields, action_url=action_url, back=back
    )


# ------------------------------------------------------------------------------------------- login


@bp.route("/login", methods=["GET", "POST"])
def login() -> Any:
    """The login form; POST checks the token (constant time), throttles failures, opens the session."""
    settings = ext("settings")
    next_url = safe_next(request.values.get("next"))
    if request.method == "GET":
        if g.ops_user is not None:
            return redirect(next_url)
        return render_template("ops/login.html", next=next_url, error=None)
    addr = client_addr(settings)
    wait = throttle.blocked_for(addr)
    if wait > 0:
        log.warning("ops login refused: too many failures", extra={"remote_addr": addr})
        body = render_template("ops/login.html", next=next_url, error="Too many failed logins; try again later.")
        return body, 429, {"Retry-After": str(int(wait) + 1)}
    name = request.form.get("name", "")
    matched = match_token(request.form.get("token", ""), settings)
    name_error = "Give your name (1 to 64 characters): it is recorded."
    try:
        actor = ops_actions.clean_actor(name)
    except OpsRefused:
        actor = None
    if actor is not None and _holds_a_secret(actor, settings):
        # A token typed into the name box (or pasted with it) would be the actor of every action: in the
        # session, in each ops_action row and in the login line. No scrubber can tell a bare token from a name.
        actor, name_error = None, "That is a token or a card number, not a name: give your name."
    if matched is None or actor is None:
        if matched is None:
            throttle.failed(addr)
            # Neither the token nor the name field: a token typed into the wrong box must not reach the logs.
            log.warning("ops login failed: unknown token", extra={"remote_addr": addr})
        error = "Unknown token." if matched is None else name_error
        return render_template("ops/login.html", next=next_url, error=error), 401 if matched is None else 400
    throttle.succeeded(addr)
    role, tk = matched
    sid, live = ops_sessions.open_session(
        _engine(), role=role, actor=actor, token_fingerprint=tk, remote_addr=addr, lifetime_seconds=SESSION_SECONDS
    )
    if isinstance(session.get("sid"), str):  # logging in again over a live session: the old one ends here
        ops_sessions.revoke_session(_engine(), session["sid"])
    session.clear()  # a fresh session (and CSRF token) for the new login: no fixation
    session.update({"role": role, "actor": actor, "tk": tk, "sid": sid, "iat": int(time.time())})
    log.info("ops login", extra={"actor": actor, "role": role, "remote_addr": addr, "ops_session_id": live.id})
    return redirect(next_url)


def _holds_a_secret(name: str, settings: Any) -> bool:
    """True when ``name`` contains a configured token, or text the log scrubber would alter (a card number)."""
    tokens = (*settings.ops_token, *settings.ops_readonly_token, *settings.merchant_api_token)
    return any(token and token in name for token in tokens) or scrub(name) != name


@bp.post("/logout")
def logout() -> Any:
    """End the session, on the server too: its row is revoked, so a copy of the cookie opens nothing."""
    revoked = ops_sessions.revoke_session(_engine(), session.get("sid") or "")
    if g.ops_user:
        log.info("ops logout", extra={"actor": g.ops_user["actor"], "ops_session_id": g.ops_user["session_id"]})
    session.clear()
    if not revoked and g.ops_user:  # cannot happen for a live session; worth a line if it does
        log.warning("ops logout found no live session row to revoke")
    return redirect(url_for("ops.login"))


# ------------------------------------------------------------------------------------------- overview


@bp.get("/")
def overview() -> Any:
    """Backlog by status, rates, open alerts, Unknown payments by age."""
    with _engine().connect() as conn:
        data = ops_actions.overview(conn, utcnow())
        data["suspense"] = ops_actions.suspense_balances(conn)
        recent = ops_actions.actions(conn, limit=10)
    return render_template("ops/overview.html", data=data, recent=recent, buckets=ops_actions.BUCKETS)


@bp.get("/aging")
def aging_report() -> Any:
    """The aging report (payments/reconciliation/aging.py) as a table."""
    report = aging.aging(_engine())
    return render_template("ops/aging.html", report=report, buckets=aging.BUCKETS)


@bp.get("/actions")
def action_log() -> Any:
    """The latest ops actions (the append-only record)."""
    with _engine().connect() as conn:
        rows = ops_actions.actions(conn, limit=200)
    return render_template("ops/actions.html", rows=rows)


# ------------------------------------------------------------------------------------------- callbacks


FILTER_FIELDS = ("order_no", "payment_id", "provider_event_id", "status", "provider", "since", "until")
"""The callback search's filters: the list's query string, and the fields "replay all matching" posts."""


def _callback_search() -> CallbackSearch:
    return CallbackSearch(
        order_no=_text_arg("order_no"),
        payment_id=_text_arg("payment_id"),
        provider_event_id=_text_arg("provider_event_id"),
        status=_int_arg("status", minimum=0, maximum=max(CallbackStatus)),
        provider=_text_arg("provider", 32),
        since=_time_arg("since"),
        until=_time_arg("until"),
        before_id=_int_arg("before_id", minimum=1),
    )


@bp.get("/callbacks")
def callbacks() -> Any:
    """Search the callback log: order number, payment id, provider event id, status, time; paginated."""
    search = _callback_search()
    with _engine().connect() as conn:
        rows, next_before = ops_actions.search_callbacks(conn, search)
        matching = ops_actions.count_replayable(conn, search)["total"] if g.ops_user["role"] == ROLE_OPERATOR else 0
    args = {k: v for k, v in request.args.items() if k != "before_id" and v}
    return render_template(
        "ops/callbacks.html",
        rows=rows,
        next_before=next_before,
        args=args,
        statuses=list(CallbackStatus),
        matching=matching,
        filter_fields=FILTER_FIELDS,
    )


@bp.post("/callbacks/replay-matching")
def replay_matching() -> Any:
    """Replay every failed, rejected or given-up row the filter matches: a count to confirm first, then in batches."""
    search = _callback_search()
    args = {k: request.form[k] for k in FILTER_FIELDS if request.form.get(k)}
    back = url_for("ops.callbacks", **args)
    try:
        note = ops_actions.clean_note(request.form.get("note", ""))
        if not _confirmed():
            with _engine().connect() as conn:
                lines, bound = ops_actions.preview_replay_matching(conn, search)
            title = f"replay all {bound['expected']} matching callbacks"
            return _confirm(title, lines, url_for("ops.replay_matching"), back, extra=bound)
        expected = _int_arg("expected", minimum=1, maximum=ops_actions.MAX_MATCHING)
        upto_id = _int_arg("upto_id", minimum=1)
        if expected is None or upto_id is None:
            abort(400, description="expected and upto_id come from the confirmation page")
        done = ops_actions.replay_matching(
            _engine(), search, actor=_actor(), note=note, expected=expected, upto_id=upto_id
        )
    except OpsRefused as exc:
        flash(str(exc), "error")
        return redirect(back)
    flash(done.outcome, "ok" if done.replayed else "error")
    return redirect(back)


@bp.get("/callbacks/<int:log_id>")
def callback(log_id: int) -> Any:
    """One callback: its row, body and headers with secrets redacted, the actions taken on it."""
    with _engine().connect() as conn:
        row = ops_actions.callback(conn, log_id)
    if row is None:
        abort(404, description=f"no callback {log_id}")
    return render_template("ops/callback.html", row=row)


@bp.post("/callbacks/replay")
def replay() -> Any:
    """Replay the selected rows (status 2, 3 or 4 back to 0), then process each at once as the sweep would."""
    ids = []
    for raw in request.form.getlist("id"):
        try:
            ids.append(int(raw))
        except ValueError:
            abort(400, description=f"callback id must be a whole number, got {raw[:32]!r}")
    back = safe_next(request.form.get("back"))
    runtime = ext("runtime")
    if len(set(ids)) > 1 and not _confirmed():
        try:
            ops_actions.clean_note(request.form.get("note", ""))
            with _engine().connect() as conn:
                lines = ops_actions.preview_replay(conn, ids)
        except OpsRefused as exc:
            flash(str(exc), "error")
            return redirect(back)
        return _confirm(f"replay {len(set(ids))} callbacks", lines, url_for("ops.replay"), back)
    try:
        results = ops_actions.replay_and_process(
            runtime.engine,
            runtime.providers,
            runtime.callback_policy,
            ids,
            actor=_actor(),
            note=request.form.get("note", ""),
        )
    except OpsRefused as exc:
        flash(str(exc), "error")
        return redirect(back)
    for result in results:
        # Green only when processing succeeded: a replay that failed again must not look done.
        flash(f"{result.subject}: {result.outcome}", "ok" if result.ok else "error")
    return redirect(back)


# ------------------------------------------------------------------------------------------- the manual queue


@bp.get("/reviews")
def reviews() -> Any:
    """The manual queue, open items first by default."""
    status = request.args.get("status", ReviewStatus.OPEN.value)
    if status not in (*(s.value for s in ReviewStatus), "all"):
        abort(400, description="status must be open, resolved or all")
    with _engine().connect() as conn:
        rows, next_before = ops_actions.list_reviews(
            conn,
            status=None if status == "all" else status,
            kind=_text_arg("kind", 40),
            before_id=_int_arg("before_id", minimum=1),
        )
    return render_template("ops/reviews.html", rows=rows, next_before=next_before, status=status)


@bp.get("/reviews/<int:review_id>")
def review(review_id: int) -> Any:
    """One item with its evidence and the actions a person can take."""
    with _engine().connect() as conn:
        item = ops_actions.review_detail(conn, review_id)
        found = alert_actions.alert_of_review(conn, item) if item else None
    if item is None:
        abort(404, description=f"no manual review {review_id}")
    return render_template(
        "ops/review.html", item=item, review_alert=found, max_minutes=alert_actions.MAX_SILENCE_MINUTES
    )


@bp.post("/reviews/<int:review_id>/resolve")
def resolve_review(review_id: int) -> Any:
    """Apply the provider's verdict, book an adjustment, or close with a note."""
    action = request.form.get("action", "")
    if action not in ops_actions.REVIEW_ACTIONS:
        abort(400, description=f"action must be one of {', '.join(ops_actions.REVIEW_ACTIONS)}")
    amount = _int_arg("amount_minor", minimum=-ops_actions.MAX_ADJUSTMENT, maximum=ops_actions.MAX_ADJUSTMENT)
    currency = request.form.get("currency") or None
    runtime = ext("runtime")
    page = url_for("ops.review", review_id=review_id)
    # Over the payment's amount: not booked, but asked of a second operator (ops_actions.request_adjustment).
    asks = action == "adjust" and request.form.get("approval") == "request"
    if not _confirmed():
        try:
            ops_actions.clean_note(request.form.get("note", ""))
            with _engine().connect() as conn:
                shown = "request_adjustment" if asks else action
                lines = ops_actions.preview(conn, review_id, shown, amount_minor=amount, currency=currency)
        except OpsRefused as exc:
            flash(f"review {review_id}: {exc}", "error")
            return redirect(page)
        title = f"ask approval to adjust review {review_id}" if asks else f"{action} review {review_id}"
        return _confirm(title, lines, url_for("ops.resolve_review", review_id=review_id), page)
    if asks:
        try:
            result = ops_actions.request_adjustment(
                runtime.engine,
                review_id,
                amount_minor=amount if amount is not None else 0,
                currency=currency,
                actor=_actor(),
                note=request.form.get("note", ""),
            )
        except OpsRefused as exc:
            flash(f"review {review_id}: {exc}", "error")
        else:
            flash(f"review {review_id}: {result.outcome}", "ok")
        return redirect(page)
    try:
        result = ops_actions.resolve(
            runtime.engine,
            runtime.providers,
            review_id,
            action,
            actor=_actor(),
            note=request.form.get("note", ""),
            amount_minor=amount,
            currency=currency,
            timeout=runtime.settings.provider_timeout_seconds,
        )
    except OpsRefused as exc:
        flash(f"review {review_id}: {exc}", "error")
    except IntegrityError:
        flash(f"review {review_id}: already adjusted (one adjustment per review)", "error")
    else:
        flash(f"review {review_id}: {result.outcome}", "ok")
    return redirect(url_for("ops.review", review_id=review_id))


@bp.post("/reviews/<int:review_id>/approval")
def review_approval(review_id: int) -> Any:
    """Approve (another operator: books it) or decline the review's pending oversized adjustment."""
    decision = request.form.get("decision", "")
    if decision not in ("approve", "decline"):
        abort(400, description="decision must be approve or decline")
    request_id = _int_arg("request_id", minimum=1)
    page = url_for("ops.review", review_id=review_id)
    note = request.form.get("note", "")
    try:
        if decision == "approve" and not _confirmed():
            ops_actions.clean_note(note)
            with _engine().connect() as conn:
                pending = ops_actions.pending_adjustment(conn, review_id)
            if pending is None or pending.ops_action_id != request_id:
                raise OpsRefused(f"review {review_id} has no such adjustment awaiting approval")
            lines = [
                f"A ReconciliationAdjusted ledger event of {pending.as_dict()['shown']} is booked for review "
                f"{review_id}, more than its payment's amount, as {pending.requested_by} asked "
                f"(ops_action {pending.ops_action_id}: {pending.reason}).",
                "The review is resolved. The ledger is append-only: undoing it is another adjustment.",
            ]
            return _confirm(f"approve the adjustment of review {review_id}", lines, request.path, page)
        act = ops_actions.approve_adjustment if decision == "approve" else ops_actions.decline_adjustment
        result = act(_engine(), review_id, actor=_actor(), note=note, request_id=request_id)
    except OpsRefused as exc:
        flash(f"review {review_id}: {exc}", "error")
    except IntegrityError:
        flash(f"review {review_id}: already adjusted (one adjustment per review)", "error")
    else:
        flash(f"review {review_id}: {result.outcome}", "ok")
    return redirect(page)


# ------------------------------------------------------------------------------------------- payments, refunds, recon


@bp.get("/payments")
def payments() -> Any:
    """Payments, newest first: by status, or find one by payment id, order number or provider transaction id."""
    return _targets("payment")


@bp.get("/refunds")
def refunds() -> Any:
    """Refunds, newest first, by status or number."""
    return _targets("refund")


def _targets(kind: str) -> Any:
    status = _text_arg("status", 16)
    if status and status not in {s.value for s in PaymentStatus}:
        abort(400, description=f"status must be one of {', '.join(s.value for s in PaymentStatus)}")
    with _engine().connect() as conn:
        rows, next_before = ops_actions.list_targets(
            conn, kind, status=status, query=_text_arg("q"), before_id=_int_arg("before_id", minimum=1)
        )
    args = {k: v for k, v in request.args.items() if k != "before_id" and v}
    return render_template(
        "ops/targets.html",
        kind=kind,
        rows=rows,
        next_before=next_before,
        args=args,
        statuses=[s.value for s in PaymentStatus],
    )


@bp.get("/payments/<payment_id>")
def payment(payment_id: str) -> Any:
    """A payment with its ledger history, refunds, provider calls, callbacks, reviews and actions."""
    with _engine().connect() as conn:
        data = ops_actions.payment_detail(conn, payment_id[:40])
    if data is None:
        abort(404, description="no such payment")
    return render_template("ops/payment.html", data=data)


@bp.get("/refunds/<refund_id>")
def refund(refund_id: str) -> Any:
    """A refund with its ledger events and provider calls."""
    with _engine().connect() as conn:
        data = ops_actions.refund_detail(conn, refund_id[:40])
    if data is None:
        abort(404, description="no such refund")
    return render_template("ops/refund.html", data=data)


@bp.get("/reconciliation")
def reconciliation() -> Any:
    """Reconciliation runs, newest first."""
    with _engine().connect() as conn:
        rows, next_before = ops_actions.reconciliation_runs(conn, before_id=_int_arg("before_id", minimum=1))
    return render_template("ops/recon_runs.html", rows=rows, next_before=next_before)


@bp.get("/reconciliation/<int:run_id>")
def reconciliation_run(run_id: int) -> Any:
    """One run and its items, by category."""
    category = _text_arg("category", 24)
    if category and category not in RECON_CATEGORIES:
        abort(400, description=f"category must be one of {', '.join(RECON_CATEGORIES)}")
    with _engine().connect() as conn:
        data = ops_actions.reconciliation_run_detail(
            conn, run_id, category=category, after_id=_int_arg("after_id", minimum=0)
        )
    if data is None:
        abort(404, description=f"no reconciliation run {run_id}")
    return render_template("ops/recon_run.html", data=data, category=category, categories=RECON_CATEGORIES)


# ------------------------------------------------------------------------------------------- alerts


@bp.get("/alerts")
def alerts() -> Any:
    """Open alerts (``?all=1``: resolved ones too), newest first, with who has them."""
    with _engine().connect() as conn:
        rows = alert_actions.list_alerts(conn, open_only=not request.args.get("all"))
    return render_template("ops/alerts.html", rows=rows, now=utcnow())


@bp.get("/alerts/<int:alert_id>")
def alert(alert_id: int) -> Any:
    """One alert, open or resolved: what it is about, where each notification went and whether the channel took it;
    ack, silence, assign."""
    with _engine().connect() as conn:
        item = alert_actions.alert_detail(conn, alert_id)
    if item is None:
        abort(404, description=f"no alert {alert_id}")
    item["subject"] = ops_actions.alert_subject(item)
    return render_template("ops/alert.html", item=item, max_minutes=alert_actions.MAX_SILENCE_MINUTES)


def _alert_action(page: str, **target: int) -> Any:
    action = request.form.get("action", "")
    if action not in alert_actions.ALERT_ACTIONS:
        abort(400, description=f"action must be one of {', '.join(alert_actions.ALERT_ACTIONS)}")
    minutes = _int_arg("minutes", minimum=0, maximum=alert_actions.MAX_SILENCE_MINUTES)
    try:
        result = alert_actions.act(
            _engine(),
            action,
            actor=_actor(),
            note=request.form.get("note", ""),
            minutes=minutes,
            assignee=request.form.get("assignee") or None,
            **target,
        )
    except OpsRefused as exc:
        flash(str(exc), "error")
    else:
        flash(f"{result.subject}: {result.outcome}", "ok")
    return redirect(page)


@bp.post("/alerts/<int:alert_id>/act")
def act_on_alert(alert_id: int) -> Any:
    """Ack, silence or assign the alert (and its review)."""
    return _alert_action(url_for("ops.alert", alert_id=alert_id), alert_id=alert_id)


@bp.post("/reviews/<int:review_id>/act")
def act_on_review(review_id: int) -> Any:
    """Ack, silence or assign the review (and its alert)."""
    return _alert_action(url_for("ops.review", review_id=review_id), review_id=review_id)


@bp.get("/runbooks/<rule>")
def runbook(rule: str) -> Any:
    """The rule's runbook (docs/runbooks/<rule>.md), where a notice's link leads."""
    if not RULE_NAME.fullmatch(rule):
        abort(404, description=f"no runbook {rule[:64]!r}")
    path = links.RUNBOOKS_DIR / f"{rule}.md"
    if not path.is_file():
        abort(404, description=f"no runbook for {rule}")
    return render_template("ops/runbook.html", rule=rule, text=path.read_text(encoding="utf-8"))
