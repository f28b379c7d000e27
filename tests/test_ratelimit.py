"""payments.infra.ratelimit: per-source token buckets, pure apart from the clock (a fake one here)."""

from __future__ import annotations

import threading

from payments.infra.ratelimit import SourceLimiter, source_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_source_gets_its_burst_then_the_rate():
    clock = Clock()
    limiter = SourceLimiter(2.0, 5, clock=clock)
    assert [limiter.allow("203.0.113.7") for _ in range(6)] == [True] * 5 + [False]
    clock.now += 0.49
    assert not limiter.allow("203.0.113.7")  # not yet a whole token back
    clock.now += 0.02
    assert limiter.allow("203.0.113.7") and not limiter.allow("203.0.113.7")
    clock.now += 3600
    assert sum(limiter.allow("203.0.113.7") for _ in range(10)) == 5  # refilled to the burst, no further


def test_sources_are_held_apart_and_ipv6_by_its_64():
    limiter = SourceLimiter(0.001, 1, clock=Clock())
    assert limiter.allow("203.0.113.7") and not limiter.allow("203.0.113.7")
    assert limiter.allow("203.0.113.8")
    assert limiter.allow("2001:db8:0:1::1") and not limiter.allow("2001:db8:0:1:ffff::2")
    assert limiter.allow("2001:db8:0:2::1")
    assert source_key("::ffff:203.0.113.7") == "203.0.113.7"
    assert source_key("2001:db8:0:1:2:3:4:5") == "2001:db8:0:1::/64"
    assert source_key(None) == "-" and source_key("garbage") == "garbage"


def test_rate_zero_is_no_limit_and_the_table_of_sources_is_bounded():
    assert all(SourceLimiter(0, 1).allow("203.0.113.7") for _ in range(1000))
    limiter = SourceLimiter(0.001, 1, max_sources=100, clock=Clock())
    for n in range(1000):
        limiter.allow(f"10.0.{n // 256}.{n % 256}")
    assert len(limiter._buckets) == 100


def test_concurrent_callers_never_get_more_than_the_burst():
    limiter = SourceLimiter(0.001, 50, clock=Clock())
    got: list[bool] = []
    lock = threading.Lock()

    def hammer() -> None:
        mine = [limiter.allow("198.51.100.1") for _ in range(100)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(got) == 50
