"""The one interface every payment provider adapter implements.

Inbound: ``parse_callback`` verifies and reads a notification (pure), and
``ack`` / ``reject`` answer in the provider's own dialect.
Outbound: ``charge``, ``query``, ``refund``, ``query_refund`` and ``settlement``
return one of Succeeded | Failed | Pending | Unknown | Mismatch (the queries
also NotFound).
Only an explicit decline is Failed; a timeout, a reset connection, a 5xx, a
429 or an unreadable body is Unknown (docs/design.md invariant 5). A clear answer
about a charge under our number for another amount or currency is Mismatch:
never applied, escalated to a person, and healthy for the circuit breaker.
``reported_status`` is the one mapping from an outcome to the status it
reports.

Each adapter declares its ``Capabilities``: how its provider dedupes a charge
sent twice (``Dedupe.KEY``, ``Dedupe.MERCHANT_ID`` or ``Dedupe.NONE``) and
whether a charge can be looked up by our number. paysync re-sends a charge
whose outcome it lost only where the provider dedupes it; a provider that can
be queried but does not dedupe is queried until the payment's deadline, and
one that can do neither goes to the manual queue.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

import requests

from payments.errors import CallbackRejected, PaysyncError
from payments.states import PaymentStatus


class Dedupe(StrEnum):
    """How a provider recognises a charge sent to it twice (``Capabilities.dedupe``)."""

    KEY = "key"
    """The same idempotency key gets the first charge's answer, never a second charge (Stripe, the sandbox)."""
    MERCHANT_ID = "merchant_id"
    """A second charge under our payment_id is refused (e.g. out_trade_no at Alipay and WeChat Pay)."""
    NONE = "none"
    """Every send may be a new charge."""


@dataclass(frozen=True)
class Capabilities:
    """What an adapter's provider can do; decides what may be retried automatically."""

    dedupe: Dedupe = Dedupe.NONE
    """How the provider dedupes a charge sent twice; NONE means a charge is never sent twice."""
    query_by_merchant_id: bool = False
    """A charge can be looked up by our payment_id."""
    payer_scans: bool = False
    """A created charge waits for the payer to scan a QR code it returns (Alipay precreate, WeChat Native): POST
    /payments sends it at once, within CHARGE_INLINE_BUDGET_SECONDS, to answer with the code."""

    @property
    def may_resend(self) -> bool:
        """An ambiguous charge may be sent again: the provider dedupes it (by key or by our number)."""
        return self.dedupe != Dedupe.NONE


@dataclass(frozen=True)
class CallbackEvent:
    """A verified notification, reduced to what processing needs."""

    provider: str
    """The platform that sent it (``Provider.platform``)."""
    event_id: str
    event_type: str
    target: Literal["payment", "refund"]
    report: PaymentStatus
    merchant_reference: str
    """Our payment_id (or refund_id for refund events)."""
    provider_reference: str | None
    """The provider's id for the charge (or refund)."""
    amount_minor: int
    currency: str
    failure_code: str | None = None
    occurred_at: int | None = None
    payment_reference: str | None = None
    """For refund events: our payment_id, when the provider sends it."""


@dataclass(frozen=True)
class Evidence:
    """What one HTTP exchange looked like, for the provider_call row (no secrets: see ``payments.infra.logs.scrub``)."""

    http_status: int | None = None
    """None when no answer arrived (timeout, reset)."""
    response: str | None = None
    """The raw answer, scrubbed and truncated."""
    latency_ms: int | None = None


@dataclass(frozen=True)
class Succeeded:
    """The provider says the money moved."""

    provider_transaction_id: str
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None


@dataclass(frozen=True)
class Failed:
    """The provider declined; ``definitive`` False means it may be retried with the same key."""

    code: str
    definitive: bool = True
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None
    provider_transaction_id: str | None = None
    """The provider's id for the declined charge, when it made one."""
    refusal: bool = False
    """The provider refused this request (an HTTP 4xx, or its dialect's equivalent) instead of reporting a
    declined charge. On a first attempt that is a decline; on a re-send it says nothing about the earlier
    attempt, so it reports Unknown (see ``reported_status``)."""


@dataclass(frozen=True)
class Pending:
    """The provider accepted the request and has not finished it."""

    provider_transaction_id: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None
    qr_code: str | None = None
    """What the buyer scans to pay (Alipay ``qr_code``, WeChat ``code_url``), when the provider gives one."""


AMOUNT_MISMATCH = "answer_for_another_amount"
"""Mismatch reason every adapter uses when the provider's charge for our number has another amount or currency."""
REVIEW_PREFIX = "review:"
"""An Unknown whose reason starts with this is also a bug or a race a person should look at (e.g. Stripe's
idempotency_error): it is resolved by query like any Unknown, and the relay escalates it for review once."""


@dataclass(frozen=True)
class Mismatch:
    """The provider answered clearly, about a charge under our number that is not the one we hold.

    Another amount or currency (``AMOUNT_MISMATCH``): nothing is applied, a
    person must look. It is a well-formed answer, so the circuit breaker
    counts it as healthy.
    """

    reason: str = AMOUNT_MISMATCH
    provider_transaction_id: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None


@dataclass(frozen=True)
class Unknown:
    """We cannot tell what happened (timeout, reset, 5xx, 429, unreadable answer)."""

    reason: str
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None


@dataclass(frozen=True)
class NotFound:
    """A query found no such transaction at the provider."""

    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None


Outcome = Succeeded | Failed | Pending | Unknown | Mismatch
QueryOutcome = Succeeded | Failed | Pending | Unknown | Mismatch | NotFound


def reported_status(outcome: QueryOutcome, *, resend: bool = False) -> PaymentStatus | None:
    """What an outcome says about the charge, as a status for the state machine (pure; invariant 5).

    Succeeded is Succeeded, only a definitive Failed is Failed, Pending is
    Pending; Unknown and a not-definitive Failed are Unknown. On a re-send
    (``resend``: an earlier send's outcome was lost) a refusal is Unknown: it
    refuses this request and says nothing definitive about the earlier one.
    NotFound and Mismatch say nothing about our charge's status: None.
    """
    if isinstance(outcome, Succeeded):
        return PaymentStatus.SUCCEEDED
    if isinstance(outcome, Failed) and outcome.definitive and not (resend and outcome.refusal):
        return PaymentStatus.FAILED
    if isinstance(outcome, Pending):
        return PaymentStatus.PENDING
    if isinstance(outcome, NotFound | Mismatch):
        return None
    return PaymentStatus.UNKNOWN


def is_answer(outcome: QueryOutcome) -> bool:
    """True when the provider gave a real answer (anything but Unknown): the breaker counts it as healthy."""
    return not isinstance(outcome, Unknown)


@dataclass(frozen=True)
class ChargeRequest:
    """What a charge sends: our business number and the money."""

    payment_id: str
    amount_minor: int
    currency: str
    description: str | None = None
    """The payment's description, for providers that show one to the payer (WeChat requires one)."""
    created_at: datetime | None = None
    """When the payment was created (naive UTC): fixes a provider-side expiry that must not change on re-send."""
    payment_method: str | None = None
    """What the provider is to charge, when the merchant names it (Stripe: a PaymentMethod id, pm_…)."""
    provider_transaction_id: str | None = None
    """The provider's id of the charge, when an earlier answer gave it to us: a lookup can read it directly."""
    sent_before: datetime | None = None
    """When the newest earlier charge call for this payment that may have reached the provider started (naive
    UTC); None: none did. A lookup by our number needs it to know how recent a charge of ours there can be."""


@dataclass(frozen=True)
class RefundRequest:
    """What a refund sends: our refund number, the provider's charge id and the amount."""

    refund_id: str
    payment_id: str
    provider_transaction_id: str
    amount_minor: int
    currency: str
    payment_amount_minor: int | None = None
    """The refunded payment's full amount, for providers that want it with every refund (WeChat's amount.total)."""


class ProviderUnavailable(PaysyncError):
    """A provider call that returns data (a settlement file) got no usable answer; try again later."""

    code = "provider_unavailable"


class SettlementTooLarge(ProviderUnavailable):
    """A settlement file past its configured size cap: the download was stopped there and nothing was imported.

    Trying again brings the same file, so the reconciliation job raises an
    alert for a person (raise the cap, or find out why the file is so big).
    """

    code = "settlement_too_large"


@dataclass(frozen=True)
class HttpAnswer:
    """A response in the provider's dialect: body, status, content type."""

    body: str
    status: int = 200
    content_type: str = "application/json"


class Provider:
    """Base class for adapters. Subclasses set ``name``, ``capabilities`` and ``callback_headers``.

    ``name`` is the adapter's: it is what ``payment.provider`` holds. The
    ``platform`` is the party behind it that sends (and signs) callbacks:
    usually the same name, but several adapters may share one platform (the
    sandbox driven as ``sandbox`` and as ``sandbox_legacy``, or two merchant
    accounts at one provider). A callback names its platform (its route, and
    ``CallbackEvent.provider``), and it may concern any payment made through
    an adapter of that platform.
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()
    callback_headers: tuple[str, ...] = ()
    """Request headers stored with each raw callback (needed to re-verify it later)."""
    callback_content_types: tuple[str, ...] = ()
    """Media types its notifications come as (Content-Type without parameters); empty: any. A delivery naming
    another is rejected (415); Content-Type must then be one of ``callback_headers``, to re-verify it later."""

    @property
    def platform(self) -> str:
        """The platform this adapter talks to (see the class docstring); an adapter sharing one overrides it."""
        return self.name

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify and read one notification; raise CallbackRejected (status 3) if it is not genuine or not readable."""
        raise NotImplementedError

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Ask the provider to charge; never raises for network trouble (that is Unknown)."""
        raise NotImplementedError

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """Look a charge up by our business number; NotFound if the provider never saw it.

        With ``expected``, a charge for another amount or currency is
        Mismatch(AMOUNT_MISMATCH), never applied as ours.
        """
        raise NotImplementedError

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Ask the provider to refund (part of) a charge."""
        raise NotImplementedError

    def query_refund(self, refund_id: str, timeout: float, expected: RefundRequest | None = None) -> QueryOutcome:
        """Look a refund up by our refund number; NotFound if the provider never saw it.

        ``expected`` is the refund as we sent it (some providers need the
        charge's id to find it); one for another amount is Mismatch. An
        adapter whose provider cannot look refunds up answers Unknown.
        """
        return Unknown("refund_query_not_supported")

    def order_expires_at(self, created_at: datetime) -> datetime | None:
        """When an unpaid order for a payment created at ``created_at`` (naive UTC) can no longer be paid.

        None (the default): the provider's charges do not wait for a payer, nothing expires.
        """
        return None

    def expire(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """Close an unpaid order past its expiry at the provider, then say what it is now.

        Failed only once the provider confirms nothing can be paid any more;
        Succeeded if it was paid meanwhile; Unknown when that cannot be told.
        Only called where ``order_expires_at`` is not None.
        """
        raise NotImplementedError

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """The settlement file for ``day`` (YYYY-MM-DD), streamed: its bytes exactly as served, in chunks.

        Raises ProviderUnavailable when there is no file to be had, and also
        while iterating if the transfer breaks off (a partial file is never
        passed on as a whole one). Parsing is ``payments.providers.settlement``'s job.
        """
        raise NotImplementedError

    def parse_fetched(self, body: bytes) -> CallbackEvent:
        """Read an event paysync fetched itself from the provider's API (a row with source ``api``).

        Such a row was written by our own job from an authenticated API answer,
        never by the gateway, so there is no delivery signature to check. Raise
        MalformedCallback if it is not an event, EventIgnored if it is not ours.
        """
        from payments.errors import MalformedCallback

        raise MalformedCallback(f"provider {self.name} has no fetched events")

    def peek_callback(self, body: bytes) -> dict[str, str | None]:
        """Best-effort, unverified index fields (event id, our reference) for the raw row; never raises."""
        return {}

    def ack(self) -> HttpAnswer:
        """The answer that tells the provider the notification was received."""
        return HttpAnswer('{"received": true}')

    def reject(self, error: CallbackRejected) -> HttpAnswer:
        """The answer to a notification we refuse (it stays stored with status 3)."""
        import json

        return HttpAnswer(json.dumps({"error": {"code": error.code, "message": str(error)}}), error.http_status)


def api_session(base_url: str) -> requests.Session:
    """A ``requests.Session`` for one provider API at ``base_url``, with the environment read once, here.

    With ``trust_env`` on, requests looks up the proxy variables (NO_PROXY
    included), ``~/.netrc`` and the CA bundle variables on every request:
    about 0.13–0.22 ms of CPU per provider call on the development machine. An
    adapter talks to one host, so its proxies are resolved for that host once
    and the CA bundle variable is read once; ``.netrc`` never holds a
    provider's credentials (every adapter sends its own).
    """
    session = requests.Session()
    session.proxies = requests.utils.get_environ_proxies(base_url)
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        session.verify = bundle
    session.trust_env = False
    return session
