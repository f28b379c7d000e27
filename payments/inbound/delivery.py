"""The callback message is the delivery itself: the broker holds a backup copy of every stored callback.

The gateway publishes, after the raw row committed, a JSON message::

    {"log_id": 42, "provider": "sandbox", "received_at": "2024-05-01T12:00:00.123456Z",
     "remote_addr": "203.0.113.7", "headers": {...}, "body": "<base64 of the raw body>",
     "body_sha256": "<hex>", "request_id": "<the gateway request's id>"}

bounded by CALLBACK_MAX_BODY_BYTES (``max_message_bytes``). The row stays the
truth; the message makes an acknowledged callback survive the database losing
its last transactions (a failover to a replica that missed them, a restore
from backup): docs/design.md invariant 12.

What the consumer does with a message (process the row it names, restoring
the row from the message when the database lost it) is
``payments.inbound.processing``.

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
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from payments.infra.logs import sane_request_id

HEADERS_BUDGET_BYTES = 64 * 1024
"""Room a message allows for everything but the body (headers, provider, address, field names)."""


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
