"""``payments.outbound.query_schedule``: the query schedule is fast at first, backs off, is capped, and keeps within the
rate."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.outbound.query_schedule import QUERY_SHARE, query_delay, query_delay_seconds
from tests.support import make_settings

attempts = st.integers(min_value=1, max_value=200)
seconds = st.floats(min_value=0.001, max_value=86400, allow_nan=False)
rates = st.floats(min_value=0.1, max_value=1_000_000, allow_nan=False)
backlogs = st.integers(min_value=1, max_value=1_000_000)
jitters = st.floats(min_value=0.0, max_value=1.0)


@given(attempts, seconds, seconds, rates, backlogs, jitters)
def test_each_query_waits_at_least_as_long_as_the_one_before(attempt, base, cap, rate, backlog, jitter):
    args = {"base": base, "cap": cap, "rate_limit": rate, "backlog": backlog, "jitter": jitter}
    assert query_delay_seconds(attempt + 1, **args) >= query_delay_seconds(attempt, **args)


@given(attempts, seconds, seconds, rates, backlogs, jitters)
def test_a_delay_never_passes_the_cap_unless_the_rate_limit_asks_for_more(attempt, base, cap, rate, backlog, jitter):
    delay = query_delay_seconds(attempt, base=base, cap=cap, rate_limit=rate, backlog=backlog, jitter=jitter)
    spacing = backlog / (QUERY_SHARE * rate)
    assert delay <= max(cap, spacing) * (1 + 1e-12)
    assert delay >= min(base, cap) / 2


@given(attempts, seconds, seconds, rates, backlogs, jitters)
def test_a_providers_backlog_together_asks_for_no_more_than_its_share_of_the_rate_limit(
    attempt, base, cap, rate, backlog, jitter
):
    # ``backlog`` payments each queried once per delay: backlog / delay queries a second, at most the share.
    delay = query_delay_seconds(attempt, base=base, cap=cap, rate_limit=rate, backlog=backlog, jitter=jitter)
    assert backlog / delay <= QUERY_SHARE * rate * (1 + 1e-9)


@given(attempts, seconds, seconds, rates, backlogs, jitters, st.floats(min_value=0, max_value=86400))
def test_a_known_settling_moment_brings_the_query_forward_within_the_rate(
    attempt, base, cap, rate, backlog, jitter, settles_in
):
    args = {"base": base, "cap": cap, "rate_limit": rate, "backlog": backlog, "jitter": jitter}
    plain = query_delay_seconds(attempt, **args)
    sooner = query_delay_seconds(attempt, **args, settles_in=settles_in)
    assert sooner <= plain
    assert sooner >= backlog / (QUERY_SHARE * rate) and backlog / sooner <= QUERY_SHARE * rate * (1 + 1e-9)
    assert sooner == plain or sooner == pytest.approx(max(settles_in, backlog / (QUERY_SHARE * rate)))


def test_an_order_closable_in_3_s_is_queried_then_not_after_its_backoff():
    assert query_delay_seconds(6, base=2, cap=600, rate_limit=50, jitter=0.5, settles_in=3.0) == 3.0
    assert query_delay_seconds(1, base=2, cap=600, rate_limit=50, jitter=1.0, settles_in=30.0) == 2.0


@given(seconds, rates, jitters)
def test_the_first_query_comes_within_the_base_delay(base, rate, jitter):
    # One payment on a provider with room to spare: the first query is no later than QUERY_BASE_SECONDS.
    cap = base * 100
    delay = query_delay_seconds(1, base=base, cap=cap, rate_limit=max(rate, 4 / base), jitter=jitter)
    assert base / 2 <= delay <= base


def test_it_doubles_up_to_the_cap():
    lows = [query_delay_seconds(n, base=1, cap=10, rate_limit=100, jitter=0) for n in range(1, 7)]
    highs = [query_delay_seconds(n, base=1, cap=10, rate_limit=100, jitter=1) for n in range(1, 7)]
    assert lows == [0.5, 1, 2, 4, 5, 5]
    assert highs == [1, 2, 4, 8, 10, 10]


def test_a_crowded_provider_spaces_its_queries_out():
    # 1,000 unresolved payments on a provider allowing 50 calls a second: each is asked every 40 s, not every 1 s.
    assert query_delay_seconds(1, base=1, cap=10, rate_limit=50, backlog=1000, jitter=0) == pytest.approx(40.0)


@pytest.mark.parametrize(
    "bad",
    [{"attempt": 0}, {"jitter": 1.5}, {"jitter": -0.1}, {"base": 0}, {"rate_limit": 0}, {"backlog": 0}],
)
def test_it_refuses_arguments_outside_its_domain(bad):
    args = {"attempt": 1, "base": 1.0, "cap": 10.0, "rate_limit": 50.0, "backlog": 1, "jitter": 0.5, **bad}
    attempt = args.pop("attempt")
    with pytest.raises(ValueError):
        query_delay_seconds(attempt, **args)


def test_query_delay_reads_the_settings_and_jitters():
    settings = replace(make_settings(), query_base_seconds=2.0, query_max_seconds=600.0, provider_rate_limit=50.0)
    delays = {round(query_delay(settings, 3, rng=random.Random(seed)), 6) for seed in range(20)}
    assert all(4.0 <= d <= 8.0 for d in delays) and len(delays) > 10
    assert query_delay(settings, 0, rng=random.Random(1)) <= 2.0, "attempt 0 is treated as the first"
