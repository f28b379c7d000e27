"""Adapter for Stripe: PaymentIntents, refunds, webhooks, missed-event catch-up, balance transactions.

Inbound (``POST /callbacks/stripe``): ``Stripe-Signature`` is verified against
every STRIPE_WEBHOOK_SECRETS entry (``stripe_sign``: HMAC-SHA256 over
``<t>.<raw body>``, refused when more than 300 s old, as Stripe's libraries
do). Events, by ``metadata.payment_id`` / ``metadata.refund_id``:

- ``payment_intent.succeeded`` → Succeeded (when ``amount_received`` is the
  amount: a success for less is another amount, a conflict for review);
  ``payment_intent.payment_failed`` and ``payment_intent.canceled`` → Failed
  (see "Failed is final" below);
- ``refund.created`` / ``refund.updated`` / ``refund.failed`` → the refund's
  status (succeeded, pending, failed/canceled); ``charge.refunded`` → the same,
  read from the charge's ``refunds`` list when the endpoint's API version still
  embeds it (since 2022-11-15 it does not, and the event is acknowledged and
  ignored: the ``refund.*`` events carry the refund).
A genuine event about anything else (another integration's PaymentIntent, an
event type we do not act on) is acknowledged and ignored (``EventIgnored``), so
Stripe does not retry it for three days and disable the endpoint. ``evt_…`` is
the event id; accepted → 200 ``{"received": true}``, refused → 4xx.

Outbound: form-encoded, ``Authorization: Bearer STRIPE_API_KEY``,
``Stripe-Version: API_VERSION``. A charge is ONE PaymentIntent created and
confirmed in one call under the payment's idempotency key, with
``metadata[payment_id]`` and the PaymentMethod the merchant named
(``payment_method`` of POST /payments: a ``pm_…`` id collected by Stripe.js, or
a test-mode id such as ``pm_card_visa``), ``error_on_requires_action=true``
(a server-side charge cannot run 3-D Secure; Stripe declines instead) and
automatic payment methods without redirects.

**Failed is final.** Stripe's docs: a failed attempt returns the PaymentIntent
to ``requires_payment_method`` "so that the payment can be retried", and only
cancelling it "invalidates the PaymentIntent for future payment attempts". Our
charge is a single server-side attempt with one PaymentMethod (the client
secret is never handed out), so a declined attempt is the payment's failure:
the adapter reports Failed and cancels the PaymentIntent, which makes that true
at Stripe as well. If the cancel does not go through, nobody holds the client
secret to try again, and a success reported later for a Failed payment opens a
manual review (invariant 4) rather than being lost.

**Keys live 24 hours.** Stripe may forget an idempotency key once it is 24
hours old, and then the same key makes a second PaymentIntent. So a charge for
a payment created more than ``KEY_LIFETIME_SECONDS`` (less a margin) ago first
looks for an existing PaymentIntent and sends only if there is none. Looking
is ``_find``, in a number of calls that does not grow with the account's
traffic: the PaymentIntent id we hold, if an answer gave us one, is retrieved;
else the search API (``metadata['payment_id']:'…'``), which is eventually
consistent ("data is searchable in less than a minute … up to an hour behind
during outages"), so its "not found" is believed only once our newest send is
older than ``search_lag_seconds``. Before that, up to LIST_PAGES pages of the
list API (consistent: "for read-after-write flows … use the list APIs") are
read; a busier window is Unknown until the lag has passed. Whatever is found is
retrieved by id before it is believed. The query job uses the same lookup.
Refunds are always looked up first in the PaymentIntent's (consistent) refund
list, so no refund key is re-sent blind; a refund key whose saved answer is a
500 is walked past like a charge's (``successor_key``), once that lookup found
no refund of ours.

Classification (invariant 5): timeouts, resets, 5xx (``api_error``), 424,
429 (rate limits and ``lock_timeout``) and unreadable answers are Unknown. A
``card_error`` (402) is the explicit decline of the attempt: Failed. It is
always the first attempt's answer: within 24 hours a re-send replays it
(``Idempotent-Replayed: true``), after that nothing is sent unless the lookup
found no PaymentIntent. ``idempotency_error`` (same key, other parameters) and
409 (``idempotency_key_in_use``) are our bug or a race: Unknown with a
``review:`` reason (the relay opens a manual review) and resolved by query.
401/403 are our configuration: Failed, not definitive. Other 400s refuse the
request outright (nothing was charged by it): Failed with ``refusal``, final
on a first send, Unknown on a re-send (a refusal of the re-send says nothing
about the lost first one). A PaymentIntent under our number for another
amount or currency is ``Mismatch``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import requests

from payments.errors import EventIgnored, MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.infra.logs import scrub
from payments.infra.settings import Settings
from payments.providers.base import (
    AMOUNT_MISMATCH,
    CallbackEvent,
    Capabilities,
    ChargeRequest,
    Dedupe,
    Evidence,
    Failed,
    Mismatch,
    NotFound,
    Outcome,
    Pending,
    Provider,
    ProviderUnavailable,
    QueryOutcome,
    RefundRequest,
    Succeeded,
    Unknown,
    api_session,
)
from payments.providers.stripe import sign as stripe_sign
from payments.providers.stripe.bill import BalanceLine, parse_balance_transactions
from payments.providers.stripe.money import AmountError, from_stripe, iso_currency, stripe_currency, to_stripe
from payments.states import PaymentStatus

log = logging.getLogger("paysync.providers.stripe")

API_VERSION = "2024-10-28.acacia"
"""The Stripe-Version every request pins (refund.* events cover card refunds from this version on).
Create the webhook endpoint with the same version: its payloads are rendered in the endpoint's version."""
KEY_LIFETIME_SECONDS = 86400
"""Stripe keeps an idempotency key at least this long after its first use."""
KEY_MARGIN_SECONDS = 600
"""Clock difference between us and Stripe we allow for when deciding a key is surely still alive."""
SEARCH_LAG_SECONDS = 3600
"""How far the search index may lag (Stripe: "up to an hour behind during outages")."""
MAX_PAGES = 10
"""Pages of 100 read for one list (a PaymentIntent's refunds); past that the answer is Unknown rather than a guess."""
LIST_PAGES = 2
"""Pages of 100 recent PaymentIntents a payment lookup reads while search may lag; a busier account waits for the
lag to pass instead, so a lookup's cost never grows with the account's traffic."""
_TOO_MANY = "lookup_window_too_large"
MAX_RESPONSE_CHARS = 2000
"""Raw answers are kept this long in provider_call.response."""
USER_AGENT = "paysync-stripe/1"

PAYMENT_EVENTS = {
    "payment_intent.succeeded": PaymentStatus.SUCCEEDED,
    "payment_intent.payment_failed": PaymentStatus.FAILED,
    "payment_intent.canceled": PaymentStatus.FAILED,
}
"""PaymentIntent event type → what it reports about our payment."""
REFUND_EVENTS = ("refund.created", "refund.updated", "refund.failed", "charge.refunded")
"""Event types that report on a refund."""
EVENT_TYPES = (*PAYMENT_EVENTS, *REFUND_EVENTS)
"""Every event type paysync applies: subscribe the webhook endpoint to these (catch_up lists these)."""
_EVENT_STATUS = {
    "payment_intent.succeeded": ("succeeded",),
    "payment_intent.payment_failed": ("requires_payment_method", "canceled"),
    "payment_intent.canceled": ("canceled",),
}
"""The PaymentIntent statuses each event's snapshot can carry; anything else is not a Stripe event."""
REFUND_STATUSES = {
    "succeeded": PaymentStatus.SUCCEEDED,
    "pending": PaymentStatus.PENDING,
    "requires_action": PaymentStatus.PENDING,
    "failed": PaymentStatus.FAILED,
    "canceled": PaymentStatus.FAILED,
}
"""Refund.status → what it reports about our refund."""

_EVENT_ID = re.compile(r"evt_[0-9A-Za-z]{1,120}", re.ASCII)
_PAYMENT_INTENT_ID = re.compile(r"pi_[0-9A-Za-z_]{1,120}", re.ASCII)
_OBJECT_ID = re.compile(r"[a-z]{2,5}_[0-9A-Za-z_]{1,120}", re.ASCII)
_OUR_ID = re.compile(r"[0-9A-Za-z_-]{1,40}", re.ASCII)
"""Our payment_id / refund_id as they may appear in metadata and in a search query (no quotes to escape)."""
_CLIENT_SECRET = re.compile(r'("client_secret"\s*:\s*")[^"]*(")')


# --------------------------------------------------------------------------------------------- answers


@dataclass(frozen=True)
class Reply:
    """One HTTP answer from Stripe (or the network error that replaced it)."""

    status: int | None
    """None when no answer arrived (timeout, reset)."""
    data: Any
    """The decoded JSON body, or None if there was none or it was not JSON."""
    evidence: Evidence
    error: str | None = None
    """The network error's name when ``status`` is None."""
    replayed: bool = False
    """Stripe answered ``Idempotent-Replayed: true``: this is the saved answer of the key's first attempt."""


def _error(data: Any) -> dict[str, Any]:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return data["error"]
    return {}


def _short(value: Any, limit: int = 64) -> str | None:
    return value[:limit] if isinstance(value, str) and value else None


def classify_error(reply: Reply) -> Outcome:
    """A non-200 answer (or none) as an outcome; the parts every call shares (pure, invariant 5)."""
    if reply.status is None:
        return Unknown(reply.error or "no_response")
    error = _error(reply.data)
    kind = _short(error.get("type"), 32)
    code = _short(error.get("code"), 48)
    detail = code or kind
    if kind == "idempotency_error" or reply.status == 409:
        # Same key with other parameters, or the same key still in flight: our bug or a race, never the
        # customer's decline. What happened under the key is found by query; a person should look.
        reason = "review:idempotency_conflict" if reply.status == 409 else "review:idempotency_error"
        return Unknown(reason + (f":{code}" if code else ""), raw=_raw(reply.data))
    if reply.status == 429:
        return Unknown("lock_timeout" if code == "lock_timeout" else "rate_limited", raw=_raw(reply.data))
    if reply.status in (401, 403):
        return Failed(detail or f"http_{reply.status}", definitive=False, raw=_raw(reply.data), refusal=True)
    if reply.status == 400 and kind == "invalid_request_error":
        return Failed(detail or "invalid_request", definitive=True, raw=_raw(reply.data), refusal=True)
    return Unknown(f"http_{reply.status}" + (f":{detail}" if detail else ""), raw=_raw(reply.data))


def read_payment_intent(data: Any, payment_id: str, expected: ChargeRequest | None) -> Outcome:
    """A PaymentIntent as an outcome for ``payment_id`` (pure).

    Unknown if it is not one or names another payment; Mismatch if (with
    ``expected``) it is for another amount or currency (``AMOUNT_MISMATCH``).
    """
    if not isinstance(data, dict):
        return Unknown("unparseable_response")
    data = {k: v for k, v in data.items() if k != "client_secret"}  # never kept, even in memory
    pi_id = data.get("id")
    if not isinstance(pi_id, str) or not pi_id.startswith("pi_") or len(pi_id) > 128:
        return Unknown("unparseable_response", raw=data)
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    if metadata.get("payment_id") != payment_id:
        return Unknown("answer_for_another_payment", raw=data)
    if expected is not None:
        try:
            same = (
                from_stripe(data.get("amount"), data.get("currency")) == expected.amount_minor
                and iso_currency(data.get("currency")) == expected.currency
            )
        except AmountError:
            return Unknown("unparseable_response", raw=data)
        if not same:
            return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=pi_id, raw=data)
    status = data.get("status")
    if status == "succeeded":
        # Succeeded means the money we asked for was taken: amount_received is what was, amount only what we asked.
        try:
            received = from_stripe(data.get("amount_received"), data.get("currency"))
            asked = (
                expected.amount_minor if expected is not None else from_stripe(data.get("amount"), data.get("currency"))
            )
        except AmountError:
            return Unknown("unparseable_response", raw=data)
        if received != asked:
            return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=pi_id, raw=data)
        return Succeeded(pi_id, raw=data)
    if status in ("processing", "requires_capture", "requires_action"):
        return Pending(pi_id, raw=data)
    if status == "canceled":
        return Failed(_canceled_code(data), definitive=True, raw=data, provider_transaction_id=pi_id)
    if status == "requires_payment_method" and isinstance(data.get("last_payment_error"), dict):
        code = _decline_code(data["last_payment_error"])
        return Failed(code, definitive=True, raw=data, provider_transaction_id=pi_id)
    if status in ("requires_payment_method", "requires_confirmation"):
        return Unknown("payment_intent_not_confirmed", raw=data)
    return Unknown("unknown_status", raw=data)


def _canceled_code(pi: Mapping[str, Any]) -> str:
    """Why a cancelled PaymentIntent failed: the decline that preceded our cancel, else Stripe's reason."""
    if isinstance(pi.get("last_payment_error"), dict):
        return _decline_code(pi["last_payment_error"])
    return _short(pi.get("cancellation_reason")) or "canceled"


def _decline_code(error: Mapping[str, Any]) -> str:
    return _short(error.get("decline_code")) or _short(error.get("code")) or "declined"


MAX_KEY_SUCCESSORS = 3
"""How many successor keys one charge call may walk past keys whose saved answer is a 500."""


def successor_key(key: str, n: int) -> str:
    """The ``n``-th key after ``key`` (pure): every worker derives the same chain, so Stripe dedupes each link."""
    return f"{key[:240]}~{n}"


def _saved_api_error(reply: Reply) -> bool:
    """A replayed 500: the key's first attempt failed inside Stripe, and every re-send under it will say so."""
    return reply.replayed and reply.status is not None and reply.status >= 500


def read_charge_answer(reply: Reply, payment_id: str, expected: ChargeRequest | None) -> Outcome:
    """The answer to POST /v1/payment_intents (create + confirm) as an outcome (pure)."""
    if reply.status == 200:
        return read_payment_intent(reply.data, payment_id, expected)
    error = _error(reply.data)
    if reply.status == 402 and error.get("type") == "card_error":
        intent = error.get("payment_intent")
        if isinstance(intent, dict):
            outcome = read_payment_intent(intent, payment_id, expected)
            if isinstance(outcome, Failed | Unknown | Mismatch):
                return outcome
            return Unknown("decline_for_a_live_payment_intent", raw=_raw(reply.data))
        return Failed(_decline_code(error), definitive=True, raw=_raw(reply.data))
    return classify_error(reply)


def read_refund(data: Any, request: RefundRequest) -> Outcome:
    """A Refund object as an outcome for ``request`` (pure)."""
    if not isinstance(data, dict):
        return Unknown("unparseable_response")
    refund_id = data.get("id")
    if not isinstance(refund_id, str) or not _OBJECT_ID.fullmatch(refund_id):
        return Unknown("unparseable_response", raw=data)
    metadata = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    if metadata.get("refund_id") != request.refund_id:
        return Unknown("answer_for_another_refund", raw=data)
    try:
        same = (
            from_stripe(data.get("amount"), data.get("currency")) == request.amount_minor
            and iso_currency(data.get("currency")) == request.currency
        )
    except AmountError:
        return Unknown("unparseable_response", raw=data)
    if not same:
        return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=refund_id, raw=data)
    report = REFUND_STATUSES.get(data.get("status"))
    if report == PaymentStatus.SUCCEEDED:
        return Succeeded(refund_id, raw=data)
    if report == PaymentStatus.PENDING:
        return Pending(refund_id, raw=data)
    if report == PaymentStatus.FAILED:
        code = _short(data.get("failure_reason")) or str(data.get("status"))
        return Failed(code, definitive=True, raw=data, provider_transaction_id=refund_id)
    return Unknown("unknown_status", raw=data)


def read_refund_answer(reply: Reply, request: RefundRequest) -> Outcome:
    """The answer to POST /v1/refunds as an outcome (pure)."""
    if reply.status == 200:
        return read_refund(reply.data, request)
    return classify_error(reply)


def _raw(data: Any) -> dict[str, Any]:
    return data if isinstance(data, dict) else {}


# --------------------------------------------------------------------------------------------- events


def parse_event(payload: Any, provider: str = "stripe") -> CallbackEvent:
    """A decoded Stripe Event as a CallbackEvent (pure).

    MalformedCallback if it is not a Stripe event of its declared type;
    EventIgnored if it is a genuine event paysync does not apply (another
    type, or an object without our metadata).
    """
    if not isinstance(payload, dict) or payload.get("object") != "event":
        raise MalformedCallback("body is not a Stripe event object")
    event_id = payload.get("id")
    if not isinstance(event_id, str) or not _EVENT_ID.fullmatch(event_id):
        raise MalformedCallback("event id must be evt_…")
    event_type = payload.get("type")
    if not isinstance(event_type, str) or not event_type or len(event_type) > 64:
        raise MalformedCallback("event type must be a short string")
    created = payload.get("created")
    if not isinstance(created, int) or isinstance(created, bool) or created <= 0:
        raise MalformedCallback("created must be a unix timestamp")
    data = payload.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        raise MalformedCallback("data.object must be an object")
    if event_type in PAYMENT_EVENTS:
        return _payment_event(provider, event_id, event_type, created, obj)
    if event_type == "charge.refunded":
        if obj.get("object") != "charge":
            raise MalformedCallback("charge.refunded must carry a charge")
        refund = _newest_refund_of_ours(obj)
        if refund is None:
            raise EventIgnored("charge.refunded names no paysync refund (refund.* events carry the refund)")
        return _refund_event(provider, event_id, event_type, created, refund)
    if event_type in REFUND_EVENTS:
        return _refund_event(provider, event_id, event_type, created, obj)
    raise EventIgnored(f"event type {event_type} is not one paysync applies")


def _payment_event(provider: str, event_id: str, event_type: str, created: int, obj: dict) -> CallbackEvent:
    if obj.get("object") != "payment_intent":
        raise MalformedCallback(f"{event_type} must carry a payment_intent")
    payment_id = _metadata_reference(obj, "payment_id")
    if payment_id is None:
        raise EventIgnored("PaymentIntent without metadata.payment_id: not a paysync payment")
    pi_id = obj.get("id")
    if not isinstance(pi_id, str) or not pi_id.startswith("pi_") or not _OBJECT_ID.fullmatch(pi_id):
        raise MalformedCallback("PaymentIntent id must be pi_…")
    if obj.get("status") not in _EVENT_STATUS[event_type]:
        raise MalformedCallback(f"{event_type} with a PaymentIntent in status {str(obj.get('status'))[:32]!r}")
    amount, currency = _money(obj)
    if event_type == "payment_intent.succeeded":
        # What was taken, not what was asked: a success for less than we charged is a conflict, never Succeeded.
        amount = _money(obj, "amount_received")[0]
    failure = None
    if event_type == "payment_intent.payment_failed":
        error = obj.get("last_payment_error")
        failure = _decline_code(error) if isinstance(error, dict) else "payment_failed"
    elif event_type == "payment_intent.canceled":
        failure = _canceled_code(obj)
    return CallbackEvent(
        provider=provider,
        event_id=event_id,
        event_type=event_type,
        target="payment",
        report=PAYMENT_EVENTS[event_type],
        merchant_reference=payment_id,
        provider_reference=pi_id,
        amount_minor=amount,
        currency=currency,
        failure_code=failure,
        occurred_at=created,
        payment_reference=payment_id,
    )


def _refund_event(provider: str, event_id: str, event_type: str, created: int, obj: dict) -> CallbackEvent:
    if obj.get("object") != "refund":
        raise MalformedCallback(f"{event_type} must carry a refund")
    refund_id = _metadata_reference(obj, "refund_id")
    if refund_id is None:
        raise EventIgnored("refund without metadata.refund_id: not a paysync refund")
    stripe_id = obj.get("id")
    if not isinstance(stripe_id, str) or not _OBJECT_ID.fullmatch(stripe_id):
        raise MalformedCallback("refund id must be re_… or pyr_…")
    report = REFUND_STATUSES.get(obj.get("status"))
    if report is None:
        raise MalformedCallback(f"unknown refund status {str(obj.get('status'))[:32]!r}")
    amount, currency = _money(obj)
    failure = _short(obj.get("failure_reason")) or (str(obj["status"]) if report == PaymentStatus.FAILED else None)
    return CallbackEvent(
        provider=provider,
        event_id=event_id,
        event_type=event_type,
        target="refund",
        report=report,
        merchant_reference=refund_id,
        provider_reference=stripe_id,
        amount_minor=amount,
        currency=currency,
        failure_code=failure,
        occurred_at=created,
        payment_reference=_metadata_reference(obj, "payment_id"),
    )


def _newest_refund_of_ours(charge: Mapping[str, Any]) -> dict[str, Any] | None:
    refunds = charge.get("refunds")
    items = refunds.get("data") if isinstance(refunds, dict) else None
    if not isinstance(items, list):
        return None
    ours = [r for r in items if isinstance(r, dict) and _metadata_reference(r, "refund_id") is not None]
    if not ours:
        return None
    return max(ours, key=lambda r: r.get("created") if isinstance(r.get("created"), int) else 0)


def _metadata_reference(obj: Mapping[str, Any], key: str) -> str | None:
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict) or metadata.get(key) in (None, ""):
        return None
    value = metadata[key]
    if not isinstance(value, str) or not _OUR_ID.fullmatch(value):
        raise MalformedCallback(f"metadata.{key} is not a paysync reference")
    return value


def _money(obj: Mapping[str, Any], field: str = "amount") -> tuple[int, str]:
    try:
        currency = iso_currency(obj.get("currency"))
        amount = from_stripe(obj.get(field), currency)
    except AmountError as exc:
        raise MalformedCallback(f"amount/currency: {exc}") from None
    if amount <= 0:
        raise MalformedCallback(f"{field} must be positive")
    return amount, currency


# --------------------------------------------------------------------------------------------- requests


def encode_form(params: Mapping[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """Stripe's form encoding: ``metadata[payment_id]=…``, ``types[0]=…``, booleans as true/false (pure)."""
    pairs: list[tuple[str, str]] = []
    for key, value in params.items():
        name = f"{prefix}[{key}]" if prefix else str(key)
        if value is None:
            continue
        if isinstance(value, Mapping):
            pairs.extend(encode_form(value, name))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                if isinstance(item, Mapping):
                    pairs.extend(encode_form(item, f"{name}[{i}]"))
                else:
                    pairs.append((f"{name}[{i}]", _scalar(item)))
        else:
            pairs.append((name, _scalar(value)))
    return pairs


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def key_surely_alive(created_at: datetime | None, now: float, lifetime: float = KEY_LIFETIME_SECONDS) -> bool:
    """True when a key first used no earlier than ``created_at`` (naive UTC) cannot have expired at Stripe yet."""
    if created_at is None:
        return False
    created = created_at.replace(tzinfo=UTC).timestamp()
    return now < created + lifetime - KEY_MARGIN_SECONDS


def day_bounds(day: str) -> tuple[int, int]:
    """[start, end) of a UTC day ``YYYY-MM-DD`` as unix seconds; ValueError if it is not a date."""
    start = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
    return int(start.timestamp()), int((start + timedelta(days=1)).timestamp())


class StripeProvider(Provider):
    """Stripe's API: idempotency keys (kept 24 hours) and a lookup by our number (search + list)."""

    name = "stripe"
    capabilities = Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True)
    """Stripe dedupes on the Idempotency-Key header, not on our number (metadata is not unique at Stripe); a
    PaymentIntent is looked up by metadata.payment_id (search + list)."""
    key_lifetime_seconds = KEY_LIFETIME_SECONDS
    """Past this a key may be forgotten (Capabilities has no lifetime: dedupe by KEY is taken as lasting); the
    adapter itself looks before it sends under an older key (module docstring)."""
    callback_headers = (stripe_sign.HEADER, "Content-Type", "User-Agent")

    def __init__(
        self,
        api_key: str,
        webhook_secrets: tuple[str, ...] | list[str],
        api_base: str = "https://api.stripe.com",
        *,
        tolerance_seconds: int = stripe_sign.DEFAULT_TOLERANCE_SECONDS,
        search_lag_seconds: float = SEARCH_LAG_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._api_key = api_key
        self._secrets = tuple(webhook_secrets)
        self._base = api_base.rstrip("/")
        self._tolerance = tolerance_seconds
        self._search_lag = search_lag_seconds
        self._clock = clock
        self._local = threading.local()  # one requests.Session (connection pool) per thread

    @classmethod
    def from_settings(cls, settings: Settings) -> StripeProvider:
        """The adapter for the STRIPE_* settings (load_settings has already checked them)."""
        return cls(settings.stripe_api_key, settings.stripe_webhook_secrets, settings.stripe_api_base)

    # ----------------------------------------------------------------------------------------- HTTP

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = api_session(self._base)
        return session

    def _call(
        self,
        method: str,
        path: str,
        timeout: float,
        *,
        query: Mapping[str, Any] | None = None,
        form: Mapping[str, Any] | None = None,
        idempotency_key: str | None = None,
    ) -> Reply:
        """One exchange with Stripe; never raises for network trouble (the Reply says what happened)."""
        headers = {
            "Authorization": f"Bearer {self._api_key}",
            "Stripe-Version": API_VERSION,
            "User-Agent": USER_AGENT,
        }
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        started = time.monotonic()
        try:
            response = self._session().request(
                method,
                self._base + path,
                params=encode_form(query) if query else None,
                data=encode_form(form) if form is not None else None,
                headers=headers,
                timeout=(min(timeout, 3.0), timeout),
                allow_redirects=False,
            )
            content = response.content  # read the body inside the timing and the try
        except requests.Timeout:
            return Reply(None, None, Evidence(latency_ms=_ms(started)), error="timeout")
        except requests.ConnectionError:
            return Reply(None, None, Evidence(latency_ms=_ms(started)), error="connection_error")
        except requests.RequestException as exc:
            return Reply(None, None, Evidence(latency_ms=_ms(started)), error=type(exc).__name__)
        latency = _ms(started)
        try:
            data = json.loads(content) if content else None
        except (UnicodeDecodeError, ValueError, RecursionError):
            data = None
        text = content[: MAX_RESPONSE_CHARS * 2].decode("utf-8", "replace")
        evidence = Evidence(
            http_status=response.status_code,
            response=scrub(_CLIENT_SECRET.sub(r"\1[REDACTED]\2", text))[:MAX_RESPONSE_CHARS],
            latency_ms=latency,
        )
        replayed = response.headers.get("Idempotent-Replayed", "").lower() == "true"
        return Reply(response.status_code, data, evidence, replayed=replayed)

    # ----------------------------------------------------------------------------------------- charges

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Create and confirm one PaymentIntent under the payment's key (looking first past the key's lifetime)."""
        if not idempotency_key:
            return Failed("idempotency_key_required", definitive=False)
        if not payment.payment_method:
            return Failed("payment_method_required", definitive=True)
        try:
            amount = to_stripe(payment.amount_minor, payment.currency)
        except AmountError:
            return Failed("amount_not_supported", definitive=True)
        if not key_surely_alive(payment.created_at, self._clock(), self.key_lifetime_seconds):
            found = self._find(payment.payment_id, timeout, payment)
            if isinstance(found, Unknown):
                return replace(found, reason=f"lookup_before_resend:{found.reason}")
            if not isinstance(found, NotFound):
                self._finish_decline(found, timeout)
                return found
        form: dict[str, Any] = {
            "amount": amount,
            "currency": stripe_currency(payment.currency),
            "confirm": True,
            "payment_method": payment.payment_method,
            "automatic_payment_methods": {"enabled": True, "allow_redirects": "never"},
            "error_on_requires_action": True,
            "metadata": {"payment_id": payment.payment_id},
        }
        if payment.description:
            form["description"] = payment.description
        reply = self._call("POST", "/v1/payment_intents", timeout, form=form, idempotency_key=idempotency_key)
        for attempt in range(1, MAX_KEY_SUCCESSORS + 1):
            if not _saved_api_error(reply):
                break
            # Stripe saved a 500 under this key and replays it for 24 hours: the key can never charge. Only
            # when a lookup finds no PaymentIntent for our number does the next key of the chain go out.
            if attempt == 1:
                found = self._find(payment.payment_id, timeout, payment)
                if not isinstance(found, NotFound):
                    if isinstance(found, Unknown):
                        return replace(found, reason=f"lookup_after_saved_error:{found.reason}")
                    self._finish_decline(found, timeout)
                    return found
            key = successor_key(idempotency_key, attempt)
            reply = self._call("POST", "/v1/payment_intents", timeout, form=form, idempotency_key=key)
        outcome = read_charge_answer(reply, payment.payment_id, payment)
        self._finish_decline(outcome, timeout)
        return replace(outcome, evidence=reply.evidence)

    def _finish_decline(self, outcome: QueryOutcome, timeout: float) -> None:
        """Cancel a PaymentIntent whose attempt failed, so nothing can succeed on it later (module docstring)."""
        if not isinstance(outcome, Failed) or not outcome.provider_transaction_id:
            return
        if outcome.raw.get("status") != "requires_payment_method":
            return  # canceled already, or no PaymentIntent was made
        pi_id = outcome.provider_transaction_id
        form = {"cancellation_reason": "abandoned"}
        reply = self._call("POST", f"/v1/payment_intents/{pi_id}/cancel", timeout, form=form)
        if reply.status != 200:
            log.warning(
                "could not cancel declined PaymentIntent %s (%s); it stays requires_payment_method",
                pi_id,
                reply.status or reply.error,
            )

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """Look the payment up by metadata.payment_id (search, the recent list, then the PaymentIntent itself)."""
        return self._find(payment_id, timeout, expected)

    def _find(self, payment_id: str, timeout: float, expected: ChargeRequest | None) -> QueryOutcome:
        """Our PaymentIntent, in at most LIST_PAGES + 2 calls however busy the account is.

        1. The pi_… an earlier answer gave us is retrieved by id (consistent).
        2. Else the search API by metadata.payment_id; what it finds is retrieved by id.
        3. Search's "none" is believed once our newest send is older than the search index's lag. Before that,
           the consistent list of PaymentIntents created in the lag window is read, at most LIST_PAGES pages; a
           busier window is Unknown (``search_may_lag``), which a later lookup settles once the lag has passed.
        """
        if not _OUR_ID.fullmatch(payment_id):
            return Unknown("unsearchable_reference")
        known = expected.provider_transaction_id if expected is not None else None
        if known and _PAYMENT_INTENT_ID.fullmatch(known):
            return self._retrieve(known, payment_id, timeout, expected)
        query = f"metadata['payment_id']:'{payment_id}'"
        reply = self._call("GET", "/v1/payment_intents/search", timeout, query={"query": query, "limit": 100})
        if reply.status != 200 or not isinstance(reply.data, dict) or not isinstance(reply.data.get("data"), list):
            return replace(_not_an_answer(reply), evidence=reply.evidence)
        if reply.data.get("has_more"):
            return Unknown("review:several_payment_intents", evidence=reply.evidence)
        ids = {
            pi["id"]
            for pi in reply.data["data"]
            if isinstance(pi, dict) and isinstance(pi.get("id"), str) and _metadata_is(pi, payment_id)
        }
        since = int(self._clock() - self._search_lag - KEY_MARGIN_SECONDS)
        if not ids and _sent_since(expected, since):
            # Search may not have seen a PaymentIntent that recent send made: the list API has (it is consistent).
            recent = self._list_ids(
                "/v1/payment_intents",
                {"created": {"gte": since}},
                timeout,
                lambda pi: _metadata_is(pi, payment_id),
                pages=LIST_PAGES,
            )
            if isinstance(recent, Unknown):
                return replace(recent, reason="search_may_lag") if recent.reason == _TOO_MANY else recent
            ids = recent
        if not ids:
            return NotFound(evidence=reply.evidence)
        if len(ids) > 1:
            return Unknown("review:several_payment_intents", raw={"payment_intents": sorted(ids)})
        (pi_id,) = ids
        if not _OBJECT_ID.fullmatch(pi_id):
            return Unknown("unparseable_response", evidence=reply.evidence)
        return self._retrieve(pi_id, payment_id, timeout, expected)

    def _retrieve(self, pi_id: str, payment_id: str, timeout: float, expected: ChargeRequest | None) -> QueryOutcome:
        current = self._call("GET", f"/v1/payment_intents/{pi_id}", timeout)
        if current.status != 200:
            return replace(_not_an_answer(current), evidence=current.evidence)
        return replace(read_payment_intent(current.data, payment_id, expected), evidence=current.evidence)

    def _list_ids(
        self,
        path: str,
        query: Mapping[str, Any],
        timeout: float,
        keep: Callable[[Mapping[str, Any]], bool],
        pages: int = MAX_PAGES,
    ) -> set[str] | Unknown:
        """Ids of the listed objects ``keep`` accepts, over at most ``pages`` pages; Unknown if that is not all."""
        found: set[str] = set()
        after: str | None = None
        for _ in range(pages):
            page = dict(query, limit=100, **({"starting_after": after} if after else {}))
            reply = self._call("GET", path, timeout, query=page)
            items = reply.data.get("data") if reply.status == 200 and isinstance(reply.data, dict) else None
            if not isinstance(items, list):
                return replace(_not_an_answer(reply), evidence=reply.evidence)
            for item in items:
                if isinstance(item, dict) and isinstance(item.get("id"), str) and keep(item):
                    found.add(item["id"])
            if not reply.data.get("has_more") or not items:
                return found
            after = items[-1].get("id") if isinstance(items[-1], dict) else None
            if not isinstance(after, str):
                return Unknown("unparseable_response", evidence=reply.evidence)
        return Unknown(_TOO_MANY)

    # ----------------------------------------------------------------------------------------- refunds

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """POST /v1/refunds with the refund's own key and metadata.refund_id, unless the refund already exists."""
        if not idempotency_key:
            return Failed("idempotency_key_required", definitive=False)
        try:
            amount = to_stripe(request.amount_minor, request.currency)
        except AmountError:
            return Failed("amount_not_supported", definitive=True)
        existing = self.query_refund(request.refund_id, timeout, request)
        if not isinstance(existing, NotFound):
            return existing
        form = {
            "payment_intent": request.provider_transaction_id,
            "amount": amount,
            "metadata": {"refund_id": request.refund_id, "payment_id": request.payment_id},
        }
        reply = self._call("POST", "/v1/refunds", timeout, form=form, idempotency_key=idempotency_key)
        for attempt in range(1, MAX_KEY_SUCCESSORS + 1):
            if not _saved_api_error(reply):
                break
            # Stripe replays the 500 it saved under this key for 24 hours: the key can never refund. The lookup
            # above ran after that first attempt (the replay says so) and found no refund of ours in the
            # consistent list, so the next key of the chain may go out.
            key = successor_key(idempotency_key, attempt)
            reply = self._call("POST", "/v1/refunds", timeout, form=form, idempotency_key=key)
        return replace(read_refund_answer(reply, request), evidence=reply.evidence)

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """Our refund among the PaymentIntent's refunds (a consistent list); NotFound if it is not there."""
        if expected is None or not _OBJECT_ID.fullmatch(expected.provider_transaction_id or ""):
            return Unknown("refund_lookup_needs_the_payment_intent")
        ids = self._list_ids(
            "/v1/refunds",
            {"payment_intent": expected.provider_transaction_id},
            timeout,
            lambda r: _metadata_is(r, refund_id, "refund_id"),
        )
        if isinstance(ids, Unknown):
            return ids
        if not ids:
            return NotFound()
        if len(ids) > 1:
            return Unknown("review:several_refunds", raw={"refunds": sorted(ids)})
        (stripe_id,) = ids
        reply = self._call("GET", f"/v1/refunds/{stripe_id}", timeout)
        if reply.status != 200:
            return replace(_not_an_answer(reply), evidence=reply.evidence)
        return replace(read_refund(reply.data, expected), evidence=reply.evidence)

    # ----------------------------------------------------------------------------------------- events

    def list_events(self, since: int, until: int, timeout: float) -> Iterator[dict[str, Any]]:
        """Every event of EVENT_TYPES created in [since, until), newest first, page by page.

        Raises ProviderUnavailable (also mid-way) when a page cannot be had:
        the caller must not take a partial list for the whole one.
        """
        after: str | None = None
        while True:
            query: dict[str, Any] = {"created": {"gte": since, "lt": until}, "types": list(EVENT_TYPES), "limit": 100}
            if after:
                query["starting_after"] = after
            reply = self._call("GET", "/v1/events", timeout, query=query)
            items = reply.data.get("data") if reply.status == 200 and isinstance(reply.data, dict) else None
            if not isinstance(items, list):
                raise ProviderUnavailable(f"events page not available: {reply.error or reply.status}")
            for item in items:
                if isinstance(item, dict):
                    yield item
            if not reply.data.get("has_more") or not items:
                return
            after = items[-1].get("id") if isinstance(items[-1], dict) else None
            if not isinstance(after, str):
                raise ProviderUnavailable("events page without a usable last id")

    def parse_fetched(self, body: bytes) -> CallbackEvent:
        """An event fetched by catch_up from GET /v1/events (authenticated by our own API call, not signed)."""
        return parse_event(_json_object(body), self.platform)

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify Stripe-Signature against every configured secret, then read the event."""
        try:
            stripe_sign.verify(
                self._secrets, body, _header(headers, stripe_sign.HEADER), now=now, tolerance=self._tolerance
            )
        except stripe_sign.TimestampError as exc:
            raise TimestampOutOfTolerance(str(exc)) from None
        except stripe_sign.SignatureError as exc:
            raise SignatureInvalid(str(exc)) from None
        return parse_event(_json_object(body), self.platform)

    def peek_callback(self, body: bytes) -> dict[str, str | None]:
        """Event id, type and references read without verification, for indexing the raw row."""
        try:
            payload = json.loads(body)
            obj = payload["data"]["object"]
            metadata = obj.get("metadata") or {}
            reference = metadata.get("refund_id") if obj.get("object") == "refund" else metadata.get("payment_id")
            values = {
                "provider_event_id": payload.get("id"),
                "event_type": payload.get("type"),
                "order_no": reference,
                "payment_order_no": obj.get("id"),
            }
        except Exception:  # noqa: BLE001 - unverified input; anything goes wrong, we index nothing
            return {}
        limits = {"provider_event_id": 128, "event_type": 64, "order_no": 64, "payment_order_no": 128}
        return {k: v for k, v in values.items() if isinstance(v, str) and len(v) <= limits[k]}

    # ----------------------------------------------------------------------------------------- bills

    def balance_transactions(self, day: str, timeout: float) -> Iterator[bytes]:
        """The day's balance transactions as JSON lines (one object per line, source expanded), page by page.

        Raises ProviderUnavailable before the first line or mid-way if a page
        cannot be had; a partial day is never passed on as a whole one.
        """
        try:
            start, end = day_bounds(day)
        except ValueError:
            raise ProviderUnavailable(f"not a day: {day[:20]!r}") from None
        after: str | None = None
        while True:
            query: dict[str, Any] = {"created": {"gte": start, "lt": end}, "limit": 100, "expand": ["data.source"]}
            if after:
                query["starting_after"] = after
            reply = self._call("GET", "/v1/balance_transactions", timeout, query=query)
            items = reply.data.get("data") if reply.status == 200 and isinstance(reply.data, dict) else None
            if not isinstance(items, list):
                reason = reply.error or reply.status
                raise ProviderUnavailable(f"balance transactions for {day} not available: {reason}")
            for item in items:
                yield json.dumps(item, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
            if not reply.data.get("has_more") or not items:
                return
            after = items[-1].get("id") if isinstance(items[-1], dict) else None
            if not isinstance(after, str):
                raise ProviderUnavailable("balance transactions page without a usable last id")

    def settlement_lines(self, day: str, timeout: float) -> Iterator[BalanceLine]:
        """The day's balance transactions read as settlement lines (``payments.providers.stripe.bill``), streaming."""
        return parse_balance_transactions(self.balance_transactions(day, timeout))

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """The day's balance transactions as JSON lines (``balance_transactions``), read by
        payments.providers.stripe.bill."""
        return self.balance_transactions(day, timeout)


def _sent_since(expected: ChargeRequest | None, since: float) -> bool:
    """Whether a charge of ours may have reached Stripe after ``since`` (unix seconds): not when none was sent."""
    if expected is None:
        return True  # nothing known about our sends: assume the newest was just now
    if expected.sent_before is None:
        return False
    # The call may have reached Stripe any time until it gave up, on a clock that may differ from ours.
    sent = expected.sent_before.replace(tzinfo=UTC).timestamp() + KEY_MARGIN_SECONDS
    return sent >= since


def _metadata_is(obj: Mapping[str, Any], reference: str, key: str = "payment_id") -> bool:
    metadata = obj.get("metadata")
    return isinstance(metadata, dict) and metadata.get(key) == reference


def _not_an_answer(reply: Reply) -> Unknown:
    """A lookup that did not get its list or object: it says nothing about the charge (never a decline)."""
    if reply.status is None:
        return Unknown(reply.error or "no_response")
    outcome = classify_error(reply) if reply.status != 200 else Unknown("unparseable_response")
    if isinstance(outcome, Unknown):
        return outcome
    return Unknown(f"lookup_refused:{outcome.code}", raw=outcome.raw)


def _json_object(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise MalformedCallback("body is not valid JSON") from None


def _header(headers: Mapping[str, str], name: str) -> str | None:
    lowered = name.lower()
    for key, value in headers.items():
        if key.lower() == lowered:
            return value
    return None


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)
