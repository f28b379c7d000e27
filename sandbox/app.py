"""The sandbox platform's HTTP surface: a Flask app over a Store, the fault Dice and the webhook Dispatcher.

Public API (``/v1/…``) behaves like a card platform with Stripe-style
idempotency keys and answers only requests bearing one of its API keys
(``Authorization: Bearer …``); the control surface (``/_sandbox/…``) answers
only requests from this machine, named by a local ``Host`` and, when a browser
sends one, a local ``Origin``, so a web page open on a developer's machine
cannot reset or steer it. Every body is read through ``_json_body``: past
``MAX_BODY_BYTES``, not JSON, not UTF-8 or absurdly nested, it is a 4xx, never
a 500. Routes stay thin: validation lives in ``sandbox.model``, state in
``sandbox.store``, chance in ``sandbox.faults``.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from sandbox import model, settlement
from sandbox.config import SandboxSettings
from sandbox.faults import Dice, Faults, parse_faults
from sandbox.store import Answer, Store
from sandbox.webhooks import DeliveryPolicy, Dispatcher

log = logging.getLogger("sandbox.app")

LOCAL_ADDRESSES = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
"""Remote addresses allowed on /_sandbox/…."""
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
"""Host names a request to /_sandbox/… may name in its Host and Origin headers."""
MAX_BODY_BYTES = 64 * 1024
"""Largest request body accepted (413 past it); the platform's requests are a few hundred bytes."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of a JSON body accepted; the platform's requests are flat objects."""


@dataclass
class Platform:
    """Everything one sandbox process holds: its books, its dice, its postman, and its settings."""

    store: Store
    dice: Dice
    dispatcher: Dispatcher | None
    fee_rate: Decimal
    configured_faults: Faults
    """The knobs from settings; what /_sandbox/reset goes back to."""
    api_keys: tuple[str, ...] = ()
    """Keys /v1/* accepts as bearer tokens."""

    def wake(self) -> None:
        """Tell the dispatcher a new event may be waiting."""
        if self.dispatcher is not None:
            self.dispatcher.wake()


def build_platform(settings: SandboxSettings, *, db_path: str | None = None, dispatch: bool = True) -> Platform:
    """Open the store and, unless ``dispatch`` is False, create (not start) the webhook dispatcher."""
    store = Store(db_path or settings.db_path)
    dice = Dice(settings.faults)
    dispatcher = None
    if dispatch:
        policy = DeliveryPolicy(
            url=settings.callback_url,
            secret=settings.webhook_secret,
            max_attempts=settings.webhook_max_attempts,
            backoff_seconds=settings.webhook_backoff_seconds,
        )
        dispatcher = Dispatcher(store, policy, lambda: dice.faults)
    return Platform(store, dice, dispatcher, settings.fee_rate, settings.faults, settings.api_keys)


class BodyError(Exception):
    """A request body the platform will not read; answered with ``status`` and nothing is done."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def _json_depth(value: Any) -> int:
    """How deeply ``value`` nests lists and objects (iterative: a hostile body cannot exhaust the stack)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _json_body() -> Any:
    """The request body as JSON, or BodyError: wrong content type 415, not UTF-8 JSON or too deep 400.

    A body past MAX_BODY_BYTES raises RequestEntityTooLarge (413) while it is read.
    """
    raw = request.get_data(cache=True)
    if request.content_length is None and len(raw) >= MAX_BODY_BYTES and request.environ["wsgi.input"].read(1):
        # A chunked body has no Content-Length to refuse up front, and Werkzeug stops reading at the
        # limit without a word: one byte more means the body was cut, and a cut body is not the request.
        raise RequestEntityTooLarge()
    if request.mimetype != "application/json":
        raise BodyError("unsupported_media_type", "the body must be application/json", 415)
    try:
        payload = json.loads(raw.decode("utf-8"))  # strict UTF-8: json.loads alone would guess UTF-16/32
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise BodyError("invalid_request", "the body is not valid UTF-8 JSON") from None
    if _json_depth(payload) > MAX_JSON_DEPTH:
        raise BodyError("invalid_request", f"the body nests deeper than {MAX_JSON_DEPTH} levels")
    return payload


def error(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> Response:
    """The JSON error shape shared with paysync: ``{"error": {"code", "message"}}``."""
    response = jsonify({"error": {"code": code, "message": message}})
    response.status_code = status
    response.headers.update(headers or {})
    return response


def _platform() -> Platform:
    return current_app.extensions["sandbox"]


def _answer(answer: Answer) -> Response:
    response = jsonify(answer.body)
    response.status_code = answer.status_code
    if answer.replayed and answer.status_code != 409:
        response.headers["Idempotent-Replayed"] = "true"
    return response


def _authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    presented = token.strip().encode()
    # Every key is compared (constant time each), so the answer's timing says nothing about which one is near.
    matches = [hmac.compare_digest(presented, key.encode()) for key in keys]
    return any(matches)


api = Blueprint("sandbox_api", __name__, url_prefix="/v1")


@api.before_request
def _authenticate() -> Response | None:
    platform = _platform()
    if not _authorized(request.headers.get("Authorization"), platform.api_keys):
        return error(
            "invalid_api_key",
            "a valid API key is required (Authorization: Bearer <key>)",
            401,
            {"WWW-Authenticate": 'Bearer realm="sandbox"'},
        )
    latency_ms = platform.dice.faults.latency_ms
    if latency_ms:
        time.sleep(latency_ms / 1000)
    return None


def _idempotent_post(endpoint: str, parse: Any, create: Any) -> Response:
    key = request.headers.get("Idempotency-Key", "")
    if not key:
        return error("missing_idempotency_key", "the Idempotency-Key header is required", 400)
    if len(key) > model.MAX_IDEMPOTENCY_KEY or not key.isprintable():
        message = f"Idempotency-Key must be 1-{model.MAX_IDEMPOTENCY_KEY} printable characters"
        return error("invalid_idempotency_key", message, 400)
    try:
        payload = _json_body()
        req = parse(payload)
    except BodyError as exc:
        return error(exc.code, str(exc), exc.status)
    except model.BadRequest as exc:
        return error(exc.code, str(exc), 400)
    platform = _platform()
    fp = model.fingerprint(endpoint, payload)
    # A replay is the stored first answer, untouched by the dice: no new 5xx, hang or decline.
    stored = platform.store.replay(key, fp)
    if stored is not None:
        return _answer(stored)
    plan = platform.dice.plan()
    if plan.error_5xx:
        return error("service_unavailable", "the platform is temporarily unavailable; nothing was done", 503)
    try:
        answer = create(key, fp, req, plan, time.time())
    except model.BadRequest as exc:
        return error(exc.code, str(exc), 400)
    if not answer.replayed:
        platform.wake()
        if plan.hang:
            # Fault "timeout after commit": the work is done and committed; the reply is late.
            time.sleep(platform.dice.faults.hang_seconds)
    return _answer(answer)


@api.post("/charges")
def create_charge() -> Response:
    """Charge ``amount`` minor units; Idempotency-Key required."""
    return _idempotent_post("POST /v1/charges", model.parse_charge, _platform().store.create_charge)


@api.get("/charges")
def find_charge() -> Response:
    """The latest charge for ``?merchant_transaction_id=``, or 404."""
    merchant_id = request.args.get("merchant_transaction_id")
    if not merchant_id:
        return error("invalid_request", "merchant_transaction_id is required", 400)
    return _found(_platform().store.charge_by_merchant_id(merchant_id), "charge")


@api.get("/charges/<charge_id>")
def get_charge(charge_id: str) -> Response:
    """One charge by id, or 404."""
    return _found(_platform().store.charge(charge_id), "charge")


@api.post("/refunds")
def create_refund() -> Response:
    """Refund part or all of a succeeded charge; Idempotency-Key required."""
    return _idempotent_post("POST /v1/refunds", model.parse_refund, _platform().store.create_refund)


@api.get("/refunds")
def find_refund() -> Response:
    """The latest refund for ``?merchant_refund_id=``, or 404."""
    merchant_id = request.args.get("merchant_refund_id")
    if not merchant_id:
        return error("invalid_request", "merchant_refund_id is required", 400)
    return _found(_platform().store.refund_by_merchant_id(merchant_id), "refund")


@api.get("/refunds/<refund_id>")
def get_refund(refund_id: str) -> Response:
    """One refund by id, or 404."""
    return _found(_platform().store.refund(refund_id), "refund")


@api.get("/settlements/<day>.csv")
def settlement_file(day: str) -> Response:
    """The settlement file of one UTC day."""
    try:
        start, end = settlement.day_bounds(settlement.parse_day(day))
    except ValueError:
        return error("invalid_request", "the date must be YYYY-MM-DD", 400)
    platform = _platform()
    text = settlement.build_csv(platform.store.settlement_rows(start, end), platform.fee_rate)
    return Response(text, mimetype="text/csv", headers={"Content-Disposition": f'attachment; filename="{day}.csv"'})


def _found(view: dict[str, Any] | None, what: str) -> Response:
    if view is None:
        return error("not_found", f"no such {what}", 404)
    return jsonify(view)


control = Blueprint("sandbox_control", __name__, url_prefix="/_sandbox")


def _local_name(netloc: str) -> bool:
    """True when a Host or Origin authority ("127.0.0.1:8100", "[::1]", "localhost") names this machine."""
    try:
        host = urlsplit(f"//{netloc}").hostname
    except ValueError:
        return False
    return host is not None and host.lower() in LOCAL_HOSTS


@control.before_request
def _local_only() -> Response | None:
    # The address keeps other machines out; Host keeps out DNS rebinding (a page whose own name resolves
    # to 127.0.0.1); Origin keeps out a page from elsewhere posting from the developer's own browser.
    origin = request.headers.get("Origin")
    local = (
        request.remote_addr in LOCAL_ADDRESSES
        and _local_name(request.host)
        and (origin is None or (urlsplit(origin).scheme in ("http", "https") and _local_name(urlsplit(origin).netloc)))
    )
    if not local:
        return error("forbidden", "the sandbox control surface answers local requests only", 403)
    return None


@control.get("/faults")
def get_faults() -> Response:
    """The fault knobs in force."""
    return jsonify(_platform().dice.faults.to_dict())


@control.post("/faults")
def set_faults() -> Response:
    """Replace the knobs: keys not given go back to their defaults (no fault). Re-seeds the dice."""
    try:
        faults = parse_faults(_json_body())
    except BodyError as exc:
        return error(exc.code, str(exc), exc.status)
    except ValueError as exc:
        return error("invalid_faults", str(exc), 400)
    _platform().dice.configure(faults)
    log.info("fault knobs set", extra={"faults": faults.to_dict()})
    return jsonify(faults.to_dict())


@control.get("/truth")
def truth() -> Response:
    """What was really charged and refunded."""
    return jsonify(_platform().store.truth())


@control.get("/deliveries")
def deliveries() -> Response:
    """Every webhook event with each delivery attempt and the answer it got (``?event_id=`` for one)."""
    return jsonify({"events": _platform().store.deliveries(request.args.get("event_id"))})


@control.post("/reset")
def reset() -> Response:
    """Forget every charge, refund, key and event; put the configured knobs and seed back."""
    platform = _platform()
    platform.store.reset()
    platform.dice.configure(platform.configured_faults)
    return jsonify({"reset": True, "faults": platform.configured_faults.to_dict()})


def create_app(platform: Platform) -> Flask:
    """The Flask app over ``platform``."""
    app = Flask("sandbox")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.extensions["sandbox"] = platform
    app.register_blueprint(api)
    app.register_blueprint(control)

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Response:
        return error((exc.name or "error").lower().replace(" ", "_"), exc.description or "", exc.code or 500)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc)
        return error("internal_error", "internal error", 500)

    return app
