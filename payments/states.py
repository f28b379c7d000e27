"""Every status column's values, and the payment (and refund) state machine.

One enum per status column: ``PaymentStatus`` (payment.status and
refund.status, with the state machine below), ``CallbackStatus``
(payment_callback_log.status), ``OutboxStatus`` (outbox.status),
``DeliveryStatus`` (event_delivery.status), ``ReviewStatus``
(manual_review.status), ``AlertStatus`` (alert.status),
``NotificationStatus`` (alert_notification.status), ``BreakerState``
(provider_breaker.state), ``SettlementFileStatus`` (settlement_file.status)
and ``ReconciliationRunStatus`` (reconciliation_run.status). Nothing else
spells those values out.

The state machine, one transition table and pure functions:

    Created ──▶ Pending ──▶ Succeeded
                   │   ╲
                   │    ▶ Failed
                   ▼        ▲
                Unknown ────┘──▶ Succeeded

Succeeded and Failed are terminal. Every status change in paysync is
``decide(current, report)`` followed by a guarded ``UPDATE … WHERE status =
current``; nothing else writes the status column.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, StrEnum


class PaymentStatus(StrEnum):
    """Status of a payment or a refund."""

    CREATED = "Created"
    """Row written, not yet sent to the provider."""
    PENDING = "Pending"
    """Sent (or about to be); the provider has not given a final answer."""
    SUCCEEDED = "Succeeded"
    """The provider said definitively that the money moved."""
    FAILED = "Failed"
    """The provider said definitively that it did not and will not."""
    UNKNOWN = "Unknown"
    """Timeout, dropped connection or unreadable answer: must be queried, never assumed."""


class CallbackStatus(IntEnum):
    """Status of a raw callback row (payment_callback_log.status)."""

    PENDING = 0
    """Stored, not processed yet."""
    PROCESSED = 1
    """Applied (or recognised as a duplicate or a conflict for review)."""
    FAILED = 2
    """Processing raised; will be retried at next_retry_at."""
    REJECTED = 3
    """Signature or parse failure: kept for audit, never retried automatically."""
    GAVE_UP = 4
    """Retries exhausted: in the manual queue."""


CALLBACK_RETRYABLE = (CallbackStatus.PENDING, CallbackStatus.FAILED)
"""Callback statuses the consumer and the sweep still work on."""


class OutboxStatus(IntEnum):
    """Status of an outbox row (outbox.status)."""

    PENDING = 0
    """Due at next_attempt_at."""
    DONE = 1
    """Sent and its effect recorded."""
    DEAD = 2
    """Given up: in the manual queue."""


class DeliveryStatus(IntEnum):
    """Status of one domain event at one destination (event_delivery.status)."""

    PENDING = 0
    """Not delivered yet; due at next_attempt_at."""
    DELIVERED = 1
    """The destination has the event (broker confirm, or a 2xx)."""
    GAVE_UP = 2
    """Retries exhausted or deadline passed (or a permanent refusal): in the manual queue."""


class ReviewStatus(StrEnum):
    """Status of a manual review item (manual_review.status)."""

    OPEN = "open"
    RESOLVED = "resolved"


class AlertStatus(StrEnum):
    """Status of an alert (alert.status)."""

    PENDING = "pending"
    """Condition seen, not for long enough yet."""
    FIRING = "firing"
    RESOLVED = "resolved"


class NotificationStatus(StrEnum):
    """Status of one notification of one alert on one channel (alert_notification.status)."""

    HELD = "held"
    """A resolved notice waiting for its alert to clear."""
    PENDING = "pending"
    """Due at next_attempt_at."""
    SENT = "sent"
    """The channel took it."""
    GAVE_UP = "gave_up"
    """Retries exhausted, or the channel said the request itself is wrong (alert_channel_failing fired)."""
    CANCELLED = "cancelled"
    """Nobody needs to hear it now (the alert resolved first, or this channel was never told it fired)."""


class BreakerState(StrEnum):
    """State of a provider's circuit breaker (provider_breaker.state)."""

    CLOSED = "closed"
    OPEN = "open"


class SettlementFileStatus(StrEnum):
    """Status of an imported settlement file (settlement_file.status)."""

    IMPORTING = "importing"
    """Registered; its lines are being stored (a crashed import resumes where it stopped)."""
    IMPORTED = "imported"
    """Every record stored."""


class ReconciliationRunStatus(StrEnum):
    """Status of one reconciliation of a provider's day (reconciliation_run.status)."""

    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    """Stopped by an error (reconciliation_run.error says which); re-running the day is safe."""


TERMINAL = frozenset({PaymentStatus.SUCCEEDED, PaymentStatus.FAILED})
"""States nothing may leave."""

TRANSITIONS: dict[PaymentStatus, frozenset[PaymentStatus]] = {
    PaymentStatus.CREATED: frozenset({PaymentStatus.PENDING}),
    PaymentStatus.PENDING: frozenset({PaymentStatus.SUCCEEDED, PaymentStatus.FAILED, PaymentStatus.UNKNOWN}),
    PaymentStatus.UNKNOWN: frozenset({PaymentStatus.SUCCEEDED, PaymentStatus.FAILED}),
    PaymentStatus.SUCCEEDED: frozenset(),
    PaymentStatus.FAILED: frozenset(),
}
"""The only allowed single steps (docs/design.md section 4, invariant 4)."""


class Verdict(StrEnum):
    """What to do with a report."""

    APPLY = "apply"
    NOOP = "noop"
    CONFLICT = "conflict"


@dataclass(frozen=True)
class Decision:
    """The outcome of ``decide``: a verdict, the states to walk, and why."""

    verdict: Verdict
    path: tuple[PaymentStatus, ...]
    reason: str

    @property
    def target(self) -> PaymentStatus | None:
        """The final state when applied, else None."""
        return self.path[-1] if self.path else None


@dataclass(frozen=True)
class StatusChange:
    """One applied transition of a payment or a refund, as the ledger and the merchant's events see it."""

    kind: str
    """"payment" or "refund"."""
    reference: str
    """The payment_id or the refund_id."""
    payment_id: str
    provider: str
    amount_minor: int
    currency: str
    previous: PaymentStatus
    target: PaymentStatus
    path: tuple[PaymentStatus, ...]
    source: str
    """What caused it: callback:<id>, call:<id> or query:<id>."""


def is_allowed(source: PaymentStatus, target: PaymentStatus) -> bool:
    """True when ``source → target`` is one allowed step."""
    return target in TRANSITIONS[source]


def decide(current: PaymentStatus, report: PaymentStatus) -> Decision:
    """Decide what a report (from a callback, a call or a query) does to a payment in ``current``.

    A report never skips a state: a success for a Created payment walks
    Created → Pending → Succeeded. A terminal state is never left; a report
    that contradicts it is a CONFLICT for a human, a stale one is a NOOP.
    """
    current = PaymentStatus(current)
    report = PaymentStatus(report)
    if report == current:
        return Decision(Verdict.NOOP, (), f"already {current.value}")
    if current in TERMINAL:
        if report in TERMINAL:
            return Decision(Verdict.CONFLICT, (), f"provider reports {report.value} but payment is {current.value}")
        return Decision(Verdict.NOOP, (), f"stale report {report.value}: payment is already {current.value}")
    if report == PaymentStatus.CREATED:
        return Decision(Verdict.NOOP, (), f"report {report.value} carries no news for {current.value}")
    path: list[PaymentStatus] = []
    state = current
    if state == PaymentStatus.CREATED:
        path.append(PaymentStatus.PENDING)
        state = PaymentStatus.PENDING
    if state == report:
        return Decision(Verdict.APPLY, tuple(path), f"{current.value} -> {report.value}")
    if not is_allowed(state, report):
        # Unknown -> Pending: the provider is still working, which we already treat as unresolved.
        return Decision(Verdict.NOOP, (), f"{state.value} does not move on report {report.value}")
    path.append(report)
    return Decision(Verdict.APPLY, tuple(path), f"{current.value} -> {' -> '.join(s.value for s in path)}")
