"""``POST /callbacks/<provider>``: store first, verify second, publish third, acknowledge last.

Between publishing and acknowledging, with CALLBACK_PROCESS_INLINE, the
callback is processed here within CALLBACK_INLINE_BUDGET_SECONDS
(``gateway.inline``); the answer never depends on how that went.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from flask import Blueprint, Response, request
from sqlalchemy.exc import SQLAlchemyError
from werkzeug.exceptions import RequestEntityTooLarge

from gateway import error_response, ext
from payments import failpoints
from payments.callbacks import reject_callback, store_callback
from payments.db import utcnow
from payments.delivery import encode_message
from payments.errors import CallbackRejected

bp = Blueprint("callbacks", __name__)
log = logging.getLogger("paysync.gateway.callbacks")


@bp.post("/callbacks/<provider_name>")
def receive(provider_name: str) -> Any:
    """Receive one provider notification (see DESIGN.md section 1 for the order of work)."""
    provider = ext("providers").get(provider_name)
    if provider is None:
        return error_response("unknown_provider", f"no provider named {provider_name[:32]!r}", 404)
    body = request.get_data(cache=False)  # raises 413 past MAX_CONTENT_LENGTH, before anything is stored
    if request.content_length is None and len(body) >= ext("settings").callback_max_body_bytes:
        # A chunked body has no Content-Length to refuse up front: Werkzeug silently stops reading at the
        # limit, so look for one byte more, or a truncated body would be stored as if it were the delivery.
        if request.environ["wsgi.input"].read(1):
            raise RequestEntityTooLarge()
    headers = {name: request.headers[name] for name in provider.callback_headers if name in request.headers}

    # 1. The raw delivery is committed before anything else may fail.
    engine = ext("engine")
    received_at = utcnow()
    try:
        log_id = store_callback(
            engine,
            provider=provider_name,
            body=body,
            headers=headers,
            remote_addr=request.remote_addr,
            index=provider.peek_callback(body),
            now=received_at,
        )
    except SQLAlchemyError as exc:
        log.error("callback not stored, answering 503: %s", type(exc).__name__)
        return error_response("storage_unavailable", "callback not stored; retry later", 503, {"Retry-After": "5"})
    failpoints.hit("gateway.after_store")

    # 2. Verify. A rejected row stays for audit (status 3).
    try:
        provider.parse_callback(body, headers, now=time.time())
    except CallbackRejected as exc:
        log.info("callback %s rejected: %s", log_id, exc.code)
        try:
            reject_callback(engine, log_id, f"{exc.code}: {exc}")
        except SQLAlchemyError:
            # The row stays status 0; the sweep re-verifies it and rejects it then.
            log.warning("callback %s rejected but not marked; the sweep will", log_id)
        answer = provider.reject(exc)
        return Response(answer.body, answer.status, content_type=answer.content_type)

    # 3. The delivery itself to the broker: the consumer's fast path, and a copy that outlives a lost row.
    publisher = ext("publisher")
    if publisher.enabled:
        message = encode_message(log_id, provider_name, received_at, body, headers, request.remote_addr)
        publisher.publish(log_id, message)

    # 3b. Processed here, within the budget; whatever happens, the row is already safe.
    inline = ext("inline")
    if inline is not None:
        inline.process(log_id)

    # 4. Acknowledge in the provider's dialect.
    answer = provider.ack()
    return Response(answer.body, answer.status, content_type=answer.content_type)
