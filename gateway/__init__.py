"""The HTTP gateway: a Flask app factory with one blueprint per surface.

``create_app`` builds the process's runtime the way the consumer and the
compensator do (``payments.runtime``: engine, adapters, retry policy,
failpoints armed), plus the gateway's own pieces: the callback publisher
(``broker.publisher``), with CALLBACK_PROCESS_INLINE the inline processor, and the
pool that sends POST /payments's inline charges (``payments.outbound.send_pool``; ``shutdown`` stops it).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from flask import Flask, Response
from werkzeug.exceptions import HTTPException

from payments.infra.settings import Settings, load_settings
from payments.runtime import Runtime, build_runtime, check_deployment

log = logging.getLogger("paysync.gateway")


def error_body(code: str, message: str) -> bytes:
    """The JSON error shape of docs/design.md section 5, as bytes (what Flask's jsonify writes for it)."""
    return json.dumps({"error": {"code": code, "message": message}}, separators=(",", ":")).encode() + b"\n"


def error_response(code: str, message: str, status: int, headers: dict[str, str] | None = None) -> Any:
    """The JSON error shape of docs/design.md section 5, as a Flask response."""
    response = Response(error_body(code, message), status, content_type="application/json")
    for key, value in (headers or {}).items():
        response.headers[key] = value
    return response


def http_error(exc: HTTPException) -> tuple[str, str, int]:
    """(code, message, status) of the error answer to a werkzeug HTTPException (a 400 for a cut request, a 405…)."""
    return (exc.name or "error").lower().replace(" ", "_"), exc.description or exc.name, exc.code or 500


def create_app(
    settings: Settings | None = None, *, engine: Any = None, publisher: Any = None, runtime: Runtime | None = None
) -> Flask:
    """Build the gateway. ``gateway.wsgi`` passes the runtime; tests pass settings and their own engine or publisher."""
    from broker.publisher import PACKING_BYTES, CallbackPublisher
    from gateway.callbacks import CallbackLimits
    from gateway.inline import InlineProcessor
    from payments.inbound.delivery import encode_batch, max_message_bytes
    from payments.infra.metrics import publish_failed  # not `metrics`: gateway.metrics (the blueprint) takes that name
    from payments.outbound.send_pool import SendPool

    if runtime is None:
        if settings is None:
            # What the settings no longer check themselves, the start-up step does (a bad rules file, key file).
            settings = load_settings()
            check_deployment(settings)
        runtime = build_runtime(settings, engine)
    settings = runtime.settings
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.callback_max_body_bytes
    app.extensions["paysync"] = {
        "runtime": runtime,
        "settings": settings,
        "engine": runtime.engine,
        "providers": runtime.providers,
        "publisher": publisher
        or CallbackPublisher(
            settings.amqp_url,
            settings.amqp_queue,
            quorum=settings.amqp_quorum_queue,
            timeout=settings.publish_timeout_seconds,
            on_failure=publish_failed,
            linger=settings.publish_linger_seconds,
            pack=encode_batch,
            batch_max=settings.publish_batch_max,
            # A batch is never larger than a message of one delivery may be: the consumer's bound holds.
            batch_bytes=max_message_bytes(settings.callback_max_body_bytes) - PACKING_BYTES,
        ),
        "inline": InlineProcessor(runtime) if settings.process_inline else None,
        # POST /payments's inline charges: one bounded pool per process, never a thread per request (send_pool).
        "send_pool": SendPool(settings.web_threads, settings.web_threads, name="charge-inline"),
        "limits": CallbackLimits.from_settings(settings),
    }

    from gateway.callbacks import CallbackFastPath
    from gateway.callbacks import bp as callbacks_bp
    from gateway.health import bp as health_bp
    from gateway.metrics import bp as metrics_bp
    from gateway.openapi import bp as openapi_bp
    from gateway.ops import bp as ops_bp
    from gateway.payments_api import bp as payments_bp

    app.register_blueprint(callbacks_bp)
    app.register_blueprint(health_bp)
    app.register_blueprint(metrics_bp)
    app.register_blueprint(payments_bp)
    app.register_blueprint(openapi_bp)
    app.register_blueprint(ops_bp)

    _request_ids(app)
    # POST /callbacks/<provider> is answered before Flask's request machinery (gateway.callbacks).
    app.wsgi_app = CallbackFastPath(app.extensions["paysync"], app.wsgi_app)  # type: ignore[method-assign]

    @app.errorhandler(HTTPException)
    def _http_error(exc: HTTPException) -> Any:
        headers = {"Allow": ", ".join(exc.valid_methods)} if getattr(exc, "valid_methods", None) else None
        return error_response(*http_error(exc), headers)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Any:
        log.error("unhandled error", exc_info=exc)
        return error_response("internal_error", "internal error", 500)

    return app


def shutdown(app: Flask) -> None:
    """Stop the process's own workers: the inline charges' pool lets its running sends finish (at worker_exit)."""
    app.extensions["paysync"]["send_pool"].shutdown()


def _request_ids(app: Flask) -> None:
    """Every request gets an id (a sane X-Request-Id, else a new one): in its log lines and its answer's header."""
    from flask import g, request

    from payments.infra.logs import REQUEST_ID, new_request_id, sane_request_id

    @app.before_request
    def _bind() -> None:
        g.request_id = sane_request_id(request.headers.get("X-Request-Id")) or new_request_id()
        g.request_id_token = REQUEST_ID.set(g.request_id)

    @app.after_request
    def _answer(response: Any) -> Any:
        if "request_id" in g:
            response.headers["X-Request-Id"] = g.request_id
        return response

    @app.teardown_request
    def _unbind(_exc: BaseException | None) -> None:
        token = g.pop("request_id_token", None)
        if token is not None:
            REQUEST_ID.reset(token)


def ext(name: str) -> Any:
    """One of the objects create_app put on the current app."""
    from flask import current_app

    return current_app.extensions["paysync"][name]
