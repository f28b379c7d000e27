"""The callback message is the delivery itself: the broker holds a backup copy of every stored callback.

The gateway publishes, after the raw row committed, a JSON message::

    {"log_id": 42, "provider": "sandbox", "received_at": "2024-05-01T12:00:00.123456Z",
     "remote_addr": "203.0.113.7", "headers": {...}, "body": "<base64 of the raw body>",
     "body_sha256": "<hex>", "request_id": "<the gateway request's id>"}

bounded by CALLBACK_MAX_BODY_BYTES (``max_message_bytes``). The row stays the
truth; the message makes an acknowledged callback survive the database losing
its last transactions (a failover to a replica that missed them, a restore
from backup): docs/design.md invariant 12.

``process_delivery`` is what the consumer does with one message:

- the row ``log_id`` exists and holds this delivery (same body digest and
  receipt time): process it, as before;
- the row is missing, or holds another delivery (the AUTO_INCREMENT id was
  handed out again after the loss): store the delivery again from the message
  (``restore_callback``) and process that row. A redelivered message finds the
  row it restored before (same provider, event id or receipt time, and digest)
  instead of storing a second copy, and the inbox (``processed_event``) keeps
  the business effect to one, whichever copy gets there first.

Several deliveries may share one message, ``{"deliveries": [<message>, ...]}``
(``encode_batch``: the gateway's publisher packs what arrived within
PUBLISH_LINGER_SECONDS), no larger than a message of one delivery may be;
each entry is a message as above and gets exactly what a message of its own
would. Broker work is per message, not per byte: on the 2-core machine a
message cost RabbitMQ about 0.2 ms of CPU at ingest rates, whatever it held.

Every message (each entry of a batch) carries ``"sig"``: an HMAC-SHA256, with
the first BROKER_MESSAGE_SECRET, of every field but the body itself (the body
is bound by ``body_sha256``, which must match it). The consumer acts on
fields of the message that no provider signature covers: ``received_at``
becomes a restored row's receipt time, which the provider's timestamp
tolerance is checked against, and a restored row is a row nobody else
vouched for. So a message without a valid signature under one of the listed
secrets (rotation: every one verifies) is ``ForgedMessage``, and goes to the
dead-letter queue with an alert, changing nothing (docs/design.md invariant 16).

A message of the earlier format, ``{"log_id": N, "sig": …}``, is still
processed by its id (a row is always verified again); one of the format
before messages were signed, with no ``sig``, is dead-lettered like any
unsigned message, and the sweep processes its row. One without
``request_id`` (or with one that is not sane) is read as having none.

``process_batch`` does the same for several messages in ONE transaction and
one COMMIT (and the consumer one multiple ack). The common batch, every
message a fresh report that moves its payment on, is written set-wise
(``callbacks.process_locked_batch``: a few multi-row statements whatever its
size); any batch with something unusual in it (a rejected or duplicate
event, a conflict, a missing payment, a failure) goes message by message
instead, a savepoint each, so a message that fails rolls back only its own
work.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, insert, select

from payments import metrics
from payments.backoff import RetryPolicy
from payments.callbacks import (
    CallbackResult,
    lock_rows,
    process_callback,
    process_locked,
    process_locked_batch,
    record_failure,
)
from payments.db import utcnow
from payments.hints import HintLimits
from payments.logs import REQUEST_ID, sane_request_id
from payments.providers.base import Provider
from payments.schema import SOURCE_WEBHOOK, payment_callback_log
from payments.states import CallbackStatus

log = logging.getLogger("paysync.delivery")

HEADERS_BUDGET_BYTES = 64 * 1024
"""Room a message allows for everything but the body (headers, provider, address, field names)."""
RESTORE_CANDIDATES = 100
"""Rows sharing the delivery's event id (or receipt time) compared against it when looking for an earlier copy."""


class UnreadableMessage(ValueError):
    """A message that is not a callback message (or whose body does not match its digest)."""


class ForgedMessage(UnreadableMessage):
    """A message paysync did not sign: no ``sig``, a wrong one, or a body other than the one it signed."""


SIGNATURE_FIELD = "sig"
"""The field of a message holding its HMAC (``message_signature``)."""
_SIGNING_CONTEXT = b"paysync callback message v1\n"
"""Prefixed to what is signed, so the key's HMACs cannot stand for anything else paysync might sign."""


def _signed_content(doc: Mapping[str, Any]) -> bytes:
    # Canonical JSON of the parsed fields, so the signature does not depend on how the JSON was spaced.
    fields = {k: v for k, v in doc.items() if k not in (SIGNATURE_FIELD, "body")}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return _SIGNING_CONTEXT + canonical.encode("utf-8", "surrogatepass")


def message_signature(doc: Mapping[str, Any], key: str) -> str:
    """Hex HMAC-SHA256 under ``key`` of a message's fields but ``sig`` and ``body`` (``body_sha256`` binds it)."""
    return hmac.new(key.encode(), _signed_content(doc), hashlib.sha256).hexdigest()


def _check_signature(doc: Mapping[str, Any], keys: Sequence[str]) -> None:
    signature = doc.get(SIGNATURE_FIELD)
    if not isinstance(signature, str):
        raise ForgedMessage("message is not signed")
    if not any(hmac.compare_digest(signature, message_signature(doc, key)) for key in keys if key):
        raise ForgedMessage("message signature does not verify under BROKER_MESSAGE_SECRET")


def sign_document(doc: dict[str, Any], key: str) -> bytes:
    """``doc`` with its ``sig`` added, encoded as the gateway publishes it (also for a bare ``{"log_id": N}``)."""
    if not key:
        raise ValueError("a callback message needs BROKER_MESSAGE_SECRET to be signed")
    signed = {**doc, SIGNATURE_FIELD: message_signature(doc, key)}
    return json.dumps(signed, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")


@dataclass(frozen=True)
class Delivery:
    """One callback delivery as the message carries it."""

    log_id: int
    provider: str
    received_at: datetime
    """Naive UTC, exactly the row's create_time (signatures are checked against it)."""
    body: bytes
    headers: dict[str, str]
    remote_addr: str | None
    body_sha256: str
    request_id: str | None = None
    """The gateway request that stored it (absent from messages published before it was carried)."""


def body_digest(body: bytes) -> str:
    """Hex SHA-256 of a raw body: how a message and a row are known to hold the same delivery."""
    return hashlib.sha256(body).hexdigest()


def max_message_bytes(max_body_bytes: int) -> int:
    """The largest message a body of ``max_body_bytes`` can make (base64 plus the rest)."""
    return (max_body_bytes + 2) // 3 * 4 + HEADERS_BUDGET_BYTES


def _iso(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def encode_message(
    log_id: int,
    provider: str,
    received_at: datetime,
    body: bytes,
    headers: Mapping[str, str],
    remote_addr: str | None = None,
    request_id: str | None = None,
    *,
    key: str,
) -> bytes:
    """The message the gateway publishes for the row it just committed (``received_at`` = its create_time).

    Signed with ``key`` (the first BROKER_MESSAGE_SECRET): see the module docstring.
    """
    doc: dict[str, Any] = {
        "log_id": log_id,
        "provider": provider,
        "received_at": _iso(received_at),
        "remote_addr": remote_addr,
        "headers": dict(headers),
        "body": base64.b64encode(body).decode("ascii"),
        "body_sha256": body_digest(body),
    }
    if request_id:
        doc["request_id"] = request_id
    return sign_document(doc, key)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


BATCH_KEY = b'{"deliveries":['
"""How a message holding several deliveries begins (``encode_batch``)."""


def encode_batch(messages: list[bytes]) -> bytes:
    """One message carrying the already-encoded messages ``messages`` (one alone is sent as it is).

    Adds 17 bytes and a comma per message: a publisher that keeps the sum of
    the parts under ``max_message_bytes`` less 64 keeps every batch readable.
    """
    if len(messages) == 1:
        return messages[0]
    return BATCH_KEY + b",".join(messages) + b"]}"


def decode_messages(raw: bytes, max_body_bytes: int, *, keys: Sequence[str]) -> list[Delivery | int]:
    """Every delivery ``raw`` carries (one, or the entries of an ``encode_batch`` message); raise UnreadableMessage.

    Each must be signed under one of ``keys`` (BROKER_MESSAGE_SECRET), else
    ForgedMessage. A batch with one unreadable or forged entry is refused as a
    whole (the dead-letter queue keeps it as it came): the gateway only packs
    messages it signed itself, so such a batch is corrupt or forged, and the
    rows it names, if real, are in the database for the sweep.
    """
    doc = _json_object(raw, max_body_bytes)
    if set(doc) != {"deliveries"}:
        return [_delivery(doc, max_body_bytes, keys)]
    entries = doc["deliveries"]
    if not isinstance(entries, list) or not entries:
        raise UnreadableMessage("deliveries must be a non-empty list")
    try:
        return [_delivery(entry, max_body_bytes, keys) for entry in entries]
    except UnreadableMessage as exc:
        raise type(exc)(f"an entry of a batch of {len(entries)}: {exc}") from None


def decode_message(raw: bytes, max_body_bytes: int, *, keys: Sequence[str]) -> Delivery | int:
    """A Delivery, or the log id of an earlier-format ``{"log_id": N}`` message; raise UnreadableMessage."""
    return _delivery(_json_object(raw, max_body_bytes), max_body_bytes, keys)


def _json_object(raw: bytes, max_body_bytes: int) -> dict[str, Any]:
    if len(raw) > max_message_bytes(max_body_bytes):
        raise UnreadableMessage(f"message of {len(raw)} bytes is larger than any callback message")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise UnreadableMessage("not JSON") from None
    if not isinstance(doc, dict):
        raise UnreadableMessage("not a JSON object")
    return doc


def _delivery(doc: Any, max_body_bytes: int, keys: Sequence[str]) -> Delivery | int:
    if not isinstance(doc, dict):
        raise UnreadableMessage("not a JSON object")
    _check_signature(doc, keys)  # first: nothing of a message paysync did not sign is looked at
    log_id = _positive_int(doc.get("log_id"))
    if log_id is None:
        raise UnreadableMessage("log_id must be a positive integer")
    if set(doc) == {"log_id", SIGNATURE_FIELD}:
        return log_id
    provider = doc.get("provider")
    if not isinstance(provider, str) or not 0 < len(provider) <= 32:
        raise UnreadableMessage("provider must be a name of at most 32 characters")
    received = doc.get("received_at")
    try:
        if not isinstance(received, str) or not received.endswith("Z"):
            raise ValueError
        received_at = datetime.fromisoformat(received[:-1])
    except ValueError:
        raise UnreadableMessage("received_at must be an ISO 8601 UTC time") from None
    if received_at.tzinfo is not None:
        received_at = received_at.astimezone(UTC).replace(tzinfo=None)
    headers = doc.get("headers")
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise UnreadableMessage("headers must be an object of strings")
    remote_addr = doc.get("remote_addr")
    if remote_addr is not None and not isinstance(remote_addr, str):
        raise UnreadableMessage("remote_addr must be a string or null")
    encoded = doc.get("body")
    try:
        if not isinstance(encoded, str):
            raise ValueError
        body = base64.b64decode(encoded, validate=True)
    except (ValueError, binascii.Error):
        raise UnreadableMessage("body must be base64") from None
    if len(body) > max_body_bytes:
        raise UnreadableMessage(f"body of {len(body)} bytes exceeds CALLBACK_MAX_BODY_BYTES")
    digest = doc.get("body_sha256")
    if not isinstance(digest, str) or digest != body_digest(body):
        # A body swapped under a signed digest: restoring it would store something nobody sent.
        raise ForgedMessage("body_sha256 does not match the body")
    return Delivery(
        log_id, provider, received_at, body, headers, remote_addr, digest, sane_request_id(doc.get("request_id"))
    )


def _earlier_copy(conn: Any, delivery: Delivery, event_id: str | None) -> int | None:
    """The id of a row already holding exactly this delivery (restored by an earlier attempt), or None."""
    t = payment_callback_log
    if event_id:
        where = (t.c.provider == delivery.provider, t.c.provider_event_id == event_id)
    else:
        where = (t.c.provider == delivery.provider, t.c.create_time == delivery.received_at)
    rows = conn.execute(
        select(t.c.id, t.c.create_time, t.c.callback_data).where(*where).order_by(t.c.id).limit(RESTORE_CANDIDATES)
    )
    for row in rows:
        if row.create_time == delivery.received_at and body_digest(bytes(row.callback_data)) == delivery.body_sha256:
            return row.id
    return None


def restore_callback(engine: Engine, providers: Mapping[str, Provider], delivery: Delivery) -> int:
    """Store ``delivery`` again (status 0, its original receipt time) unless a row already holds it; return the id."""
    provider = providers.get(delivery.provider)
    index = provider.peek_callback(delivery.body) if provider is not None else {}
    now = utcnow()
    with engine.begin() as conn:
        existing = _earlier_copy(conn, delivery, index.get("provider_event_id"))
        if existing is not None:
            return existing
        result = conn.execute(
            insert(payment_callback_log).values(
                provider=delivery.provider,
                callback_data=delivery.body,
                headers=json.dumps(delivery.headers, sort_keys=True, ensure_ascii=False),
                remote_addr=(delivery.remote_addr or "")[:64] or None,
                source=SOURCE_WEBHOOK,  # only the gateway publishes messages: every one is a webhook delivery
                order_no=index.get("order_no"),
                payment_order_no=index.get("payment_order_no"),
                provider_event_id=index.get("provider_event_id"),
                event_type=index.get("event_type"),
                status=CallbackStatus.PENDING,
                result=f"restored from the broker's copy of callback {delivery.log_id}",
                retry_count=0,
                next_retry_at=now,
                create_time=delivery.received_at,
                update_time=now,
                request_id=delivery.request_id,
            )
        )
        log_id = int(result.inserted_primary_key[0])
    log.warning(
        "callback %s was not in the database: restored from its message as callback %s",
        delivery.log_id,
        log_id,
        extra={"provider": delivery.provider, "provider_event_id": index.get("provider_event_id")},
    )
    return log_id


def process_delivery(
    engine: Engine,
    providers: dict[str, Provider],
    delivery: Delivery,
    policy: RetryPolicy,
    hints: HintLimits | None = None,
) -> tuple[int, CallbackResult]:
    """Process the row holding ``delivery``, restoring it first if the database lost it; return (row id, outcome)."""
    expect = (delivery.body_sha256, delivery.received_at)
    outcome = process_callback(engine, providers, delivery.log_id, policy, expect=expect, hints=hints)
    if outcome is not CallbackResult.MISSING:
        return delivery.log_id, outcome
    log_id = restore_callback(engine, providers, delivery)
    return log_id, process_callback(engine, providers, log_id, policy, expect=expect, hints=hints)


def process_batch(
    engine: Engine,
    providers: dict[str, Provider],
    messages: list[Delivery | int],
    policy: RetryPolicy,
    stop: Callable[[], bool] | None = None,
    hints: HintLimits | None = None,
) -> list[tuple[int, CallbackResult | None]]:
    """Process ``messages`` in one transaction, set-wise or a savepoint each; return (row id, outcome) per message.

    Once ``stop()`` is true no further message is started: those not started
    have the outcome None (hand them back), and the finished ones commit.

    Each message gets exactly what ``process_delivery`` gives it: a failure
    rolls back to its savepoint and is recorded (retry count, backoff) after
    the batch committed, in its own transaction; a missing row is restored and
    processed on its own. If the transaction itself is lost (a deadlock rolls
    back all of it, the connection dies), every message is processed again
    one by one. Raises only when even that cannot reach the database.
    """
    now = utcnow()
    outcomes: list[CallbackResult | None] = [None] * len(messages)
    failures: dict[int, Exception] = {}
    try:
        with engine.begin() as conn:
            locked = lock_rows(conn, sorted({_target(m)[0] for m in messages}))
            request_ids = {log_id: row.request_id for log_id, row in locked.items() if row.request_id}
            # The whole batch at once when it is the common case; else a savepoint per message.
            done = None if stop is not None and stop() else _set_wise(conn, providers, messages, now, locked)
            if done is not None:
                outcomes = done
            else:
                _message_by_message(conn, providers, messages, now, locked, hints, stop, outcomes, failures)
    except Exception as exc:  # noqa: BLE001 - the batch as a whole is gone: nothing of it committed
        log.info("batch of %s rolled back (%s); processing its messages one by one", len(messages), type(exc).__name__)
        return [_one(engine, providers, message, policy, hints) for message in messages]
    results = []
    for i, message in enumerate(messages):
        log_id, _ = _target(message)
        outcome = outcomes[i]
        if outcome is None and i not in failures:
            pass  # not started (stop): handed back
        elif i in failures:
            # Its lines name the gateway request that stored the row, as process_callback's do.
            token = REQUEST_ID.set(request_ids.get(log_id, REQUEST_ID.get()))
            try:
                outcome = record_failure(engine, log_id, failures[i], policy, now)
            finally:
                REQUEST_ID.reset(token)
            metrics.callback_processed(outcome)
        elif outcome is CallbackResult.MISSING and isinstance(message, Delivery):
            log_id, outcome = process_delivery(engine, providers, message, policy, hints)  # counted by process_callback
        else:
            metrics.callback_processed(outcome)
        results.append((log_id, outcome))
    return results


def _message_by_message(
    conn: Any,
    providers: dict[str, Provider],
    messages: list[Delivery | int],
    now: datetime,
    locked: Mapping[int, Any],
    hints: HintLimits | None,
    stop: Callable[[], bool] | None,
    outcomes: list[CallbackResult | None],
    failures: dict[int, Exception],
) -> None:
    """``process_locked`` for each message under its own savepoint; fills ``outcomes`` and ``failures``."""
    seen: set[tuple[int, tuple[str, datetime] | None]] = set()
    for i, message in enumerate(messages):
        if i and stop is not None and stop():
            break
        log_id, expect = _target(message)
        if (log_id, expect) in seen:
            # A redelivery in the same batch: the row was read once, before the first copy changed it.
            # (Another delivery naming the same id, after a loss, is compared with the row as usual.)
            outcomes[i] = CallbackResult.SKIPPED
            continue
        seen.add((log_id, expect))
        # One name, set again for each message (MySQL and SQLite both allow it) and never released:
        # COMMIT releases them all, and a RELEASE per message would be one more round trip.
        conn.exec_driver_sql("SAVEPOINT paysync_message")
        # process_locked binds the row's request id for its log lines; each message gets its own.
        token = REQUEST_ID.set(REQUEST_ID.get())
        try:
            outcomes[i] = process_locked(conn, providers, log_id, now, expect, hints, locked=locked)
        except Exception as exc:  # noqa: BLE001 - recorded on the row by process_batch, as process_callback does
            # Raises if the server already rolled everything back (a deadlock): the batch is redone.
            conn.exec_driver_sql("ROLLBACK TO SAVEPOINT paysync_message")
            failures[i] = exc
        finally:
            REQUEST_ID.reset(token)


def _set_wise(
    conn: Any, providers: dict[str, Provider], messages: list[Delivery | int], now: datetime, locked: Mapping[int, Any]
) -> list[CallbackResult | None] | None:
    """Every message's outcome from ``process_locked_batch``, or None: the batch goes message by message."""
    firsts: dict[tuple[int, tuple[str, datetime] | None], int] = {}
    for i, message in enumerate(messages):
        firsts.setdefault(_target(message), i)
    done = process_locked_batch(conn, providers, list(firsts), now, locked)
    if done is None:
        return None
    outcomes: list[CallbackResult | None] = [CallbackResult.SKIPPED] * len(messages)  # redeliveries in the batch
    for i, outcome in zip(firsts.values(), done, strict=True):
        outcomes[i] = outcome
    return outcomes


def _target(message: Delivery | int) -> tuple[int, tuple[str, datetime] | None]:
    if isinstance(message, int):
        return message, None
    return message.log_id, (message.body_sha256, message.received_at)


def _one(
    engine: Engine,
    providers: dict[str, Provider],
    message: Delivery | int,
    policy: RetryPolicy,
    hints: HintLimits | None = None,
) -> tuple[int, CallbackResult]:
    if isinstance(message, int):
        return message, process_callback(engine, providers, message, policy, hints=hints)
    return process_delivery(engine, providers, message, policy, hints)
