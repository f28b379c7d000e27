"""A small token bucket so a sweep never floods the database or a provider."""

from __future__ import annotations

import time
from collections.abc import Callable


class RateLimiter:
    """Allow at most ``rate`` acquisitions per second, with bursts up to ``burst``."""

    def __init__(
        self,
        rate: float,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate / 10)
        self._tokens = self.burst
        self._clock = clock
        self._sleep = sleep
        self._last = clock()

    def acquire(self) -> None:
        """Take one token, sleeping until one is available."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens < 1:
            wait = (1 - self._tokens) / self.rate
            self._sleep(wait)
            self._tokens = 1.0
            self._last = self._clock()
        self._tokens -= 1
