"""GET /openapi.json stays true: valid OpenAPI 3.1, one entry per merchant route, real answers that conform,
and schemathesis fuzzing the real gunicorn gateway from it (positive and negative cases, then stateful runs
that follow the document's links from a created payment to reading it).
"""

from __future__ import annotations

import uuid

import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.config import ChecksConfig, SchemathesisConfig

from gateway import create_app
from payments.outbound.charges import ISO_4217, InvalidRequest, parse_create
from payments.outbound.refunds import parse_refund
from tests.hostile import MERCHANT_TOKEN
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
KEYED_POST_STATUSES = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx", "422"]
"""positive_data_acceptance on the keyed POSTs: schemathesis' default list, plus 422.

No check is off. This one is widened by one status, for one reason JSON Schema cannot express: an
Idempotency-Key names one request, so the same key with another (schema-valid) body is refused with 422
by contract (docs/flows/charges.md, and the document's 422 of each POST says so), as is a refund of more
than is left (``amount_exceeds_refundable``), which depends on the database, not on the body. A schema-valid
body refused with 400 (as ``{"amount": 8388607.0}`` was) still fails the check.
"""
CONFIG = SchemathesisConfig.from_dict(
    {
        "checks": {"enabled": True},  # every check schemathesis has: the `--checks all` of its CLI
        "operations": [
            {
                "include-method": "POST",
                "checks": {"positive_data_acceptance": {"expected-statuses": KEYED_POST_STATUSES}},
            }
        ],
    }
)
schema = schemathesis.openapi.from_dict(_document(), config=CONFIG)
schema.config.generation.update(
    modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
    max_examples=60,
    deterministic=True,
    # The merchant token is set below; the token checks are in tests/test_security.py.
    with_security_parameters=False,
)


def test_every_schemathesis_check_is_on_for_every_operation():
    built_in = [name for name in ChecksConfig.__annotations__ if not name.startswith("_")]
    assert len(built_in) > 10, built_in
    for result in schema.get_all_operations():
        operation = result.ok()
        checks = schema.config.checks_config_for(operation=operation)
        # max_response_time is the one left out: it needs a limit, and a time limit would test the machine.
        off = [name for name in built_in if name != "max_response_time" and not getattr(checks, name).enabled]
        assert off == [], (operation.label, off)


@pytest.mark.parametrize("amount", ["8388607.0", "8388607", "8.388607e6", "8388607.000", "838860700e-2"])
def test_an_integral_amount_is_taken_exactly_however_json_writes_it(amount):
    body = f'{{"order_no": "o-1", "amount": {amount}, "currency": "CNY", "provider": "sandbox"}}'.encode()
    assert parse_create(body, frozenset({"sandbox"}), 10**8).amount_minor == 8388607
    assert parse_refund(f'{{"amount": {amount}}}'.encode()) == (8388607, None)
    big = f"{2**53 + 1}.0".encode()  # past what a double holds exactly: still exact, as it was never one
    assert parse_refund(b'{"amount": ' + big + b"}") == (2**53 + 1, None)


@pytest.mark.parametrize("amount", ["8388607.5", "1e-2", "0.0", "-1.0", "1e999999999", '"5"', "true"])
def test_an_amount_with_a_fraction_or_out_of_range_is_refused(amount):
    body = f'{{"order_no": "o-1", "amount": {amount}, "currency": "CNY", "provider": "sandbox"}}'.encode()
    with pytest.raises(InvalidRequest) as refused:
        parse_create(body, frozenset({"sandbox"}), 10**8)
    assert refused.value.code in ("invalid_amount", "amount_too_large")


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
    from payments.infra.db import make_engine
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
