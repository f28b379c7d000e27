"""The platform's vocabulary as pure functions: request validation, key fingerprints, JSON views, events.

Nothing here does I/O, so the HTTP layer and the store share one definition
of what a charge looks like on the wire.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_AMOUNT = 10**12
"""Largest amount accepted, in minor units."""
MAX_REFERENCE = 64
"""Longest merchant reference accepted."""
MAX_IDEMPOTENCY_KEY = 255
"""Longest Idempotency-Key accepted (Stripe's limit)."""

_CURRENCY = re.compile(r"[A-Z]{3}", re.ASCII)
_REFERENCE = re.compile(r"[\x21-\x7e]+", re.ASCII)  # printable ASCII, no spaces


class BadRequest(ValueError):
    """The request is not one the platform accepts; answered 400 and nothing is stored."""

    code = "invalid_request"


@dataclass(frozen=True)
class ChargeRequest:
    """A validated ``POST /v1/charges`` body."""

    merchant_transaction_id: str
    amount: int
    currency: str


@dataclass(frozen=True)
class RefundRequest:
    """A validated ``POST /v1/refunds`` body."""

    charge: str
    amount: int
    merchant_refund_id: str | None
    currency: str | None


def _reference(payload: Mapping[str, Any], key: str, required: bool = True) -> str | None:
    value = payload.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REFERENCE or not _REFERENCE.fullmatch(value):
        raise BadRequest(f"{key} must be 1-{MAX_REFERENCE} printable ASCII characters without spaces")
    return value


def _amount(payload: Mapping[str, Any]) -> int:
    value = payload.get("amount")
    # bool is an int subclass and a float is never money (docs/design.md invariant 7).
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_AMOUNT:
        raise BadRequest(f"amount must be a positive integer of minor units, at most {MAX_AMOUNT}")
    return value


def _currency(payload: Mapping[str, Any], required: bool = True) -> str | None:
    value = payload.get("currency")
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _CURRENCY.fullmatch(value):
        raise BadRequest("currency must be an ISO 4217 code such as CNY")
    return value


def parse_charge(payload: Any) -> ChargeRequest:
    """Validate a charge request body; raise BadRequest."""
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    return ChargeRequest(
        merchant_transaction_id=_reference(payload, "merchant_transaction_id"),
        amount=_amount(payload),
        currency=_currency(payload),
    )


def parse_refund(payload: Any) -> RefundRequest:
    """Validate a refund request body; raise BadRequest."""
    if not isinstance(payload, dict):
        raise BadRequest("body must be a JSON object")
    charge = payload.get("charge")
    if not isinstance(charge, str) or not charge.startswith("ch_") or len(charge) > MAX_REFERENCE:
        raise BadRequest("charge must be a charge id (ch_…)")
    return RefundRequest(
        charge=charge,
        amount=_amount(payload),
        merchant_refund_id=_reference(payload, "merchant_refund_id", required=False),
        currency=_currency(payload, required=False),
    )


def fingerprint(endpoint: str, payload: Any) -> str:
    """What "the same parameters" means for an idempotency key: endpoint plus canonical JSON of the body."""
    canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(f"{endpoint}\n{canonical}".encode()).hexdigest()


def charge_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A charge as the API shows it."""
    return {
        "id": row["id"],
        "object": "charge",
        "status": row["status"],
        "merchant_transaction_id": row["merchant_transaction_id"],
        "amount": row["amount"],
        "currency": row["currency"],
        "failure_code": row["failure_code"],
        "amount_refunded": row.get("amount_refunded", 0),
        "created": int(row["created_at"]),
    }


def refund_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """A refund as the API shows it."""
    return {
        "id": row["id"],
        "object": "refund",
        "status": row["status"],
        "charge": row["charge_id"],
        "merchant_refund_id": row["merchant_refund_id"],
        "merchant_transaction_id": row["merchant_transaction_id"],
        "amount": row["amount"],
        "currency": row["currency"],
        "failure_code": row["failure_code"],
        "created": int(row["created_at"]),
    }


def charge_event(event_id: str, row: Mapping[str, Any], created: int) -> dict[str, Any]:
    """The webhook event announcing a completed charge."""
    return {
        "id": event_id,
        "type": f"charge.{row['status']}",
        "created": created,
        "data": {
            "merchant_transaction_id": row["merchant_transaction_id"],
            "provider_transaction_id": row["id"],
            "amount": row["amount"],
            "currency": row["currency"],
            "failure_code": row["failure_code"],
        },
    }


def refund_event(event_id: str, row: Mapping[str, Any], created: int) -> dict[str, Any]:
    """The webhook event announcing a completed refund (names the charge and both merchant references)."""
    return {
        "id": event_id,
        "type": f"refund.{row['status']}",
        "created": created,
        "data": {
            "merchant_transaction_id": row["merchant_transaction_id"],
            "merchant_refund_id": row["merchant_refund_id"],
            "provider_transaction_id": row["id"],
            "charge": row["charge_id"],
            "amount": row["amount"],
            "currency": row["currency"],
            "failure_code": row["failure_code"],
        },
    }
