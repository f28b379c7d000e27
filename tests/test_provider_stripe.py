"""The Stripe adapter against the fake Stripe platform over HTTP: credentials, keys, outcomes, lookups.

Every call goes over a real socket to ``sandbox.fakes.stripe``, which checks
our secret key and applies Stripe's idempotency rules (replay, 400 on other
parameters, 409 in flight, keys forgotten after 24 hours on its own clock).
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import requests

from payments.providers.base import (
    AMOUNT_MISMATCH,
    Failed,
    Mismatch,
    NotFound,
    Pending,
    ProviderUnavailable,
    RefundRequest,
    Succeeded,
    Unknown,
)
from payments.providers.settlement import checked
from payments.providers.stripe.adapter import API_VERSION, EVENT_TYPES, StripeProvider, successor_key
from payments.providers.stripe.bill import read_settlement
from sandbox.fakes.stripe import IdempotencyRecord
from tests.stripe_support import API_KEY, OLD_SECRET, FakeServer, charge_request, new_fake
from tests.support import ROOT, env_for, free_port, wait_for_port

TIMEOUT = 10.0
"""For calls that should get an answer: generous, so a loaded machine does not turn answers into timeouts."""
SHORT = 1.5
"""For calls the fake holds (hang, timeout_after_commit): shorter than its hold, longer than any real answer."""
DAY = 86400


@pytest.fixture
def served():
    server = FakeServer(new_fake())
    server.platform.faults.hang_seconds = 4.0
    yield server
    server.close()


@pytest.fixture
def fake(served):
    return served.platform


@pytest.fixture
def stripe(served):
    return StripeProvider(API_KEY, (OLD_SECRET,), served.url)


def posts(fake, path="/v1/payment_intents"):
    return [r for r in fake.requests if r["method"] == "POST" and r["path"] == path]


# --------------------------------------------------------------------------------------------- charges


def test_a_charge_is_one_confirmed_payment_intent_sent_with_our_key_version_and_idempotency_key(stripe, fake):
    outcome = stripe.charge(charge_request(), "merchant-key-1", TIMEOUT)

    assert isinstance(outcome, Succeeded)
    ((pi_id, pi),) = fake.payment_intents.items()
    assert outcome.provider_transaction_id == pi_id and pi["status"] == "succeeded"
    (sent,) = posts(fake)
    assert sent["auth_ok"] and sent["stripe_version"] == API_VERSION and sent["idempotency_key"] == "merchant-key-1"
    params = sent["params"]
    assert params["metadata"] == {"payment_id": "pay_1"}
    assert (params["amount"], params["currency"], params["confirm"]) == ("1000", "usd", "true")
    assert (params["payment_method"], params["error_on_requires_action"]) == ("pm_card_visa", "true")
    assert params["automatic_payment_methods"] == {"enabled": "true", "allow_redirects": "never"}
    assert outcome.evidence.http_status == 200
    assert "_secret_" not in outcome.evidence.response and "client_secret" not in outcome.raw


def test_a_zero_decimal_charge_is_sent_in_whole_yen(stripe, fake):
    assert isinstance(stripe.charge(charge_request(amount=500, currency="JPY"), "k-jpy", TIMEOUT), Succeeded)
    (pi,) = fake.payment_intents.values()
    assert (pi["amount"], pi["currency"]) == (500, "jpy")


def test_a_wrong_secret_key_is_refused_by_the_platform_and_is_our_configuration_not_a_decline(served, fake):
    wrong = StripeProvider("sk_test_" + "x" * 32, (OLD_SECRET,), served.url)
    outcome = wrong.charge(charge_request(), "k", TIMEOUT)
    assert isinstance(outcome, Failed) and not outcome.definitive
    assert fake.requests[-1]["auth_ok"] is False and not fake.payment_intents


def test_the_same_key_replays_the_first_answer_and_never_makes_a_second_payment_intent(stripe, fake, served):
    first = stripe.charge(charge_request(), "k-same", TIMEOUT)
    second = stripe.charge(charge_request(), "k-same", TIMEOUT)
    assert first.provider_transaction_id == second.provider_transaction_id and len(fake.payment_intents) == 1
    # The platform says it replayed, as Stripe does.
    (sent,) = posts(fake)[:1]
    raw = requests.post(
        served.url + "/v1/payment_intents",
        data=_flat(sent["params"]),
        headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": "k-same"},
        timeout=5,
    )
    assert raw.headers["Idempotent-Replayed"] == "true" and raw.json()["id"] == first.provider_transaction_id


def test_the_same_key_with_other_parameters_is_an_idempotency_error_kept_unknown_for_review(stripe, fake):
    assert isinstance(stripe.charge(charge_request(amount=1000), "k-reused", TIMEOUT), Succeeded)
    outcome = stripe.charge(charge_request(amount=2000), "k-reused", TIMEOUT)
    assert isinstance(outcome, Unknown) and outcome.reason == "review:idempotency_error"
    assert len(fake.payment_intents) == 1


def test_a_key_still_in_flight_is_a_409_kept_unknown_for_review(stripe, fake):
    fake.idempotency["k-busy"] = IdempotencyRecord("/v1/payment_intents", {}, fake.clock.now())
    outcome = stripe.charge(charge_request(), "k-busy", TIMEOUT)
    assert isinstance(outcome, Unknown) and outcome.reason == "review:idempotency_conflict:idempotency_key_in_use"
    assert not fake.payment_intents


def test_a_decline_is_failed_and_the_payment_intent_is_cancelled_so_nothing_can_succeed_on_it_later(stripe, fake):
    outcome = stripe.charge(charge_request(pm="pm_card_chargeDeclinedInsufficientFunds"), "k-decline", TIMEOUT)
    assert isinstance(outcome, Failed) and outcome.definitive and outcome.code == "insufficient_funds"
    assert not outcome.refusal, "a card decline is the attempt's answer, replayed as such to a re-send"
    pi = fake.payment_intents[outcome.provider_transaction_id]
    assert (pi["status"], pi["cancellation_reason"]) == ("canceled", "abandoned")
    again = stripe.charge(charge_request(pm="pm_card_chargeDeclinedInsufficientFunds"), "k-decline", TIMEOUT)
    assert isinstance(again, Failed) and again.code == "insufficient_funds", "the replayed first answer"
    assert len(fake.payment_intents) == 1


def test_a_card_that_needs_3d_secure_is_declined_server_side_instead_of_waiting_for_the_customer(stripe, fake):
    outcome = stripe.charge(charge_request(pm="pm_card_authenticationRequired"), "k-3ds", TIMEOUT)
    assert isinstance(outcome, Failed) and outcome.code == "authentication_required"


def test_a_charge_without_a_payment_method_or_with_an_amount_stripe_cannot_take_is_refused_without_a_call(stripe, fake):
    assert stripe.charge(charge_request(pm=None), "k", TIMEOUT) == Failed("payment_method_required")
    assert stripe.charge(charge_request(amount=5124, currency="KWD"), "k", TIMEOUT) == Failed("amount_not_supported")
    assert fake.requests == []


def test_an_unknown_payment_method_is_refused_outright(stripe, fake):
    outcome = stripe.charge(charge_request(pm="pm_nobody"), "k-nobody", TIMEOUT)
    assert isinstance(outcome, Failed) and outcome.definitive and outcome.code == "resource_missing"
    assert outcome.refusal, "Stripe refused the request: on a re-send it says nothing about the first one"
    assert "k-nobody" not in fake.idempotency, "a validation error saves nothing under the key"


@pytest.mark.parametrize(
    ("fault", "reason", "charged"),
    [
        ("5xx", "http_503:api_error", False),
        ("rate_limit", "rate_limited", False),
        ("lock_timeout", "lock_timeout", False),
        ("hang", "timeout", False),
        ("timeout_after_commit", "timeout", True),
    ],
)
def test_ambiguous_answers_are_unknown_and_a_query_then_says_what_happened(stripe, fake, fault, reason, charged):
    fake.fail_next(fault, path="POST /v1/payment_intents")
    held = fault in ("hang", "timeout_after_commit")
    outcome = stripe.charge(charge_request(), "k-ambiguous", SHORT if held else TIMEOUT)
    assert isinstance(outcome, Unknown) and outcome.reason == reason

    found = stripe.query("pay_1", TIMEOUT, charge_request())
    if charged:
        assert isinstance(found, Succeeded) and found.provider_transaction_id in fake.payment_intents
    else:
        assert isinstance(found, NotFound)
    # Either way the same key may go again: it replays, or makes the one PaymentIntent.
    assert isinstance(stripe.charge(charge_request(), "k-ambiguous", TIMEOUT), Succeeded)
    assert len(fake.payment_intents) == 1


def test_an_api_error_is_saved_under_the_key_and_a_resend_looks_first_then_charges_under_the_next_key(stripe, fake):
    """Stripe replays a saved 500 for 24 hours: that key can never charge. A re-send sees the replay
    (``Idempotent-Replayed``), looks the payment up, and only when nothing is found sends the next key of a
    chain every worker derives alike (``successor_key``), so Stripe still dedupes concurrent re-sends."""
    fake.fail_next("api_error", path="POST /v1/payment_intents")
    assert stripe.charge(charge_request(), "k-500", TIMEOUT).reason == "http_500:api_error"
    assert isinstance(stripe.query("pay_1", TIMEOUT, charge_request()), NotFound)
    outcome = stripe.charge(charge_request(), "k-500", TIMEOUT)
    assert isinstance(outcome, Succeeded) and len(fake.payment_intents) == 1
    assert [r["idempotency_key"] for r in posts(fake)] == ["k-500", "k-500", successor_key("k-500", 1)]
    # Once more (a worker that lost the answer): the saved 500 again, the lookup finds the PaymentIntent.
    again = stripe.charge(charge_request(), "k-500", TIMEOUT)
    assert isinstance(again, Succeeded) and again.provider_transaction_id == outcome.provider_transaction_id
    assert len(fake.payment_intents) == 1 and len(posts(fake)) == 4


def test_a_chain_of_saved_api_errors_is_walked_and_a_failed_lookup_sends_nothing_new(stripe, fake):
    # Scripted faults also hit replays: the first send, its replay, then the first successor all answer 500.
    fake.fail_next("api_error", count=3, path="POST /v1/payment_intents")
    stripe.charge(charge_request(), "k-chain", TIMEOUT)  # k-chain saves a 500
    assert stripe.charge(charge_request(), "k-chain", TIMEOUT).reason == "http_500:api_error"  # so does k-chain~1
    fake.fail_next("5xx", path="GET /v1/payment_intents/search")
    blind = stripe.charge(charge_request(), "k-chain", TIMEOUT)
    assert blind.reason.startswith("lookup_after_saved_error") and not fake.payment_intents
    outcome = stripe.charge(charge_request(), "k-chain", TIMEOUT)
    assert isinstance(outcome, Succeeded) and len(fake.payment_intents) == 1
    assert posts(fake)[-1]["idempotency_key"] == successor_key("k-chain", 2)


# --------------------------------------------------------------------------------------------- 24 hours


def test_past_24_hours_the_same_key_sent_blind_makes_a_second_payment_intent_at_stripe(served, fake, stripe):
    """The hazard the adapter guards against, shown on the platform itself."""
    stripe.charge(charge_request(), "k-day", TIMEOUT)
    (sent,) = posts(fake)
    fake.clock.advance(DAY + 1)
    requests.post(
        served.url + "/v1/payment_intents",
        data=_flat(sent["params"]),
        headers={"Authorization": f"Bearer {API_KEY}", "Idempotency-Key": "k-day"},
        timeout=5,
    ).raise_for_status()
    assert len(fake.payment_intents) == 2


def test_past_24_hours_the_adapter_looks_first_and_finds_the_payment_intent_instead_of_making_another(stripe, fake):
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    assert isinstance(stripe.charge(charge_request(), "k-late", SHORT), Unknown)
    fake.clock.advance(DAY + 3600)  # Stripe has forgotten the key

    outcome = stripe.charge(charge_request(age=DAY + 3600), "k-late", TIMEOUT)

    assert isinstance(outcome, Succeeded) and len(fake.payment_intents) == 1
    assert len(posts(fake)) == 1, "nothing was sent: the lookup found it"
    assert any(r["path"] == "/v1/payment_intents/search" for r in fake.requests)


def test_past_24_hours_with_nothing_found_the_charge_is_sent_once(stripe, fake):
    outcome = stripe.charge(charge_request(age=2 * DAY), "k-old", TIMEOUT)
    assert isinstance(outcome, Succeeded) and len(fake.payment_intents) == 1
    paths = [r["path"] for r in fake.requests]
    assert (
        paths.index("/v1/payment_intents/search") < [i for i, r in enumerate(fake.requests) if r["method"] == "POST"][0]
    )


def test_past_24_hours_a_failed_lookup_sends_nothing(stripe, fake):
    fake.fail_next("5xx", path="GET /v1/payment_intents/search")
    outcome = stripe.charge(charge_request(age=2 * DAY), "k-old", TIMEOUT)
    assert isinstance(outcome, Unknown) and outcome.reason.startswith("lookup_before_resend:http_503")
    assert posts(fake) == []


def test_a_payment_intent_too_new_for_the_lagging_search_index_is_still_found_through_the_list(served, fake):
    fake.config.search_lag_seconds = 1800
    stripe = StripeProvider(API_KEY, (OLD_SECRET,), served.url)
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    stripe.charge(charge_request(), "k-lag", SHORT)
    assert fake.search_payment_intents({"query": "metadata['payment_id']:'pay_1'"})["data"] == [], "search lags"

    found = stripe.query("pay_1", TIMEOUT, charge_request())

    assert isinstance(found, Succeeded) and found.provider_transaction_id in fake.payment_intents


def test_the_lookup_reads_the_payment_intent_itself_not_the_stale_search_snapshot(served, fake):
    stripe = StripeProvider(API_KEY, (OLD_SECRET,), served.url, search_lag_seconds=0)
    assert isinstance(stripe.charge(charge_request(pm="pm_fake_processing"), "k-p", TIMEOUT), Pending)
    fake.clock.advance(60)
    fake.config.search_lag_seconds = 30
    (pi_id,) = fake.payment_intents
    fake.complete_payment_intent(pi_id)
    assert fake.search_payment_intents({"query": "metadata['payment_id']:'pay_1'"})["data"][0]["status"] == "processing"
    assert isinstance(stripe.query("pay_1", TIMEOUT, charge_request()), Succeeded)


# --------------------------------------------------------------------------------------------- a busy account

OTHERS = 10_000
"""Another integration's PaymentIntents created in the lookup's window: 2.3 a second for 70 minutes."""


def gets(fake):
    return [r for r in fake.requests if r["method"] == "GET"]


def test_a_lost_answer_is_settled_in_a_constant_number_of_calls_among_10000_other_payment_intents(stripe, fake):
    fake.fail_next("timeout_after_commit", path="POST /v1/payment_intents")
    assert isinstance(stripe.charge(charge_request(), "k-busy", SHORT), Unknown)
    fake.other_traffic(OTHERS)
    before = len(gets(fake))

    found = stripe.query("pay_1", TIMEOUT, charge_request(sent_ago=5))

    assert isinstance(found, Succeeded) and fake.payment_intents[found.provider_transaction_id]["metadata"] == {
        "payment_id": "pay_1"
    }
    assert len(gets(fake)) - before == 2, "search, then the PaymentIntent itself"


def test_past_24_hours_a_payment_stripe_never_saw_is_sent_once_among_10000_other_payment_intents(stripe, fake):
    fake.other_traffic(OTHERS)
    # The last send (2 hours ago) is older than the search index can lag: search's "none" is the answer.
    outcome = stripe.charge(charge_request(age=2 * DAY, sent_ago=7200), "k-old-busy", TIMEOUT)

    assert isinstance(outcome, Succeeded) and len(posts(fake)) == 1
    assert [r["path"] for r in gets(fake)] == ["/v1/payment_intents/search"]


def test_while_search_may_lag_a_busy_account_is_unknown_in_a_few_calls_and_settles_once_the_lag_has_passed(served):
    platform = served.platform
    platform.config.search_lag_seconds = 120
    offset = [0.0]
    stripe = StripeProvider(
        API_KEY, (OLD_SECRET,), served.url, search_lag_seconds=600, clock=lambda: time.time() + offset[0]
    )
    platform.other_traffic(OTHERS)
    request = charge_request(age=2 * DAY, sent_ago=0)  # its newest send just now: search may not show it yet

    early = stripe.charge(request, "k-lagging", TIMEOUT)
    assert isinstance(early, Unknown) and early.reason == "lookup_before_resend:search_may_lag"
    assert posts(platform) == [] and len(gets(platform)) <= 3

    offset[0] = platform.clock.offset = 600 + 2 * 600 + 60  # the lag and the clock margins have passed since then
    before = len(gets(platform))
    late = stripe.charge(request, "k-lagging", TIMEOUT)
    assert isinstance(late, Succeeded) and len(posts(platform)) == 1
    assert len(gets(platform)) - before == 1, "search alone"


def test_a_payment_intent_id_we_hold_is_read_directly(stripe, fake):
    charged = stripe.charge(charge_request(), "k-known", TIMEOUT)
    fake.other_traffic(OTHERS)
    before = len(gets(fake))

    found = stripe.query("pay_1", TIMEOUT, charge_request(provider_transaction_id=charged.provider_transaction_id))

    assert isinstance(found, Succeeded) and found.provider_transaction_id == charged.provider_transaction_id
    assert [r["path"] for r in gets(fake)[before:]] == [f"/v1/payment_intents/{charged.provider_transaction_id}"]


# --------------------------------------------------------------------------------------------- amount received


def test_a_succeeded_payment_intent_that_received_less_than_we_charged_is_a_mismatch_never_succeeded(stripe, fake):
    outcome = stripe.charge(charge_request(pm="pm_fake_partial_capture"), "k-partial", TIMEOUT)
    (pi,) = fake.payment_intents.values()
    assert pi["status"] == "succeeded" and pi["amount_received"] == 500

    assert isinstance(outcome, Mismatch) and outcome.reason == AMOUNT_MISMATCH
    assert isinstance(stripe.query("pay_1", TIMEOUT, charge_request()), Mismatch)
    assert isinstance(stripe.query("pay_1", TIMEOUT), Mismatch), "without what we expected, against its own amount"


# --------------------------------------------------------------------------------------------- queries


def test_a_query_finds_nothing_for_a_payment_stripe_never_saw(stripe, fake):
    assert isinstance(stripe.query("pay_unknown", TIMEOUT), NotFound)


def test_a_query_for_another_amount_is_never_taken_as_ours(stripe, fake):
    stripe.charge(charge_request(amount=1000), "k", TIMEOUT)
    other = stripe.query("pay_1", TIMEOUT, charge_request(amount=999))
    assert isinstance(other, Mismatch) and other.reason == AMOUNT_MISMATCH and other.provider_transaction_id


def test_two_payment_intents_for_one_payment_are_unknown_for_review(stripe, fake):
    stripe.charge(charge_request(), "k-a", TIMEOUT)
    stripe.charge(charge_request(), "k-b", TIMEOUT)
    assert stripe.query("pay_1", TIMEOUT, charge_request()).reason == "review:several_payment_intents"


def test_a_failed_query_is_unknown_never_a_decline(stripe, fake):
    for fault in ("5xx", "rate_limit", "hang"):
        fake.fail_next(fault, path="GET /v1/payment_intents/search")
        assert isinstance(stripe.query("pay_1", SHORT if fault == "hang" else TIMEOUT), Unknown)


# --------------------------------------------------------------------------------------------- refunds


def _paid(stripe, fake) -> RefundRequest:
    outcome = stripe.charge(charge_request(), "k-paid", TIMEOUT)
    return RefundRequest("re_ours1", "pay_1", outcome.provider_transaction_id, 300, "USD")


def test_a_refund_carries_its_own_key_and_our_refund_id_and_is_looked_up_before_it_is_sent(stripe, fake):
    request = _paid(stripe, fake)
    outcome = stripe.refund(request, "refund-key-1", TIMEOUT)
    assert isinstance(outcome, Succeeded)
    (refund,) = fake.refunds.values()
    assert outcome.provider_transaction_id == refund["id"]
    assert refund["metadata"] == {"refund_id": "re_ours1", "payment_id": "pay_1"} and refund["amount"] == 300
    (sent,) = posts(fake, "/v1/refunds")
    assert sent["idempotency_key"] == "refund-key-1" and sent["auth_ok"]
    listed = [i for i, r in enumerate(fake.requests) if r["path"] == "/v1/refunds" and r["method"] == "GET"]
    assert listed and listed[0] < fake.requests.index(sent)


def test_a_refund_sent_again_after_any_time_finds_the_first_and_never_refunds_twice(stripe, fake):
    request = _paid(stripe, fake)
    first = stripe.refund(request, "refund-key", TIMEOUT)
    fake.clock.advance(3 * DAY)
    again = stripe.refund(request, "refund-key", TIMEOUT)
    assert again.provider_transaction_id == first.provider_transaction_id and len(fake.refunds) == 1


def test_more_than_is_left_is_a_definitive_refusal(stripe, fake):
    request = replace(_paid(stripe, fake), amount_minor=5000)
    outcome = stripe.refund(request, "refund-key", TIMEOUT)
    assert isinstance(outcome, Failed) and outcome.definitive and outcome.code == "amount_too_large"


def test_an_ambiguous_refund_is_unknown_and_its_query_finds_it(stripe, fake):
    request = _paid(stripe, fake)
    fake.fail_next("timeout_after_commit", path="POST /v1/refunds")
    assert stripe.refund(request, "refund-key", SHORT).reason == "timeout"
    assert isinstance(stripe.query_refund("re_ours1", TIMEOUT, request), Succeeded)


def test_a_pending_refund_is_pending_until_stripe_finishes_it(stripe, fake):
    request = _paid(stripe, fake)
    fake.refunds_pending = True
    outcome = stripe.refund(request, "refund-key", TIMEOUT)
    assert isinstance(outcome, Pending)
    fake.complete_refund(outcome.provider_transaction_id, succeed=False)
    failed = stripe.query_refund("re_ours1", TIMEOUT, request)
    assert isinstance(failed, Failed) and failed.code == "expired_or_canceled_card"


def test_a_refund_key_with_a_saved_api_error_is_walked_past_once_the_lookup_finds_no_refund(stripe, fake):
    """Found by the chaos run: Stripe replays a 500 saved under the refund's key for 24 hours, so re-sending the
    same key never refunds and the refund stayed Unknown for good. The re-send looks first (nothing there), then
    sends the next key of the chain; once refunded, a further re-send finds it and sends nothing."""
    request = _paid(stripe, fake)
    fake.fail_next("api_error", path="POST /v1/refunds")
    assert stripe.refund(request, "refund-500", TIMEOUT).reason == "http_500:api_error"
    assert isinstance(stripe.query_refund("re_ours1", TIMEOUT, request), NotFound)
    outcome = stripe.refund(request, "refund-500", TIMEOUT)
    assert isinstance(outcome, Succeeded) and len(fake.refunds) == 1
    keys = [r["idempotency_key"] for r in posts(fake, "/v1/refunds")]
    assert keys == ["refund-500", "refund-500", successor_key("refund-500", 1)]
    again = stripe.refund(request, "refund-500", TIMEOUT)
    assert again.provider_transaction_id == outcome.provider_transaction_id
    assert len(fake.refunds) == 1 and len(posts(fake, "/v1/refunds")) == 3


def test_a_refund_nobody_made_is_not_found(stripe, fake):
    request = _paid(stripe, fake)
    assert isinstance(stripe.query_refund("re_ours1", TIMEOUT, request), NotFound)
    assert isinstance(stripe.query_refund("re_ours1", TIMEOUT, None), Unknown)


# --------------------------------------------------------------------------------------------- events, bills


def _succeed_many(fake, n: int) -> None:
    with fake.lock:
        for i in range(n):
            params = {"amount": "100", "currency": "usd", "confirm": "true", "payment_method": "pm_card_visa"}
            fake.create_payment_intent({**params, "metadata": {"payment_id": f"pay_{i}"}}, None)


def test_events_are_listed_page_by_page_for_the_types_paysync_applies(stripe, fake):
    _succeed_many(fake, 130)
    now = int(fake.clock.now())
    events = list(stripe.list_events(now - 60, now + 1, TIMEOUT))
    assert len(events) == 130 and len({e["id"] for e in events}) == 130
    assert {e["type"] for e in events} == {"payment_intent.succeeded"}
    (first_page, *_) = [r for r in fake.requests if r["path"] == "/v1/events"]
    assert first_page["params"]["types"] == list(EVENT_TYPES)


def test_a_page_that_fails_half_way_through_the_events_raises_instead_of_ending_the_list(stripe, fake):
    _succeed_many(fake, 130)
    now = int(fake.clock.now())
    listing = stripe.list_events(now - 60, now + 1, TIMEOUT)
    got = [next(listing) for _ in range(100)]
    fake.fail_next("5xx", path="GET /v1/events")
    with pytest.raises(ProviderUnavailable):
        got.extend(listing)
    assert len(got) == 100


def test_the_days_balance_transactions_stream_page_by_page_into_settlement_lines(stripe, fake):
    day = time.strftime("%Y-%m-%d", time.gmtime(fake.clock.now()))
    _succeed_many(fake, 120)
    request = RefundRequest("re_ours1", "pay_0", next(iter(fake.payment_intents)), 40, "USD")
    stripe.refund(request, "rk", TIMEOUT)
    fake.clock.advance(DAY)
    _succeed_many(fake, 3)  # the next day: not in this day's lines

    lines = list(stripe.settlement_lines(day, TIMEOUT))

    assert [x.kind for x in lines].count("charge") == 120 and [x.kind for x in lines].count("refund") == 1
    refund = next(x for x in lines if x.kind == "refund")
    assert (refund.merchant_reference, refund.amount_minor) == ("re_ours1", 40)
    assert all(x.provider_reference.startswith("pi_") for x in lines if x.kind == "charge")
    settled = list(read_settlement(io.BytesIO(b"".join(stripe.settlement(day, TIMEOUT)))))
    assert [x.kind for x in settled] == [x.kind if x.kind in ("charge", "refund", "fee") else "info" for x in lines]
    assert settled[0].currency == "USD" and all(checked(x) == x for x in settled)


def test_balance_transactions_that_cannot_be_had_raise(stripe, fake):
    fake.fail_next("5xx", path="GET /v1/balance_transactions")
    with pytest.raises(ProviderUnavailable):
        list(stripe.balance_transactions("2024-05-01", TIMEOUT))
    with pytest.raises(ProviderUnavailable):
        list(stripe.balance_transactions("yesterday", TIMEOUT))


# --------------------------------------------------------------------------------------------- the fake as a process


def test_the_fake_runs_as_its_own_process_and_checks_the_key(tmp_path):
    port = free_port()
    env = env_for({"STRIPE_FAKE_API_KEY": API_KEY, "STRIPE_FAKE_WEBHOOK_SECRETS": OLD_SECRET, "STRIPE_FAKE_SEED": "7"})
    env["PAYSYNC_ENV"] = "development"
    proc = subprocess.Popen(  # noqa: S603
        [sys.executable, "-m", "sandbox.fakes.stripe", "--port", str(port)],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port)
        stripe = StripeProvider(API_KEY, (OLD_SECRET,), f"http://127.0.0.1:{port}")
        assert isinstance(stripe.charge(charge_request(), "k-proc", 5), Succeeded)
        wrong = StripeProvider("sk_test_" + "y" * 32, (OLD_SECRET,), f"http://127.0.0.1:{port}")
        assert isinstance(wrong.query("pay_1", 5), Unknown)
        clock = requests.post(f"http://127.0.0.1:{port}/_fake/clock", json={"advance": 10}, timeout=5).json()
        assert clock["now"] > time.time() + 5
    finally:
        proc.terminate()
        proc.wait(10)


def _flat(params: dict, prefix: str = "") -> list[tuple[str, str]]:
    """Bracket-encode the fake's decoded parameters again, to send the very same request by hand."""
    pairs = []
    for key, value in params.items():
        name = f"{prefix}[{key}]" if prefix else key
        if isinstance(value, dict):
            pairs.extend(_flat(value, name))
        else:
            pairs.append((name, value))
    return pairs
