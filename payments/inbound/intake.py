"""Taking in one provider notification: store first, verify second, publish third, then the answer to give.

The gateway's callback view is HTTP framing around ``receive_callback``
(DESIGN.md section 1 for the order of work): it finds the adapter, the
client's address and its source verdict, holds a client past its rate, and
reads the body; everything from the raw row's commit to the acknowledgement
in the provider's dialect happens here.

1. The raw delivery is committed before anything else may fail (one from a
   source outside the provider's allow-list: committed as refused, and only
   hinted). The database down → a 503 refusal, so the provider retries
   (invariant 1).
2. Verify. A rejected row stays for audit (status 3); the payment it names
   may be queried (a hint).
3. Publish the delivery itself to the broker: the consumer's fast path, and a
   copy that outlives a lost row (invariant 12).
4. With CALLBACK_PROCESS_INLINE, process it here within the budget; the
   answer never depends on how that went.
5. The adapter's ack (or reject) is the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from payments.errors import BodyTooLarge, CallbackRejected, EventIgnored, SourceNotAllowed
from payments.inbound.callbacks import hint_rejected, reject_callback, store_callback, verify_callback
from payments.inbound.delivery import encode_message
from payments.inbound.hints import HintLimits
from payments.infra import failpoints, metrics
from payments.infra.db import utcnow
from payments.providers.base import HttpAnswer, Provider

log = logging.getLogger("paysync.gateway.callbacks")  # the gateway's lines, as they were before the split


class Incoming(NamedTuple):
    """One notification as the HTTP edge read it."""

    provider: str
    body: bytes
    """The body, or its first ``limit`` bytes when ``too_large``."""
    headers: dict[str, str]
    """The headers the adapter keeps (``Provider.callback_headers``)."""
    remote_addr: str | None
    refused: SourceNotAllowed | None
    """Why its source is refused, or None when it may deliver."""
    too_large: bool
    limit: int
    """The body limit that applied (REFUSED_BODY_BYTES for a refused source, else CALLBACK_MAX_BODY_BYTES)."""
    request_id: str | None


class Refusal(NamedTuple):
    """An answer in paysync's own JSON error shape, not the provider's dialect."""

    code: str
    message: str
    status: int
    headers: tuple[tuple[str, str], ...] = ()


class Publisher(Protocol):
    """The gateway's broker publisher (``broker.publisher.CallbackPublisher``), as far as intake uses it."""

    enabled: bool

    def publish(self, log_id: int, body: bytes) -> bool: ...


class Inline(Protocol):
    """The gateway's inline processor (``gateway.inline.InlineProcessor``), as far as intake uses it."""

    def process(self, log_id: int) -> object: ...


def receive_callback(
    engine: Engine,
    providers: Mapping[str, Provider],
    settings: Any,
    provider: Provider,
    incoming: Incoming,
    publisher: Publisher,
    inline: Inline | None,
) -> HttpAnswer | Refusal:
    """Store, verify, publish and (maybe) process one notification; return what to answer (module docstring)."""
    received_at = utcnow()
    reason = None
    if incoming.refused is not None:
        refused = incoming.refused
        cut = f"; body cut to its first {incoming.limit} bytes" if incoming.too_large else ""
        reason = f"{refused.code}: {refused}{cut}"
        metrics.callback_refused(incoming.provider, refused.code)
    try:
        log_id = store_callback(
            engine,
            provider=incoming.provider,
            body=incoming.body,
            headers=incoming.headers,
            remote_addr=incoming.remote_addr,
            index={} if incoming.too_large else provider.peek_callback(incoming.body),
            now=received_at,
            rejected=reason,
            request_id=incoming.request_id,
        )
    except SQLAlchemyError as exc:
        log.error("callback not stored, answering 503: %s", type(exc).__name__)
        return Refusal("storage_unavailable", "callback not stored; retry later", 503, (("Retry-After", "5"),))
    failpoints.hit("gateway.after_store")
    if incoming.refused is not None:
        log.info("callback %s refused: %s", log_id, incoming.refused.code)
        _hint_quietly(engine, providers, log_id, HintLimits.from_settings(settings))
        return provider.reject(incoming.refused)
    rejected = _verify(engine, providers, settings, provider, incoming, log_id)
    if rejected is not None:
        return rejected
    if publisher.enabled:
        message = encode_message(
            log_id,
            incoming.provider,
            received_at,
            incoming.body,
            incoming.headers,
            incoming.remote_addr,
            incoming.request_id,
            key=settings.broker_message_secret[0],
        )
        if not publisher.publish(log_id, message):
            metrics.publish_failed("dropped")
    if inline is not None:
        inline.process(log_id)  # whatever happens, the row is already safe
    return provider.ack()


def _verify(
    engine: Engine,
    providers: Mapping[str, Provider],
    settings: Any,
    provider: Provider,
    incoming: Incoming,
    log_id: int,
) -> HttpAnswer | Refusal | None:
    """Verify the stored delivery; the answer to a rejected one (its row marked status 3), or None: go on."""
    try:
        if incoming.too_large:
            size = len(incoming.body)
            raise BodyTooLarge(f"body over {size} bytes (CALLBACK_MAX_BODY_BYTES): only the first were kept")
        verify_callback(provider, incoming.body, incoming.headers, now=time.time())
    except CallbackRejected as exc:
        log.info("callback %s rejected: %s", log_id, exc.code)
        try:
            hints = HintLimits.from_settings(settings)
            reject_callback(engine, log_id, f"{exc.code}: {exc}", providers=providers, hints=hints)
        except SQLAlchemyError:
            # The row stays status 0; the sweep re-verifies it and rejects it then.
            log.warning("callback %s rejected but not marked; the sweep will", log_id)
        if incoming.too_large:  # our JSON error, not the provider's dialect: no provider sends such a body
            return Refusal(exc.code, str(exc), 413)
        return provider.reject(exc)
    except EventIgnored:
        pass  # genuine but not ours to apply: acknowledged, and processing records it as ignored
    return None


def _hint_quietly(engine: Engine, providers: Mapping[str, Provider], log_id: int, hints: HintLimits) -> None:
    """The hint of a refused delivery; it is only a hint, so a database error loses nothing that matters."""
    try:
        hint_rejected(engine, providers, log_id, hints)
    except SQLAlchemyError:
        log.warning("callback %s refused; its hint was not recorded", log_id)
