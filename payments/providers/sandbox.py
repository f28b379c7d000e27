"""Adapter for the built-in sandbox payment platform (``sandbox/``).

Notification format: ``{"id": "evt_…", "type": "charge.succeeded" | "charge.failed"
| "refund.succeeded" | "refund.failed", "created": <unix>, "data":
{"merchant_transaction_id", "provider_transaction_id", "amount", "currency",
"failure_code"}}``; refund events add ``merchant_refund_id`` (our refund_id)
and name the charge's merchant_transaction_id.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from payments.errors import MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.providers.base import CallbackEvent, Capabilities, Provider
from payments.states import PaymentStatus
from sandbox import signing

EVENT_TYPES = {
    "charge.succeeded": ("payment", PaymentStatus.SUCCEEDED),
    "charge.failed": ("payment", PaymentStatus.FAILED),
    "refund.succeeded": ("refund", PaymentStatus.SUCCEEDED),
    "refund.failed": ("refund", PaymentStatus.FAILED),
}


def _text(data: Mapping[str, Any], key: str, max_len: int, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise MalformedCallback(f"{key} must be a non-empty string of at most {max_len} characters")
    return value


def parse_event(provider: str, payload: Any) -> CallbackEvent:
    """Read a decoded sandbox event into a CallbackEvent; raise MalformedCallback if it is not one."""
    if not isinstance(payload, dict):
        raise MalformedCallback("event must be a JSON object")
    event_id = _text(payload, "id", 128)
    event_type = payload.get("type")
    if event_type not in EVENT_TYPES:
        raise MalformedCallback(f"unknown event type {str(event_type)[:64]!r}")
    data = payload.get("data")
    if not isinstance(data, dict):
        raise MalformedCallback("data must be a JSON object")
    amount = data.get("amount")
    # bool is an int subclass and a float is never money here (invariant 7).
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise MalformedCallback("amount must be a positive integer in minor units")
    currency = data.get("currency")
    if not isinstance(currency, str) or len(currency) != 3 or not currency.isalpha() or not currency.isupper():
        raise MalformedCallback("currency must be an ISO 4217 code such as CNY")
    failure_code = data.get("failure_code")
    if failure_code is not None and (not isinstance(failure_code, str) or len(failure_code) > 64):
        raise MalformedCallback("failure_code must be a string of at most 64 characters or null")
    created = payload.get("created")
    if created is not None and (not isinstance(created, int) or isinstance(created, bool)):
        raise MalformedCallback("created must be a unix timestamp")
    target, report = EVENT_TYPES[event_type]
    payment_ref = _text(data, "merchant_transaction_id", 40)
    if target == "refund":
        merchant_ref = _text(data, "merchant_refund_id", 40)
    else:
        merchant_ref = payment_ref
    return CallbackEvent(
        provider=provider,
        event_id=event_id,
        event_type=event_type,
        target=target,
        report=report,
        merchant_reference=merchant_ref,
        provider_reference=_text(data, "provider_transaction_id", 128, required=False),
        amount_minor=amount,
        currency=currency,
        failure_code=failure_code,
        occurred_at=created,
        payment_reference=payment_ref,
    )


class SandboxProvider(Provider):
    """The sandbox platform: idempotency keys and query by merchant number, like Stripe."""

    name = "sandbox"
    capabilities = Capabilities(idempotency_keys=True, query_by_merchant_id=True)
    callback_headers = (signing.HEADER, "Content-Type", "User-Agent")

    def __init__(self, webhook_secret: str, tolerance_seconds: int = signing.DEFAULT_TOLERANCE_SECONDS) -> None:
        self._secret = webhook_secret
        self._tolerance = tolerance_seconds

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify the Sandbox-Signature header, then read the event."""
        try:
            signing.verify(self._secret, body, _header(headers, signing.HEADER), now=now, tolerance=self._tolerance)
        except signing.TimestampError as exc:
            raise TimestampOutOfTolerance(str(exc)) from None
        except signing.SignatureError as exc:
            raise SignatureInvalid(str(exc)) from None
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            raise MalformedCallback("body is not valid JSON") from None
        return parse_event(self.name, payload)

    def peek_callback(self, body: bytes) -> dict[str, str | None]:
        """Event id, type and references read without verification, for indexing the raw row."""
        try:
            payload = json.loads(body)
            data = payload.get("data") or {}
            values = {
                "provider_event_id": payload.get("id"),
                "event_type": payload.get("type"),
                "order_no": data.get("merchant_refund_id") or data.get("merchant_transaction_id"),
                "payment_order_no": data.get("provider_transaction_id"),
            }
        except Exception:  # noqa: BLE001 - unverified input; anything goes wrong, we index nothing
            return {}
        limits = {"provider_event_id": 128, "event_type": 64, "order_no": 64, "payment_order_no": 128}
        return {k: v for k, v in values.items() if isinstance(v, str) and len(v) <= limits[k]}


def _header(headers: Mapping[str, str], name: str) -> str | None:
    lowered = name.lower()
    for key, value in headers.items():
        if key.lower() == lowered:
            return value
    return None
