"""``POST /callbacks/<provider>``: store first, verify second, publish third, acknowledge last.

Between publishing and acknowledging, with CALLBACK_PROCESS_INLINE, the
callback is processed here within CALLBACK_INLINE_BUDGET_SECONDS
(``gateway.inline``); the answer never depends on how that went.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Blueprint, Response, g, request
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.exceptions import ClientDisconnected

from gateway import error_response, ext
from payments import failpoints, metrics
from payments.callbacks import hint_rejected, reject_callback, store_callback, verify_callback
from payments.db import utcnow
from payments.delivery import encode_message
from payments.errors import BodyTooLarge, CallbackRejected, EventIgnored, SourceNotAllowed
from payments.hints import HintLimits
from payments.sources import client_address, source_allowed

bp = Blueprint("callbacks", __name__)
log = logging.getLogger("paysync.gateway.callbacks")


@bp.before_request
def _started() -> None:
    g.callback_started = time.perf_counter()


@bp.after_request
def _answered(response: Response) -> Response:
    """Count the answer (outcome from its status) and its latency: at the edge, so ``receive`` stays as it is."""
    name = (request.view_args or {}).get("provider_name", "")
    provider = name if name in ext("providers") else "unknown"  # no label per made-up URL
    metrics.callback_answered(provider, response.status_code, time.perf_counter() - g.callback_started)
    return response


@bp.post("/callbacks/<provider_name>")
def receive(provider_name: str) -> Any:
    """Receive one provider notification (see DESIGN.md section 1 for the order of work)."""
    provider = ext("providers").get(provider_name)
    if provider is None:
        return error_response("unknown_provider", f"no provider named {provider_name[:32]!r}", 404)
    body, too_large = _read_body(ext("settings").callback_max_body_bytes)
    headers = {name: request.headers[name] for name in provider.callback_headers if name in request.headers}
    settings = ext("settings")
    remote_addr, refused = _source(settings, provider_name)

    # 1. The raw delivery is committed before anything else may fail (one from elsewhere: committed as refused).
    engine = ext("engine")
    received_at = utcnow()
    try:
        log_id = store_callback(
            engine,
            provider=provider_name,
            body=body,
            headers=headers,
            remote_addr=remote_addr,
            index={} if too_large else provider.peek_callback(body),
            now=received_at,
            rejected=f"{refused.code}: {refused}" if refused else None,
            request_id=g.get("request_id"),
        )
    except SQLAlchemyError as exc:
        log.error("callback not stored, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "callback not stored; retry later", 503, {"Retry-After": "5"})
    failpoints.hit("gateway.after_store")

    hints = HintLimits.from_settings(settings)
    if refused is not None:
        log.info("callback %s refused: %s", log_id, refused.code)
        _hint_quietly(engine, log_id, hints)
        answer = provider.reject(refused)
        return Response(answer.body, answer.status, content_type=answer.content_type)

    # 2. Verify. A rejected row stays for audit (status 3); the payment it names may be queried (a hint).
    try:
        if too_large:
            raise BodyTooLarge(f"body over {len(body)} bytes (CALLBACK_MAX_BODY_BYTES): only the first were kept")
        verify_callback(provider, body, headers, now=time.time())
    except CallbackRejected as exc:
        log.info("callback %s rejected: %s", log_id, exc.code)
        try:
            reject_callback(engine, log_id, f"{exc.code}: {exc}", providers=ext("providers"), hints=hints)
        except SQLAlchemyError:
            # The row stays status 0; the sweep re-verifies it and rejects it then.
            log.warning("callback %s rejected but not marked; the sweep will", log_id)
        if too_large:  # our JSON error, not the provider's dialect: no provider sends such a body
            return error_response(exc.code, str(exc), 413)
        answer = provider.reject(exc)
        return Response(answer.body, answer.status, content_type=answer.content_type)
    except EventIgnored:
        pass  # genuine but not ours to apply: acknowledged, and processing records it as ignored

    # 3. The delivery itself to the broker: the consumer's fast path, and a copy that outlives a lost row.
    publisher = ext("publisher")
    if publisher.enabled:
        message = encode_message(log_id, provider_name, received_at, body, headers, remote_addr, g.get("request_id"))
        if not publisher.publish(log_id, message):
            metrics.publish_failed("dropped")

    # 3b. Processed here, within the budget; whatever happens, the row is already safe.
    inline = ext("inline")
    if inline is not None:
        inline.process(log_id)

    # 4. Acknowledge in the provider's dialect.
    answer = provider.ack()
    return Response(answer.body, answer.status, content_type=answer.content_type)


def _source(settings: Any, provider_name: str) -> tuple[str | None, SourceNotAllowed | None]:
    """(the client's address, the refusal when the provider's allow-list does not hold it).

    The client is the peer, or the rightmost hop of X-Forwarded-For not inside
    TRUSTED_PROXIES when the peer is one of them (``payments.sources``).
    """
    forwarded = ",".join(request.headers.getlist("X-Forwarded-For"))
    client = client_address(request.remote_addr, forwarded, settings.trusted_proxies)
    allowed = getattr(settings, f"{provider_name}_source_cidrs", ())
    if source_allowed(client, allowed):
        return client, None
    return client, SourceNotAllowed(f"source {client!s:.64} is outside {provider_name.upper()}_SOURCE_CIDRS")


def _hint_quietly(engine: Any, log_id: int, hints: HintLimits) -> None:
    """The hint of a refused delivery; it is only a hint, so a database error loses nothing that matters."""
    try:
        hint_rejected(engine, ext("providers"), log_id, hints)
    except SQLAlchemyError:
        log.warning("callback %s refused; its hint was not recorded", log_id)


def _read_body(limit: int) -> tuple[bytes, bool]:
    """(body, over the limit?). Past the limit only the first ``limit`` bytes are read, to be stored as rejected.

    Werkzeug refuses a Content-Length over MAX_CONTENT_LENGTH outright and
    silently stops a chunked body at the limit, so the raw WSGI input is read
    here instead: one byte more than the limit tells a body that is too large.
    """
    stream = request.environ["wsgi.input"]
    length = request.content_length
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
