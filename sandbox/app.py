"""The sandbox platform's HTTP surface: a Flask app over a Store, the fault Dice and the webhook Dispatcher.

Public API (``/v1/…``) behaves like a card platform with Stripe-style
idempotency keys; the control surface (``/_sandbox/…``) answers only to
requests from this machine. Routes stay thin: validation lives in
``sandbox.model``, state in ``sandbox.store``, chance in ``sandbox.faults``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from flask import Blueprint, Flask, Response, current_app, jsonify, request
from werkzeug.exceptions import HTTPException

from payments.settings import Settings
from sandbox import model, settlement
from sandbox.faults import Dice, Faults, parse_faults
from sandbox.store import Answer, Store
from sandbox.webhooks import DeliveryPolicy, Dispatcher

log = logging.getLogger("sandbox.app")

LOCAL_ADDRESSES = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
"""Remote addresses allowed on /_sandbox/…."""


@dataclass
class Platform:
    """Everything one sandbox process holds: its books, its dice, its postman, and its settings."""

    store: Store
    dice: Dice
    dispatcher: Dispatcher | None
    fee_rate: Decimal
    configured_faults: Faults
    """The knobs from settings; what /_sandbox/reset goes back to."""

    def wake(self) -> None:
        """Tell the dispatcher a new event may be waiting."""
        if self.dispatcher is not None:
            self.dispatcher.wake()


def configured_faults(settings: Settings) -> Faults:
    """The fault knobs the settings ask for (SANDBOX_FAULTS over SANDBOX_SEED)."""
    return parse_faults(settings.sandbox_faults, base=Faults(seed=settings.sandbox_seed))


def build_platform(settings: Settings, *, db_path: str | None = None, dispatch: bool = True) -> Platform:
    """Open the store and, unless ``dispatch`` is False, create (not start) the webhook dispatcher."""
    store = Store(db_path or settings.sandbox_db_path)
    faults = configured_faults(settings)
    dice = Dice(faults)
    dispatcher = None
    if dispatch:
        policy = DeliveryPolicy(
            url=settings.sandbox_callback_url,
            secret=settings.sandbox_webhook_secret[0] if settings.sandbox_webhook_secret else "",
            max_attempts=settings.sandbox_webhook_max_attempts,
            backoff_seconds=settings.sandbox_webhook_backoff_seconds,
        )
        dispatcher = Dispatcher(store, policy, lambda: dice.faults)
    return Platform(store, dice, dispatcher, settings.sandbox_fee_rate, faults)


def error(code: str, message: str, status: int) -> Response:
    """The JSON error shape shared with paysync: ``{"error": {"code", "message"}}``."""
    response = jsonify({"error": {"code": code, "message": message}})
    response.status_code = status
    return response


def _platform() -> Platform:
    return current_app.extensions["sandbox"]


def _answer(answer: Answer) -> Response:
    response = jsonify(answer.body)
    response.status_code = answer.status_code
    if answer.replayed and answer.status_code != 409:
        response.headers["Idempotent-Replayed"] = "true"
    return response


api = Blueprint("sandbox_api", __name__, url_prefix="/v1")


@api.before_request
def _added_latency() -> None:
    latency_ms = _platform().dice.faults.latency_ms
    if latency_ms:
        time.sleep(latency_ms / 1000)


def _idempotent_post(endpoint: str, parse: Any, create: Any) -> Response:
    key = request.headers.get("Idempotency-Key", "")
    if not key:
        return error("missing_idempotency_key", "the Idempotency-Key header is required", 400)
    if len(key) > model.MAX_IDEMPOTENCY_KEY or not key.isprintable():
        message = f"Idempotency-Key must be 1-{model.MAX_IDEMPOTENCY_KEY} printable characters"
        return error("invalid_idempotency_key", message, 400)
    payload = request.get_json(silent=True)
    try:
        req = parse(payload)
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


@control.before_request
def _local_only() -> Response | None:
    if request.remote_addr not in LOCAL_ADDRESSES:
        return error("forbidden", "the sandbox control surface answers local requests only", 403)
    return None


@control.get("/faults")
def get_faults() -> Response:
    """The fault knobs in force."""
    return jsonify(_platform().dice.faults.to_dict())


@control.post("/faults")
def set_faults() -> Response:
    """Replace the knobs: keys not given go back to their defaults (no fault). Re-seeds the dice."""
    payload = request.get_json(silent=True)
    try:
        faults = parse_faults(payload if payload is not None else "not json")
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
