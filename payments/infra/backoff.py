"""Retry timing: exponential backoff with jitter, as one pure function."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one unit of work."""

    max_retries: int = 10
    """Failed attempts before giving up into the manual queue."""
    base_seconds: float = 2.0
    """Delay after the first failure (before jitter)."""
    max_seconds: float = 3600.0
    """Cap on one delay."""

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        return compute_backoff(attempt, self.base_seconds, self.max_seconds, rng)

    def exhausted(self, attempts: int) -> bool:
        """True when ``attempts`` failures mean we stop retrying."""
        return attempts >= self.max_retries


def compute_backoff(attempt: int, base: float, cap: float, rng: random.Random | None = None) -> float:
    """Exponential backoff with "equal jitter": a delay in [d/2, d], d = min(cap, base * 2**(attempt-1)).

    The lower half is fixed so delays grow with every attempt; the upper half
    is random so a crowd of failed rows does not come back in lockstep.
    """
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    exp = min(attempt - 1, 62)  # keeps 2**exp a finite float for absurd attempt counts
    ceiling = min(cap, base * (2.0**exp))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)
