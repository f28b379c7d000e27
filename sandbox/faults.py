"""Fault injection: the knobs, their validation, and the seeded dice that decide each request's fate.

Pure standard library (``sandbox.config`` validates ``SANDBOX_FAULTS`` with
``parse_faults``). Every request draws the same number of random values in
the same order whatever the knobs say, so two runs with one seed and the same
sequence of requests get the same outcomes; webhook signature faults are drawn
from a per-event seed, so the order in which delivery threads run does not
change them either.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import asdict, dataclass, fields
from typing import Any

RATES = (
    "decline_rate",
    "error_5xx_rate",
    "timeout_after_commit_rate",
    "processing_rate",
    "drop_rate",
    "duplicate_rate",
    "delay_rate",
    "reorder_rate",
    "bad_signature_rate",
)
"""Knobs that are probabilities in [0, 1]."""

DURATIONS = {"hang_seconds": 600.0, "processing_seconds": 3600.0, "delay_seconds": 3600.0, "latency_ms": 60_000.0}
"""Knobs that are non-negative numbers, with their upper bounds."""


@dataclass(frozen=True)
class Faults:
    """The fault configuration in force. All rates default to 0: a well-behaved platform."""

    decline_rate: float = 0.0
    """Share of charges that fail with failure_code "card_declined"."""
    error_5xx_rate: float = 0.0
    """Share of charge/refund requests answered 503 before anything is done."""
    timeout_after_commit_rate: float = 0.0
    """Share of charges/refunds made and committed whose reply is then held for hang_seconds."""
    hang_seconds: float = 3.0
    """How long a timeout-after-commit reply is held."""
    processing_rate: float = 0.0
    """Share of charges/refunds answered "processing" and completed processing_seconds later."""
    processing_seconds: float = 2.0
    """Delay before a "processing" charge or refund completes by itself."""
    latency_ms: float = 0.0
    """Added to every /v1 API call."""
    drop_rate: float = 0.0
    """Share of webhook events never delivered."""
    duplicate_rate: float = 0.0
    """Share of webhook events delivered a second time after the first successful delivery."""
    delay_rate: float = 0.0
    """Share of webhook events whose first attempt waits delay_seconds."""
    delay_seconds: float = 5.0
    """The delay applied to delayed events."""
    reorder_rate: float = 0.0
    """Share of webhook events held back until a later event has been sent."""
    bad_signature_rate: float = 0.0
    """Share of delivery attempts signed with a wrong secret."""
    seed: int | None = None
    """Seed of the dice; None draws from the operating system."""

    def to_dict(self) -> dict[str, Any]:
        """The knobs as a JSON-ready dict."""
        return asdict(self)


KNOBS = tuple(f.name for f in fields(Faults))
"""Every accepted key, in declaration order."""


def parse_faults(raw: str | dict[str, Any] | None, base: Faults | None = None) -> Faults:
    """Validate a JSON object (text or decoded) of knobs over ``base``; raise ValueError naming the bad key."""
    if raw is None or raw == "":
        return base or Faults()
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"not valid JSON ({exc.msg})") from None
    if not isinstance(raw, dict):
        raise ValueError("must be a JSON object of fault knobs")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in KNOBS:
            raise ValueError(f"unknown fault knob {str(key)[:40]!r} (known: {', '.join(KNOBS)})")
        values[key] = _check(key, value)
    return Faults(**{**(base or Faults()).to_dict(), **values})


def _check(key: str, value: Any) -> Any:
    if key == "seed":
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError("seed must be an integer or null")
        return value
    # bool is an int subclass: "true" must not silently mean a rate of 1.
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ValueError(f"{key} must be a number")
    upper = 1.0 if key in RATES else DURATIONS[key]
    if not 0 <= value <= upper:
        raise ValueError(f"{key} must be between 0 and {upper:g}, got {value}")
    return float(value)


@dataclass(frozen=True)
class WebhookPlan:
    """What happens to the webhook event of one charge or refund."""

    drop: bool = False
    duplicate: bool = False
    delay_seconds: float = 0.0
    reorder: bool = False
    signature_seed: int = 0
    """Seeds the per-attempt bad-signature dice (see ``bad_signature``)."""


@dataclass(frozen=True)
class Plan:
    """The fate of one charge or refund request, decided once when it arrives."""

    error_5xx: bool = False
    decline: bool = False
    processing: bool = False
    hang: bool = False
    processing_seconds: float = 0.0
    """How long a processing charge or refund takes (the knob's value when the dice were rolled)."""
    webhook: WebhookPlan = WebhookPlan()


class Dice:
    """A seeded random.Random under a lock, turning the knobs into Plans."""

    def __init__(self, faults: Faults) -> None:
        self._lock = threading.Lock()
        self._faults = faults
        self._rng = random.Random(faults.seed)  # noqa: S311 - simulation, not security

    @property
    def faults(self) -> Faults:
        """The knobs in force."""
        return self._faults

    def configure(self, faults: Faults) -> None:
        """Install new knobs and re-seed (from the OS when the seed is None)."""
        with self._lock:
            self._faults = faults
            self._rng = random.Random(faults.seed)  # noqa: S311

    def plan(self) -> Plan:
        """Roll the dice for one request. Always 9 draws, so seeded runs stay aligned whatever the knobs."""
        with self._lock:
            f = self._faults
            r = [self._rng.random() for _ in range(8)]
            signature_seed = self._rng.getrandbits(63)
        return Plan(
            error_5xx=r[0] < f.error_5xx_rate,
            decline=r[1] < f.decline_rate,
            processing=r[2] < f.processing_rate,
            hang=r[3] < f.timeout_after_commit_rate,
            processing_seconds=f.processing_seconds,
            webhook=WebhookPlan(
                drop=r[4] < f.drop_rate,
                duplicate=r[5] < f.duplicate_rate,
                delay_seconds=f.delay_seconds if r[6] < f.delay_rate else 0.0,
                reorder=r[7] < f.reorder_rate,
                signature_seed=signature_seed,
            ),
        )


def bad_signature(signature_seed: int, attempt: int, rate: float) -> bool:
    """Whether delivery attempt ``attempt`` of an event is signed with a wrong secret (deterministic)."""
    if rate <= 0:
        return False
    return random.Random(signature_seed * 1000 + attempt).random() < rate  # noqa: S311
