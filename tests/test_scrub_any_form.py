"""Invariant 9 whatever the form: card numbers with any separators, secret names in any case style, PEM blocks.

The scrubber (``payments.infra.logs``) is checked against an independent detector
written here: a card number leaks if its digits appear in order with only a
few non-digits between them, a secret leaks if its value appears at all. The
first tests feed generated text to every formatting path in-process; the
last ones go through the running gateway (gunicorn, MariaDB), whose own
"Invalid HTTP Version" warning echoes an unauthenticated request line, and
through the ops login, whose name field is recorded.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import socket
import uuid

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from payments.infra import logs
from payments.infra.logs import JsonFormatter, scrub, scrub_logger
from tests.hostile import MERCHANT_TOKEN, OPS_TOKEN
from tests.support import wait_until

# --- generated card numbers and secrets --------------------------------------------------------------------


def _luhn_complete(body: str) -> str:
    total = 0
    for i, ch in enumerate(reversed(body)):
        d = int(ch)
        if i % 2 == 0:  # doubled: these sit at odd positions once the check digit is appended
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return body + str((10 - total % 10) % 10)


@st.composite
def card_numbers(draw) -> str:
    """A Luhn-valid 13-19 digit number starting like a card network's (random digits even in simple examples)."""
    length = draw(st.integers(13, 19))
    seed = draw(st.integers(0, 2**64))
    digits = "".join(str(b % 10) for b in hashlib.sha256(str(seed).encode()).digest())[: length - 2]
    return _luhn_complete(draw(st.sampled_from("3456")) + digits)


SEPARATORS = [" ", "  ", "   ", "\t", "-", " - ", ".", "_", "/", " / ", "+", "\t\t", "_-", "%20"]


@st.composite
def written_cards(draw) -> tuple[str, str]:
    """(digits, as written): grouped by 4 (or 4-6-5), one separator style throughout or a mix."""
    pan = draw(card_numbers())
    groups = [pan[:4], pan[4:10], pan[10:]] if draw(st.booleans()) else [pan[i : i + 4] for i in range(0, len(pan), 4)]
    if draw(st.booleans()):
        sep = draw(st.sampled_from(SEPARATORS))
        return pan, sep.join(groups)
    text = groups[0]
    for group in groups[1:]:
        text += draw(st.sampled_from(SEPARATORS)) + group
    return pan, text


PREFIXES = ["access", "client", "refresh", "api", "private", "app", "db", "merchant", "v3", "webhook"]
WORDS = ["token", "secret", "password", "passwd", "pwd", "passphrase", "key", "credential"]


def _styled(words: list[str], style: str) -> str:
    if style == "snake":
        return "_".join(words)
    if style == "screaming":
        return "_".join(words).upper()
    if style == "kebab":
        return "-".join(words)
    if style == "train":
        return "-".join(w.capitalize() for w in words)
    if style == "dot":
        return ".".join(words)
    if style == "flat":
        return "".join(words)
    if style == "camel":
        return words[0] + "".join(w.capitalize() for w in words[1:])
    if style == "acronym":  # APIv3Key
        return words[0].upper() + "".join(w if w[0].isdigit() else w.capitalize() for w in words[1:])
    return "".join(w.capitalize() for w in words)  # pascal


@st.composite
def secret_names(draw) -> str:
    word = draw(st.sampled_from(WORDS))
    prefix = draw(st.lists(st.sampled_from(PREFIXES), min_size=1 if word == "key" else 0, max_size=3))
    style = draw(st.sampled_from(["snake", "screaming", "kebab", "train", "dot", "flat", "camel", "acronym", "pascal"]))
    return _styled([*prefix, word], style)


@st.composite
def secret_values(draw) -> str:
    seed = draw(st.integers(0, 2**64))
    return "Q" + hashlib.sha256(f"value {seed}".encode()).hexdigest()[:20]


FORMS = ["{n}={v}", "{n}: {v}", '"{n}": "{v}"', "'{n}': '{v}'", "{n} = {v}", '{{"{n}":"{v}"}}', "{n}={v}&x=1"]


@st.composite
def named_secrets(draw) -> tuple[str, str]:
    """(value, text naming it) in one of the forms logs hold: k=v, a header, JSON, a repr, a query string."""
    name, value = draw(secret_names()), draw(secret_values())
    return value, draw(st.sampled_from(FORMS)).format(n=name, v=value)


def pem_block(seed: int, newline: str = "\n") -> tuple[str, str]:
    body = hashlib.sha256(str(seed).encode()).hexdigest()
    pem = f"-----BEGIN PRIVATE KEY-----{newline}MIIE{body}{newline}{body[::-1]}{newline}-----END PRIVATE KEY-----"
    return body, pem


# --- the independent detector ------------------------------------------------------------------------------


def card_leaked(digits: str, text: str) -> bool:
    """The digits in order, with at most six non-digits or %-escapes between any two (separators, quoting)."""
    return re.search(r"(?:\D|%[0-9A-Fa-f]{2}){0,6}".join(digits), text) is not None


def leaks(text: str, cards: list[str], secrets: list[str]) -> list[str]:
    found = [f"card {d[:4]}…{d[-2:]}" for d in cards if card_leaked(d, text)]
    return found + [f"secret {s[:6]}…" for s in secrets if s in text]


# --- in-process: every formatting path ---------------------------------------------------------------------


def _through_every_path(text: str) -> str:
    """``text`` through paysync's JSON formatter (message, args, extras, traceback) and a gunicorn-style logger."""
    out = []
    formatter = JsonFormatter()
    record = logging.LogRecord("paysync.t", logging.WARNING, __file__, 1, "saw %s", (text,), None)
    record.detail = {"raw": text, "items": [text]}
    out.append(formatter.format(record))
    out.append(formatter.format(logging.LogRecord("paysync.t", logging.WARNING, __file__, 1, text, (), None)))
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("test.scrub.any_form")
    logger.handlers[:] = [handler]
    logger.propagate = False
    scrub_logger("test.scrub.any_form")  # what gunicorn_conf does for gunicorn's loggers
    logger.warning("Invalid HTTP Version: %r", text)  # gunicorn's own warning, in its shape
    logger.handlers[:] = []
    out.append(buffer.getvalue())
    return "\n".join(out)


@settings(max_examples=400, deadline=None)
@given(written_cards(), named_secrets(), st.integers(0, 2**32))
@example(("4111111111111111", "4111  1111  1111  1111"), ("Q1", "accessToken=Q1"), 0)
@example(("4111111111111111", "4111_1111_1111_1111"), ("Q2", '"clientSecret": "Q2"'), 1)
@example(("4111111111111111", "4111/1111/1111/1111"), ("Q3", "privateKey: Q3"), 2)
@example(("4111111111111111", "4111\t1111\t1111\t1111"), ("Q4", "APIv3Key=Q4"), 3)
@example(("5500000000000004", "5500\t\t0000 0000-0004"), ("Q5", "pwd=Q5"), 4)
def test_no_card_number_secret_or_pem_block_survives_any_log_path(card, named, seed):
    (digits, card_text), (value, secret_text) = card, named
    pem_body, pem = pem_block(seed, "\n" if seed % 2 else "\\n")
    text = f"declined card {card_text} with {secret_text} and key {pem} done"
    output = _through_every_path(text)
    assert leaks(output, [digits], [value, pem_body]) == [], (text, output)


def test_the_detector_finds_what_it_looks_for():
    assert card_leaked("4111111111111111", "x 4111\\t1111\\t1111\\t1111 y")
    assert card_leaked("4111111111111111", '"4111  1111 / 1111_1111"')
    assert card_leaked("4111111111111111", "4111%201111%201111%201111")
    assert not card_leaked("4111111111111111", "4111 [REDACTED] 1111")
    assert leaks("pwd=Qabc", [], ["Qabc"]) == ["secret Qabc…"]


def test_names_that_are_not_secrets_stay_readable():
    for text in [
        "invalid_signature: bad",
        "design: v2",
        "key: cache-1",
        "created 1764487000000 ms",
        "order 2026-12-03",
    ]:
        assert scrub(text) == text


def test_a_child_loggers_records_are_scrubbed_by_the_handler_they_reach():
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    parent = logging.getLogger("test.scrub.parent")
    parent.handlers[:] = [handler]
    parent.propagate = False
    scrub_logger("test.scrub.parent")  # the logger's own filter does not see its children's records
    try:
        assert logs.scrub_every_handler() >= 1
        parent.getChild("http").warning("Invalid request line: %r", "GET /x?pan=4111111111111111 HTTP/9")
    finally:
        parent.handlers[:] = []
    assert "[REDACTED-PAN]" in buffer.getvalue() and "4111111111111111" not in buffer.getvalue()


# --- through the running gateway ---------------------------------------------------------------------------


def _marker() -> str:
    """A word only letters make (no digit the card detector could use), unique to one request."""
    return "mark" + "".join(chr(ord("a") + int(c, 16)) for c in uuid.uuid4().hex[:16])


def _raw_request_line(port: int, line: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(line.encode("latin-1") + b"\r\nHost: x\r\n\r\n")
        return sock.recv(200)


@pytest.mark.mariadb
@pytest.mark.slow
def test_gunicorns_warning_about_a_bad_request_line_leaks_nothing(gateway):  # noqa: F811
    """Unauthenticated request lines gunicorn refuses and echoes in its own warning, with generated payloads."""
    # Only what the gateway logged from here on: it is the worker's, shared with other modules, whose lines may
    # hold a two-letter "secret" such as Q1 by chance (an id, a signature).
    start = len(gateway.web.output())

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(written_cards(), named_secrets(), st.integers(0, 2**32))
    @example(("4111111111111111", "4111  1111  1111  1111"), ("Q1", "clientSecret=Q1"), 0)
    @example(("4111111111111111", "4111\t1111\t1111\t1111"), ("Q2", "APIv3Key=Q2"), 1)
    def one(card, named, seed):
        (digits, card_text), (value, secret_text) = card, named
        pem_body, pem = pem_block(seed, " ")
        marker = _marker()
        payload = f"{marker} {card_text} {secret_text} {pem}"
        # gunicorn echoes a request line from its third word on as the bad "version" (the whole line, with tabs).
        line = f"GET /x {payload} HTTP/1.1"
        assert _raw_request_line(gateway.port, line).startswith(b"HTTP/1.1 400")
        wait_until(lambda: marker in gateway.web.output(), timeout=10, message="gunicorn's warning")
        logged = [ln for ln in gateway.web.output().splitlines() if marker in ln]
        assert leaks("\n".join(logged), [digits], [value, pem_body]) == [], (line, logged)
        cards.append(digits)
        secrets.extend([value, pem_body])

    cards: list[str] = []
    secrets: list[str] = []
    one()
    gateway.assert_responsive()
    assert leaks(gateway.web.output()[start:], cards, secrets) == [], "on a line of its own"


def _ops_login(gateway, name: str, token: str) -> requests.Response:  # noqa: F811
    with requests.Session() as session:
        page = session.get(f"{gateway.url}/ops/login", timeout=10)
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
        data = {"csrf": csrf, "name": name, "token": token}
        return session.post(f"{gateway.url}/ops/login", data=data, allow_redirects=False, timeout=10)


@pytest.mark.mariadb
@pytest.mark.slow
@pytest.mark.parametrize("token_as_name", [OPS_TOKEN, f"alice {OPS_TOKEN}", MERCHANT_TOKEN, "bob 4111 1111 1111 1111"])
def test_a_token_or_card_number_typed_as_the_ops_name_is_refused_and_never_logged(gateway, token_as_name):  # noqa: F811
    answer = _ops_login(gateway, token_as_name, OPS_TOKEN)
    assert answer.status_code == 400 and "not a name" in answer.text
    marker = _marker()
    assert _ops_login(gateway, f"alice {marker}", OPS_TOKEN).status_code == 302  # a name is a name
    wait_until(lambda: marker in gateway.web.output(), timeout=10, message="the login line")
    output = gateway.web.output()
    assert leaks(output, ["4111111111111111"], [OPS_TOKEN, MERCHANT_TOKEN]) == []
    assert json.loads(next(ln for ln in output.splitlines() if marker in ln))["actor"] == f"alice {marker}"
