"""The merchant API: ``POST /payments`` and ``GET /payments/<payment_id>``; the logic is in payments.charges."""

from __future__ import annotations

import hmac
import logging
from typing import Any

from flask import Blueprint, Response, jsonify, request
from sqlalchemy.exc import SQLAlchemyError

from gateway import error_response, ext
from payments.charges import InvalidRequest, check_key, create_payment, get_payment, parse_create

bp = Blueprint("payments_api", __name__)
log = logging.getLogger("paysync.gateway.payments")


def _authorized() -> bool:
    expected = ext("settings").merchant_api_token
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    # Constant-time, so the token cannot be guessed a character at a time.
    return bool(expected) and scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), expected.encode())


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
        body = parse_create(request.get_data(cache=False), frozenset(ext("providers")), settings.merchant_max_amount)
        answer = create_payment(
            ext("engine"),
            body,
            key,
            deadline_seconds=settings.payment_deadline_seconds,
            lock_seconds=settings.idempotency_lock_seconds,
        )
    except InvalidRequest as exc:
        return error_response(exc.code, str(exc), exc.http_status)
    except SQLAlchemyError as exc:
        log.error("payment not created, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "payment not created; retry with the same key", 503)
    response = Response(answer.body, answer.status, content_type="application/json")
    if answer.replayed:
        response.headers["Idempotent-Replayed"] = "true"
    return response


@bp.get("/payments/<payment_id>")
def show(payment_id: str) -> Any:
    """Status, provider transaction id, ledger history, provider calls and callbacks of one payment."""
    if not _authorized():
        return _unauthorized()
    try:
        found = get_payment(ext("engine"), payment_id[:40])
    except SQLAlchemyError as exc:
        log.error("payment not read, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "payment not readable right now; retry later", 503)
    if found is None:
        return error_response("not_found", "no such payment", 404)
    return jsonify(found)
