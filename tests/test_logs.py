"""The log scrubber: the second line of defence for invariant 9."""

from __future__ import annotations

import importlib
import io
import json
import logging
import pkgutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from sqlalchemy import select

from payments.infra.db import utcnow
from payments.infra.logs import JsonFormatter, luhn_valid, scrub, scrub_logger, setup_logging
from payments.infra.schema import provider_call
from payments.outbound import provider_calls
from payments.providers.base import ChargeRequest
from payments.providers.sandbox.adapter import SandboxProvider


def test_card_numbers_are_redacted_however_they_are_written():
    for text in ["4111111111111111", "pay_4111111111111111", "4111 1111 1111 1111", "5500-0000-0000-0004"]:
        scrubbed = scrub(f"card {text} seen")
        assert "[REDACTED-PAN]" in scrubbed, text
        assert text not in scrubbed


def test_long_numbers_that_are_not_card_numbers_stay_readable():
    assert scrub("created 1764487000000 ms") == "created 1764487000000 ms"
    assert not luhn_valid("1764487000000")


def test_secrets_signatures_and_bearer_tokens_are_redacted():
    text = scrub('secret=whsec_abc token: "tok_1" Sandbox-Signature t=1,v1=' + "ab" * 32 + " Bearer xyz123")
    assert "whsec_abc" not in text and "tok_1" not in text and "ab" * 32 not in text and "xyz123" not in text


def test_the_formatter_scrubs_messages_and_extras():
    record = logging.LogRecord("t", logging.INFO, __file__, 1, "paid with %s", ("4111111111111111",), None)
    record.body = {"cvv": "123", "pan": "4012888888881881"}
    line = JsonFormatter().format(record)
    assert "4111111111111111" not in line and "4012888888881881" not in line
    assert json.loads(line)["msg"] == "paid with [REDACTED-PAN]"


# --- the scrubbing table (issue 6): each text, and the parts of it that must never come out ------------------

STANDARD_WEBHOOK_SIG = "K5oZfzN95Z9UVu1EsfQmfVNQhnkZ2pj9o9NDN/H/pI4="
OTHER_SIG = "3p8WQmE0b2FvHkXr7c9Gq1sYzT4nLd6uJwA5iRfMhBo="
SCRUB_TABLE: list[tuple[str, str, list[str]]] = [
    ("bearer header", "Authorization: Bearer eyJhbGciOi.J9x-y_z", ["eyJhbGciOi", "J9x-y_z"]),
    ("bearer in text", "retrying with bearer tok_8f3kd02kdl", ["tok_8f3kd02kdl"]),
    ("bearer json", '{"Authorization": "Bearer abc123def456"}', ["abc123def456"]),
    ("*_token k=v", "access_token=at9f8e7d6c&expires=3600", ["at9f8e7d6c"]),
    ("*_token json with spaces", '{"refresh_token": "rt one two three"}', ["rt one two three", "one two"]),
    ("*_token header", "X-Ops-Token: ops tok 4242", ["ops tok 4242", "tok 4242"]),
    ("*_secret k=v with spaces", "client_secret=very secret words here", ["very secret words"]),
    ("*_secret json", '{"app_secret": "s3cr3t-value"}', ["s3cr3t-value"]),
    ("*_secret header", "Webhook-Secret: s3cr3t header value", ["s3cr3t header value"]),
    ("*_key k=v", "api_key=AKIA1234567890", ["AKIA1234567890"]),
    ("*_key json with spaces", '{"private_key": "-----BEGIN KEY----- abc def"}', ["BEGIN KEY", "abc def"]),
    ("*_key header", "X-Api-Key: key with spaces 99", ["key with spaces 99"]),
    ("password k=v with spaces", "login password=correct horse battery staple", ["correct horse", "staple"]),
    ("password json", '{"user": "bob", "password": "hunter 2"}', ["hunter 2"]),
    ("password header", "Password: open sesame", ["open sesame"]),
    ("password repr", "{'password': 'p4ss w0rd'}", ["p4ss w0rd"]),
    ("cvv k=v", "card cvv=737 ok", ["737"]),
    ("cvc json number", '{"cvc": 4242, "amount": 100}', ["4242"]),
    ("cvv json string", '{"cvv": "123"}', ['"123"']),
    ("cvc header", "CVC: 321", ["321"]),
    ("whsec", "secret is whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]),
    ("sk_live", "stripe key sk_live_51HbQ2eKz9xYvTQ", ["51HbQ2eKz9xYvTQ", "sk_live_51"]),
    ("sk_test", "using sk_test_4eC39HqLyjWDarjtT1zdp7dc", ["4eC39HqLyjWDarjtT1zdp7dc"]),
    ("standard webhooks signature", f"webhook-signature: v1,{STANDARD_WEBHOOK_SIG}", [STANDARD_WEBHOOK_SIG]),
    (
        "standard webhooks, several",
        f"sigs v1,{STANDARD_WEBHOOK_SIG} v1,{OTHER_SIG}",
        [
            STANDARD_WEBHOOK_SIG,
            OTHER_SIG,
        ],
    ),
    ("sandbox signature", "Sandbox-Signature: t=1764487000,v1=" + "9f" * 32, ["9f" * 32]),
    ("cookie header", "Cookie: session=8d7f6e5d; csrftoken=abc999", ["8d7f6e5d", "abc999"]),
    ("set-cookie header", "Set-Cookie: sid=31d4d96e407aad42; Path=/; Secure", ["31d4d96e407aad42"]),
    ("card with spaces", "card 4111 1111 1111 1111 declined", ["4111 1111 1111 1111", "1111 1111"]),
    ("card with dashes", "card 5500-0000-0000-0004", ["5500-0000-0000-0004", "0000-0004"]),
    ("card with dots", "card 4012.8888.8888.1881", ["4012.8888.8888.1881", "8888.1881"]),
    ("card plain", "pan=4242424242424242", ["4242424242424242"]),
    ("url password", "mysql+pymysql://paysync:dbpass123@db:3306/paysync", ["dbpass123"]),
]
IDS = [name for name, _, _ in SCRUB_TABLE]


def _paysync_loggers() -> list[str]:
    """Every logger paysync's own modules create, found by importing them all."""
    import compensator
    import consumer
    import gateway
    import payments

    for package in (payments, gateway, consumer, compensator):
        for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if module.name in ("gateway.wsgi", "gateway.gunicorn_conf"):  # these start a process
                continue
            if (
                module.name.startswith("payments.infra.migrations.")
                and module.name != "payments.infra.migrations.compare"
            ):
                continue  # Alembic scripts: they run inside Alembic's context, not on import
            importlib.import_module(module.name)
    names = [n for n in logging.root.manager.loggerDict if n.startswith("paysync")]
    assert len(names) > 10, names
    return sorted(names)


@pytest.fixture
def json_logs():
    """setup_logging as every process calls it, writing to a buffer; the global logging state restored after."""
    root = logging.getLogger()
    saved = (root.handlers[:], root.level, logging.getLogRecordFactory())
    setup_logging("DEBUG", "test")
    buffer = io.StringIO()
    root.handlers[0].stream = buffer
    yield buffer
    root.handlers[:], _, factory = saved
    root.setLevel(saved[1])
    logging.setLogRecordFactory(factory)


def _leaks(output: str, secrets: list[str]) -> list[str]:
    return [s for s in secrets if s in output]


@pytest.mark.parametrize(("name", "text", "secrets"), SCRUB_TABLE, ids=IDS)
def test_every_paysync_logger_scrubs_the_table(json_logs, name, text, secrets):
    for logger_name in _paysync_loggers():
        logger = logging.getLogger(logger_name)
        logger.warning(text)
        logger.warning("saw %s", text)
        logger.warning("extras", extra={"detail": text, "headers": {"raw": text}, "items": [text]})
        try:
            raise ValueError(text)
        except ValueError:
            logger.exception("failed")
    lines = [json.loads(line) for line in json_logs.getvalue().splitlines()]  # still one JSON object a line
    assert len(lines) >= 4 * len(_paysync_loggers())
    for line in lines:
        del line["ts"]  # its microseconds could hold any short run of digits, such as a CVC
    output = json.dumps(lines, ensure_ascii=False)
    assert not _leaks(output, secrets), (name, output[:600])


@pytest.mark.parametrize(("name", "text", "secrets"), SCRUB_TABLE, ids=IDS)
def test_gunicorns_loggers_are_scrubbed_too(name, text, secrets):
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("%(message)s %(exc_text)s"))
    for logger_name in ("gunicorn.error", "gunicorn.access"):
        logger = logging.getLogger(logger_name)
        scrub_logger(logger_name)  # what gateway/gunicorn_conf.py's when_ready does
        logger.addHandler(handler)
        try:
            logger.error("bad request %s", text)
            try:
                raise OSError(text)
            except OSError:
                logger.exception("Socket error processing request.")
        finally:
            logger.removeHandler(handler)
    assert buffer.getvalue().count("bad request") == 2
    assert not _leaks(buffer.getvalue(), secrets), (name, buffer.getvalue()[:600])


class _Echo(BaseHTTPRequestHandler):
    """A provider that answers every request with the body it was told to (a 500, so the outcome is Unknown)."""

    answer = b""

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.answer)))
        self.end_headers()
        self.wfile.write(self.answer)

    def log_message(self, *_args) -> None:  # noqa: ANN002
        pass


@pytest.fixture(scope="module")
def echo_provider():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield SandboxProvider("whsec_unused", api_url=f"http://127.0.0.1:{server.server_address[1]}")
    server.shutdown()


@pytest.mark.parametrize(("name", "text", "secrets"), SCRUB_TABLE, ids=IDS)
def test_the_provider_call_response_column_is_scrubbed(sqlite, echo_provider, name, text, secrets):
    _Echo.answer = (
        json.dumps({"error": {"code": "boom", "message": text}, "echo": text}).encode() + b"\n" + text.encode()
    )
    outcome = echo_provider.charge(ChargeRequest("pay_scrub", 100, "CNY"), "key-1", timeout=5)
    with sqlite.begin() as conn:
        call_id = provider_calls.start(
            conn, provider="sandbox", operation="charge", params={"payment_id": "pay_scrub"}, now=utcnow()
        )
        provider_calls.finish(conn, call_id, outcome, utcnow())
    with sqlite.connect() as conn:
        stored = conn.execute(select(provider_call.c.response).where(provider_call.c.id == call_id)).scalar_one()
    assert stored and "boom" in stored  # the evidence is there ...
    assert not _leaks(stored, secrets), (name, stored)  # ... without the secret parts
