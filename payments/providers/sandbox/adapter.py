"""Adapter for the sandbox payment platform (``sandbox/``, an outside party this module does not import).

Notification format: ``{"id": "evt_…", "type": "charge.succeeded" | "charge.failed"
| "refund.succeeded" | "refund.failed", "created": <unix>, "data":
{"merchant_transaction_id", "provider_transaction_id", "amount", "currency",
"failure_code"}}``; refund events add ``merchant_refund_id`` (our refund_id)
and name the charge's merchant_transaction_id.

Notifications are signed ``Sandbox-Signature: t=<unix seconds>,v1=<hex
HMAC-SHA256 of "<t>.<raw body>">`` (Stripe's scheme; several ``v1`` values may
appear, one match is enough). This module implements the check itself, as it
will for every real provider: with the platform's own signer beside it, two
independent implementations of one scheme catch each other's bugs
(tests/test_sandbox_signature.py).

Outbound (``charge``, ``query``, ``refund``, ``settlement``) is plain HTTP with
``requests`` against SANDBOX_API_URL, authenticated with SANDBOX_API_KEY as a
bearer token, like a provider's secret key. ``read_answer`` is the one pure
function that turns an HTTP answer into an outcome: only a 200 whose body says
"failed" (or a 4xx that refuses the request outright) is Failed; a timeout, a
reset, a 5xx, a 429 or a body we cannot read is Unknown (invariant 5).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import requests

from payments.errors import MalformedCallback, SignatureInvalid, TimestampOutOfTolerance
from payments.infra.logs import scrub
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
from payments.states import PaymentStatus

SIGNATURE_HEADER = "Sandbox-Signature"
"""The header that carries the signature of a notification."""
DEFAULT_TOLERANCE_SECONDS = 300
"""Signed timestamps further than this from now are refused."""


def _signature_parts(header: str | None) -> tuple[int, list[str]]:
    """The timestamp and the v1 signatures of a header; SignatureInvalid if it is not one."""
    if not header:
        raise SignatureInvalid("missing signature header")
    timestamp = None
    signatures = []
    for part in header.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep:
            raise SignatureInvalid("malformed signature header")
        if key == "t":
            # str.isdigit() also takes "²" or "١", which int() would read as digits.
            if not (value.isascii() and value.isdigit()) or len(value) > 12:
                raise SignatureInvalid("malformed signature timestamp")
            timestamp = int(value)
        elif key == "v1":
            signatures.append(value)
    if timestamp is None or not signatures:
        raise SignatureInvalid("signature header lacks t or v1")
    return timestamp, signatures


def verify_signature(
    secrets: Sequence[str], body: bytes, header: str | None, now: float, tolerance: int = DEFAULT_TOLERANCE_SECONDS
) -> int:
    """Check a Sandbox-Signature header against ``body`` under any of ``secrets``; return its timestamp.

    Raises SignatureInvalid, or TimestampOutOfTolerance when a signature
    matched but its timestamp is too far from ``now`` (checked only after a
    match, so a forged header learns nothing about the clock). Comparisons are
    constant-time.
    """
    timestamp, signatures = _signature_parts(header)
    message = str(timestamp).encode() + b"." + body
    expected = [hmac.new(secret.encode(), message, hashlib.sha256).hexdigest() for secret in secrets]
    # compare_digest raises TypeError on non-ASCII text (header bytes past 0x7f arrive as latin-1): no match.
    if not any(
        candidate.isascii() and hmac.compare_digest(want, candidate) for candidate in signatures for want in expected
    ):
        raise SignatureInvalid("no signature matches the body")
    if abs(now - timestamp) > tolerance:
        raise TimestampOutOfTolerance(
            f"signature timestamp is {int(now - timestamp)} s from now (tolerance {tolerance} s)"
        )
    return timestamp


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
    # A list or an object is unhashable: looked up as it is, it would be a TypeError (a 500), not a bad event.
    if not isinstance(event_type, str) or event_type not in EVENT_TYPES:
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
    capabilities = Capabilities(dedupe=Dedupe.KEY, query_by_merchant_id=True)
    callback_headers = (SIGNATURE_HEADER, "Content-Type", "User-Agent")
    callback_content_types = ("application/json",)

    def __init__(
        self,
        webhook_secret: str | Sequence[str],
        tolerance_seconds: int = DEFAULT_TOLERANCE_SECONDS,
        api_url: str = "http://127.0.0.1:8100",
        api_key: str = "",
    ) -> None:
        # Every listed secret verifies (rotation): a row stored under the old one still verifies later.
        self._secrets = (webhook_secret,) if isinstance(webhook_secret, str) else tuple(webhook_secret)
        self._tolerance = tolerance_seconds
        self._api_url = api_url.rstrip("/")
        self._api_key = api_key
        self._local = threading.local()  # one requests.Session (connection pool) per thread

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = api_session(self._api_url)
            if self._api_key:
                session.headers["Authorization"] = f"Bearer {self._api_key}"
        return session

    def _exchange(
        self, method: str, path: str, timeout: float, **kwargs: Any
    ) -> tuple[requests.Response | None, str | None, int]:
        """One HTTP exchange: (response or None, network error name or None, latency ms). Never raises."""
        started = time.monotonic()
        try:
            response = self._session().request(
                method, self._api_url + path, timeout=(min(timeout, 3.0), timeout), allow_redirects=False, **kwargs
            )
            _ = response.content  # read the body inside the timing and the try
            return response, None, _ms(started)
        except requests.Timeout:
            return None, "timeout", _ms(started)
        except requests.ConnectionError:
            return None, "connection_error", _ms(started)
        except requests.RequestException as exc:
            return None, type(exc).__name__, _ms(started)

    def _charge_headers(self, idempotency_key: str | None) -> dict[str, str]:
        return {"Idempotency-Key": idempotency_key} if idempotency_key else {}

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """POST /v1/charges with the payment's fixed idempotency key."""
        body = {
            "merchant_transaction_id": payment.payment_id,
            "amount": payment.amount_minor,
            "currency": payment.currency,
        }
        response, error, latency = self._exchange(
            "POST", "/v1/charges", timeout, json=body, headers=self._charge_headers(idempotency_key)
        )
        return _read(response, error, latency, lambda data: read_charge(data, payment.payment_id, payment))

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """GET /v1/charges?merchant_transaction_id=…: the charge, or NotFound on 404."""
        response, error, latency = self._exchange(
            "GET", "/v1/charges", timeout, params={"merchant_transaction_id": payment_id}
        )
        if response is not None and response.status_code == 404:
            return NotFound(evidence=_evidence(response, latency))
        if response is not None and response.status_code in _FINAL_4XX:
            # A refused query says nothing about the charge: never read it as a decline (invariant 5).
            return Unknown(f"query_refused_http_{response.status_code}", evidence=_evidence(response, latency))
        return _read(response, error, latency, lambda data: read_charge(data, payment_id, expected))

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """POST /v1/refunds with the refund's fixed idempotency key."""
        body = {
            "charge": request.provider_transaction_id,
            "amount": request.amount_minor,
            "merchant_refund_id": request.refund_id,
        }
        response, error, latency = self._exchange(
            "POST", "/v1/refunds", timeout, json=body, headers=self._charge_headers(idempotency_key)
        )
        return _read(response, error, latency, lambda data: read_refund(data, request))

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """GET /v1/refunds?merchant_refund_id=…: the refund, or NotFound on 404."""
        response, error, latency = self._exchange(
            "GET", "/v1/refunds", timeout, params={"merchant_refund_id": refund_id}
        )
        if response is not None and response.status_code == 404:
            return NotFound(evidence=_evidence(response, latency))
        if response is not None and response.status_code in _FINAL_4XX:
            # A refused query says nothing about the refund: never read it as a decline (invariant 5).
            return Unknown(f"query_refused_http_{response.status_code}", evidence=_evidence(response, latency))
        request = expected or RefundRequest(refund_id, "", "", 0, "")
        checked = expected is not None
        return _read(response, error, latency, lambda data: read_refund(data, request, check_amount=checked))

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """GET /v1/settlements/<day>.csv, streamed in chunks (``timeout`` bounds each read, not the whole file)."""
        url = f"{self._api_url}/v1/settlements/{day}.csv"
        try:
            response = self._session().get(
                url, timeout=(min(timeout, 3.0), timeout), allow_redirects=False, stream=True
            )
        except requests.RequestException as exc:
            raise ProviderUnavailable(f"settlement file for {day} not available: {type(exc).__name__}") from None
        if response.status_code != 200:
            response.close()
            raise ProviderUnavailable(f"settlement file for {day} not available: http_{response.status_code}")
        return _stream(response, day)

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify the Sandbox-Signature header against each configured secret, then read the event."""
        verify_signature(self._secrets, body, _header(headers, SIGNATURE_HEADER), now, self._tolerance)
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            raise MalformedCallback("body is not valid JSON") from None
        return parse_event(self.platform, payload)

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


SETTLEMENT_CHUNK_BYTES = 64 * 1024


def _stream(response: requests.Response, day: str) -> Iterator[bytes]:
    """The body in chunks; ProviderUnavailable if it breaks off or comes up short of Content-Length."""
    received = 0
    try:
        for chunk in response.iter_content(SETTLEMENT_CHUNK_BYTES):
            received += len(chunk)
            yield chunk
    except requests.RequestException as exc:
        reason = f"broke off after {received} bytes: {type(exc).__name__}"
        raise ProviderUnavailable(f"settlement file for {day} {reason}") from None
    finally:
        response.close()
    expected = response.headers.get("Content-Length")
    if expected is not None and expected.isdigit() and int(expected) != received:
        raise ProviderUnavailable(f"settlement file for {day} is {received} bytes, the platform announced {expected}")


def _header(headers: Mapping[str, str], name: str) -> str | None:
    lowered = name.lower()
    for key, value in headers.items():
        if key.lower() == lowered:
            return value
    return None


class LegacySandboxProvider(SandboxProvider):
    """The same sandbox platform, driven the way an old provider API works: no idempotency keys, no query.

    Each call carries a fresh random key, so the platform treats every send as
    a new charge: exactly what re-sending to a provider without idempotency
    support would do. Its capabilities say so, and paysync never re-sends to
    it automatically (an ambiguous charge goes to the manual queue instead).
    Registered as ``sandbox_legacy`` when SANDBOX_LEGACY_ENABLED=true.
    """

    name = "sandbox_legacy"
    platform = "sandbox"  # one platform: its callbacks come to /callbacks/sandbox for payments of either adapter
    capabilities = Capabilities(dedupe=Dedupe.NONE, query_by_merchant_id=False)

    def _charge_headers(self, idempotency_key: str | None) -> dict[str, str]:
        return {"Idempotency-Key": f"legacy-{uuid.uuid4().hex}"}

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """This provider cannot look charges up: always Unknown, without a call."""
        return Unknown("query_not_supported")

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """This provider cannot look refunds up either: always Unknown, without a call."""
        return Unknown("query_not_supported")


MAX_RESPONSE_CHARS = 2000
"""Raw answers are kept this long in provider_call.response."""

_FINAL_4XX = frozenset({400, 402, 422})
"""Answers that refuse the request outright: nothing was or will be charged."""


def _ms(started: float) -> int:
    return int((time.monotonic() - started) * 1000)


def _evidence(response: requests.Response | None, latency: int) -> Evidence:
    if response is None:
        return Evidence(latency_ms=latency)
    text = response.content[: MAX_RESPONSE_CHARS * 2].decode("utf-8", "replace")
    return Evidence(http_status=response.status_code, response=scrub(text)[:MAX_RESPONSE_CHARS], latency_ms=latency)


def _read(
    response: requests.Response | None,
    error: str | None,
    latency: int,
    reader: Callable[[Any], Outcome],
) -> Outcome:
    """Classify one exchange; attach its evidence to the outcome."""
    evidence = _evidence(response, latency)
    if response is None:
        outcome: Outcome = Unknown(error or "no_response")
    else:
        outcome = read_answer(response.status_code, response.content, reader)
    return _with_evidence(outcome, evidence)


def _with_evidence(outcome: Outcome, evidence: Evidence) -> Outcome:
    return replace(outcome, evidence=evidence)


def read_answer(status: int, body: bytes, reader: Callable[[Any], Outcome]) -> Outcome:
    """Turn an HTTP status and body into an outcome (pure; invariant 5).

    5xx, 429, 408, 409 (idempotency key reuse: a bug to look at, not a decline),
    any other unexpected status and any unreadable body are Unknown. 400/402/422
    refuse the request outright: Failed with the platform's code. 401/403 are
    our configuration, not the customer's decline: Failed but not definitive,
    so the charge is retried once the key is fixed.
    """
    try:
        data = json.loads(body) if body else None
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        data = None
    if status == 200:
        if not isinstance(data, dict):
            return Unknown("unparseable_response")
        return reader(data)
    code = _error_code(data)
    if status in _FINAL_4XX:
        return Failed(code or f"http_{status}", definitive=True, raw=_raw(data), refusal=True)
    if status in (401, 403):
        return Failed(code or f"http_{status}", definitive=False, raw=_raw(data))
    return Unknown(f"http_{status}" + (f":{code}" if code else ""), raw=_raw(data))


def _error_code(data: Any) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        code = data["error"].get("code")
        if isinstance(code, str) and code:
            return code[:48]
    return None


def _raw(data: Any) -> dict[str, Any]:
    return data if isinstance(data, dict) else {}


def read_charge(data: Mapping[str, Any], payment_id: str, request: ChargeRequest | None) -> Outcome:
    """Read a charge object; Unknown if it is not one or is about another payment or amount."""
    charge_id = data.get("id")
    status = data.get("status")
    if not isinstance(charge_id, str) or not charge_id or len(charge_id) > 128:
        return Unknown("unparseable_response", raw=dict(data))
    if data.get("merchant_transaction_id") != payment_id:
        return Unknown("answer_for_another_payment", raw=dict(data))
    if request is not None and (data.get("amount") != request.amount_minor or data.get("currency") != request.currency):
        return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=charge_id, raw=dict(data))
    return _by_status(status, charge_id, data)


def read_refund(data: Mapping[str, Any], request: RefundRequest, *, check_amount: bool = True) -> Outcome:
    """Read a refund object; Unknown if it is not one, Mismatch if it is ours for another amount."""
    refund_id = data.get("id")
    if not isinstance(refund_id, str) or not refund_id or len(refund_id) > 128:
        return Unknown("unparseable_response", raw=dict(data))
    merchant_refund_id = data.get("merchant_refund_id")
    if merchant_refund_id is not None and merchant_refund_id != request.refund_id:
        return Unknown("answer_for_another_refund", raw=dict(data))
    if check_amount and "amount" in data and data.get("amount") != request.amount_minor:
        return Mismatch(AMOUNT_MISMATCH, provider_transaction_id=refund_id, raw=dict(data))
    return _by_status(data.get("status"), refund_id, data)


def _by_status(status: Any, reference: str, data: Mapping[str, Any]) -> Outcome:
    if status == "succeeded":
        return Succeeded(reference, raw=dict(data))
    if status == "failed":
        code = data.get("failure_code")
        code = code[:64] if isinstance(code, str) and code else "declined"
        return Failed(code, definitive=True, raw=dict(data), provider_transaction_id=reference)
    if status in ("processing", "pending"):
        return Pending(reference, raw=dict(data))
    return Unknown("unknown_status", raw=dict(data))
