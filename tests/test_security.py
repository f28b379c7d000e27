"""Security tests through the real gunicorn gateway: forged, replayed and hostile requests, tokens, and the logs.

Every refused notification is still stored (status 3, with the reason) and
changes nothing; every hostile body gets a 4xx; SQL-looking text is stored as
text; routes that need a token refuse a missing or wrong one; and nothing a
client sent (card numbers, CVVs) or the gateway knows (tokens, secrets) shows
up in any log line.
"""

from __future__ import annotations

import json
import re
import time
import uuid

import pytest
import requests
from sqlalchemy import func, select

from gateway import create_app
from payments.infra.schema import ledger_event, payment, payment_callback_log
from sandbox import signing
from tests.hostile import MERCHANT_TOKEN, OPS_TOKEN, SECRETS
from tests.leaks import leaks_in, scan_logs
from tests.support import SECRET, create_payment, make_settings, sandbox_event, signed

pytestmark = [pytest.mark.mariadb, pytest.mark.slow]

TOLERANCE = 300  # CALLBACK_TOLERANCE_SECONDS' default, which the gateway runs with
PROVIDER_ROUTES = ["sandbox", "sandbox_legacy", "alipay", "wechatpay", "stripe"]
"""docs/design.md section 5's provider routes (plus the legacy sandbox)."""

SQL_STRINGS = [
    "'; DROP TABLE payment; --",
    "1' OR '1'='1",
    '" OR ""="',
    "x'); DELETE FROM payment_callback_log WHERE ('1'='1",
    "1; SELECT SLEEP(5); --",
    "\\'; UPDATE payment SET status='Succeeded'; --",
    "%' UNION SELECT callback_data FROM payment_callback_log --",
]


CLOSE = {"Connection": "close"}
"""For a request the gateway may answer before reading its body (see the oversized-body tests)."""


def _payment(gateway, **kw) -> str:  # noqa: F811
    return create_payment(gateway.engine, amount=kw.pop("amount", 1000), **kw)


def _status(gateway, payment_id: str) -> str:  # noqa: F811
    with gateway.engine.connect() as conn:
        return conn.execute(select(payment.c.status).where(payment.c.payment_id == payment_id)).scalar_one()


def _effects(gateway, payment_id: str) -> int:  # noqa: F811
    with gateway.engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(ledger_event).where(ledger_event.c.payment_id == payment_id)
        ).scalar_one()


def _refused_and_kept(gateway, body: bytes, headers: dict, code: str, path: str = "/callbacks/sandbox"):  # noqa: F811
    """POST the delivery; assert 4xx with ``code``, one row stored as rejected with the reason; return it."""
    before = gateway.last_callback_id()
    answer = gateway.request("POST", path, data=body, headers=headers)
    assert answer.status_code in (400, 401, 415), answer.text
    assert answer.json()["error"]["code"] == code
    rows = gateway.callbacks_after(before)
    assert len(rows) == 1 and bytes(rows[0].callback_data) == body
    assert rows[0].status == 3 and code in (rows[0].result or "")
    return rows[0]


# --- forged and replayed notifications ---------------------------------------------------------------------


@pytest.mark.parametrize("age", [TOLERANCE + 5, 3600, 10 * 86400, -(TOLERANCE + 5)])
def test_a_notification_signed_outside_the_tolerance_is_refused_kept_and_changes_nothing(gateway, age):  # noqa: F811
    payment_id = _payment(gateway)
    body, headers = signed(sandbox_event(payment_id), timestamp=int(time.time()) - age)
    _refused_and_kept(gateway, body, headers, "stale_timestamp")
    assert _status(gateway, payment_id) == "Pending" and _effects(gateway, payment_id) == 0


def test_the_same_notification_replayed_inside_the_tolerance_is_applied_once(gateway):  # noqa: F811
    payment_id = _payment(gateway)
    body, headers = signed(sandbox_event(payment_id))
    for _ in range(3):
        assert gateway.request("POST", "/callbacks/sandbox", data=body, headers=headers).status_code == 200
    # No broker and no compensator here: one sweep, as cron would run it, processes the stored rows.
    swept = gateway.stack.run("-m", "compensator", "compensate", "--once")
    assert swept.returncode == 0, swept.stderr[-2000:]
    assert _status(gateway, payment_id) == "Succeeded"
    with gateway.engine.connect() as conn:
        confirmed = conn.execute(
            select(func.count())
            .select_from(ledger_event)
            .where(ledger_event.c.payment_id == payment_id, ledger_event.c.event_type == "PaymentConfirmed")
        ).scalar_one()
    assert confirmed == 1


@pytest.mark.parametrize(
    "tamper",
    [
        lambda e: e["data"].update(amount=e["data"]["amount"] * 100),
        lambda e: e.update(type="charge.failed"),
        lambda e: e["data"].update(merchant_transaction_id="pay_someone_else"),
        lambda e: e["data"].update(provider_transaction_id="ch_forged"),
    ],
    ids=["amount", "type", "payment", "transaction"],
)
def test_a_tampered_body_under_the_original_signature_is_refused_and_kept(gateway, tamper):  # noqa: F811
    payment_id = _payment(gateway)
    event = sandbox_event(payment_id)
    _, headers = signed(event)
    tamper(event)
    row = _refused_and_kept(gateway, json.dumps(event).encode(), headers, "invalid_signature")
    assert row.status == 3
    assert _status(gateway, payment_id) == "Pending" and _effects(gateway, payment_id) == 0


def test_a_byte_appended_to_a_signed_body_is_refused(gateway):  # noqa: F811
    body, headers = signed(sandbox_event(_payment(gateway)))
    _refused_and_kept(gateway, body + b" ", headers, "invalid_signature")


@pytest.mark.parametrize("secret", ["whsec_wrong", SECRET + "x", SECRET[:-1], "", MERCHANT_TOKEN])
def test_a_signature_made_with_the_wrong_key_is_refused_and_kept(gateway, secret):  # noqa: F811
    payment_id = _payment(gateway)
    body, headers = signed(sandbox_event(payment_id), secret=secret)
    _refused_and_kept(gateway, body, headers, "invalid_signature")
    assert _status(gateway, payment_id) == "Pending"


@pytest.mark.parametrize(
    "foreign",
    [
        # Other providers' schemes over a valid sandbox body, keyed with the sandbox's own secret.
        lambda body, t: {"Stripe-Signature": signing.sign(SECRET, body, t)},
        lambda body, t: {
            "Wechatpay-Timestamp": str(t),
            "Wechatpay-Nonce": uuid.uuid4().hex,
            "Wechatpay-Signature": signing.compute(SECRET, body, t),
            "Wechatpay-Serial": "1234567890ABCDEF",
        },
        lambda body, t: {"Content-Type": "application/x-www-form-urlencoded", "sign": signing.compute(SECRET, body, t)},
    ],
    ids=["stripe", "wechatpay", "alipay"],
)
def test_another_providers_signature_on_the_sandbox_route_is_refused(gateway, foreign):  # noqa: F811
    payment_id = _payment(gateway)
    body = json.dumps(sandbox_event(payment_id)).encode()
    headers = foreign(body, int(time.time()))
    # Alipay's form encoding is refused for its content type before its signature is even looked at.
    code = "unsupported_content_type" if "form" in headers.get("Content-Type", "") else "invalid_signature"
    _refused_and_kept(gateway, body, headers, code)
    assert _status(gateway, payment_id) == "Pending"


@pytest.mark.parametrize("route", [r for r in PROVIDER_ROUTES if r != "sandbox"])
def test_a_sandbox_signed_delivery_on_another_providers_route_never_moves_the_payment(gateway, route):  # noqa: F811
    payment_id = _payment(gateway)
    body, headers = signed(sandbox_event(payment_id))
    before = gateway.last_callback_id()
    answer = gateway.request("POST", f"/callbacks/{route}", data=body, headers=headers)
    assert answer.status_code < 500
    if answer.status_code == 404:
        # The provider is not enabled here: it has no route and nothing is stored.
        assert answer.json()["error"]["code"] == "unknown_provider"
        assert gateway.callbacks_after(before) == []
    else:
        rows = gateway.callbacks_after(before)
        assert len(rows) == 1 and rows[0].provider == route
    # Whatever the route made of it, the sandbox's payment is not moved by another provider's route.
    assert _status(gateway, payment_id) == "Pending" and _effects(gateway, payment_id) == 0


# --- hostile bodies ---------------------------------------------------------------------------------------


def test_an_oversized_callback_is_413_and_kept_as_rejected(gateway):  # noqa: F811
    limit = make_settings().callback_max_body_bytes
    body = b'{"pad": "' + b"x" * limit + b'"}'
    before = gateway.last_callback_id()
    # Connection: close, as for every oversized request here: a body answered before it was read may leave
    # gunicorn closing the connection after the answer, and the next test's request must not race that close.
    answer = gateway.request("POST", "/callbacks/sandbox", data=body, headers={**signed(body)[1], **CLOSE})
    assert answer.status_code == 413
    chunked = gateway.request("POST", "/callbacks/sandbox", data=iter([body[:1000], body[1000:]]), headers=CLOSE)
    assert chunked.status_code == 413
    # Every delivery that reached the gateway is kept (invariant 2): rejected, with its first bytes only.
    rows = gateway.callbacks_after(before)
    assert [r.status for r in rows] == [3, 3]
    assert all(bytes(r.callback_data) == body[:limit] for r in rows)


def test_an_oversized_payment_request_is_413(gateway):  # noqa: F811
    body = json.dumps({"order_no": "o", "amount": 1, "currency": "CNY", "provider": "sandbox", "pad": "x" * 300_000})
    headers = {**gateway.merchant(), "Idempotency-Key": uuid.uuid4().hex, "Content-Type": "application/json", **CLOSE}
    answer = gateway.request("POST", "/payments", data=body, headers=headers)
    assert answer.status_code == 413


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_deeply_nested_validly_signed_callback_is_400_and_kept(gateway, depth):  # noqa: F811
    body = b"[" * depth + b"]" * depth
    _refused_and_kept(gateway, body, signed(body)[1], "malformed_callback")


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_deeply_nested_payment_request_is_400(gateway, depth):  # noqa: F811
    body = '{"order_no": "o", "amount": 1, "currency": "CNY", "provider": "sandbox", "description": '
    body += "[" * depth + "]" * depth + "}"
    headers = {**gateway.merchant(), "Idempotency-Key": uuid.uuid4().hex, "Content-Type": "application/json"}
    answer = gateway.request("POST", "/payments", data=body, headers=headers)
    assert answer.status_code == 400
    assert answer.json()["error"]["code"]


def test_invalid_utf8_and_wrong_content_types_get_4xx(gateway):  # noqa: F811
    for body, content_type in [
        (b"\xff\xfe\x00{", "application/json"),
        (b"order_no=1&amount=2", "application/x-www-form-urlencoded"),
        (b"<xml/>", "application/xml"),
        (b"", "application/json"),
    ]:
        headers = {**gateway.merchant(), "Idempotency-Key": uuid.uuid4().hex, "Content-Type": content_type}
        assert 400 <= gateway.request("POST", "/payments", data=body, headers=headers).status_code < 500
        before = gateway.last_callback_id()
        answer = gateway.request("POST", "/callbacks/sandbox", data=body, headers={"Content-Type": content_type})
        assert answer.status_code in (400, 401, 415)
        assert len(gateway.callbacks_after(before)) == 1


# --- SQL-looking strings -----------------------------------------------------------------------------------


@pytest.mark.parametrize("sql", SQL_STRINGS)
def test_sql_looking_strings_in_every_callback_field_are_stored_as_text(gateway, sql):  # noqa: F811
    event = sandbox_event(sql, event_id=sql, provider_transaction_id=sql, failure_code=sql)
    event["type"] = sql
    event["data"]["currency"] = sql
    body, headers = signed(event)
    headers["User-Agent"] = sql
    before = gateway.last_callback_id()
    succeeded = _succeeded(gateway)
    started = time.monotonic()
    answer = gateway.request("POST", "/callbacks/sandbox", data=body, headers=headers)
    assert time.monotonic() - started < 4, "an SQL SLEEP ran"
    assert answer.status_code == 400
    rows = gateway.callbacks_after(before)
    assert len(rows) == 1 and bytes(rows[0].callback_data) == body and rows[0].status == 3
    assert json.loads(rows[0].headers)["User-Agent"] == sql
    _tables_intact(gateway, succeeded)


@pytest.mark.parametrize("sql", SQL_STRINGS)
def test_sql_looking_strings_in_every_payment_field_are_refused_or_stored_verbatim(gateway, sql):  # noqa: F811
    order_no = sql[:64]
    good = {"order_no": order_no, "amount": 100, "currency": "CNY", "provider": "sandbox", "description": sql}
    succeeded = _succeeded(gateway)
    started = time.monotonic()
    answer = gateway.request("POST", "/payments", json=good, headers={**gateway.merchant(), "Idempotency-Key": sql})
    assert answer.status_code == 201, answer.text
    payment_id = answer.json()["payment_id"]
    with gateway.engine.connect() as conn:
        row = conn.execute(select(payment).where(payment.c.payment_id == payment_id)).one()
    assert (row.order_no, row.description, row.idempotency_key, row.status) == (order_no, sql, sql, "Created")
    for field in ("currency", "provider", "amount"):
        bad = {**good, field: sql}
        answer = gateway.request(
            "POST", "/payments", json=bad, headers={**gateway.merchant(), "Idempotency-Key": uuid.uuid4().hex}
        )
        assert answer.status_code == 400, (field, answer.text)
    answer = gateway.request("GET", "/payments/" + requests.utils.quote(sql, safe=""), headers=gateway.merchant())
    assert answer.status_code == 404
    assert time.monotonic() - started < 10, "an SQL SLEEP ran"
    _tables_intact(gateway, succeeded)


def _succeeded(gateway) -> int:  # noqa: F811
    with gateway.engine.connect() as conn:
        return conn.execute(select(func.count()).where(payment.c.status == "Succeeded")).scalar_one()


def _tables_intact(gateway, succeeded: int) -> None:  # noqa: F811
    """Every table still reads, and no payment became Succeeded: the gateway is shared by the
    worker's modules, so the count is compared with the one before the request, not with a fresh database's."""
    with gateway.engine.connect() as conn:
        for table in (payment, payment_callback_log, ledger_event):
            conn.execute(select(func.count()).select_from(table)).scalar_one()
    assert _succeeded(gateway) == succeeded


# --- tokens ------------------------------------------------------------------------------------------------

PUBLIC = {"/healthz", "/readyz", "/metrics", "/openapi.json", "/callbacks/<provider_name>", "/static/<path:filename>"}
"""Routes that answer without a token: the load balancer's, Prometheus' (by source address), and providers'."""


OPS_PUBLIC = {"/ops/login", "/ops/static/<path:filename>"}
"""The ops console's login form and stylesheet; its other routes need a session (a browser's cookie, not a token)."""


def _protected_routes(ops: bool = False) -> list[tuple[str, str]]:
    """Every (method, path) of the gateway outside PUBLIC: the token-protected ones, or (``ops``) the console's."""
    app = create_app(make_settings(database_url="sqlite://"))
    found = []
    for rule in app.url_map.iter_rules():
        if rule.rule in PUBLIC or rule.rule in OPS_PUBLIC or rule.rule.startswith("/ops") != ops:
            continue
        path = rule.rule.replace("<payment_id>", "pay_x").replace("<refund_id>", "re_x").replace("<int:", "<1")
        path = re.sub(r"<1[a-z_]+>", "1", path)
        path = path.replace("<", "").replace(">", "")
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            found.append((method, path))
    return found


BAD_AUTHORIZATION = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer wrong-token",
    f"Bearer {MERCHANT_TOKEN[:-1]}",
    f"Bearer {MERCHANT_TOKEN}x",
    f"Basic {MERCHANT_TOKEN}",
    MERCHANT_TOKEN,
    f"Bearer {OPS_TOKEN}",
]


@pytest.mark.parametrize(("method", "path"), _protected_routes())
def test_protected_routes_refuse_a_missing_or_wrong_token(gateway, method, path):  # noqa: F811
    for authorization in BAD_AUTHORIZATION:
        headers = {"Idempotency-Key": uuid.uuid4().hex}
        if authorization is not None:
            headers["Authorization"] = authorization
        body = {"order_no": "o", "amount": 1, "currency": "CNY", "provider": "sandbox"}
        answer = gateway.request(method, path, json=body, headers=headers)
        assert answer.status_code in (401, 403), (authorization, answer.status_code)
        assert answer.json()["error"]["code"]
    with gateway.engine.connect() as conn:
        assert conn.execute(select(func.count()).where(payment.c.order_no == "o")).scalar_one() == 0


@pytest.mark.parametrize(("method", "path"), _protected_routes(ops=True))
def test_ops_routes_refuse_a_request_without_a_session_whatever_its_token(gateway, method, path):  # noqa: F811
    for authorization in [*BAD_AUTHORIZATION, f"Bearer {OPS_TOKEN}"]:
        headers = {"Authorization": authorization} if authorization is not None else {}
        answer = gateway.request(method, path, data={"note": "n", "id": "1"}, headers=headers, allow_redirects=False)
        if method == "GET":
            assert answer.status_code == 302 and answer.headers["Location"].startswith("/ops/login"), path
        else:
            assert answer.status_code == 401, (path, authorization, answer.status_code)
        assert 'id="logout"' not in answer.text  # nothing of a logged-in page


def test_the_ops_routes_are_among_the_session_protected_ones():
    routes = _protected_routes(ops=True)
    assert ("GET", "/ops/") in routes and ("POST", "/ops/callbacks/replay") in routes
    assert ("POST", "/ops/reviews/1/resolve") in routes


def test_the_merchant_routes_are_among_the_protected_ones():
    routes = _protected_routes()
    assert ("POST", "/payments") in routes and ("GET", "/payments/pay_x") in routes


# --- what reaches the logs ---------------------------------------------------------------------------------

CARDS = ["4111111111111111", "4111 1111 1111 1111", "5500-0000-0000-0004", "340000000000009"]


def test_nothing_secret_reaches_any_log(gateway):  # noqa: F811
    """Plant card numbers, CVVs, tokens and secrets everywhere a client can put them, then read every log."""
    for card in CARDS:
        event = sandbox_event(card, card_number=card, cvv="123", cvc="9876", note=f"card {card} cvv=123")
        body, headers = signed(event)
        gateway.request("POST", "/callbacks/sandbox", data=body, headers={**headers, "User-Agent": f"cvv: 123 {card}"})
        gateway.request("POST", "/callbacks/sandbox", data=body, headers={signing.HEADER: f"t=1,v1={SECRET}"})
        gateway.request("POST", "/callbacks/sandbox", data=b"{" + card.encode(), headers=headers)
        create = {"order_no": card, "amount": 1, "currency": "CNY", "provider": "sandbox", "description": "cvv=123"}
        gateway.request("POST", "/payments", json=create, headers={**gateway.merchant(), "Idempotency-Key": card})
        gateway.request("POST", "/payments", json={"card": card, "cvv": "123"}, headers=gateway.merchant())
        gateway.request("POST", "/payments", json=create, headers={"Authorization": f"Bearer {card}"})
        gateway.request("GET", f"/payments/{card}", headers=gateway.merchant())
        gateway.request("GET", f"/payments/{card}?cvv=123&token={MERCHANT_TOKEN}")
    deep = b"[" * 100_000 + b"]" * 100_000
    gateway.request("POST", "/callbacks/sandbox", data=deep, headers=signed(deep)[1])
    gateway.request("POST", "/payments", data=deep, headers={**gateway.merchant(), "Idempotency-Key": "deep"})
    time.sleep(0.5)  # let the workers flush their log lines
    logs = sorted(gateway.stack.tmp_path.glob("*.log"))
    assert logs and sum(p.stat().st_size for p in logs) > 0
    assert scan_logs(logs, SECRETS) == []


def test_the_leak_scanner_finds_what_it_looks_for():
    line = json.dumps({"msg": "x", "pan": "4111 1111 1111 1111", "extra": "cvv=123", "t": SECRET})
    found = leaks_in(line, [SECRET])
    assert (
        any("card number" in f for f in found) and any("CVV" in f for f in found) and any("secret" in f for f in found)
    )
    # Millisecond timestamps, ids and other long numbers are not card numbers.
    assert leaks_in('{"ts": 1733040000123, "id": "pay_01J4111111111111111", "n": 1234567890123}', []) == []
