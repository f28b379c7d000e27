"""Hypothesis fuzzing of every HTTP route through the real gunicorn gateway.

Wanted, whatever arrives: never a 500, never a stalled or crashed worker, and
every callback delivery stored byte for byte before it is answered (only a
body over the limit is refused unstored, with 413).
"""

from __future__ import annotations

import json
import string
import time
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from payments.infra.schema import payment
from sandbox import signing
from tests.support import SECRET, sandbox_event

pytestmark = [pytest.mark.mariadb, pytest.mark.slow]

FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- strategies --------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=25,
)

# Header values requests will send: latin-1, no control characters, no leading or trailing blanks.
header_text = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=120
).map(str.strip)
header_names = st.text(alphabet=string.ascii_letters + string.digits + "-", min_size=1, max_size=24).filter(
    lambda n: n.lower() not in {"content-length", "transfer-encoding", "host", "connection", "expect"}
)


@st.composite
def mutated_event(draw) -> dict:
    """A sandbox event with a few fields removed, retyped or added."""
    event = sandbox_event(draw(st.text(min_size=1, max_size=40)))
    for _ in range(draw(st.integers(0, 3))):
        data = event.get("data")
        target = data if isinstance(data, dict) and draw(st.booleans()) else event
        action = draw(st.sampled_from(["drop", "retype", "add"]))
        if action == "drop" and target:
            target.pop(draw(st.sampled_from(sorted(target))))
        elif action == "retype" and target:
            target[draw(st.sampled_from(sorted(target)))] = draw(json_values)
        else:
            target[draw(st.text(max_size=12))] = draw(json_values)
    return event


valid_event = st.builds(
    lambda pid, amount, currency, kind: sandbox_event(pid, amount=amount, currency=currency, event_type=kind),
    st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=1, max_size=40),
    st.integers(1, 10**12),
    st.sampled_from(["CNY", "USD", "EUR"]),
    st.sampled_from(["charge.succeeded", "charge.failed"]),
)
"""A well-formed sandbox event about a payment that may or may not exist."""

valid_create = st.fixed_dictionaries(
    {
        "order_no": st.text(min_size=1, max_size=64).filter(str.strip),
        "amount": st.integers(1, 100_000_000),
        "currency": st.sampled_from(["CNY", "USD", "JPY", "EUR"]),
        "provider": st.just("sandbox"),
    },
    optional={"description": st.none() | st.text(max_size=500)},
)
"""A POST /payments body the API must accept."""

printable_key = st.text(alphabet=string.ascii_letters + string.digits + "-_:.", min_size=1, max_size=255)

bodies = st.one_of(
    st.binary(max_size=2048),
    json_values.map(lambda v: json.dumps(v).encode()),
    mutated_event().map(lambda e: json.dumps(e).encode()),
    st.text(max_size=500).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


@st.composite
def delivery(draw) -> tuple[bytes, dict[str, str]]:
    """(body, headers): random or mutated bodies under valid, garbage, wrong-key or missing signatures."""
    mode = draw(st.sampled_from(["valid", "valid_over_garbage", "garbage_over_valid", "wrong_key", "random", "none"]))
    if mode in ("valid", "garbage_over_valid"):
        body = json.dumps(draw(valid_event)).encode()
    else:
        body = draw(bodies)
    headers = {name: value for name, value in draw(st.dictionaries(header_names, header_text, max_size=4)).items()}
    if mode == "valid":
        headers[signing.HEADER] = signing.sign(SECRET, body)
    elif mode == "valid_over_garbage":
        headers[signing.HEADER] = signing.sign(SECRET, body, draw(st.none() | st.integers(0, 2**40)))
    elif mode == "wrong_key":
        headers[signing.HEADER] = signing.sign(draw(st.text(min_size=1, max_size=30)), body)
    elif mode in ("garbage_over_valid", "random"):
        headers[signing.HEADER] = draw(header_text)
    headers["Content-Type"] = draw(st.sampled_from(["application/json", "text/plain", "", "application/x-www-form"]))
    return body, headers


# --- tests -------------------------------------------------------------------------------------------------


def test_fuzzed_callbacks_never_500_and_every_delivery_is_stored_byte_for_byte(gateway):  # noqa: F811
    workers = gateway.workers()

    @FUZZ
    @given(delivery())
    def one(case: tuple[bytes, dict[str, str]]) -> None:
        body, headers = case
        before = gateway.last_callback_id()
        answer = gateway.request("POST", "/callbacks/sandbox", data=body, headers=headers)
        assert answer.status_code < 500, answer.text[:300]
        stored = gateway.callbacks_after(before)
        assert len(stored) == 1, f"{answer.status_code}: expected exactly one stored row, found {len(stored)}"
        assert bytes(stored[0].callback_data) == body
        if answer.status_code == 200:
            assert stored[0].status in (0, 1, 2), "an acknowledged delivery is pending or processed"
        else:
            assert answer.status_code in (400, 401, 415), answer.status_code
            assert stored[0].status == 3, "a refused delivery is kept as rejected"

    before = gateway.last_callback_id()
    one()
    gateway.assert_responsive()
    assert gateway.workers() == workers, "a gateway worker crashed or timed out"
    statuses = {row.status for row in gateway.callbacks_after(before)}
    # Without a broker the gateway processes what it acknowledges inline: such rows are 1 or 2, or 0 on an overrun.
    assert statuses & {0, 1, 2} and 3 in statuses, f"the fuzzing reached only callback statuses {statuses}"


def test_fuzzed_create_payment_never_500(gateway):  # noqa: F811
    workers = gateway.workers()

    @FUZZ
    @given(
        body=st.one_of(
            valid_create.map(lambda d: json.dumps(d).encode()),
            st.tuples(valid_create, st.sampled_from(["order_no", "amount", "currency", "provider"]), json_values).map(
                lambda t: json.dumps({**t[0], t[1]: t[2]}).encode()
            ),
            bodies,
            st.fixed_dictionaries(
                {"order_no": st.text(max_size=70), "amount": json_values, "currency": st.text(max_size=4)},
                optional={
                    "provider": st.sampled_from(["sandbox", "alipay", ""]) | st.text(),
                    "description": json_values,
                },
            ).map(lambda d: json.dumps(d).encode()),
        ),
        key=st.one_of(printable_key, printable_key, st.none(), header_text),
        content_type=st.sampled_from(["application/json", "text/plain", "multipart/form-data", ""]),
    )
    def one(body: bytes, key: str | None, content_type: str) -> None:
        headers = {**gateway.merchant(), "Content-Type": content_type}
        if key is not None:
            headers["Idempotency-Key"] = key
        answer = gateway.request("POST", "/payments", data=body, headers=headers)
        assert answer.status_code < 500, answer.text[:300]
        assert answer.status_code in (201, 400, 409, 413, 415, 422), answer.status_code
        if answer.status_code == 201:
            created.append(answer.json()["payment_id"])
        else:
            assert answer.json()["error"]["code"]

    created: list[str] = []
    one()
    assert created, "the fuzzing never created a payment"
    with gateway.engine.connect() as conn:
        found = conn.execute(select(func.count()).where(payment.c.payment_id.in_(created))).scalar_one()
    assert found == len(set(created))
    gateway.assert_responsive()
    assert gateway.workers() == workers


def test_fuzzed_get_payment_never_500(gateway):  # noqa: F811
    # Ids that reach the route: a "/" (even as %2F, which the server decodes) or a bare "." / ".." segment
    # (which the client normalises away) names another path, where 404 is the right answer.
    route_ids = st.text(min_size=1, max_size=300).filter(lambda t: "/" not in t and t not in (".", ".."))

    @FUZZ
    @given(payment_id=route_ids, auth=st.booleans())
    def one(payment_id: str, auth: bool) -> None:
        headers = gateway.merchant() if auth else {}
        answer = gateway.request("GET", "/payments/" + quote(payment_id, safe=""), headers=headers)
        assert answer.status_code < 500, answer.text[:300]
        assert answer.status_code in ((200, 404) if auth else (401,)), answer.status_code

    one()
    gateway.assert_responsive()


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/openapi.json"])
def test_fuzzed_health_metrics_and_openapi_never_500(gateway, path):  # noqa: F811
    @settings(FUZZ, max_examples=40)
    @given(
        query=st.dictionaries(st.text(max_size=10), st.text(max_size=30), max_size=3),
        headers=st.dictionaries(header_names, header_text, max_size=4),
        method=st.sampled_from(["GET", "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS"]),
    )
    def one(query: dict, headers: dict, method: str) -> None:
        started = time.monotonic()
        answer = gateway.request(method, path, params=query, headers=headers)
        assert answer.status_code < 500 or (path == "/readyz" and answer.status_code == 503), answer.text[:300]
        assert time.monotonic() - started < 5

    one()
    gateway.assert_responsive()


@pytest.mark.parametrize("path", ["/callbacks/sandbox", "/payments", "/payments/pay_x"])
def test_wrong_methods_are_405_not_500(gateway, path):  # noqa: F811
    for method in ("PUT", "DELETE", "PATCH"):
        answer = gateway.request(method, path, headers=gateway.merchant())
        assert answer.status_code == 405, (method, answer.status_code)
        assert answer.json()["error"]["code"]
