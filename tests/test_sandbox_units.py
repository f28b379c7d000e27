"""The sandbox's pure parts: fault knobs and dice, settlement fees and CSV, request validation, settings."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from payments.infra.settings import load_settings as load_paysync_settings
from sandbox import model, settlement
from sandbox.config import DEV_API_KEY, SandboxConfigError, load_settings
from sandbox.faults import Dice, Faults, bad_signature, parse_faults
from sandbox.webhooks import next_status

# --- fault knobs -------------------------------------------------------------------------------


def test_fault_knobs_parse_over_defaults():
    faults = parse_faults('{"decline_rate": 0.25, "latency_ms": 10, "seed": 7}')
    assert faults.decline_rate == 0.25
    assert faults.latency_ms == 10.0
    assert faults.seed == 7
    assert faults.hang_seconds == 3.0
    assert faults.error_5xx_rate == 0.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"decline": 0.1}', "unknown fault knob 'decline'"),
        ('{"decline_rate": 1.5}', "decline_rate must be between 0 and 1"),
        ('{"drop_rate": -0.1}', "drop_rate must be between 0 and 1"),
        ('{"decline_rate": true}', "decline_rate must be a number"),
        ('{"decline_rate": "0.1"}', "decline_rate must be a number"),
        ('{"hang_seconds": 601}', "hang_seconds must be between 0 and 600"),
        ('{"seed": 1.5}', "seed must be an integer"),
    ],
)
def test_bad_fault_knobs_are_refused_with_the_reason(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_faults(raw)


def test_bad_sandbox_faults_setting_stops_the_sandbox_naming_the_variable():
    with pytest.raises(SandboxConfigError, match="SANDBOX_FAULTS: unknown fault knob"):
        load_settings({"SANDBOX_FAULTS": '{"nope": 1}'})
    with pytest.raises(SandboxConfigError, match="SANDBOX_FAULTS: not valid JSON"):
        load_settings({"SANDBOX_FAULTS": "{"})
    with pytest.raises(SandboxConfigError, match="SANDBOX_FAULTS: decline_rate must be between 0 and 1"):
        load_settings({"SANDBOX_FAULTS": '{"decline_rate": 2}'})


def test_the_sandboxs_knobs_are_not_paysyncs_business():
    # An outside party's configuration: paysync neither reads nor validates it.
    assert load_paysync_settings({"SANDBOX_FAULTS": "{", "SANDBOX_PORT": "x"}).sandbox_api_url


def test_sandbox_settings_parse_and_refuse_bad_values():
    s = load_settings(
        {
            "SANDBOX_FEE_RATE": "0.0125",
            "SANDBOX_SEED": "42",
            "SANDBOX_FAULTS": '{"decline_rate": 0.1}',
            "SANDBOX_DB_PATH": ":memory:",
            "SANDBOX_WEBHOOK_MAX_ATTEMPTS": "3",
            "SANDBOX_WEBHOOK_BACKOFF_SECONDS": "0.5",
            "SANDBOX_PORT": "9100",
            "SANDBOX_CALLBACK_URL": "http://127.0.0.1:9000/callbacks/sandbox",
            "SANDBOX_API_KEY": "sk_new, sk_old",
            "SANDBOX_WEBHOOK_SECRET": "whsec_first,whsec_second",
        }
    )
    assert s.fee_rate == Decimal("0.0125")
    assert s.faults.seed == 42 and s.faults.decline_rate == 0.1
    assert s.db_path == ":memory:"
    assert (s.webhook_max_attempts, s.webhook_backoff_seconds) == (3, 0.5)
    assert (s.port, s.callback_url) == (9100, "http://127.0.0.1:9000/callbacks/sandbox")
    assert s.api_keys == ("sk_new", "sk_old")
    assert s.webhook_secret == "whsec_first", "the platform signs with the first secret of a list"
    defaults = load_settings({})
    assert defaults.fee_rate == Decimal("0.006") and defaults.api_keys == (DEV_API_KEY,)
    for name, value in [
        ("SANDBOX_FEE_RATE", "abc"),
        ("SANDBOX_FEE_RATE", "1"),
        ("SANDBOX_FEE_RATE", "NaN"),
        ("SANDBOX_SEED", "x"),
        ("SANDBOX_WEBHOOK_MAX_ATTEMPTS", "0"),
        ("SANDBOX_WEBHOOK_BACKOFF_SECONDS", "-1"),
        ("SANDBOX_WEBHOOK_BACKOFF_SECONDS", "nan"),
        ("SANDBOX_PORT", "70000"),
        ("SANDBOX_CALLBACK_URL", "ftp://x"),
        ("SANDBOX_API_KEY", " , "),
        ("SANDBOX_THREADS", "0"),
        ("LOG_LEVEL", "LOUD"),
    ]:
        with pytest.raises(SandboxConfigError, match=name):
            load_settings({name: value})


def _outcomes(dice: Dice, n: int) -> list[tuple]:
    return [(p.error_5xx, p.decline, p.processing, p.hang, p.webhook) for p in (dice.plan() for _ in range(n))]


def test_the_same_seed_rolls_the_same_fates():
    knobs = Faults(decline_rate=0.3, error_5xx_rate=0.2, drop_rate=0.5, delay_rate=0.5, reorder_rate=0.2, seed=1234)
    first = _outcomes(Dice(knobs), 200)
    assert first == _outcomes(Dice(knobs), 200)
    assert first != _outcomes(Dice(Faults(**{**knobs.to_dict(), "seed": 4321})), 200)
    declines = sum(1 for o in first if o[1])
    assert 30 < declines < 90  # about 30% of 200


def test_reconfiguring_with_the_seed_restarts_the_sequence():
    dice = Dice(Faults(decline_rate=0.5, seed=9))
    first = _outcomes(dice, 50)
    dice.configure(Faults(decline_rate=0.5, seed=9))
    assert _outcomes(dice, 50) == first


def test_rates_of_zero_and_one_are_never_and_always():
    never = Dice(Faults(seed=1))
    always = Dice(Faults(**{name: 1.0 for name in ("decline_rate", "processing_rate", "drop_rate")}, seed=1))
    assert not any(p.decline or p.processing or p.webhook.drop for p in (never.plan() for _ in range(100)))
    assert all(p.decline and p.processing and p.webhook.drop for p in (always.plan() for _ in range(100)))


def test_bad_signature_dice_depend_only_on_event_seed_and_attempt():
    results = [bad_signature(seed, attempt, 0.5) for seed in range(40) for attempt in (1, 2)]
    assert results == [bad_signature(seed, attempt, 0.5) for seed in range(40) for attempt in (1, 2)]
    assert 10 < sum(results) < 70
    assert not any(bad_signature(seed, 1, 0.0) for seed in range(40))
    assert all(bad_signature(seed, 1, 1.0) for seed in range(40))


def test_event_status_after_an_attempt():
    assert next_status(200, 1, 8) == "delivered"
    assert next_status(204, 8, 8) == "delivered"
    assert next_status(500, 1, 8) == "pending"
    assert next_status(None, 7, 8) == "pending"
    assert next_status(401, 8, 8) == "failed"


# --- settlement --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("amount", "rate", "expected"),
    [
        (1000, "0.006", 6),
        (1, "0.006", 0),
        (250, "0.006", 2),  # 1.5 rounds half up
        (83, "0.006", 0),  # 0.498
        (84, "0.006", 1),  # 0.504
        (12345, "0.0125", 154),  # 154.3125
        (10**12, "0.006", 6 * 10**9),
        (999, "0", 0),
    ],
)
def test_fee_is_rounded_half_up_to_whole_minor_units(amount, rate, expected):
    assert settlement.fee(amount, Decimal(rate)) == expected


@given(
    amount=st.integers(min_value=1, max_value=10**12),
    rate=st.decimals(min_value=0, max_value=Decimal("0.5"), places=5, allow_nan=False, allow_infinity=False),
)
def test_fee_is_exact_half_up_rounding(amount, rate):
    exact = Fraction(amount) * Fraction(rate)
    fee = settlement.fee(amount, rate)
    assert isinstance(fee, int)
    # Half up: the fee is the one whole number in [exact - 1/2, exact + 1/2), so an exact half goes up.
    assert fee - Fraction(1, 2) <= exact < fee + Fraction(1, 2)


row_strategy = st.builds(
    settlement.SettlementRow,
    provider_transaction_id=st.from_regex(r"(ch|re)_[0-9A-Z]{8}", fullmatch=True),
    merchant_transaction_id=st.from_regex(r"pay_[0-9a-z,\"]{1,10}", fullmatch=True),
    type=st.sampled_from(["charge", "refund"]),
    amount=st.integers(min_value=1, max_value=10**9),
    currency=st.sampled_from(["CNY", "USD"]),
    status=st.sampled_from(["succeeded", "failed"]),
    created_at=st.floats(min_value=1.7e9, max_value=1.8e9),
)


@given(
    rows=st.lists(row_strategy, max_size=30, unique_by=lambda r: r.provider_transaction_id),
    rate=st.sampled_from([Decimal("0.006"), Decimal("0.029")]),
)
def test_settlement_csv_holds_every_row_in_time_order_and_only_succeeded_charges_pay_fees(rows, rate):
    text = settlement.build_csv(rows, rate)
    assert text.splitlines()[0] == ",".join(settlement.COLUMNS)
    parsed = list(csv.DictReader(io.StringIO(text)))
    expected = sorted(rows, key=lambda r: (r.created_at, r.provider_transaction_id))
    assert [line["provider_transaction_id"] for line in parsed] == [r.provider_transaction_id for r in expected]
    for line, row in zip(parsed, expected, strict=True):
        assert line["merchant_transaction_id"] == row.merchant_transaction_id
        assert (line["type"], line["currency"], line["status"]) == (row.type, row.currency, row.status)
        assert int(line["amount"]) == row.amount
        pays_fee = (row.type, row.status) == ("charge", "succeeded")
        assert int(line["fee"]) == (settlement.fee(row.amount, rate) if pays_fee else 0)
        assert line["created_at"] == settlement.iso(row.created_at)


@pytest.mark.parametrize("text", ["2024-13-01", "2024-02-30", "20240101", "2024-W01-1", "yesterday", "２０２４-01-01"])
def test_bad_settlement_days_are_refused(text):
    with pytest.raises(ValueError):
        settlement.parse_day(text)


def test_a_day_is_its_utc_bounds():
    start, end = settlement.day_bounds(settlement.parse_day("2024-03-01"))
    assert settlement.iso(start) == "2024-03-01T00:00:00Z"
    assert end - start == 86400


# --- request validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        {"merchant_transaction_id": "pay_1", "amount": 10.0, "currency": "CNY"},
        {"merchant_transaction_id": "pay_1", "amount": 0, "currency": "CNY"},
        {"merchant_transaction_id": "pay_1", "amount": -5, "currency": "CNY"},
        {"merchant_transaction_id": "pay_1", "amount": True, "currency": "CNY"},
        {"merchant_transaction_id": "pay_1", "amount": "100", "currency": "CNY"},
        {"merchant_transaction_id": "pay_1", "amount": 100, "currency": "cny"},
        {"merchant_transaction_id": "pay_1", "amount": 100, "currency": "YUAN"},
        {"merchant_transaction_id": "", "amount": 100, "currency": "CNY"},
        {"merchant_transaction_id": "pay 1", "amount": 100, "currency": "CNY"},
        {"merchant_transaction_id": "p" * 65, "amount": 100, "currency": "CNY"},
        {"amount": 100, "currency": "CNY"},
    ],
)
def test_bad_charge_requests_are_refused(payload):
    with pytest.raises(model.BadRequest):
        model.parse_charge(payload)


def test_fingerprints_ignore_key_order_but_not_values_or_endpoint():
    a = model.fingerprint("POST /v1/charges", {"amount": 1, "currency": "CNY"})
    assert a == model.fingerprint("POST /v1/charges", {"currency": "CNY", "amount": 1})
    assert a != model.fingerprint("POST /v1/charges", {"currency": "CNY", "amount": 2})
    assert a != model.fingerprint("POST /v1/refunds", {"currency": "CNY", "amount": 1})
