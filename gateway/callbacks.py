"""``POST /callbacks/<provider>``: store first, verify second, publish third, acknowledge last.

Before any of it, the source: a client past its per-source rate (``payments.ratelimit``) is
answered 429 with nothing read or stored, and one outside the provider's allow-list is stored
small (headers and the first REFUSED_BODY_BYTES) and refused.

Between publishing and acknowledging, with CALLBACK_PROCESS_INLINE, the
callback is processed here within CALLBACK_INLINE_BUDGET_SECONDS
(``gateway.inline``); the answer never depends on how that went.

The work is ``receive_delivery``, which knows WSGI but not Flask.
``CallbackFastPath``, a WSGI layer ``create_app`` puts in front of Flask,
serves the route with it directly, with the request id, the answer's metrics
and the error shapes every other route has: Flask's request machinery
(context, routing, hooks, Response) cost a tenth of the gateway's CPU per
callback, more than storing the row did in Python. Anything else, a GET to the
route included, goes on to Flask, whose view of the route (``receive``) runs
the same function.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from flask import Blueprint, Response, current_app, g, request
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.datastructures import EnvironHeaders
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.wsgi import get_content_length

from gateway import error_body, http_error
from payments import failpoints, metrics
from payments.callbacks import hint_rejected, reject_callback, store_callback, verify_callback
from payments.db import utcnow
from payments.delivery import encode_message
from payments.errors import BodyTooLarge, CallbackRejected, EventIgnored, SourceNotAllowed
from payments.hints import HintLimits
from payments.logs import REQUEST_ID, new_request_id, sane_request_id
from payments.ratelimit import SourceLimiter
from payments.settings import PROVIDERS, env_name, source_cidrs
from payments.sources import client_address, source_allowed

bp = Blueprint("callbacks", __name__)
log = logging.getLogger("paysync.gateway.callbacks")
PREFIX = "/callbacks/"


class CallbackLimits(NamedTuple):
    """The per-source limits of the callback routes (``payments.ratelimit``), one pair per gateway worker."""

    every: SourceLimiter
    """Every POST to a callback route (CALLBACK_SOURCE_RATE, CALLBACK_SOURCE_BURST)."""
    refused: SourceLimiter
    """Of those, the ones refused for their source, stored (REFUSED_SOURCE_RATE, REFUSED_SOURCE_BURST)."""

    @classmethod
    def from_settings(cls, settings: Any) -> CallbackLimits:
        """The limits the settings ask for."""
        return cls(
            SourceLimiter(settings.callback_source_rate, settings.callback_source_burst),
            SourceLimiter(settings.refused_source_rate, settings.refused_source_burst),
        )


class Answer(NamedTuple):
    """What to answer: status, body, content type and any further headers."""

    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()


def error_answer(code: str, message: str, status: int, headers: Mapping[str, str] | None = None) -> Answer:
    """The JSON error shape of docs/design.md section 5 (``gateway.error_body``) as an Answer."""
    return Answer(status, error_body(code, message), "application/json", tuple((headers or {}).items()))


def receive_delivery(
    paysync: Mapping[str, Any], provider_name: str, environ: Mapping[str, Any], request_id: str | None
) -> Answer:
    """Receive one provider notification (see docs/design.md section 1 for the order of work).

    ``paysync`` is what ``create_app`` put in ``app.extensions["paysync"]``.
    Raises ClientDisconnected for a request cut short (nothing is stored).
    """
    providers, settings, engine = paysync["providers"], paysync["settings"], paysync["engine"]
    provider = providers.get(provider_name)
    if provider is None:
        return error_answer("unknown_provider", f"no provider named {provider_name[:32]!r}", 404)
    request_headers = EnvironHeaders(environ)
    headers = {name: request_headers[name] for name in provider.callback_headers if name in request_headers}
    remote_addr, refused = _source(settings, provider_name, environ.get("REMOTE_ADDR"), request_headers)

    # 0. A source past its rate is answered before its body is read: nothing stored, nothing acknowledged, so a
    #    provider retries it later; a flood costs neither a row nor a body's worth of reading.
    limits: CallbackLimits = paysync["limits"]
    held = None if limits.every.allow(remote_addr) else limits.every
    if held is None and refused is not None and not limits.refused.allow(remote_addr):
        held = limits.refused
    if held is not None:
        metrics.callback_refused(provider_name, "rate_limited")
        retry = {"Retry-After": str(held.retry_after())}
        return error_answer("rate_limited", "too many callbacks from this source; retry later", 429, retry)
    # One from elsewhere is evidence, not a delivery: its headers and its first bytes are enough to tell what it was.
    limit = settings.refused_body_bytes if refused is not None else settings.callback_max_body_bytes
    body, too_large = _read_body(environ, limit)

    # 1. The raw delivery is committed before anything else may fail (one from elsewhere: committed as refused).
    received_at = utcnow()
    reason = None
    if refused is not None:
        reason = f"{refused.code}: {refused}" + (f"; body cut to its first {limit} bytes" if too_large else "")
        metrics.callback_refused(provider_name, refused.code)
    try:
        log_id = store_callback(
            engine,
            provider=provider_name,
            body=body,
            headers=headers,
            remote_addr=remote_addr,
            index={} if too_large else provider.peek_callback(body),
            now=received_at,
            rejected=reason,
            request_id=request_id,
        )
    except SQLAlchemyError as exc:
        log.error("callback not stored, answering 503: %s", type(exc).__name__)
        return error_answer("storage_unavailable", "callback not stored; retry later", 503, {"Retry-After": "5"})
    failpoints.hit("gateway.after_store")

    if refused is not None:
        log.info("callback %s refused: %s", log_id, refused.code)
        _hint_quietly(engine, providers, log_id, HintLimits.from_settings(settings))
        answer = provider.reject(refused)
        return _in_dialect(answer)

    # 2. Verify. A rejected row stays for audit (status 3); the payment it names may be queried (a hint).
    try:
        if too_large:
            raise BodyTooLarge(f"body over {len(body)} bytes (CALLBACK_MAX_BODY_BYTES): only the first were kept")
        verify_callback(provider, body, headers, now=time.time())
    except CallbackRejected as exc:
        log.info("callback %s rejected: %s", log_id, exc.code)
        try:
            hints = HintLimits.from_settings(settings)
            reject_callback(engine, log_id, f"{exc.code}: {exc}", providers=providers, hints=hints)
        except SQLAlchemyError:
            # The row stays status 0; the sweep re-verifies it and rejects it then.
            log.warning("callback %s rejected but not marked; the sweep will", log_id)
        if too_large:  # our JSON error, not the provider's dialect: no provider sends such a body
            return error_answer(exc.code, str(exc), 413)
        answer = provider.reject(exc)
        return _in_dialect(answer)
    except EventIgnored:
        pass  # genuine but not ours to apply: acknowledged, and processing records it as ignored

    # 3. The delivery itself to the broker: the consumer's fast path, and a copy that outlives a lost row.
    publisher = paysync["publisher"]
    if publisher.enabled:
        message = encode_message(
            log_id,
            provider_name,
            received_at,
            body,
            headers,
            remote_addr,
            request_id,
            key=settings.broker_message_secret[0],
        )
        if not publisher.publish(log_id, message):
            metrics.publish_failed("dropped")

    # 3b. Processed here, within the budget; whatever happens, the row is already safe.
    inline = paysync["inline"]
    if inline is not None:
        inline.process(log_id)

    # 4. Acknowledge in the provider's dialect.
    answer = provider.ack()
    return _in_dialect(answer)


def _in_dialect(answer: Any) -> Answer:
    """An adapter's ack or reject (``CallbackAnswer``: its body is text) as an Answer."""
    return Answer(answer.status, answer.body.encode(), answer.content_type)


class CallbackFastPath:
    """WSGI: POST /callbacks/<provider> answered by ``receive_delivery`` itself; every other request goes to Flask.

    What Flask gives every route is done here too: the request id (a sane
    X-Request-Id or a new one, in the log lines and the answer's header), the
    JSON error shapes (a cut request is Flask's 400, an unexpected error is
    logged and a 500), and the callback metrics of the blueprint's hooks.
    """

    def __init__(self, paysync: Mapping[str, Any], flask_wsgi: Any) -> None:
        self.paysync = paysync
        self.flask_wsgi = flask_wsgi

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        """Serve one request (PEP 3333)."""
        path = environ.get("PATH_INFO", "")
        provider_name = path[len(PREFIX) :]
        if environ.get("REQUEST_METHOD") != "POST" or not path.startswith(PREFIX) or not provider_name:
            return self.flask_wsgi(environ, start_response)  # another route or method: Flask's, its 405 included
        if "/" in provider_name:
            return self.flask_wsgi(environ, start_response)  # not the route: Flask's 404
        if not provider_name.isascii():  # PEP 3333 paths are latin-1 text of the raw bytes; Flask decodes UTF-8
            provider_name = provider_name.encode("latin-1").decode("utf-8", "replace")
        started = time.perf_counter()
        request_id = sane_request_id(environ.get("HTTP_X_REQUEST_ID")) or new_request_id()
        token = REQUEST_ID.set(request_id)
        try:
            answer = receive_delivery(self.paysync, provider_name, environ, request_id)
        except HTTPException as exc:  # ClientDisconnected: answered as the app's handler answers it
            answer = error_answer(*http_error(exc))
        except Exception as exc:  # noqa: BLE001 - as the app's own handler: logged, and a JSON 500
            log.error("unhandled error", exc_info=exc)
            answer = error_answer("internal_error", "internal error", 500)
        finally:
            REQUEST_ID.reset(token)
        label = provider_name if provider_name in self.paysync["providers"] else "unknown"  # no label per made-up URL
        metrics.callback_answered(label, answer.status, time.perf_counter() - started)
        headers = [
            ("Content-Type", answer.content_type),
            ("Content-Length", str(len(answer.body))),
            *answer.headers,
            ("X-Request-Id", request_id),
        ]
        start_response(f"{answer.status} {HTTP_STATUS_CODES.get(answer.status, 'UNKNOWN')}", headers)
        return [answer.body]


@bp.before_request
def _started() -> None:
    g.callback_started = time.perf_counter()


@bp.after_request
def _answered(response: Response) -> Response:
    """Count the answer (outcome from its status) and its latency: at the edge, so ``receive`` stays as it is."""
    name = (request.view_args or {}).get("provider_name", "")
    provider = name if name in current_app.extensions["paysync"]["providers"] else "unknown"
    metrics.callback_answered(provider, response.status_code, time.perf_counter() - g.callback_started)
    return response


@bp.post("/callbacks/<provider_name>")
def receive(provider_name: str) -> Any:
    """The route as a Flask view, for a request ``CallbackFastPath`` did not take (it takes every POST)."""
    answer = receive_delivery(current_app.extensions["paysync"], provider_name, request.environ, g.get("request_id"))
    response = Response(answer.body, answer.status, content_type=answer.content_type)
    for name, value in answer.headers:
        response.headers[name] = value
    return response


def _source(
    settings: Any, provider_name: str, peer: str | None, request_headers: EnvironHeaders
) -> tuple[str | None, SourceNotAllowed | None]:
    """(the client's address, the refusal when the provider's allow-list does not hold it).

    The client is the peer, or the rightmost hop of X-Forwarded-For not inside
    TRUSTED_PROXIES when the peer is one of them (``payments.sources``).
    """
    forwarded = ",".join(request_headers.getlist("X-Forwarded-For"))
    client = client_address(peer, forwarded, settings.trusted_proxies)
    spec = PROVIDERS.get(provider_name)
    if spec is None:  # an adapter registered without a PROVIDERS line: refused, not waved through
        return client, SourceNotAllowed(f"provider {provider_name[:32]!r} declares no source allow-list")
    if source_allowed(client, source_cidrs(settings, provider_name)):
        return client, None
    return client, SourceNotAllowed(f"source {client!s:.64} is outside {env_name(spec.sources)}")


def _hint_quietly(engine: Any, providers: Mapping[str, Any], log_id: int, hints: HintLimits) -> None:
    """The hint of a refused delivery; it is only a hint, so a database error loses nothing that matters."""
    try:
        hint_rejected(engine, providers, log_id, hints)
    except SQLAlchemyError:
        log.warning("callback %s refused; its hint was not recorded", log_id)


def _read_body(environ: Mapping[str, Any], limit: int) -> tuple[bytes, bool]:
    """(body, over the limit?). Past the limit only the first ``limit`` bytes are read, to be stored as rejected.

    Werkzeug refuses a Content-Length over MAX_CONTENT_LENGTH outright and
    silently stops a chunked body at the limit, so the raw WSGI input is read
    here instead: one byte more than the limit tells a body that is too large.
    """
    stream = environ["wsgi.input"]
    length = get_content_length(environ)
    want = limit + 1 if length is None or length > limit else length
    chunks, got = [], 0
    try:
        while got < want:
            chunk = stream.read(min(65536, want - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError:
        # The client stalled past WEB_READ_TIMEOUT_SECONDS or went away: nothing to acknowledge.
        raise ClientDisconnected() from None
    body = b"".join(chunks)
    if length is not None and len(body) < min(length, limit):
        raise ClientDisconnected()  # shorter than announced: a cut request, not a delivery
    if len(body) > limit or (length is not None and length > limit):
        return body[:limit], True
    return body, False
