"""A fake Stripe API: an outside party written from Stripe's documentation; imports nothing of paysync.

It behaves the way Stripe's v1 API does for one account, so paysync's adapter
can be tested without a network:

- **Checks our credentials as Stripe does.** ``Authorization: Bearer sk_…`` (or
  HTTP Basic with the key as user name) must be the account's secret key, else
  401; an unknown ``Stripe-Version`` is 400. Requests are form-encoded with
  Stripe's bracket notation (``metadata[payment_id]=…``, ``types[0]=…``).
- **Idempotency keys the Stripe way.** A POST with an ``Idempotency-Key`` whose
  endpoint started executing saves its status and body (200s, 402 card errors
  and 500 ``api_error`` alike); the same key with the same parameters replays
  them with ``Idempotent-Replayed: true``; with other parameters (or another
  endpoint) it is ``400 idempotency_error``; while the first is still running
  it is ``409`` ``idempotency_key_in_use``. Validation errors, 401s and 429s
  save nothing. Keys are forgotten 24 hours after first use, on the fake's
  clock, which tests can move forward (``clock.advance``).
- **Keeps PaymentIntents, charges, refunds, events and balance transactions.**
  Create (and confirm) PaymentIntents with Stripe's test PaymentMethods
  (``pm_card_visa`` succeeds, ``pm_card_chargeDeclined`` and
  ``pm_card_chargeDeclinedInsufficientFunds`` decline with 402,
  ``pm_card_authenticationRequired`` needs 3-D Secure) plus ``pm_fake_processing``
  (stays ``processing`` until completed through the control surface); retrieve,
  list, cancel; **search** by ``metadata['key']:'value'``, answering from an
  index that lags ``search_lag_seconds`` behind (new and changed objects both);
  refunds (succeeded at once, or pending until completed); the event list
  (30 days); balance transactions with ``expand[]=data.source``, converted into the
  account's ``settlement_currency`` (with ``exchange_rate``) when it has one.
- **Sends webhooks** for the subscribed event types to ``webhook_url``:
  ``Stripe-Signature: t=…,v1=…`` with one ``v1`` per active signing secret
  (HMAC-SHA256 of ``t.body`` keyed with the whole ``whsec_…`` string), retried
  on a non-2xx answer.
- **Fault knobs** (seeded): 503 before anything happens, 500 ``api_error``
  (saved under the key, like Stripe), 429 rate limits and ``lock_timeout``, a
  hang before the work, an answer held back after the work is committed, and
  dropped webhooks; ``fail_next`` scripts faults for the next requests.

Control surface (``/_fake/…``, this machine only): move the clock, set faults,
script faults, complete processing PaymentIntents and pending refunds, add another
integration's PaymentIntents (``other_traffic``), read the balance (``balance``:
net per currency of every balance transaction), make new
refunds start pending (``refunds_pending``), change the signing secrets, read
the deliveries, every PaymentIntent (``payment_intents``) and every refund
(``refunds``).

``python -m sandbox.fakes.stripe --port N`` serves it, configured from
``STRIPE_FAKE_API_KEY``, ``STRIPE_FAKE_WEBHOOK_SECRETS`` (comma-separated),
``STRIPE_FAKE_WEBHOOK_URL``, ``STRIPE_FAKE_SEARCH_LAG_SECONDS``,
``STRIPE_FAKE_SEED``, ``STRIPE_FAKE_FAULTS`` (a JSON object of knobs),
``STRIPE_FAKE_REFUNDS_PENDING`` (``1``: new refunds start pending) and
``STRIPE_FAKE_SETTLEMENT_CURRENCY`` (e.g. ``usd``: the balance's currency;
charges in others are converted into it at the fake's ``EXCHANGE_RATES``).
"""

from __future__ import annotations

import argparse
import base64
import copy
import decimal
import hashlib
import hmac
import json
import os
import queue
import random
import re
import secrets
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any

import requests
from flask import Flask, Response, request

KNOWN_VERSIONS = frozenset(
    {"2022-11-15", "2023-08-16", "2023-10-16", "2024-04-10", "2024-06-20", "2024-09-30.acacia", "2024-10-28.acacia"}
)
"""Stripe-Version values this fake answers (others are 400, as Stripe refuses a version it does not know)."""
ACCOUNT_VERSION = "2024-10-28.acacia"
"""The account's default API version: used when a request names none, and for events."""
KEY_LIFETIME = 24 * 3600
EVENT_RETENTION = 30 * 86400
SUBSCRIBED_EVENTS = (
    "payment_intent.succeeded",
    "payment_intent.payment_failed",
    "payment_intent.canceled",
    "refund.created",
    "refund.updated",
    "refund.failed",
    "charge.refunded",
)
"""Event types the fake's webhook endpoint is subscribed to by default."""

# Stripe's currency rules, written down here from https://docs.stripe.com/currencies (not shared with paysync).
ZERO_DECIMAL = frozenset("bif clp djf gnf jpy kmf krw mga pyg rwf ugx vnd vuv xaf xof xpf".split())
THREE_DECIMAL = frozenset("bhd jod kwd omr tnd".split())
WHOLE_UNITS = frozenset({"isk", "huf", "twd"})
"""Charged in whole units only in some contexts; ISK amounts must be divisible by 100 (we apply it to ISK)."""

EXCHANGE_RATES = {"eur": "1.0850", "gbp": "1.2710", "jpy": "0.006700", "usd": "1", "chf": "1.1360"}
"""Default rates into the settlement currency, read as into USD (a fake's, not today's market)."""

TEST_PAYMENT_METHODS = {
    "pm_card_visa": None,
    "pm_card_mastercard": None,
    "pm_card_chargeDeclined": ("card_declined", "generic_decline"),
    "pm_card_chargeDeclinedInsufficientFunds": ("card_declined", "insufficient_funds"),
    "pm_card_chargeDeclinedExpiredCard": ("expired_card", "expired_card"),
    "pm_card_authenticationRequired": "requires_action",
    "pm_fake_processing": "processing",
    "pm_fake_partial_capture": "partial_capture",
}
"""PaymentMethod id → None (succeeds), (code, decline_code) (declines), or the status it leaves the intent in.
``pm_fake_partial_capture`` succeeds having captured half the amount (as a manual capture with a smaller
``amount_to_capture`` does): ``status`` is succeeded, ``amount_received`` less than ``amount``."""

RATES = (
    "error_5xx_rate",
    "api_error_rate",
    "rate_limit_rate",
    "lock_timeout_rate",
    "hang_rate",
    "timeout_after_commit_rate",
    "drop_webhook_rate",
)
FAULT_KINDS = ("5xx", "api_error", "rate_limit", "lock_timeout", "hang", "timeout_after_commit", "drop_webhook")
"""What ``fail_next`` can script, in the order a request's dice are read."""


@dataclass
class Faults:
    """Fault rates in [0, 1] (all 0: a well-behaved Stripe) and how long a hang lasts."""

    error_5xx_rate: float = 0.0
    """503 before anything is done (nothing saved under the key)."""
    api_error_rate: float = 0.0
    """500 api_error: the endpoint began and failed; saved under the key, nothing done."""
    rate_limit_rate: float = 0.0
    """429 rate_limit (nothing saved)."""
    lock_timeout_rate: float = 0.0
    """429 lock_timeout (nothing saved)."""
    hang_rate: float = 0.0
    """The request hangs hang_seconds before anything is done, then 503."""
    timeout_after_commit_rate: float = 0.0
    """The work is done and saved, then the answer is held hang_seconds."""
    drop_webhook_rate: float = 0.0
    """Share of webhook events never sent."""
    hang_seconds: float = 3.0


def _stripe_exponent(currency: str) -> int:
    return 0 if currency in ZERO_DECIMAL else 3 if currency in THREE_DECIMAL else 2


def parse_faults(raw: str | dict[str, Any] | None) -> Faults:
    """Knobs from JSON text or a dict; ValueError naming the bad one."""
    if raw in (None, ""):
        return Faults()
    data = json.loads(raw) if isinstance(raw, str) else raw
    if not isinstance(data, dict):
        raise ValueError("faults must be a JSON object")
    known = {f.name for f in fields(Faults)}
    values: dict[str, float] = {}
    for key, value in data.items():
        if key not in known:
            raise ValueError(f"unknown fault knob {key!r}")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{key} must be a number")
        if key in RATES and not 0 <= value <= 1:
            raise ValueError(f"{key} must be between 0 and 1")
        if key == "hang_seconds" and not 0 <= value <= 600:
            raise ValueError("hang_seconds must be between 0 and 600")
        values[key] = float(value)
    return Faults(**values)


@dataclass
class FakeConfig:
    """One Stripe account as the fake sees it."""

    api_key: str
    webhook_secrets: list[str] = field(default_factory=list)
    """Active signing secrets of the webhook endpoint; each delivery carries one v1 per secret."""
    webhook_url: str | None = None
    subscribed_events: tuple[str, ...] = SUBSCRIBED_EVENTS
    search_lag_seconds: float = 0.0
    webhook_max_attempts: int = 3
    webhook_backoff_seconds: float = 0.05
    seed: int | None = None
    settlement_currency: str | None = None
    """The account's balance currency: charges and refunds in another one are converted into it at
    ``exchange_rates`` and their balance transactions carry ``exchange_rate``. None: every currency settles as
    itself."""
    exchange_rates: dict[str, str] = field(default_factory=lambda: dict(EXCHANGE_RATES))
    """Currency -> how many units of the settlement currency one unit of it buys (decimal text)."""


class Clock:
    """Stripe's clock: the real one plus an offset tests can move forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        """Seconds since the epoch, as Stripe sees it."""
        return time.time() + self.offset

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        self.offset += seconds


def signature_header(secrets_: list[str], payload: bytes, timestamp: int) -> str:
    """``t=…,v1=…[,v1=…]``: HMAC-SHA256 of ``t.payload`` under each whole ``whsec_…`` secret."""
    signed = f"{timestamp}.".encode() + payload
    parts = [f"t={timestamp}"]
    for secret in secrets_:
        parts.append("v1=" + hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).hexdigest())
    return ",".join(parts)


def decode_form(pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """Stripe's bracket notation into nested dicts and lists (``a[b][0]=x`` → ``{"a": {"b": ["x"]}}``)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        match = re.fullmatch(r"([^\[\]]+)((?:\[[^\[\]]*\])*)", key)
        if not match:
            raise ValueError(f"bad parameter name {key[:60]!r}")
        path = [match.group(1), *re.findall(r"\[([^\[\]]*)\]", match.group(2))]
        node: Any = result
        for i, part in enumerate(path):
            last = i == len(path) - 1
            child_is_list = not last and (path[i + 1] == "" or path[i + 1].isdigit())
            if isinstance(node, list):
                index = len(node) if part == "" else int(part)
                while len(node) <= index:
                    node.append(None)
                if last:
                    node[index] = value
                else:
                    if node[index] is None:
                        node[index] = [] if child_is_list else {}
                    node = node[index]
            else:
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, [] if child_is_list else {})
    return result


class StripeError(Exception):
    """An error answer: status, Stripe error body, and whether it is saved under the idempotency key."""

    def __init__(self, status: int, kind: str, message: str, *, code: str | None = None, saved: bool = False, **extra):  # noqa: ANN003
        super().__init__(message)
        self.status = status
        self.saved = saved
        self.body = {"error": {"type": kind, "message": message, **({"code": code} if code else {}), **extra}}


@dataclass
class IdempotencyRecord:
    """What one key was first used for, and its saved answer (None while the first request runs)."""

    endpoint: str
    params: dict[str, Any]
    first_used: float
    status: int | None = None
    body: str | None = None


class FakeStripe:
    """The account's state and its HTTP surface (``app()``); ``start()`` runs the webhook sender."""

    def __init__(self, config: FakeConfig, faults: Faults | None = None) -> None:
        self.config = config
        self.faults = faults or Faults()
        self.clock = Clock()
        self.lock = threading.RLock()
        self.rng = random.Random(config.seed)
        self.script: deque[tuple[str, str | None]] = deque()
        """Scripted faults: (kind, path prefix or None for any request), taken in order by matching requests."""
        self.refunds_pending = False
        """New refunds start ``pending`` (completed through ``complete_refund``) instead of ``succeeded``."""
        self.payment_intents: dict[str, dict[str, Any]] = {}
        self.index: dict[str, list[tuple[float, dict[str, Any]]]] = {}
        """Search index: PaymentIntent id → (time, snapshot) history; search reads what is older than the lag."""
        self.charges: dict[str, dict[str, Any]] = {}
        self.refunds: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.balance_transactions: list[dict[str, Any]] = []
        self.idempotency: dict[str, IdempotencyRecord] = {}
        self.requests: list[dict[str, Any]] = []
        """Every /v1 request seen: method, path, auth_ok, idempotency_key, stripe_version, params."""
        self.deliveries: list[dict[str, Any]] = []
        """Every webhook attempt: event id, type, status (None: connection failed), attempt."""
        self._outbox: queue.Queue[str | None] = queue.Queue()
        self._sender: threading.Thread | None = None
        self._stopping = threading.Event()

    # ----------------------------------------------------------------------------------------- helpers

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{secrets.token_hex(12)}"

    def _now(self) -> int:
        return int(self.clock.now())

    def fail_next(self, kind: str, count: int = 1, path: str | None = None) -> None:
        """Make the next ``count`` /v1 requests whose path starts with ``path`` (any, if None) fail with ``kind``.

        ``drop_webhook`` drops the next ``count`` webhook events instead.
        """
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}")
        with self.lock:
            self.script.extend([(kind, path)] * count)

    def _draw(self, method: str, path: str) -> str | None:
        """This request's fate: a scripted fault first, else the dice (always all of them, for repeatability)."""
        with self.lock:
            rolls = [self.rng.random() for _ in RATES[:-1]]
            for i, (kind, prefix) in enumerate(self.script):
                if kind != "drop_webhook" and (prefix is None or f"{method} {path}".startswith(prefix)):
                    del self.script[i]
                    return kind
            for roll, rate_name, kind in zip(rolls, RATES[:-1], FAULT_KINDS[:-1], strict=True):
                if roll < getattr(self.faults, rate_name):
                    return kind
        return None

    def _emit(self, event_type: str, obj: dict[str, Any], idempotency_key: str | None = None) -> None:
        event = {
            "id": self._id("evt"),
            "object": "event",
            "api_version": ACCOUNT_VERSION,
            "created": self._now(),
            "data": {"object": copy.deepcopy(obj)},
            "livemode": self.config.api_key.startswith("sk_live_"),
            "pending_webhooks": 1 if event_type in self.config.subscribed_events else 0,
            "request": {"id": self._id("req"), "idempotency_key": idempotency_key},
            "type": event_type,
        }
        self.events.append(event)
        if self.config.webhook_url and event_type in self.config.subscribed_events:
            self._outbox.put(event["id"])

    def _indexed(self, pi: dict[str, Any]) -> None:
        self.index.setdefault(pi["id"], []).append((self.clock.now(), copy.deepcopy(pi)))

    def _fee(self, amount: int, currency: str) -> int:
        fixed = 0 if currency in ZERO_DECIMAL else 300 if currency in THREE_DECIMAL else 30
        fee = (amount * 29 + 500) // 1000 + fixed
        return fee - fee % 10 if currency in THREE_DECIMAL else fee

    def _settled(self, amount: int, currency: str) -> tuple[int, str, float | None]:
        """(amount, currency, exchange_rate) of ``amount`` in ``currency`` as it reaches the balance."""
        into = self.config.settlement_currency
        if into is None or into == currency:
            return amount, currency, None
        rate = decimal.Decimal(self.config.exchange_rates[currency]) / decimal.Decimal(self.config.exchange_rates[into])
        rate = rate.quantize(decimal.Decimal("0.000001"))
        shift = decimal.Decimal(10) ** (_stripe_exponent(into) - _stripe_exponent(currency))
        settled = int((decimal.Decimal(amount) * rate * shift).to_integral_value(decimal.ROUND_HALF_UP))
        return settled, into, float(rate)

    def _balance(self, txn_type: str, amount: int, fee: int, currency: str, source: str) -> str:
        amount, currency, rate = self._settled(amount, currency)
        if fee:
            fee = self._fee(abs(amount), currency)
        txn = {
            "id": self._id("txn"),
            "object": "balance_transaction",
            "amount": amount,
            "available_on": self._now() + 2 * 86400,
            "created": self._now(),
            "currency": currency,
            "description": None,
            "exchange_rate": rate,
            "fee": fee,
            "fee_details": [{"amount": fee, "currency": currency, "type": "stripe_fee", "description": "Stripe fee"}]
            if fee
            else [],
            "net": amount - fee,
            "reporting_category": {"charge": "charge", "refund": "refund", "refund_failure": "refund_failure"}.get(
                txn_type, txn_type
            ),
            "source": source,
            "status": "pending",
            "type": txn_type,
        }
        self.balance_transactions.append(txn)
        return txn["id"]

    # ----------------------------------------------------------------------------------------- the account

    def create_payment_intent(self, params: dict[str, Any], idempotency_key: str | None) -> tuple[int, dict]:
        """POST /v1/payment_intents."""
        amount = _positive_int(params, "amount")
        currency = _currency(params)
        _check_amount(amount, currency)
        confirm = _bool(params, "confirm")
        method = params.get("payment_method")
        if method is not None and method not in TEST_PAYMENT_METHODS:
            raise StripeError(
                400, "invalid_request_error", f"No such PaymentMethod: '{method}'", code="resource_missing"
            )
        metadata = params.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise StripeError(400, "invalid_request_error", "metadata must be a hash", code="parameter_invalid_empty")
        apm = params.get("automatic_payment_methods") or {}
        if confirm and isinstance(apm, dict) and _bool(apm, "enabled") and apm.get("allow_redirects") != "never":
            if not params.get("return_url"):
                raise StripeError(
                    400,
                    "invalid_request_error",
                    "This PaymentIntent is configured to accept payment methods enabled in your Dashboard, some of "
                    "which require a return_url; pass return_url or set automatic_payment_methods[allow_redirects]="
                    "never.",
                )
        if confirm and method is None:
            raise StripeError(400, "invalid_request_error", "You must provide a payment_method to confirm")
        pi_id = self._id("pi")
        pi = {
            "id": pi_id,
            "object": "payment_intent",
            "amount": amount,
            "amount_received": 0,
            "automatic_payment_methods": {"enabled": _bool(apm, "enabled")} if isinstance(apm, dict) and apm else None,
            "canceled_at": None,
            "cancellation_reason": None,
            "capture_method": "automatic",
            "client_secret": f"{pi_id}_secret_{secrets.token_hex(12)}",
            "confirmation_method": "automatic",
            "created": self._now(),
            "currency": currency,
            "description": params.get("description"),
            "last_payment_error": None,
            "latest_charge": None,
            "livemode": self.config.api_key.startswith("sk_live_"),
            "metadata": dict(metadata),
            "payment_method": method,
            "status": "requires_confirmation" if method else "requires_payment_method",
        }
        self.payment_intents[pi_id] = pi
        self._emit("payment_intent.created", pi, idempotency_key)
        if confirm:
            self._attempt(pi, method, _bool(params, "error_on_requires_action"), idempotency_key)
        self._indexed(pi)
        if pi["status"] == "requires_payment_method" and pi["last_payment_error"]:
            error = dict(pi["last_payment_error"])
            raise StripeError(
                402,
                "card_error",
                error.pop("message"),
                saved=True,
                payment_intent=copy.deepcopy(pi),
                **{k: v for k, v in error.items() if k != "type"},
            )
        return 200, copy.deepcopy(pi)

    def _attempt(self, pi: dict[str, Any], method: str, error_on_action: bool, key: str | None) -> None:
        outcome = TEST_PAYMENT_METHODS[method]
        if outcome == "requires_action" and error_on_action:
            outcome = ("authentication_required", "authentication_required")
        if outcome == "requires_action":
            pi["status"] = "requires_action"
            pi["next_action"] = {"type": "use_stripe_sdk"}
            return
        if outcome == "processing":
            pi["status"] = "processing"
            return
        if outcome == "partial_capture":
            self._succeed(pi, self._charge(pi, "succeeded", None), key, received=pi["amount"] // 2)
            return
        charge = self._charge(pi, "failed" if outcome else "succeeded", outcome[0] if outcome else None)
        if outcome is None:
            self._succeed(pi, charge, key)
            return
        code, decline = outcome
        pi["status"] = "requires_payment_method"
        pi["last_payment_error"] = {
            "type": "card_error",
            "code": code,
            "decline_code": decline,
            "message": "Your card was declined." if code == "card_declined" else f"Card error: {code}.",
            "charge": charge["id"],
            "payment_method": {"id": method, "object": "payment_method"},
        }
        self._emit("charge.failed", charge, key)
        self._emit("payment_intent.payment_failed", pi, key)

    def _charge(self, pi: dict[str, Any], status: str, failure_code: str | None) -> dict[str, Any]:
        charge = {
            "id": self._id("ch"),
            "object": "charge",
            "amount": pi["amount"],
            "amount_refunded": 0,
            "balance_transaction": None,
            "created": self._now(),
            "currency": pi["currency"],
            "failure_code": failure_code,
            "metadata": {},
            "paid": status == "succeeded",
            "payment_intent": pi["id"],
            "payment_method": pi["payment_method"],
            "refunded": False,
            "status": status,
        }
        self.charges[charge["id"]] = charge
        pi["latest_charge"] = charge["id"]
        return charge

    def _succeed(
        self, pi: dict[str, Any], charge: dict[str, Any], key: str | None, received: int | None = None
    ) -> None:
        received = pi["amount"] if received is None else received
        charge["status"], charge["paid"] = "succeeded", True
        charge["amount_captured"] = received
        charge["balance_transaction"] = self._balance(
            "charge", received, self._fee(received, pi["currency"]), pi["currency"], charge["id"]
        )
        pi["status"], pi["amount_received"] = "succeeded", received
        self._emit("charge.succeeded", charge, key)
        self._emit("payment_intent.succeeded", pi, key)

    def complete_payment_intent(self, pi_id: str, succeed: bool = True) -> dict[str, Any]:
        """Finish a ``processing`` PaymentIntent (control surface)."""
        with self.lock:
            pi = self.payment_intents[pi_id]
            if pi["status"] != "processing":
                raise ValueError(f"{pi_id} is {pi['status']}, not processing")
            charge = self._charge(pi, "succeeded" if succeed else "failed", None if succeed else "card_declined")
            if succeed:
                self._succeed(pi, charge, None)
            else:
                pi["status"] = "requires_payment_method"
                pi["last_payment_error"] = {"type": "card_error", "code": "card_declined", "message": "declined"}
                self._emit("payment_intent.payment_failed", pi)
            self._indexed(pi)
            return copy.deepcopy(pi)

    def other_traffic(self, count: int, amount: int = 500, currency: str = "usd") -> int:
        """``count`` succeeded PaymentIntents of another integration on this account, created now (control surface).

        The account's other business: no ``metadata.payment_id``, no webhooks to us. Lookups by our number must
        cost the same however many of these there are.
        """
        with self.lock:
            now = self._now()
            for n in range(count):
                pi_id = self._id("pi")
                pi = {
                    "id": pi_id,
                    "object": "payment_intent",
                    "amount": amount,
                    "amount_received": amount,
                    "capture_method": "automatic",
                    "created": now,
                    "currency": currency,
                    "last_payment_error": None,
                    "latest_charge": None,
                    "livemode": self.config.api_key.startswith("sk_live_"),
                    "metadata": {"order_id": f"other-{n}"},
                    "status": "succeeded",
                }
                self.payment_intents[pi_id] = pi
                self._indexed(pi)
        return count

    def cancel_payment_intent(self, pi_id: str, params: dict[str, Any]) -> tuple[int, dict]:
        """POST /v1/payment_intents/<id>/cancel."""
        pi = self._get(self.payment_intents, pi_id, "payment_intent")
        if pi["status"] in ("succeeded", "canceled", "processing"):
            raise StripeError(
                400,
                "invalid_request_error",
                f"You cannot cancel this PaymentIntent because it has a status of {pi['status']}.",
                code="payment_intent_unexpected_state",
                saved=True,
            )
        pi["status"] = "canceled"
        pi["canceled_at"] = self._now()
        pi["cancellation_reason"] = params.get("cancellation_reason")
        self._indexed(pi)
        self._emit("payment_intent.canceled", pi)
        return 200, copy.deepcopy(pi)

    def search_payment_intents(self, args: dict[str, Any]) -> dict[str, Any]:
        """GET /v1/payment_intents/search: metadata['k']:'v' [AND …], from the lagging index."""
        text = args.get("query")
        if not isinstance(text, str) or not text:
            raise StripeError(400, "invalid_request_error", "Missing required param: query.", code="parameter_missing")
        wanted = {}
        for clause in text.split(" AND "):
            match = re.fullmatch(r"\s*metadata\['([^'\\]+)'\]:'([^'\\]*)'\s*", clause)
            if not match:
                raise StripeError(400, "invalid_request_error", "This fake searches metadata['key']:'value' only.")
            wanted[match.group(1)] = match.group(2)
        visible_until = self.clock.now() - self.config.search_lag_seconds
        found = []
        for history in self.index.values():
            snapshot = None
            for t, snap in history:
                if t <= visible_until:
                    snapshot = snap
            if snapshot is not None and all(snapshot["metadata"].get(k) == v for k, v in wanted.items()):
                found.append(snapshot)
        found.sort(key=lambda pi: pi["created"], reverse=True)
        limit = _limit(args)
        offset = int(args.get("page") or 0)
        page = found[offset : offset + limit]
        more = offset + limit < len(found)
        return {
            "object": "search_result",
            "url": "/v1/payment_intents/search",
            "has_more": more,
            "next_page": str(offset + limit) if more else None,
            "data": copy.deepcopy(page),
        }

    def create_refund(self, params: dict[str, Any], idempotency_key: str | None, pending: bool) -> tuple[int, dict]:
        """POST /v1/refunds (succeeded at once, or pending when ``pending``)."""
        pi_id = params.get("payment_intent")
        if pi_id is not None:
            pi = self._get(self.payment_intents, pi_id, "payment_intent", status=400)
            charge = self.charges.get(pi.get("latest_charge") or "")
        else:
            charge = self._get(self.charges, params.get("charge") or "", "charge", status=400)
        if charge is None or charge["status"] != "succeeded":
            raise StripeError(
                400, "invalid_request_error", "This PaymentIntent does not have a successful charge to refund."
            )
        remaining = charge["amount"] - charge["amount_refunded"]
        if remaining <= 0:
            raise StripeError(
                400, "invalid_request_error", "Charge has already been refunded.", code="charge_already_refunded"
            )
        amount = _positive_int(params, "amount") if "amount" in params else remaining
        if amount > remaining:
            raise StripeError(
                400,
                "invalid_request_error",
                f"Refund amount ({amount}) is greater than unrefunded amount.",
                code="amount_too_large",
            )
        metadata = params.get("metadata") or {}
        refund = {
            "id": self._id("re"),
            "object": "refund",
            "amount": amount,
            "balance_transaction": None,
            "charge": charge["id"],
            "created": self._now(),
            "currency": charge["currency"],
            "failure_reason": None,
            "metadata": dict(metadata) if isinstance(metadata, dict) else {},
            "payment_intent": charge["payment_intent"],
            "reason": params.get("reason"),
            "status": "pending" if pending else "succeeded",
        }
        self.refunds[refund["id"]] = refund
        charge["amount_refunded"] += amount
        charge["refunded"] = charge["amount_refunded"] == charge["amount"]
        refund["balance_transaction"] = self._balance("refund", -amount, 0, refund["currency"], refund["id"])
        self._emit("refund.created", refund, idempotency_key)
        self._emit("charge.refunded", charge, idempotency_key)
        return 200, copy.deepcopy(refund)

    def complete_refund(self, refund_id: str, succeed: bool = True) -> dict[str, Any]:
        """Finish a pending refund (control surface): refund.updated, and refund.failed if it failed."""
        with self.lock:
            refund = self.refunds[refund_id]
            if refund["status"] != "pending":
                raise ValueError(f"{refund_id} is {refund['status']}, not pending")
            if succeed:
                refund["status"] = "succeeded"
            else:
                refund["status"], refund["failure_reason"] = "failed", "expired_or_canceled_card"
                charge = self.charges[refund["charge"]]
                charge["amount_refunded"] -= refund["amount"]
                charge["refunded"] = False
                self._balance("refund_failure", refund["amount"], 0, refund["currency"], refund["id"])
            self._emit("refund.updated", refund)
            if not succeed:
                self._emit("refund.failed", refund)
            return copy.deepcopy(refund)

    def _get(self, table: dict[str, dict], object_id: str, kind: str, status: int = 404) -> dict[str, Any]:
        obj = table.get(object_id)
        if obj is None:
            raise StripeError(
                status, "invalid_request_error", f"No such {kind}: '{object_id}'", code="resource_missing"
            )
        return obj

    def _list(self, items: list[dict[str, Any]], args: dict[str, Any], url: str) -> dict[str, Any]:
        """Stripe's list envelope over ``items``: newest first, created[…] filters, cursor pagination."""
        created = args.get("created")
        rows = sorted(items, key=lambda o: (o["created"], o["id"]), reverse=True)
        if isinstance(created, dict):
            for op, test in (
                ("gte", lambda c, v: c >= v),
                ("gt", lambda c, v: c > v),
                ("lte", lambda c, v: c <= v),
                ("lt", lambda c, v: c < v),
            ):
                if op in created:
                    bound = _int_value(created[op], f"created[{op}]")
                    rows = [o for o in rows if test(o["created"], bound)]
        elif created is not None:
            bound = _int_value(created, "created")
            rows = [o for o in rows if o["created"] == bound]
        after, before = args.get("starting_after"), args.get("ending_before")
        ids = [o["id"] for o in rows]
        if after:
            if after not in ids:
                raise StripeError(400, "invalid_request_error", f"No such object: '{after}'", code="resource_missing")
            rows = rows[ids.index(after) + 1 :]
        elif before:
            if before not in ids:
                raise StripeError(400, "invalid_request_error", f"No such object: '{before}'", code="resource_missing")
            rows = rows[: ids.index(before)]
            limit = _limit(args)
            page, more = rows[-limit:], len(rows) > limit
            return {"object": "list", "url": url, "has_more": more, "data": copy.deepcopy(page)}
        limit = _limit(args)
        return {"object": "list", "url": url, "has_more": len(rows) > limit, "data": copy.deepcopy(rows[:limit])}

    def list_events(self, args: dict[str, Any]) -> dict[str, Any]:
        """GET /v1/events: the last 30 days, filtered by type or types[]."""
        oldest = self._now() - EVENT_RETENTION
        rows = [e for e in self.events if e["created"] >= oldest]
        types = args.get("types")
        if types is not None and args.get("type") is not None:
            raise StripeError(400, "invalid_request_error", "You may pass either type or types, but not both.")
        if isinstance(types, list):
            if len(types) > 20:
                raise StripeError(400, "invalid_request_error", "types accepts at most 20 event types.")
            rows = [e for e in rows if e["type"] in types]
        elif isinstance(args.get("type"), str):
            pattern = re.escape(args["type"]).replace(r"\*", ".*")
            rows = [e for e in rows if re.fullmatch(pattern, e["type"])]
        return self._list(rows, args, "/v1/events")

    def list_balance_transactions(self, args: dict[str, Any]) -> dict[str, Any]:
        """GET /v1/balance_transactions, with ``expand[]=data.source`` honoured."""
        rows = self.balance_transactions
        if isinstance(args.get("type"), str):
            rows = [t for t in rows if t["type"] == args["type"]]
        page = self._list(rows, args, "/v1/balance_transactions")
        if "data.source" in (args.get("expand") or []):
            for txn in page["data"]:
                source = self.charges.get(txn["source"]) or self.refunds.get(txn["source"])
                if source is not None:
                    txn["source"] = copy.deepcopy(source)
        return page

    # ----------------------------------------------------------------------------------------- HTTP

    def app(self) -> Flask:
        """The Flask app: /v1/… as Stripe, /_fake/… for tests (this machine only)."""
        app = Flask("fake_stripe")
        fake = self

        @app.route("/v1/<path:path>", methods=["GET", "POST", "DELETE"])
        def api(path: str) -> Response:
            return fake._serve("/v1/" + path)

        @app.post("/_fake/<action>")
        def control(action: str) -> Response:
            if request.remote_addr not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
                return _json(403, {"error": "control surface answers this machine only"})
            body = request.get_json(silent=True) or {}
            try:
                return _json(200, fake._control(action, body))
            except (KeyError, ValueError) as exc:
                return _json(400, {"error": str(exc)})

        return app

    def _control(self, action: str, body: dict[str, Any]) -> Any:
        if action == "clock":
            self.clock.advance(float(body.get("advance", 0)))
            return {"now": self.clock.now()}
        if action == "faults":
            self.faults = parse_faults(body)
            return {"faults": self.faults.__dict__}
        if action == "fail_next":
            self.fail_next(str(body.get("kind")), int(body.get("count", 1)), body.get("path"))
            return {"script": [list(item) for item in self.script]}
        if action == "other_traffic":
            return {"created": self.other_traffic(int(body.get("count", 1)))}
        if action == "complete_payment_intent":
            return self.complete_payment_intent(str(body["id"]), bool(body.get("succeed", True)))
        if action == "complete_refund":
            return self.complete_refund(str(body["id"]), bool(body.get("succeed", True)))
        if action == "webhook_secrets":
            self.config.webhook_secrets = [str(s) for s in body["secrets"]]
            return {"count": len(self.config.webhook_secrets)}
        if action == "deliveries":
            return {"deliveries": list(self.deliveries)}
        if action == "payment_intents":
            with self.lock:
                return {
                    "payment_intents": [
                        {k: pi.get(k) for k in ("id", "status", "amount", "currency", "metadata", "latest_charge")}
                        for pi in self.payment_intents.values()
                    ]
                }
        if action == "balance":
            with self.lock:
                net: dict[str, int] = {}
                for txn in self.balance_transactions:
                    net[txn["currency"]] = net.get(txn["currency"], 0) + txn["net"]
                return {"net": net, "transactions": len(self.balance_transactions)}
        if action == "refunds_pending":
            self.refunds_pending = bool(body.get("pending", True))
            return {"refunds_pending": self.refunds_pending}
        if action == "refunds":
            keys = ("id", "status", "amount", "currency", "charge", "payment_intent", "metadata", "failure_reason")
            with self.lock:
                return {"refunds": [{k: r.get(k) for k in keys} for r in self.refunds.values()]}
        raise KeyError(f"no control action {action!r}")

    def _serve(self, path: str) -> Response:
        method = request.method
        pairs = list(request.form.items(multi=True)) if method == "POST" else list(request.args.items(multi=True))
        record = {
            "method": method,
            "path": path,
            "idempotency_key": request.headers.get("Idempotency-Key"),
            "stripe_version": request.headers.get("Stripe-Version"),
            "auth_ok": self._authorized(request.headers.get("Authorization")),
        }
        with self.lock:
            self.requests.append(record)
        if not record["auth_ok"]:
            return _json(
                401,
                {"error": {"type": "invalid_request_error", "message": "Invalid API Key provided."}},
            )
        version = record["stripe_version"]
        if version is not None and version not in KNOWN_VERSIONS:
            return _json(
                400, {"error": {"type": "invalid_request_error", "message": f"Invalid Stripe API version: {version}"}}
            )
        try:
            params = decode_form(pairs)
        except ValueError as exc:
            return _json(400, {"error": {"type": "invalid_request_error", "message": str(exc)}})
        record["params"] = params
        fate = self._draw(method, path)
        if fate == "5xx":
            return _json(503, {"error": {"type": "api_error", "message": "Service unavailable."}})
        if fate == "rate_limit":
            return _json(
                429, {"error": {"type": "invalid_request_error", "code": "rate_limit", "message": "Too many requests."}}
            )
        if fate == "lock_timeout":
            return _json(
                429, {"error": {"type": "invalid_request_error", "code": "lock_timeout", "message": "Object locked."}}
            )
        if fate == "hang":
            self._stopping.wait(self.faults.hang_seconds)
            return _json(503, {"error": {"type": "api_error", "message": "Timed out."}})
        if method == "GET":
            try:
                with self.lock:
                    status, body = 200, self._get_route(path, params)
            except StripeError as exc:
                status, body = exc.status, exc.body
            if fate == "timeout_after_commit":
                self._stopping.wait(self.faults.hang_seconds)
            return _json(status, body)
        key = record["idempotency_key"]
        status, text, replayed = self._post(path, params, key, fate)
        response = Response(text, status, content_type="application/json")
        if replayed:
            response.headers["Idempotent-Replayed"] = "true"
        if key:
            response.headers["Idempotency-Key"] = key
        if fate == "timeout_after_commit":
            self._stopping.wait(self.faults.hang_seconds)  # a stopping platform lets held answers go
        return response

    def _authorized(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                value = base64.b64decode(value, validate=True).decode().partition(":")[0]
            except (ValueError, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(value.encode(), self.config.api_key.encode())

    def _post(self, path: str, params: dict[str, Any], key: str | None, fate: str | None) -> tuple[int, str, bool]:
        """Run one POST under the Stripe idempotency rules; (status, body text, replayed)."""
        with self.lock:
            if key is not None:
                if len(key) > 255:
                    return 400, _error_text("invalid_request_error", "Idempotency key too long"), False
                known = self.idempotency.get(key)
                if known is not None and self.clock.now() - known.first_used >= KEY_LIFETIME:
                    del self.idempotency[key]  # pruned after 24 hours: the key makes a new request
                    known = None
                if known is not None:
                    if known.status is None:
                        message = "There is currently another in-progress request using this Idempotent Key."
                        return 409, _error_text("idempotency_error", message, "idempotency_key_in_use"), False
                    if known.endpoint != path or known.params != params:
                        message = (
                            "Keys for idempotent requests can only be used with the same parameters they were "
                            f"first used with. Try using a key other than '{key}' if you meant to execute a "
                            "different request."
                        )
                        return 400, _error_text("idempotency_error", message), False
                    return known.status, known.body or "", True
                self.idempotency[key] = IdempotencyRecord(path, params, self.clock.now())
        try:
            if fate == "api_error":
                raise StripeError(500, "api_error", "An unknown error occurred.", saved=True)
            with self.lock:
                status, body = self._post_route(path, params, key)
            saved = True
        except StripeError as exc:
            status, body, saved = exc.status, exc.body, exc.saved
        text = _text(body)
        with self.lock:
            if key is not None:
                if saved:
                    record = self.idempotency[key]
                    record.status, record.body = status, text
                else:
                    self.idempotency.pop(key, None)  # nothing saved: the key is free again
        return status, text, False

    def _post_route(self, path: str, params: dict[str, Any], key: str | None) -> tuple[int, dict]:
        if path == "/v1/payment_intents":
            return self.create_payment_intent(params, key)
        match = re.fullmatch(r"/v1/payment_intents/([^/]+)/cancel", path)
        if match:
            return self.cancel_payment_intent(match.group(1), params)
        if path == "/v1/refunds":
            return self.create_refund(params, key, pending=self.refunds_pending)
        raise StripeError(404, "invalid_request_error", f"Unrecognized request URL (POST: {path}).")

    def _get_route(self, path: str, args: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/payment_intents/search":
            return self.search_payment_intents(args)
        if path == "/v1/payment_intents":
            return self._list(list(self.payment_intents.values()), args, path)
        match = re.fullmatch(r"/v1/payment_intents/([^/]+)", path)
        if match:
            return copy.deepcopy(self._get(self.payment_intents, match.group(1), "payment_intent"))
        if path == "/v1/refunds":
            rows = list(self.refunds.values())
            for name in ("payment_intent", "charge"):
                if args.get(name):
                    rows = [r for r in rows if r[name] == args[name]]
            return self._list(rows, args, path)
        match = re.fullmatch(r"/v1/refunds/([^/]+)", path)
        if match:
            return copy.deepcopy(self._get(self.refunds, match.group(1), "refund"))
        if path == "/v1/events":
            return self.list_events(args)
        match = re.fullmatch(r"/v1/events/([^/]+)", path)
        if match:
            oldest = self._now() - EVENT_RETENTION
            events = {e["id"]: e for e in self.events if e["created"] >= oldest}
            return copy.deepcopy(self._get(events, match.group(1), "event"))
        if path == "/v1/balance_transactions":
            return self.list_balance_transactions(args)
        raise StripeError(404, "invalid_request_error", f"Unrecognized request URL (GET: {path}).")

    # ----------------------------------------------------------------------------------------- webhooks

    def start(self) -> None:
        """Start the webhook sender thread."""
        if self._sender is None:
            self._stopping.clear()
            self._sender = threading.Thread(target=self._send_loop, name="fake-stripe-webhooks", daemon=True)
            self._sender.start()

    def stop(self) -> None:
        """Stop the webhook sender (undelivered events are dropped)."""
        self._stopping.set()
        self._outbox.put(None)
        if self._sender is not None:
            self._sender.join(5)
            self._sender = None

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until every queued webhook has been attempted (for tests)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._outbox.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    def _send_loop(self) -> None:
        session = requests.Session()
        while not self._stopping.is_set():
            event_id = self._outbox.get()
            try:
                if event_id is not None:
                    self._deliver(session, event_id)
            finally:
                self._outbox.task_done()

    def _deliver(self, session: requests.Session, event_id: str) -> None:
        with self.lock:
            event = next((e for e in self.events if e["id"] == event_id), None)
            dropped = ("drop_webhook", None) in self.script
            if dropped:
                self.script.remove(("drop_webhook", None))
            elif self.rng.random() < self.faults.drop_webhook_rate:
                dropped = True
            secrets_ = list(self.config.webhook_secrets)
        if event is None:
            return
        if dropped:
            self.deliveries.append({"event": event_id, "type": event["type"], "status": "dropped", "attempt": 0})
            return
        payload = json.dumps(event, indent=2).encode()  # Stripe pretty-prints its webhook bodies
        for attempt in range(1, self.config.webhook_max_attempts + 1):
            headers = {
                "Content-Type": "application/json; charset=utf-8",
                "User-Agent": "Stripe/1.0 (+https://stripe.com/docs/webhooks)",
                "Stripe-Signature": signature_header(secrets_, payload, self._now()),
            }
            try:
                status: int | None = session.post(
                    self.config.webhook_url, data=payload, headers=headers, timeout=10
                ).status_code
            except requests.RequestException:
                status = None
            self.deliveries.append({"event": event_id, "type": event["type"], "status": status, "attempt": attempt})
            if status is not None and 200 <= status < 300:
                return
            if self._stopping.wait(self.config.webhook_backoff_seconds * 2 ** (attempt - 1)):
                return


def _json(status: int, body: Any) -> Response:
    return Response(_text(body), status, content_type="application/json")


def _text(body: Any) -> str:
    return json.dumps(body, indent=2)


def _error_text(kind: str, message: str, code: str | None = None) -> str:
    return _text({"error": {"type": kind, "message": message, **({"code": code} if code else {})}})


def _int_value(value: Any, name: str) -> int:
    if not isinstance(value, str) or not re.fullmatch(r"-?[0-9]{1,18}", value):
        raise StripeError(400, "invalid_request_error", f"Invalid integer: {name}", code="parameter_invalid_integer")
    return int(value)


def _positive_int(params: dict[str, Any], name: str) -> int:
    if name not in params:
        raise StripeError(400, "invalid_request_error", f"Missing required param: {name}.", code="parameter_missing")
    value = _int_value(params[name], name)
    if value <= 0:
        raise StripeError(400, "invalid_request_error", f"{name} must be positive", code="amount_too_small")
    return value


def _currency(params: dict[str, Any]) -> str:
    value = params.get("currency")
    if not isinstance(value, str) or not re.fullmatch(r"[a-z]{3}", value):
        raise StripeError(
            400, "invalid_request_error", "Invalid currency (lower-case ISO code).", code="parameter_invalid"
        )
    return value


def _check_amount(amount: int, currency: str) -> None:
    if currency in THREE_DECIMAL and amount % 10:
        raise StripeError(
            400, "invalid_request_error", "Three-decimal amounts must end in 0.", code="invalid_charge_amount"
        )
    if currency == "isk" and amount % 100:
        raise StripeError(
            400,
            "invalid_request_error",
            "Invalid amount. Currency ISK has become effectively zero-decimal and charged amounts must be evenly "
            "divisible by 100.",
            code="invalid_charge_amount_no_decimal_compatible",
        )


def _bool(params: dict[str, Any], name: str) -> bool:
    value = params.get(name)
    if value in (None, "false"):
        return False
    if value == "true":
        return True
    raise StripeError(400, "invalid_request_error", f"Invalid boolean: {name}", code="parameter_invalid")


def _limit(args: dict[str, Any]) -> int:
    if args.get("limit") is None:
        return 10
    value = _int_value(args["limit"], "limit")
    if not 1 <= value <= 100:
        raise StripeError(400, "invalid_request_error", "limit must be between 1 and 100")
    return value


def config_from_env(env: dict[str, str]) -> tuple[FakeConfig, Faults]:
    """The fake's settings from ``STRIPE_FAKE_*`` (ValueError naming the bad one)."""
    key = env.get("STRIPE_FAKE_API_KEY", "")
    if not re.fullmatch(r"sk_(test|live)_[0-9A-Za-z]{16,}", key):
        raise ValueError("STRIPE_FAKE_API_KEY must be a secret key sk_test_… with 16+ characters after the prefix")
    secrets_ = [s.strip() for s in env.get("STRIPE_FAKE_WEBHOOK_SECRETS", "").split(",") if s.strip()]
    if not secrets_ or not all(s.startswith("whsec_") for s in secrets_):
        raise ValueError("STRIPE_FAKE_WEBHOOK_SECRETS must list whsec_… secrets")
    seed = env.get("STRIPE_FAKE_SEED", "").strip()
    settles_in = env.get("STRIPE_FAKE_SETTLEMENT_CURRENCY", "").strip().lower() or None
    if settles_in is not None and settles_in not in EXCHANGE_RATES:
        raise ValueError(f"STRIPE_FAKE_SETTLEMENT_CURRENCY must be one of {', '.join(sorted(EXCHANGE_RATES))}")
    config = FakeConfig(
        api_key=key,
        webhook_secrets=secrets_,
        webhook_url=env.get("STRIPE_FAKE_WEBHOOK_URL") or None,
        search_lag_seconds=float(env.get("STRIPE_FAKE_SEARCH_LAG_SECONDS", "0") or 0),
        seed=int(seed) if seed else None,
        webhook_backoff_seconds=1.0,
        webhook_max_attempts=8,
        settlement_currency=settles_in,
    )
    return config, parse_faults(env.get("STRIPE_FAKE_FAULTS", ""))


def main(argv: list[str] | None = None) -> int:
    """``python -m sandbox.fakes.stripe --port N``."""
    parser = argparse.ArgumentParser(prog="python -m sandbox.fakes.stripe", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--host", default=os.environ.get("STRIPE_FAKE_HOST", "127.0.0.1"))
    args = parser.parse_args(argv)
    try:
        config, faults = config_from_env(dict(os.environ))
    except ValueError as exc:
        print(f"fake stripe: {exc}", file=sys.stderr)
        return 2
    from werkzeug.serving import make_server

    platform = FakeStripe(config, faults)
    platform.refunds_pending = os.environ.get("STRIPE_FAKE_REFUNDS_PENDING", "") == "1"
    server = make_server(args.host, args.port, platform.app(), threaded=True)
    platform.start()
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(f"fake stripe listening on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        platform.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
