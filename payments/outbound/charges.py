"""The merchant's side of outbound charges: create a payment idempotently, and show one.

``create_payment`` is what ``POST /payments`` does. The merchant's
Idempotency-Key is handled by ``payments.outbound.idempotency``: claimed first in a
short transaction of its own, so a second request with the same key while the
first is still in flight gets 409. Then ONE transaction writes the payment
(status Created, its fixed idempotency key, the request digest, a deadline),
the ``ChargeRequested`` outbox row the relay will send, the
``PaymentRequested`` ledger event, and the stored answer. A retry
with the same key and the same request gets that answer again, byte for byte;
with another request, 422. Nothing is written for a request that fails
validation.

For a provider the payer pays by scanning a QR code (``Capabilities.payer_scans``),
the charge is then sent at once, through the relay's own claim and send, within
CHARGE_INLINE_BUDGET_SECONDS; the key stays in flight (409) meanwhile. If the
QR code came back in time the answer is Pending with ``qr_code``, else Created
as without it, and the answer stored for replays is the one sent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select

from payments.errors import CallbackRejected
from payments.inbound.callbacks import verify_callback
from payments.infra.db import utcnow
from payments.infra.ids import new_id
from payments.infra.schema import payment, payment_callback_log
from payments.lifecycle import outbox
from payments.money import ledger
from payments.outbound import idempotency, provider_calls, refunds

# Re-exported: the gateway, the OpenAPI document and the tests know them as the payments API's.
from payments.outbound.idempotency import (  # noqa: F401
    MAX_KEY_LENGTH,
    Answer,
    IdempotencyConflict,
    InvalidRequest,
    check_key,
    minor_units,
    request_object,
)
from payments.providers.base import Provider
from payments.states import CallbackStatus, PaymentStatus

log = logging.getLogger("paysync.charges")

SCOPE = "payments"
"""The idempotency_request scope of POST /payments."""
MAX_ORDER_NO_LENGTH = 64
CALLBACKS_SHOWN = 50
"""GET /payments/<id> lists at most this many callbacks, and this many rejected ones (the newest; totals beside)."""
CALLBACKS_VERIFIED = 20
"""Unprocessed rows naming a payment that GET /payments/<id> reads with their bodies and verifies (the newest)."""
ORDER_NO_VISIBLE = r"[^\s\x1c-\x1f\x85\ufeff]"
"""An order_no must contain one character this matches: the same set in Python's ``re`` and in the OpenAPI
document's ECMA-262 regex (whose whitespace class lacks U+001C-U+001F and U+0085 and has U+FEFF), so the
schema and the server accept the same order numbers."""
MAX_DESCRIPTION_LENGTH = 500
MAX_PAYMENT_METHOD_LENGTH = 255
CHARGE_REQUESTED = "ChargeRequested"
"""The outbox event the relay turns into a provider call."""

# ISO 4217 active codes (2024), minus funds codes and precious metals.
ISO_4217 = frozenset(
    """
    AED AFN ALL AMD ANG AOA ARS AUD AWG AZN BAM BBD BDT BGN BHD BIF BMD BND BOB BRL BSD BTN BWP BYN BZD CAD
    CDF CHF CLP CNY COP CRC CUP CVE CZK DJF DKK DOP DZD EGP ERN ETB EUR FJD FKP GBP GEL GHS GIP GMD GNF GTQ
    GYD HKD HNL HTG HUF IDR ILS INR IQD IRR ISK JMD JOD JPY KES KGS KHR KMF KPW KRW KWD KYD KZT LAK LBP LKR
    LRD LSL LYD MAD MDL MGA MKD MMK MNT MOP MRU MUR MVR MWK MXN MYR MZN NAD NGN NIO NOK NPR NZD OMR PAB PEN
    PGK PHP PKR PLN PYG QAR RON RSD RUB RWF SAR SBD SCR SDG SEK SGD SHP SLE SOS SRD SSP STN SVC SYP SZL THB
    TJS TMT TND TOP TRY TTD TWD TZS UAH UGX USD UYU UZS VES VND VUV WST XAF XCD XOF XPF YER ZAR ZMW ZWL
    """.split()
)
"""Currencies POST /payments accepts."""


_PAYMENT_METHOD = re.compile(r"[0-9A-Za-z_-]+", re.ASCII)


@dataclass(frozen=True)
class CreatePayment:
    """A validated POST /payments body."""

    order_no: str
    amount_minor: int
    currency: str
    provider: str
    description: str | None
    payment_method: str | None = None
    """What the provider is to charge (Stripe: a PaymentMethod id); optional for providers that need none."""

    def digest(self) -> str:
        """sha256 of the canonical request: same fields, same digest, whatever the JSON key order."""
        fields: dict[str, Any] = {
            "order_no": self.order_no,
            "amount": self.amount_minor,
            "currency": self.currency,
            "provider": self.provider,
            "description": self.description,
        }
        if self.payment_method is not None:
            # Only when given, so digests of requests stored before the field existed still match.
            fields["payment_method"] = self.payment_method
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def parse_create(raw: bytes, providers: set[str] | frozenset[str], max_amount: int) -> CreatePayment:
    """Validate a POST /payments body (pure); raise InvalidRequest with a message naming the field."""
    data = request_object(raw)
    allowed = {"order_no", "amount", "currency", "provider", "description", "payment_method"}
    extra = sorted(set(data) - allowed)
    if extra:
        raise InvalidRequest(f"unknown field {extra[0][:40]!r}")
    order_no = data.get("order_no")
    if (
        not isinstance(order_no, str)
        or not re.search(ORDER_NO_VISIBLE, order_no)
        or len(order_no) > MAX_ORDER_NO_LENGTH
    ):
        raise InvalidRequest(f"order_no must be a non-empty string of at most {MAX_ORDER_NO_LENGTH} characters")
    # Money is integer minor units (invariant 7): 1000, 1000.0 or 1e3 (exactly), never 10.5, "10" or true.
    amount = minor_units(data.get("amount"))
    if amount is None:
        raise InvalidRequest("amount must be an integer number of minor units", "invalid_amount")
    if amount <= 0:
        raise InvalidRequest("amount must be greater than zero", "invalid_amount")
    if amount > max_amount:
        raise InvalidRequest(f"amount must be at most {max_amount}", "amount_too_large")
    currency = data.get("currency")
    if not isinstance(currency, str) or currency not in ISO_4217:
        raise InvalidRequest("currency must be an ISO 4217 code in upper case, such as CNY", "invalid_currency")
    provider = data.get("provider")
    if not isinstance(provider, str) or provider not in providers:
        raise InvalidRequest(f"provider must be one of {', '.join(sorted(providers))}", "unknown_provider")
    description = data.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_LENGTH):
        raise InvalidRequest(f"description must be a string of at most {MAX_DESCRIPTION_LENGTH} characters")
    payment_method = data.get("payment_method")
    if payment_method is not None and (
        not isinstance(payment_method, str)
        or not _PAYMENT_METHOD.fullmatch(payment_method)
        or len(payment_method) > MAX_PAYMENT_METHOD_LENGTH
    ):
        raise InvalidRequest(
            f"payment_method must be a provider's payment method id (letters, digits, _ and -, "
            f"at most {MAX_PAYMENT_METHOD_LENGTH} characters)"
        )
    return CreatePayment(order_no, amount, currency, provider, description, payment_method)


def create_payment(
    engine: Engine,
    request: CreatePayment,
    key: str,
    *,
    deadline_seconds: float,
    lock_seconds: float,
    send_now: Callable[[str], bool] | None = None,
    now: datetime | None = None,
) -> Answer:
    """Create the payment for ``request`` under the merchant's ``key`` (see the module docstring).

    ``send_now``, for a provider the payer pays by scanning a QR code, sends
    the committed ChargeRequested row (by event id) at once and says whether
    that finished in time (``payments.outbound.send_pool.relay_charge_inline``): if it did
    and the payment is Pending with a QR code, that is the answer.
    """
    now = now or utcnow()
    digest = request.digest()
    payment_id = new_id("pay")
    body = {
        "payment_id": payment_id,
        "order_no": request.order_no,
        "amount": request.amount_minor,
        "currency": request.currency,
        "provider": request.provider,
        "description": request.description,
        "payment_method": request.payment_method,
        "status": PaymentStatus.CREATED.value,
        "provider_transaction_id": None,
        "created_at": now.isoformat() + "Z",
    }
    text = json.dumps(body, sort_keys=True)

    event_id = new_id("evt")

    def work(conn: Connection) -> idempotency.Stored:
        _write_payment(conn, request, key, digest, payment_id, now, deadline_seconds, event_id)
        return idempotency.Stored(201, text, payment_id)

    def then(created: idempotency.Stored) -> idempotency.Stored:
        return _after_send(engine, send_now, event_id, body, created)

    answer = idempotency.run(
        engine,
        scope=SCOPE,
        key=key,
        digest=digest,
        lock_seconds=lock_seconds,
        work=work,
        then=then if send_now is not None else None,
        now=now,
    )
    if not answer.replayed:
        log.info("payment created", extra={"payment_id": payment_id, "provider": request.provider})
    return answer


def _after_send(
    engine: Engine,
    send_now: Callable[[str], bool] | None,
    event_id: str,
    body: dict[str, Any],
    created: idempotency.Stored,
) -> idempotency.Stored:
    """The answer once ChargeRequested ``event_id`` was sent at once: Pending with its QR code, or as created."""
    payment_id = body["payment_id"]
    try:
        if send_now is None or not send_now(event_id):
            return created  # over the budget: the charge goes on, and the relay finishes what is left
        with engine.connect() as conn:
            row = conn.execute(
                select(payment.c.status, payment.c.qr_code).where(payment.c.payment_id == payment_id)
            ).first()
    except Exception:  # noqa: BLE001 - the payment is committed; the answer is the one it had without this
        log.warning("inline charge not read back; answering Created", extra={"payment_id": payment_id})
        return created
    if row is None or row.status != PaymentStatus.PENDING or not row.qr_code:
        return created
    pending = {**body, "status": PaymentStatus.PENDING.value, "qr_code": row.qr_code}
    return idempotency.Stored(201, json.dumps(pending, sort_keys=True), payment_id)


_INSERT_PAYMENT = insert(payment)
"""Built once, values at execute time (see payments.outbound.idempotency)."""


def _write_payment(
    conn: Connection,
    request: CreatePayment,
    key: str,
    digest: str,
    payment_id: str,
    now: datetime,
    deadline_seconds: float,
    event_id: str,
) -> None:
    conn.execute(
        _INSERT_PAYMENT,
        {
            "payment_id": payment_id,
            "order_no": request.order_no,
            "amount_minor": request.amount_minor,
            "currency": request.currency,
            "provider": request.provider,
            "status": PaymentStatus.CREATED.value,
            "idempotency_key": key,
            "request_digest": digest,
            "description": request.description,
            "payment_method": request.payment_method,
            "query_attempts": 0,
            "deadline_at": now + timedelta(seconds=deadline_seconds),
            "created_at": now,
            "updated_at": now,
        },
    )
    outbox.enqueue(
        conn,
        event_type=CHARGE_REQUESTED,
        aggregate_id=payment_id,
        now=now,
        payload={"payment_id": payment_id, "provider": request.provider},
        event_id=event_id,
    )
    ledger.append(
        conn,
        event_type="PaymentRequested",
        dedupe_key=f"PaymentRequested:{payment_id}",
        amount_minor=request.amount_minor,
        currency=request.currency,
        source_type="api",
        source_id=None,
        now=now,
        payment_id=payment_id,
        details={"order_no": request.order_no, "provider": request.provider},
    )


def get_payment(
    engine: Engine, payment_id: str, providers: Mapping[str, Provider] | None = None
) -> dict[str, Any] | None:
    """The payment as GET /payments/<id> shows it: status, provider ids, ledger, refunds, calls, callbacks; or None.

    ``callbacks`` lists only deliveries that verified as this payment's
    callbacks: processed rows (processing verified them), and rows not
    processed yet that verify now against ``providers``. Deliveries that did
    not verify are listed apart, in ``rejected_callbacks``, with the reason
    and nothing of what they claim, and only when what they claim names this
    payment (the row's unverified index).

    Anyone can make rows that name a payment, so both lists are bounded: the
    newest CALLBACKS_SHOWN of each, and ``callbacks_total`` /
    ``rejected_callbacks_total`` count all of them. Only the newest
    CALLBACKS_VERIFIED unprocessed rows are read with their bodies and verified
    now; older unprocessed ones are counted as not verified.
    """
    with engine.connect() as conn:
        row = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).mappings().first()
        if row is None:
            return None
        verified, rejected, totals = _callbacks_of(conn, payment_id, providers or {})
        refund_rows = refunds.refunds_of(conn, payment_id)
        return {
            "payment_id": row["payment_id"],
            "order_no": row["order_no"],
            "amount": row["amount_minor"],
            "currency": row["currency"],
            "provider": row["provider"],
            "description": row["description"],
            "payment_method": row["payment_method"],
            "status": row["status"],
            "status_source": row["status_source"],
            "provider_transaction_id": row["provider_transaction_id"],
            "qr_code": row["qr_code"],
            "error_code": row["error_code"],
            "next_query_at": _iso(row["next_query_at"]),
            "query_attempts": row["query_attempts"],
            "deadline_at": _iso(row["deadline_at"]),
            "created_at": _iso(row["created_at"]),
            "updated_at": _iso(row["updated_at"]),
            "ledger": ledger.history(conn, payment_id),
            "refunds": refund_rows,
            "amount_refunded": sum(r["amount"] for r in refund_rows if r["status"] == PaymentStatus.SUCCEEDED),
            "amount_refundable": (
                refunds.refundable(conn, payment_id, row["amount_minor"])
                if row["status"] == PaymentStatus.SUCCEEDED
                else 0
            ),
            "provider_calls": provider_calls.for_payment(conn, payment_id),
            "callbacks": verified,
            "callbacks_total": totals[0],
            "rejected_callbacks": rejected,
            "rejected_callbacks_total": totals[1],
        }


def _callbacks_of(
    conn: Connection, payment_id: str, providers: Mapping[str, Provider]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], tuple[int, int]]:
    """(newest verified, newest not verified, (count verified, count not verified)) of the rows naming a payment."""
    t = payment_callback_log
    names_it = t.c.order_no == payment_id
    counts = dict(conn.execute(select(t.c.status, func.count()).where(names_it).group_by(t.c.status)).all())
    summary = (t.c.id, t.c.provider, t.c.event_type, t.c.status, t.c.result, t.c.create_time)

    def newest(statuses: tuple[int, ...], limit: int, *extra: Any) -> list[Any]:
        query = select(*summary, *extra).where(names_it, t.c.status.in_(statuses))
        return list(conn.execute(query.order_by(t.c.id.desc()).limit(limit)))

    # Each list read on its own: a flood of forgeries cannot push the genuine callbacks out of sight.
    processed = newest((CallbackStatus.PROCESSED,), CALLBACKS_SHOWN)
    refused = newest((CallbackStatus.REJECTED,), CALLBACKS_SHOWN)
    # The bodies only of the few rows that must be verified now: memory stays bounded whatever piles up.
    unprocessed = (CallbackStatus.PENDING, CallbackStatus.FAILED, CallbackStatus.GAVE_UP)
    checked = newest(unprocessed, CALLBACKS_VERIFIED, t.c.callback_data, t.c.headers)
    verified, rejected = [], []
    checked_ok = 0
    for d in sorted([*processed, *refused, *checked], key=lambda d: d.id):
        reason = _unverified_reason(d, payment_id, providers)
        if reason is None:
            checked_ok += d.status != CallbackStatus.PROCESSED
            verified.append(
                {
                    "source": f"callback:{d.id}",
                    "event_type": d.event_type,
                    "status": d.status,
                    "result": d.result,
                    "received_at": _iso(d.create_time),
                }
            )
        else:
            rejected.append({"source": f"callback:{d.id}", "reason": reason, "received_at": _iso(d.create_time)})
    verified_total = counts.get(CallbackStatus.PROCESSED, 0) + checked_ok
    return (
        verified[-CALLBACKS_SHOWN:],
        rejected[-CALLBACKS_SHOWN:],
        (verified_total, sum(counts.values()) - verified_total),
    )


def _unverified_reason(delivery: Any, payment_id: str, providers: Mapping[str, Provider]) -> str | None:
    """None when the stored delivery verified as a callback of ``payment_id``; else why not."""
    if delivery.status == CallbackStatus.PROCESSED:
        return None  # processing verified it, and indexed it under the payment it names
    if delivery.status == CallbackStatus.REJECTED:
        return (delivery.result or "rejected").removeprefix("rejected: ")
    provider = providers.get(delivery.provider)
    if provider is None:
        return f"not verified: provider {delivery.provider} is not enabled"
    received = (delivery.create_time - datetime(1970, 1, 1)).total_seconds()
    try:
        event = verify_callback(provider, bytes(delivery.callback_data), json.loads(delivery.headers), received)
    except CallbackRejected as exc:
        return f"{exc.code}: {exc}"
    if event.target != "payment" or event.merchant_reference != payment_id:
        return "verified, but as a callback of another payment or refund"
    return None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() + "Z" if value is not None else None
