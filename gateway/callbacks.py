"""``POST /callbacks/<provider>``: HTTP framing around one call into the core (``payments.inbound.intake``).

The core stores first, verifies second, publishes third and acknowledges
last. Before any of it, here, the source: a client past its per-source rate (``payments.infra.ratelimit``) is
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
from werkzeug.datastructures import EnvironHeaders
from werkzeug.exceptions import ClientDisconnected, HTTPException
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.wsgi import get_content_length

from gateway import error_body, http_error
from payments.errors import SourceNotAllowed
from payments.inbound.intake import Incoming, Refusal, receive_callback
from payments.infra import metrics
from payments.infra.logs import REQUEST_ID, new_request_id, sane_request_id
from payments.infra.ratelimit import SourceLimiter
from payments.infra.settings import PROVIDERS, env_name, source_cidrs
from payments.infra.sources import client_address, source_allowed

bp = Blueprint("callbacks", __name__)
log = logging.getLogger("paysync.gateway.callbacks")
PREFIX = "/callbacks/"


class CallbackLimits(NamedTuple):
    """The per-source limits of the callback routes (``payments.infra.ratelimit``), one pair per gateway worker."""

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
    """Receive one provider notification: HTTP framing around ``payments.inbound.intake.receive_callback``
    (docs/design.md section 1 has the order of work).

    ``paysync`` is what ``create_app`` put in ``app.extensions["paysync"]``.
    Raises ClientDisconnected for a request cut short (nothing is stored).
    """
    settings = paysync["settings"]
    provider = paysync["providers"].get(provider_name)
    if provider is None:
        return error_answer("unknown_provider", f"no provider named {provider_name[:32]!r}", 404)
    request_headers = EnvironHeaders(environ)
    headers = {name: request_headers[name] for name in provider.callback_headers if name in request_headers}
    remote_addr, refused = _source(settings, provider_name, environ.get("REMOTE_ADDR"), request_headers)
    held = _held(paysync["limits"], remote_addr, refused)
    if held is not None:
        # A source past its rate is answered before its body is read: nothing stored, nothing acknowledged, so a
        # provider retries it later; a flood costs neither a row nor a body's worth of reading.
        metrics.callback_refused(provider_name, "rate_limited")
        retry = {"Retry-After": str(held.retry_after())}
        return error_answer("rate_limited", "too many callbacks from this source; retry later", 429, retry)
    # One from elsewhere is evidence, not a delivery: its headers and its first bytes are enough to tell what it was.
    limit = settings.refused_body_bytes if refused is not None else settings.callback_max_body_bytes
    body, too_large = _read_body(environ, limit)
    incoming = Incoming(provider_name, body, headers, remote_addr, refused, too_large, limit, request_id)
    engine, providers = paysync["engine"], paysync["providers"]
    answer = receive_callback(engine, providers, settings, provider, incoming, paysync["publisher"], paysync["inline"])
    if isinstance(answer, Refusal):
        return Answer(answer.status, error_body(answer.code, answer.message), "application/json", answer.headers)
    return _in_dialect(answer)


def _held(limits: CallbackLimits, remote_addr: str | None, refused: SourceNotAllowed | None) -> SourceLimiter | None:
    """The per-source limit a client is past (every callback's, or the refused ones'), or None."""
    if not limits.every.allow(remote_addr):
        return limits.every
    if refused is not None and not limits.refused.allow(remote_addr):
        return limits.refused
    return None


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
    TRUSTED_PROXIES when the peer is one of them (``payments.infra.sources``).
    """
    forwarded = ",".join(request_headers.getlist("X-Forwarded-For"))
    client = client_address(peer, forwarded, settings.trusted_proxies)
    spec = PROVIDERS.get(provider_name)
    if spec is None:  # an adapter registered without a PROVIDERS line: refused, not waved through
        return client, SourceNotAllowed(f"provider {provider_name[:32]!r} declares no source allow-list")
    if source_allowed(client, source_cidrs(settings, provider_name)):
        return client, None
    return client, SourceNotAllowed(f"source {client!s:.64} is outside {env_name(spec.sources)}")


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
