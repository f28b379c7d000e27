"""Per-source rate limits of the callback routes: token buckets keyed by client address, in memory.

One ``SourceLimiter`` per gateway worker process: a limit shared through the
database would cost a round trip per request, which is the very load a flood
is meant to cause. So the limits hold per worker (a deployment with G
gateways of W workers lets a source through at up to G x W times the rate),
which is how a proxy's own limits (nginx ``limit_req``) behave too.

Keys: an IPv4 address as it is; an IPv6 address by its /64, the block one
host is given, so that walking the addresses of its own /64 gains a flooder
nothing. The table of buckets is bounded (least recently seen forgotten
first), so a flood from many addresses costs bounded memory.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_SOURCES = 10_000
"""Buckets kept at once; past it the least recently seen source is forgotten (it starts again full)."""


def source_key(address: str | None) -> str:
    """The bucket key of a client address: IPv4 as is, IPv6 as its /64, anything unreadable as given (64 chars)."""
    if not address:
        return "-"
    try:
        parsed = ipaddress.ip_address(address.strip().split("%", 1)[0])
    except ValueError:
        return address[:64]
    if isinstance(parsed, ipaddress.IPv6Address):
        if parsed.ipv4_mapped is not None:
            return str(parsed.ipv4_mapped)
        return str(ipaddress.IPv6Network((parsed, 64), strict=False))
    return str(parsed)


class SourceLimiter:
    """Token buckets of ``burst`` tokens refilled at ``rate`` a second, one per source; thread-safe.

    ``rate`` 0 switches the limit off (every call allowed).
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        max_sources: int = MAX_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        self.max_sources = max_sources
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def allow(self, address: str | None) -> bool:
        """Take one token from the source's bucket: True if there was one (the request may go on)."""
        if self.rate <= 0:
            return True
        key = source_key(address)
        now = self.clock()
        with self._lock:
            tokens, then = self._buckets.pop(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - then) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_sources:
                self._buckets.popitem(last=False)
        return allowed

    def retry_after(self) -> int:
        """Whole seconds until a drained bucket holds a token again (for the Retry-After header)."""
        return max(1, int(1 / self.rate + 0.999)) if self.rate > 0 else 1
