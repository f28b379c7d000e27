"""The one interface every payment provider adapter implements.

Inbound: ``parse_callback`` verifies and reads a notification (pure), and
``ack`` / ``reject`` answer in the provider's own dialect.
Outbound: ``charge``, ``query``, ``refund`` and ``settlement`` return one of
Succeeded | Failed | Pending | Unknown. Only an explicit decline is Failed;
a timeout, a reset connection, a 5xx, a 429 or an unreadable body is Unknown
(DESIGN.md invariant 5).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from payments.errors import CallbackRejected, PaysyncError
from payments.states import PaymentStatus


@dataclass(frozen=True)
class Capabilities:
    """What an adapter's provider can do; decides what may be retried automatically."""

    idempotency_keys: bool = False
    """Re-sending a charge with the same key cannot charge twice."""
    query_by_merchant_id: bool = False
    """A charge can be looked up by our payment_id."""

    @property
    def safe_to_resend(self) -> bool:
        """An ambiguous charge may be sent again only if the provider dedupes it or we can look first."""
        return self.idempotency_keys or self.query_by_merchant_id


@dataclass(frozen=True)
class CallbackEvent:
    """A verified notification, reduced to what processing needs."""

    provider: str
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
    """What one HTTP exchange looked like, for the provider_call row (no secrets: see ``payments.logs.scrub``)."""

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


@dataclass(frozen=True)
class Pending:
    """The provider accepted the request and has not finished it."""

    provider_transaction_id: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict)
    evidence: Evidence | None = None


AMOUNT_MISMATCH = "answer_for_another_amount"
"""Unknown reason every adapter uses when the provider's charge for our number has another amount or currency."""


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


Outcome = Succeeded | Failed | Pending | Unknown
QueryOutcome = Succeeded | Failed | Pending | Unknown | NotFound


@dataclass(frozen=True)
class ChargeRequest:
    """What a charge sends: our business number and the money."""

    payment_id: str
    amount_minor: int
    currency: str


@dataclass(frozen=True)
class RefundRequest:
    """What a refund sends: our refund number, the provider's charge id and the amount."""

    refund_id: str
    payment_id: str
    provider_transaction_id: str
    amount_minor: int
    currency: str


class ProviderUnavailable(PaysyncError):
    """A provider call that returns data (a settlement file) got no usable answer; try again later."""

    code = "provider_unavailable"


@dataclass(frozen=True)
class HttpAnswer:
    """A response in the provider's dialect: body, status, content type."""

    body: str
    status: int = 200
    content_type: str = "application/json"


class Provider:
    """Base class for adapters. Subclasses set ``name``, ``capabilities`` and ``callback_headers``."""

    name: str = ""
    capabilities: Capabilities = Capabilities()
    callback_headers: tuple[str, ...] = ()
    """Request headers stored with each raw callback (needed to re-verify it later)."""

    def parse_callback(self, body: bytes, headers: Mapping[str, str], now: float) -> CallbackEvent:
        """Verify and read one notification; raise CallbackRejected (status 3) if it is not genuine or not readable."""
        raise NotImplementedError

    def charge(self, payment: ChargeRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Ask the provider to charge; never raises for network trouble (that is Unknown)."""
        raise NotImplementedError

    def query(self, payment_id: str, timeout: float, expected: ChargeRequest | None = None) -> QueryOutcome:
        """Look a charge up by our business number; NotFound if the provider never saw it.

        With ``expected``, a charge for another amount or currency is
        Unknown("answer_for_another_amount"), never applied as ours.
        """
        raise NotImplementedError

    def refund(self, request: RefundRequest, idempotency_key: str | None, timeout: float) -> Outcome:
        """Ask the provider to refund (part of) a charge."""
        raise NotImplementedError

    def settlement(self, day: str, timeout: float) -> Iterator[bytes]:
        """The settlement file for ``day`` (YYYY-MM-DD), streamed: its bytes exactly as served, in chunks.

        Raises ProviderUnavailable when there is no file to be had, and also
        while iterating if the transfer breaks off (a partial file is never
        passed on as a whole one). Parsing is ``payments.settlement``'s job.
        """
        raise NotImplementedError

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
