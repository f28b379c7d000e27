"""The sandbox platform's HTTP contract through Flask's test client (in-memory state, no webhook thread).

Real-process behaviour (concurrency, hanging replies, webhook delivery,
signals) is in test_sandbox_http.py.
"""

from __future__ import annotations

import csv
import io
import time
import uuid

import pytest

from sandbox.app import build_platform, create_app
from sandbox.config import DEV_API_KEY, SandboxSettings
from sandbox.faults import Faults


@pytest.fixture
def platform():
    p = build_platform(SandboxSettings(db_path=":memory:"), dispatch=False)
    yield p
    p.store.close()


def authorized_client(platform):
    """A test client that presents the platform's API key, as paysync's adapter does."""
    client = create_app(platform).test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {DEV_API_KEY}"
    return client


@pytest.fixture
def client(platform):
    return authorized_client(platform)


def charge(client, key=None, **overrides):
    body = {"merchant_transaction_id": f"pay_{uuid.uuid4().hex[:12]}", "amount": 1000, "currency": "CNY"}
    body.update(overrides)
    return client.post("/v1/charges", json=body, headers={"Idempotency-Key": key or uuid.uuid4().hex})


def refund(client, charge_id, amount, key=None, **extra):
    body = {"charge": charge_id, "amount": amount, "merchant_refund_id": f"ref_{uuid.uuid4().hex[:12]}", **extra}
    return client.post("/v1/refunds", json=body, headers={"Idempotency-Key": key or uuid.uuid4().hex})


def set_faults(client, **knobs):
    response = client.post("/_sandbox/faults", json=knobs)
    assert response.status_code == 200, response.json
    return response.json


# --- charges and keys --------------------------------------------------------------------------


def test_a_charge_succeeds_and_answers_the_contract_shape(client):
    response = charge(client, merchant_transaction_id="pay_shape", amount=1234)
    assert response.status_code == 200
    body = response.json
    assert body["id"].startswith("ch_")
    assert {k: body[k] for k in ("status", "merchant_transaction_id", "amount", "currency", "failure_code")} == {
        "status": "succeeded",
        "merchant_transaction_id": "pay_shape",
        "amount": 1234,
        "currency": "CNY",
        "failure_code": None,
    }


def test_the_same_key_and_params_replay_the_first_answer_without_charging_again(client):
    first = charge(client, key="k-replay", merchant_transaction_id="pay_replay")
    again = charge(client, key="k-replay", merchant_transaction_id="pay_replay")
    assert (again.status_code, again.json) == (first.status_code, first.json)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert client.get("/_sandbox/truth").json["charge_counts"] == {"pay_replay": 1}


def test_the_same_key_with_other_params_is_a_409_and_charges_nothing(client):
    charge(client, key="k-reuse", merchant_transaction_id="pay_reuse", amount=1000)
    response = charge(client, key="k-reuse", merchant_transaction_id="pay_reuse", amount=999)
    assert response.status_code == 409
    assert response.json["error"]["code"] == "idempotency_key_reuse"
    other_endpoint = client.post(
        "/v1/refunds", json={"charge": "ch_x", "amount": 1}, headers={"Idempotency-Key": "k-reuse"}
    )
    assert other_endpoint.status_code == 409
    assert len(client.get("/_sandbox/truth").json["charges"]) == 1


def test_a_missing_idempotency_key_is_a_400_and_charges_nothing(client):
    response = client.post("/v1/charges", json={"merchant_transaction_id": "pay_nokey", "amount": 1, "currency": "CNY"})
    assert response.status_code == 400
    assert response.json["error"]["code"] == "missing_idempotency_key"
    assert client.get("/_sandbox/truth").json["charges"] == []


@pytest.mark.parametrize(
    "body",
    [
        {"merchant_transaction_id": "pay_bad", "amount": 10.5, "currency": "CNY"},
        {"merchant_transaction_id": "pay_bad", "amount": 0, "currency": "CNY"},
        {"merchant_transaction_id": "pay_bad", "amount": 100, "currency": "rmb"},
        {"amount": 100, "currency": "CNY"},
        "not an object",
    ],
)
def test_bad_input_is_a_json_400_that_stores_nothing_not_even_the_key(client, body):
    response = client.post("/v1/charges", json=body, headers={"Idempotency-Key": "k-bad"})
    assert response.status_code == 400
    assert response.json["error"]["code"] == "invalid_request"
    # The key was not consumed: a good request with it goes through.
    assert charge(client, key="k-bad").status_code == 200
    assert len(client.get("/_sandbox/truth").json["charges"]) == 1


def test_a_body_that_is_not_json_is_a_400(client):
    response = client.post(
        "/v1/charges", data=b"{oops", headers={"Idempotency-Key": "k", "Content-Type": "application/json"}
    )
    assert response.status_code == 400


def test_charges_are_found_by_merchant_number_and_by_id(client):
    made = charge(client, merchant_transaction_id="pay_find").json
    by_merchant = client.get("/v1/charges", query_string={"merchant_transaction_id": "pay_find"})
    assert (by_merchant.status_code, by_merchant.json) == (200, made)
    assert client.get(f"/v1/charges/{made['id']}").json == made
    missing = client.get("/v1/charges", query_string={"merchant_transaction_id": "pay_nobody"})
    assert missing.status_code == 404
    assert missing.json["error"]["code"] == "not_found"
    assert client.get("/v1/charges/ch_nope").status_code == 404
    assert client.get("/v1/charges").status_code == 400


# --- faults through the API --------------------------------------------------------------------


def test_decline_rate_fails_the_charge_with_card_declined(client):
    set_faults(client, decline_rate=1.0)
    body = charge(client).json
    assert (body["status"], body["failure_code"]) == ("failed", "card_declined")


def test_a_5xx_before_processing_charges_nothing_and_leaves_the_key_unused(client):
    set_faults(client, error_5xx_rate=1.0)
    response = charge(client, key="k-5xx", merchant_transaction_id="pay_5xx")
    assert response.status_code == 503
    assert response.json["error"]["code"] == "service_unavailable"
    assert client.get("/_sandbox/truth").json["charges"] == []
    set_faults(client)
    assert charge(client, key="k-5xx", merchant_transaction_id="pay_5xx").json["status"] == "succeeded"


def test_a_replay_is_the_stored_answer_whatever_the_dice_say_now(client):
    first = charge(client, key="k-clean", merchant_transaction_id="pay_clean")
    set_faults(client, error_5xx_rate=1.0, decline_rate=1.0, timeout_after_commit_rate=1.0, hang_seconds=5)
    started = time.monotonic()
    again = charge(client, key="k-clean", merchant_transaction_id="pay_clean")
    assert time.monotonic() - started < 1.0
    assert (again.status_code, again.json) == (200, first.json)


def test_processing_charges_complete_later_with_the_outcome_rolled_at_creation(client, platform):
    set_faults(client, processing_rate=1.0, processing_seconds=0.0, decline_rate=1.0)
    made = charge(client, merchant_transaction_id="pay_slow").json
    assert made["status"] == "processing"
    assert client.get("/_sandbox/deliveries").json["events"] == []  # no event until it completes
    assert platform.store.complete_due(time.time() + 0.01) == 1
    now = client.get(f"/v1/charges/{made['id']}").json
    assert (now["status"], now["failure_code"]) == ("failed", "card_declined")
    (event,) = client.get("/_sandbox/deliveries").json["events"]
    assert event["type"] == "charge.failed"
    assert event["data"]["provider_transaction_id"] == made["id"]


def test_latency_is_added_to_api_calls(client):
    set_faults(client, latency_ms=200)
    started = time.monotonic()
    client.get("/v1/charges", query_string={"merchant_transaction_id": "pay_x"})
    assert time.monotonic() - started >= 0.2


def test_the_seed_makes_a_run_repeatable(client):
    def run():
        client.post("/_sandbox/reset")
        set_faults(client, decline_rate=0.5, error_5xx_rate=0.2, processing_rate=0.2, seed=2024)
        return [
            (r.status_code, r.json.get("status"), r.json.get("failure_code"))
            for r in (charge(client, merchant_transaction_id=f"pay_seed_{i}") for i in range(40))
        ]

    first = run()
    assert first == run()
    assert {outcome[:2] for outcome in first} >= {(200, "succeeded"), (200, "failed"), (503, None)}


def test_faults_read_back_and_bad_knobs_are_refused(client):
    assert set_faults(client, drop_rate=0.5)["drop_rate"] == 0.5
    assert client.get("/_sandbox/faults").json["drop_rate"] == 0.5
    response = client.post("/_sandbox/faults", json={"drop_rate": 3})
    assert response.status_code == 400
    assert "drop_rate" in response.json["error"]["message"]
    assert client.post("/_sandbox/faults", json={"bogus": 1}).status_code == 400
    assert client.get("/_sandbox/faults").json["drop_rate"] == 0.5


def test_faults_from_settings_are_what_reset_goes_back_to():
    settings = SandboxSettings(db_path=":memory:", faults=Faults(decline_rate=1.0, seed=5))
    platform = build_platform(settings, dispatch=False)
    client = authorized_client(platform)
    assert charge(client).json["status"] == "failed"
    set_faults(client)
    assert charge(client).json["status"] == "succeeded"
    reset = client.post("/_sandbox/reset").json
    assert reset["faults"]["decline_rate"] == 1.0
    assert reset["faults"]["seed"] == 5
    assert client.get("/_sandbox/truth").json["charges"] == []
    assert charge(client).json["status"] == "failed"


# --- refunds -----------------------------------------------------------------------------------


def test_partial_refunds_succeed_until_the_charge_is_used_up(client):
    made = charge(client, amount=1000, merchant_transaction_id="pay_ref").json
    first = refund(client, made["id"], 600, merchant_refund_id="ref_a")
    assert first.status_code == 200
    assert {k: first.json[k] for k in ("status", "charge", "merchant_refund_id", "amount", "currency")} == {
        "status": "succeeded",
        "charge": made["id"],
        "merchant_refund_id": "ref_a",
        "amount": 600,
        "currency": "CNY",
    }
    assert first.json["id"].startswith("re_")
    too_much = refund(client, made["id"], 401, merchant_refund_id="ref_b").json
    assert (too_much["status"], too_much["failure_code"]) == ("failed", "amount_exceeds_refundable")
    rest = refund(client, made["id"], 400, merchant_refund_id="ref_c").json
    assert rest["status"] == "succeeded"
    assert client.get(f"/v1/charges/{made['id']}").json["amount_refunded"] == 1000
    found = client.get("/v1/refunds", query_string={"merchant_refund_id": "ref_a"})
    assert (found.status_code, found.json) == (200, first.json)
    assert client.get(f"/v1/refunds/{first.json['id']}").json == first.json
    assert client.get("/v1/refunds", query_string={"merchant_refund_id": "ref_nobody"}).status_code == 404
    truth = client.get("/_sandbox/truth").json
    assert [(r["amount"], r["status"]) for r in truth["refunds"]] == [
        (600, "succeeded"),
        (401, "failed"),
        (400, "succeeded"),
    ]


def test_refund_keys_replay_and_refuse_reuse(client):
    made = charge(client, amount=1000).json
    first = refund(client, made["id"], 100, key="rk", merchant_refund_id="ref_k")
    again = refund(client, made["id"], 100, key="rk", merchant_refund_id="ref_k")
    assert again.json == first.json
    assert refund(client, made["id"], 200, key="rk", merchant_refund_id="ref_k").status_code == 409
    assert len(client.get("/_sandbox/truth").json["refunds"]) == 1


def test_a_declined_charge_cannot_be_refunded(client):
    set_faults(client, decline_rate=1.0)
    made = charge(client).json
    body = refund(client, made["id"], 10).json
    assert (body["status"], body["failure_code"]) == ("failed", "charge_not_refundable")


def test_a_refund_of_an_unknown_charge_or_in_another_currency_is_a_400(client):
    assert refund(client, "ch_unknown", 10).status_code == 400
    made = charge(client).json
    assert refund(client, made["id"], 10, currency="USD").status_code == 400
    assert refund(client, made["id"], 10, currency="CNY").status_code == 200
    assert client.post("/v1/refunds", json={"charge": made["id"], "amount": 1}).status_code == 400  # no key


# --- settlement --------------------------------------------------------------------------------


def test_the_settlement_file_lists_completed_charges_and_refunds_of_the_day_with_fees(client):
    set_faults(client, seed=1)
    paid = charge(client, amount=1000, merchant_transaction_id="pay_s1").json
    refunded = refund(client, paid["id"], 300, merchant_refund_id="ref_s1").json
    set_faults(client, decline_rate=1.0)
    declined = charge(client, amount=250, merchant_transaction_id="pay_s2").json
    set_faults(client, processing_rate=1.0, processing_seconds=600)
    charge(client, amount=99, merchant_transaction_id="pay_s3")  # still processing: not settled
    today = time.strftime("%Y-%m-%d", time.gmtime())
    response = client.get(f"/v1/settlements/{today}.csv")
    assert response.status_code == 200
    assert response.mimetype == "text/csv"
    lines = list(csv.DictReader(io.StringIO(response.get_data(as_text=True))))
    assert [
        (r["provider_transaction_id"], r["merchant_transaction_id"], r["type"], r["amount"], r["fee"], r["status"])
        for r in lines
    ] == [
        (paid["id"], "pay_s1", "charge", "1000", "6", "succeeded"),
        (refunded["id"], "ref_s1", "refund", "300", "0", "succeeded"),
        (declined["id"], "pay_s2", "charge", "250", "0", "failed"),
    ]
    empty = client.get("/v1/settlements/2001-01-01.csv").get_data(as_text=True)
    assert empty.strip() == "provider_transaction_id,merchant_transaction_id,type,amount,fee,currency,status,created_at"


def test_a_bad_settlement_date_is_a_400(client):
    for day in ("2024-02-30", "2024-1-1", "latest"):
        response = client.get(f"/v1/settlements/{day}.csv")
        assert response.status_code == 400
        assert response.json["error"]["code"] == "invalid_request"


# --- control surface ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/_sandbox/faults"),
        ("POST", "/_sandbox/faults"),
        ("GET", "/_sandbox/truth"),
        ("GET", "/_sandbox/deliveries"),
        ("POST", "/_sandbox/reset"),
    ],
)
def test_the_control_surface_refuses_other_addresses(client, method, path):
    charge(client, merchant_transaction_id="pay_keep")
    remote = client.open(path, method=method, json={}, environ_base={"REMOTE_ADDR": "10.1.2.3"})
    assert remote.status_code == 403
    assert remote.json["error"]["code"] == "forbidden"
    local_v6 = client.open("/_sandbox/faults", method="GET", environ_base={"REMOTE_ADDR": "::1"})
    assert local_v6.status_code == 200
    assert client.get("/_sandbox/truth").json["charge_counts"] == {"pay_keep": 1}  # the reset did not happen


def test_the_public_api_answers_other_addresses(client):
    response = client.post(
        "/v1/charges",
        json={"merchant_transaction_id": "pay_remote", "amount": 5, "currency": "CNY"},
        headers={"Idempotency-Key": "k-remote"},
        environ_base={"REMOTE_ADDR": "10.1.2.3"},
    )
    assert response.status_code == 200


def test_unknown_routes_and_methods_answer_json_errors(client):
    assert client.get("/v2/nothing").json["error"]["code"] == "not_found"
    assert client.delete("/v1/charges").status_code == 405


# --- API keys, local-only control, hostile bodies ------------------------------------------------


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer ", "Basic c2s6", f"Bearer {DEV_API_KEY}x", f"Token {DEV_API_KEY}", "Bearer é"],
)
def test_the_public_api_refuses_a_missing_or_wrong_api_key_and_does_nothing(platform, authorization):
    client = create_app(platform).test_client()
    headers = {"Idempotency-Key": "k-auth"}
    if authorization is not None:
        headers["Authorization"] = authorization
    body = {"merchant_transaction_id": "pay_auth", "amount": 5, "currency": "CNY"}
    response = client.post("/v1/charges", json=body, headers=headers)
    assert response.status_code == 401
    assert response.json["error"]["code"] == "invalid_api_key"
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert client.get("/v1/charges?merchant_transaction_id=pay_auth", headers=headers).status_code == 401
    assert client.get("/_sandbox/truth").json["charges"] == []
    # The same request with the key goes through, and the key Idempotency-Key was not used up.
    assert authorized_client(platform).post("/v1/charges", json=body, headers={"Idempotency-Key": "k-auth"}).json[
        "status"
    ] == ("succeeded")


def test_every_listed_api_key_is_accepted():
    platform = build_platform(SandboxSettings(db_path=":memory:", api_keys=("sk_new", "sk_old")), dispatch=False)
    client = create_app(platform).test_client()
    for key in ("sk_new", "sk_old"):
        answer = client.get("/v1/charges/ch_nope", headers={"Authorization": f"bearer {key}"})
        assert answer.status_code == 404, key
    assert client.get("/v1/charges/ch_nope", headers={"Authorization": "Bearer sk_other"}).status_code == 401


@pytest.mark.parametrize(
    ("host", "origin", "allowed"),
    [
        ("127.0.0.1:8100", None, True),
        ("localhost:8100", "http://localhost:3000", True),
        ("[::1]:8100", "http://[::1]:8100", True),
        ("127.0.0.1", "https://127.0.0.1", True),
        ("evil.example:8100", None, False),  # DNS rebinding: a page's own name resolving to 127.0.0.1
        ("127.0.0.1.evil.example", None, False),
        ("127.0.0.1:8100", "http://evil.example", False),  # a page elsewhere, posting from the developer's browser
        ("127.0.0.1:8100", "null", False),  # a sandboxed iframe or a file:// page
        ("127.0.0.1:8100", "http://localhost.evil.example", False),
        ("127.0.0.1:8100", "chrome-extension://abc", False),
    ],
)
def test_the_control_surface_refuses_a_foreign_host_or_origin(client, host, origin, allowed):
    charge(client, merchant_transaction_id="pay_keep")
    headers = {"Host": host, **({"Origin": origin} if origin else {})}
    answer = client.post("/_sandbox/reset", headers=headers)
    assert answer.status_code == (200 if allowed else 403)
    faults = client.post("/_sandbox/faults", json={"decline_rate": 1.0}, headers=headers)
    assert faults.status_code == (200 if allowed else 403)
    if not allowed:
        assert answer.json["error"]["code"] == "forbidden"
        assert client.get("/_sandbox/truth").json["charge_counts"] == {"pay_keep": 1}, "nothing was reset"
        assert client.get("/_sandbox/faults").json["decline_rate"] == 0.0


HOSTILE = {
    "deep_json_100k": (b"[" * 100_000 + b"]" * 100_000, "application/json", 413),  # past the body limit, too
    "deep_json": (b"[" * 30_000 + b"]" * 30_000, "application/json", 400),  # inside the limit: the parser's turn
    "deep_object": (b'{"a":' * 50 + b"1" + b"}" * 50, "application/json", 400),
    "invalid_utf8": (
        b'{"merchant_transaction_id": "\xff\xfe", "amount": 1, "currency": "CNY"}',
        "application/json",
        400,
    ),
    "utf16": ('{"amount": 1}'.encode("utf-16"), "application/json", 400),
    "oversized": (b'{"a": "' + b"x" * (70 * 1024) + b'"}', "application/json", 413),
    "wrong_type": (b'{"merchant_transaction_id": "pay_x", "amount": 1, "currency": "CNY"}', "text/plain", 415),
    "form": (b"amount=1&currency=CNY", "application/x-www-form-urlencoded", 415),
    "empty": (b"", "application/json", 400),
    "nul_bytes": (b"\x00" * 100, "application/json", 400),
}


@pytest.mark.parametrize("path", ["/v1/charges", "/v1/refunds", "/_sandbox/faults"])
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_bodies_get_a_4xx_json_error_and_change_nothing(client, path, kind):
    body, content_type, status = HOSTILE[kind]
    answer = client.post(path, data=body, headers={"Content-Type": content_type, "Idempotency-Key": f"k-{kind}"})
    assert answer.status_code == status, answer.data[:200]
    assert set(answer.json["error"]) == {"code", "message"}
    truth = client.get("/_sandbox/truth").json
    assert truth["charges"] == [] and truth["refunds"] == []
    assert client.get("/_sandbox/faults").json["decline_rate"] == 0.0
