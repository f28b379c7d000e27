"""GET /openapi.json stays true: valid OpenAPI 3.1, one entry per merchant route, real answers that conform,
and schemathesis fuzzing the real gunicorn gateway from it (positive and negative cases, then stateful runs
that follow the document's links from a created payment to reading it).
"""

from __future__ import annotations

import re
import uuid

import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from gateway import create_app
from gateway.openapi import IDEMPOTENCY_KEY_PATTERN
from payments.charges import ISO_4217
from tests.hostile import MERCHANT_TOKEN, gateway  # noqa: F401 - the module's gateway fixture
from tests.support import make_settings

MERCHANT_PREFIX = "/payments"
"""The merchant API's routes; every one must be in the document, and nothing else may be."""


def _app(**overrides):  # noqa: ANN202
    return create_app(make_settings(database_url="sqlite://", **overrides))


def _document(**overrides) -> dict:
    answer = _app(**overrides).test_client().get("/openapi.json")
    assert answer.status_code == 200 and answer.content_type == "application/json"
    return answer.get_json()


def test_the_document_is_valid_openapi_3_1():
    doc = _document()
    assert doc["openapi"].startswith("3.1")
    schemathesis.openapi.from_dict(doc).validate()  # raises on anything the 3.1 meta-schema refuses


def test_the_document_describes_every_merchant_route_and_nothing_else():
    app = _app()
    served = set()
    for rule in app.url_map.iter_rules():
        if rule.rule.startswith(MERCHANT_PREFIX):
            path = rule.rule.replace("<", "{").replace(">", "}")
            served |= {(path, m.lower()) for m in rule.methods - {"HEAD", "OPTIONS"}}
    described = {(path, method) for path, item in _document()["paths"].items() for method in item}
    assert described == served


def test_a_pending_answer_with_its_qr_code_is_a_documented_payment():
    schema = _document()["components"]["schemas"]["Payment"]
    assert "Pending" in schema["properties"]["status"]["enum"] and "qr_code" not in schema["required"]
    pending = {
        "payment_id": "pay_01J0000000000000000000000",
        "order_no": "o-1",
        "amount": 1000,
        "currency": "CNY",
        "provider": "alipay",
        "description": None,
        "payment_method": None,
        "status": "Pending",
        "provider_transaction_id": None,
        "qr_code": "https://qr.alipay.com/bax00000",
        "created_at": "2026-12-01T00:00:00Z",
    }
    jsonschema_rs.validate(schema, pending)
    with pytest.raises(jsonschema_rs.ValidationError):  # the schema does look at it: a QR code is text
        jsonschema_rs.validate(schema, {**pending, "qr_code": 5})


def test_the_document_follows_the_configuration():
    doc = _document(merchant_max_amount=5000, sandbox_legacy_enabled=True)
    create = doc["components"]["schemas"]["CreatePayment"]["properties"]
    assert create["amount"]["maximum"] == 5000
    assert create["provider"]["enum"] == ["sandbox", "sandbox_legacy"]
    assert set(create["currency"]["enum"]) == ISO_4217
    assert _document()["components"]["schemas"]["CreatePayment"]["properties"]["provider"]["enum"] == ["sandbox"]


# --- against the real gateway -------------------------------------------------------------------------------


# Built from the code's own document (what a gateway with the default settings serves; the first live test
# checks that it does), because schemathesis needs the schema when pytest collects the tests.
schema = schemathesis.openapi.from_dict(_document())
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=60,
    deterministic=True,
    # The merchant token is set below; the token checks are in tests/test_security.py.
    with_security_parameters=False,
)


@schema.hook("map_case")
def _what_json_schema_cannot_say(_context, case):  # noqa: ANN001, ANN202
    """Two rules of the API that JSON Schema cannot express, applied to the generated cases.

    - An Idempotency-Key names one request: the same key with another body is 422 by contract (README
      "Outbound charges"). A schema-valid key is replaced by a fresh one so a valid case stays valid.
    - JSON Schema's "integer" admits 1.0; paysync refuses a float amount on purpose (invariant 7), so an
      integral float is sent as the integer it stands for.
    """
    if case.operation.path not in ("/payments", "/payments/{payment_id}/refunds") or case.method.upper() != "POST":
        return case
    key = (case.headers or {}).get("Idempotency-Key")
    if isinstance(key, str) and len(key) <= 255 and re.fullmatch(IDEMPOTENCY_KEY_PATTERN, key):
        case.headers["Idempotency-Key"] = uuid.uuid4().hex
    if isinstance(case.body, dict) and isinstance(case.body.get("amount"), float) and case.body["amount"].is_integer():
        case.body["amount"] = int(case.body["amount"])
    return case


@pytest.fixture(scope="module")
def api_schema(gateway):  # noqa: F811
    """The schema, set up to call the running gateway with the merchant token."""
    schema.config.update(base_url=gateway.url, headers={"Authorization": f"Bearer {MERCHANT_TOKEN}"})
    return schema


@pytest.mark.mariadb
@pytest.mark.slow
def test_real_answers_conform_to_the_document(gateway, api_schema):  # noqa: F811
    assert requests.get(f"{gateway.url}/openapi.json", timeout=10).json() == _document()
    auth = {"Authorization": f"Bearer {MERCHANT_TOKEN}"}
    create = api_schema["/payments"]["POST"]
    show = api_schema["/payments/{payment_id}"]["GET"]
    key = uuid.uuid4().hex
    body = {"order_no": f"o-{key[:8]}", "amount": 1234, "currency": "CNY", "provider": "sandbox"}
    url = gateway.url
    answers = []
    first = requests.post(f"{url}/payments", json=body, headers={**auth, "Idempotency-Key": key}, timeout=10)
    assert first.status_code == 201
    answers.append((create, first))
    again = requests.post(f"{url}/payments", json=body, headers={**auth, "Idempotency-Key": key}, timeout=10)
    assert again.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    answers.append((create, again))
    other = requests.post(
        f"{url}/payments", json={**body, "amount": 1}, headers={**auth, "Idempotency-Key": key}, timeout=10
    )
    assert other.status_code == 422
    answers.append((create, other))
    for bad in ({**body, "amount": 1.5}, {**body, "currency": "XXX"}, {**body, "extra": 1}):
        refused = requests.post(f"{url}/payments", json=bad, headers={**auth, "Idempotency-Key": uuid.uuid4().hex})
        assert refused.status_code == 400
        answers.append((create, refused))
    answers.append((create, requests.post(f"{url}/payments", json=body, timeout=10)))
    payment_id = first.json()["payment_id"]
    found = requests.get(f"{url}/payments/{payment_id}", headers=auth, timeout=10)
    assert found.status_code == 200 and found.json()["payment_id"] == payment_id
    answers.append((show, found))
    answers.append((show, requests.get(f"{url}/payments/pay_nope", headers=auth, timeout=10)))
    answers.append((show, requests.get(f"{url}/payments/{payment_id}", timeout=10)))
    refund = api_schema["/payments/{payment_id}/refunds"]["POST"]
    show_refund = api_schema["/payments/{payment_id}/refunds/{refund_id}"]["GET"]
    refund_url = f"{url}/payments/{payment_id}/refunds"
    for target, data in (
        (refund_url, {"amount": 1}),
        (refund_url, {"amount": 0}),
        (f"{url}/payments/x/refunds", {"amount": 1}),
    ):
        # A Created payment cannot be refunded yet (409), a bad amount is 400, an unknown payment 404.
        answers.append((refund, requests.post(target, json=data, headers={**auth, "Idempotency-Key": key}, timeout=10)))
    assert [a.status_code for _, a in answers[-3:]] == [409, 400, 404]
    answers.append((show_refund, requests.get(f"{refund_url}/re_nope", headers=auth, timeout=10)))
    for operation, answer in answers:
        assert str(answer.status_code) in operation.definition.raw["responses"], (operation.label, answer.status_code)
        operation.validate_response(answer)  # raises with the differences if the body is not the documented one


@pytest.mark.mariadb
@pytest.mark.slow
@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_positive_and_negative_cases(case, gateway):  # noqa: F811
    """Every check schemathesis has: no 5xx, documented status codes, content types, headers and bodies,
    valid data accepted and invalid data refused."""
    case.call_and_validate(base_url=gateway.url, headers={"Authorization": f"Bearer {MERCHANT_TOKEN}"})


@pytest.mark.mariadb
@pytest.mark.slow
def test_schemathesis_stateful_create_then_read(api_schema, gateway):  # noqa: F811
    """Sequences that follow the document's link from POST /payments to GET /payments/{payment_id}."""

    class Merchant(api_schema.as_state_machine()):
        def get_call_kwargs(self, case):  # noqa: ANN001, ANN202
            return {"base_url": gateway.url, "headers": {"Authorization": f"Bearer {MERCHANT_TOKEN}"}}

    Merchant.run(
        settings=settings(
            max_examples=25,
            stateful_step_count=6,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
    )


@pytest.mark.mariadb
def test_reading_a_payment_with_the_database_down_is_the_documented_503(mariadb):
    from payments.db import make_engine
    from tests.stack import db_url, url_via
    from tests.support import TcpProxy, create_payment

    payment_id = create_payment(mariadb)
    proxy = TcpProxy("127.0.0.1", mariadb.url.port or 3306)
    engine = make_engine(url_via(db_url(mariadb), proxy.port))
    try:
        app = create_app(
            make_settings(database_url=db_url(mariadb), merchant_api_token=(MERCHANT_TOKEN,)), engine=engine
        )
        client = app.test_client()
        auth = {"Authorization": f"Bearer {MERCHANT_TOKEN}"}
        assert client.get(f"/payments/{payment_id}", headers=auth).status_code == 200
        proxy.cut()
        answer = client.get(f"/payments/{payment_id}", headers=auth)
        assert answer.status_code == 503 and answer.get_json()["error"]["code"] == "storage_unavailable"
        assert "503" in _document()["paths"]["/payments/{payment_id}"]["get"]["responses"]
    finally:
        proxy.close()
        engine.dispose()
