"""The merchant API: payments and their refunds; the logic is in payments.outbound.charges and
payments.outbound.refunds."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, jsonify, request
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.exceptions import RequestEntityTooLarge

from gateway import error_response, ext
from gateway.auth import bearer_ok
from payments.outbound.charges import InvalidRequest, check_key, create_payment, get_payment, parse_create
from payments.outbound.idempotency import Answer
from payments.outbound.protocol import Context
from payments.outbound.refunds import create_refund, get_refund, parse_refund
from payments.outbound.send_pool import relay_charge_inline

bp = Blueprint("payments_api", __name__)
log = logging.getLogger("paysync.gateway.payments")


def _authorized() -> bool:
    return bearer_ok(ext("settings").merchant_api_token)


def _unauthorized() -> Any:
    return error_response("unauthorized", "a valid bearer token is required", 401, {"WWW-Authenticate": "Bearer"})


@bp.post("/payments")
def create() -> Any:
    """Create a payment (Idempotency-Key required); 201 with the payment, or the first answer again."""
    if not _authorized():
        return _unauthorized()
    settings = ext("settings")
    try:
        key = check_key(request.headers.get("Idempotency-Key"))
        if request.mimetype != "application/json":
            raise InvalidRequest("Content-Type must be application/json", "unsupported_media_type", 415)
        body = parse_create(
            _body(settings.callback_max_body_bytes), frozenset(ext("providers")), settings.merchant_max_amount
        )
        answer = create_payment(
            ext("engine"),
            body,
            key,
            deadline_seconds=settings.payment_deadline_seconds,
            lock_seconds=settings.idempotency_lock_seconds,
            send_now=_send_now(body.provider),
        )
    except InvalidRequest as exc:
        return error_response(exc.code, str(exc), exc.http_status)
    except SQLAlchemyError as exc:
        log.error("payment not created, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "payment not created; retry with the same key", 503)
    return _stored_answer(answer)


class _Calls:
    """This process's token bucket per provider for inline charges (PROVIDER_RATE_LIMIT, as the relay's): a call
    is taken at once or not at all, since the merchant is waiting and the relay can always send it later."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # provider: (tokens, monotonic time)

    def take(self, provider: str, rate: float) -> bool:
        burst = max(1.0, rate / 10)  # the relay's RateLimiter burst
        with self._lock:
            now = time.monotonic()
            tokens, then = self._buckets.get(provider, (burst, now))
            tokens = min(burst, tokens + (now - then) * rate)
            if tokens < 1:
                self._buckets[provider] = (tokens, now)
                return False
            self._buckets[provider] = (tokens - 1, now)
            return True


_calls = _Calls()


def _stored_answer(answer: Answer) -> Response:
    """The answer of a keyed POST as stored with its key (``payments.outbound.idempotency``); a replay says so."""
    response = Response(answer.body, answer.status, content_type="application/json")
    if answer.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


def _send_now(provider: str) -> Callable[[str], bool] | None:
    """How POST /payments sends a charge at once (see ``payments.outbound.charges``); None when it waits for the
    relay."""
    settings = ext("settings")
    adapter = ext("providers").get(provider)
    budget = settings.charge_inline_budget_seconds
    if budget <= 0 or adapter is None or not adapter.capabilities.payer_scans:
        return None
    ctx = Context(ext("engine"), ext("providers"), settings)

    def throttle(name: str) -> bool:
        return _calls.take(name, settings.provider_rate_limit)

    pool = ext("send_pool")
    return lambda event_id: relay_charge_inline(ctx, pool, event_id, provider, budget, throttle)


def _body(limit: int) -> bytes:
    body = request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH
    # A chunked body has no Content-Length to refuse up front and Werkzeug silently stops reading at the
    # limit: look for one byte more, or the first part of an oversized body would be taken as the request.
    if request.content_length is None and len(body) >= limit and request.environ["wsgi.input"].read(1):
        raise RequestEntityTooLarge()
    return body


@bp.get("/payments/<payment_id>")
def show(payment_id: str) -> Any:
    """Status, provider transaction id, ledger history, provider calls and callbacks of one payment."""
    if not _authorized():
        return _unauthorized()
    try:
        found = get_payment(ext("engine"), payment_id[:40], ext("providers"))
    except SQLAlchemyError as exc:
        log.error("payment not read, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "payment not readable right now; retry later", 503)
    if found is None:
        return error_response("not_found", "no such payment", 404)
    return jsonify(found)


@bp.post("/payments/<payment_id>/refunds")
def refund(payment_id: str) -> Any:
    """Request a refund of (part of) a Succeeded payment (Idempotency-Key required); 201 with the refund."""
    if not _authorized():
        return _unauthorized()
    settings = ext("settings")
    try:
        key = check_key(request.headers.get("Idempotency-Key"))
        if request.mimetype != "application/json":
            raise InvalidRequest("Content-Type must be application/json", "unsupported_media_type", 415)
        amount, reason = parse_refund(_body(settings.callback_max_body_bytes))
        if len(payment_id) > 40:
            raise InvalidRequest("no such payment", "not_found", 404)
        answer = create_refund(
            ext("engine"),
            payment_id,
            amount,
            reason,
            key,
            deadline_seconds=settings.refund_deadline_seconds,
            lock_seconds=settings.idempotency_lock_seconds,
        )
    except InvalidRequest as exc:
        return error_response(exc.code, str(exc), exc.http_status)
    except SQLAlchemyError as exc:
        log.error("refund not created, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "refund not created; retry with the same key", 503)
    return _stored_answer(answer)


@bp.get("/payments/<payment_id>/refunds/<refund_id>")
def show_refund(payment_id: str, refund_id: str) -> Any:
    """One refund of one payment: status, provider refund id, ledger events and provider calls."""
    if not _authorized():
        return _unauthorized()
    try:
        found = get_refund(ext("engine"), payment_id[:40], refund_id[:40])
    except SQLAlchemyError as exc:
        log.error("refund not read, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "refund not readable right now; retry later", 503)
    if found is None:
        return error_response("not_found", "no such refund of this payment", 404)
    return jsonify(found)
