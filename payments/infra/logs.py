"""Structured logging: one JSON object per line, with secrets scrubbed.

Invariant 9: logs never contain card numbers, CVV, passwords, keys or
signatures. Code is careful not to log them; the filter here is the second
line of defence for whatever slips through (exception texts, extras).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

# Card numbers: 13-19 digits, wherever they stand (also glued to letters, as in "pay_4111111111111111"),
# grouped by up to three separators between two digits: blanks (tabs and double spaces included), dashes,
# dots, underscores, slashes, "+", and the escaped forms a repr, JSON or a URL gives a blank or a slash
# ("\t", "%20", "%2F"), since gunicorn logs a raw request line as a repr. Only runs that pass the Luhn
# check are redacted, so millisecond timestamps and other long numbers stay readable.
_PAN_SEPARATOR = r"(?:[\s._/+\\-]|\\[tnr]|\\x09|\\u0009|%(?:20|09|2[dDfF]|5[fF]))"
_PAN = re.compile(rf"(?<!\d)\d(?:{_PAN_SEPARATOR}{{0,3}}\d){{12,18}}(?!\d)")
_NOT_DIGIT = re.compile(r"\D")
_DECIMAL = re.compile(r"\d+\.\d+")


def luhn_valid(digits: str) -> bool:
    """True when ``digits`` passes the Luhn checksum every card number carries."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _redact_pan(match: re.Match[str]) -> str:
    text = match.group(0)
    if _DECIMAL.fullmatch(text):
        return text  # a decimal number (a float timestamp, an amount), not a card grouped by dots
    digits = _NOT_DIGIT.sub("", re.sub(r"%[0-9A-Fa-f]{2}|\\x09|\\u0009", "", text))
    return "[REDACTED-PAN]" if 13 <= len(digits) <= 19 and luhn_valid(digits) else text


SENSITIVE_NAMES = (
    # In any case style: access_token, access-token, access.token, accessToken, AccessToken, ACCESS_TOKEN,
    # accesstoken (the prefix may be glued on), clientSecret, db_pwd, APIv3Key, privateKey, X-Api-Key.
    # Prefixes are bounded (64): unbounded, a long run of "1.1.1…" made every position scan to the end.
    r"[A-Za-z0-9_.-]{0,64}?(?:token|secret|password|passwd|pwd|passphrase|credentials?)"
    r"|[A-Za-z0-9_.-]{1,64}?key"
    # These only whole or after a separator, and "sign" also camel-cased (WeChat Pay's paySign): a glued
    # prefix would take in "design" or "assign".
    r"|(?:[A-Za-z0-9_.-]{0,64}?[_.-])?(?:cvv2?|cvc2?|sign|authorization|cookie|set-cookie)"
    r"|[A-Za-z0-9_.-]{0,64}?[a-z0-9](?-i:Sign)"
)
"""Names whose values are secrets: *token, *secret, *key, password, pwd, cvv, cvc, Authorization, Cookie, sign.

Not "signature": "invalid_signature: …" is a reason worth reading; signature values themselves are
caught by their shape (v1=<hex>, v1,<base64>). Not a bare "key" either (a dict key, a cache key)."""
_SENSITIVE_NAME = re.compile(rf"(?i)^(?:{SENSITIVE_NAMES})$")
# A quoted value: "…", '…', or \"…\" (JSON inside a JSON string, as a provider's error text may echo it).
_QUOTED = r"""\\"(?:(?!\\").)*\\"|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'"""

# Name: value. Quoted name (JSON, a repr): a quoted value or a bare scalar. Bare name (a header): the rest
# of the line, since a header value (Cookie, Authorization: Digest …) has spaces, commas and semicolons.
_NAMED_COLON = re.compile(
    rf"""(?i)(?<![\w-])(?P<q>\\?["'])?(?P<name>{SENSITIVE_NAMES})(?(q)(?P=q))(?P<sep>\s*:\s*)(?!["']?\[REDACTED)"""
    rf"""(?P<value>{_QUOTED}|(?(q)[^\s,}}\]]*|[^\r\n]*))"""
)
# name=value (form bodies, query strings, log text): a quoted value, or up to the next delimiter, spaces and all.
_NAMED_EQUALS = re.compile(
    rf"""(?i)(?<![\w-])(?P<q>)(?P<name>{SENSITIVE_NAMES})(?P<sep>\s*=\s*)(?!["']?\[REDACTED)(?P<value>{_QUOTED}|[^\r\n&;,"'}}\[\]]*)"""
)


def _redact_named(match: re.Match[str]) -> str:
    q, value = match.group("q") or "", match.group("value")
    quote = value[:2] if value.startswith('\\"') else value[:1] if value[:1] in ("'", '"') else ""
    if not value:
        return match.group(0)
    return f"{q}{match.group('name')}{q}{match.group('sep')}{quote}[REDACTED]{quote}"


_SCRUBBERS = [
    # PEM blocks (private keys, certificates) whole, even cut off before their END line or with escaped newlines.
    (re.compile(r"-----BEGIN [A-Z0-9 ]{1,64}-----.*?(?:-----END [A-Z0-9 ]{1,64}-----|\Z)", re.S), "[REDACTED-PEM]"),
    # Provider and webhook secrets wherever they stand, named or not.
    (re.compile(r"\b(?:whsec|sk_live|sk_test|rk_live|rk_test)_[A-Za-z0-9+/=_-]+"), "[REDACTED]"),
    # Standard Webhooks signatures (v1,<base64>) and hex HMACs (v1=<hex>).
    (re.compile(r"\b(v1,)[A-Za-z0-9+/]{16,}={0,2}"), r"\1[REDACTED]"),
    (re.compile(r"(?i)\b(v1=)[0-9a-f]{16,}"), r"\1[REDACTED]"),
    # Credentials in an Authorization value, even with no header name before them.
    # (a token has a digit or a symbol, or is long: "a bearer token is required" stays readable)
    (re.compile(r"(?i)\b(bearer\s+)(?:(?=[A-Za-z]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]+|[A-Za-z]{16,})"), r"\1[REDACTED]"),
    (re.compile(r"(?i)\b(basic\s+)[A-Za-z0-9+/]{8,}={0,2}"), r"\1[REDACTED]"),
    # user:password@ in URLs.
    (re.compile(r"://([^:/@\s]+):[^@/\s]+@"), r"://\1:[REDACTED]@"),
]


def scrub(text: str) -> str:
    """Remove anything that looks like a card number, secret or signature (see the table in tests/test_logs.py)."""
    text = _PAN.sub(_redact_pan, text)
    for pattern, replacement in _SCRUBBERS:
        text = pattern.sub(replacement, text)
    text = _NAMED_EQUALS.sub(_redact_named, text)
    return _NAMED_COLON.sub(_redact_named, text)


def scrub_value(value: Any, name: str = "") -> Any:
    """``scrub`` through a structure (log extras): a secret-named key loses its value whatever its type."""
    if name and _SENSITIVE_NAME.match(name):
        return "[REDACTED]"
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        cleaned = scrub(str(value))
        return value if cleaned == str(value) else cleaned
    if isinstance(value, dict):
        return {k: scrub_value(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [scrub_value(v) for v in value]
    return scrub(str(value))


REQUEST_ID: ContextVar[str | None] = ContextVar("paysync_request_id", default=None)
"""The request id of the work in hand (a gateway request, the callback it stored): every log line carries it."""
_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")


def sane_request_id(raw: object) -> str | None:
    """``raw`` when it is a usable request id (1-64 of letters, digits and ``. _ : -``), else None.

    A client-supplied X-Request-Id ends up in every log line and in the
    database: anything longer or odder (spaces, quotes, control characters)
    is replaced rather than trusted, and so is one the scrubber would alter
    (a card number sent as a request id must not reach the logs).
    """
    if isinstance(raw, str) and _REQUEST_ID.fullmatch(raw) and scrub(raw) == raw:
        return raw
    return None


def new_request_id() -> str:
    """A fresh request id (32 hex digits)."""
    return uuid.uuid4().hex


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON line: time, level, logger, message, extras, exception; every part scrubbed."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": scrub(record.getMessage()),
        }
        request_id = REQUEST_ID.get()
        if request_id is not None:
            doc["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = scrub_value(value, key)
        if record.exc_info:
            doc["exc"] = scrub(self.formatException(record.exc_info))
        # Scrubbed before encoding: JSON's escaping would hide a quoted secret from the patterns.
        return json.dumps(doc, default=str, ensure_ascii=False)


class ScrubFilter(logging.Filter):
    """Scrubs records of loggers paysync does not format itself (gunicorn's), message and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = scrub(record.getMessage()), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        return True


def scrub_logger(name: str) -> None:
    """Add ScrubFilter to a logger whose records do not reach paysync's formatter (gunicorn's own)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, ScrubFilter) for f in logger.filters):
        logger.addFilter(ScrubFilter())


def scrub_every_handler() -> int:
    """Add ScrubFilter to every handler of every logger that does not format with JsonFormatter; return how many.

    A filter on a logger sees only the records logged to that very logger; one
    on a handler sees every record the handler writes, from child loggers too.
    So whatever reaches the process output through a handler someone else set
    up (gunicorn's error and access logs, a library's own StreamHandler) is
    scrubbed on its way out. Call it once the handlers exist (gunicorn's
    ``when_ready``, before the workers fork).
    """
    loggers = [logging.getLogger()] + [
        logger for logger in logging.root.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    added = 0
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler.formatter, JsonFormatter):
                continue  # paysync's own lines: already scrubbed, every part, by the formatter
            if not any(isinstance(f, ScrubFilter) for f in handler.filters):
                handler.addFilter(ScrubFilter())
                added += 1
    return added


_PROCESS: str | None = None


def process_name() -> str | None:
    """The name ``setup_logging`` was given (web, consumer, compensator), or None before it ran."""
    return _PROCESS


def setup_logging(level: str = "INFO", process: str | None = None) -> None:
    """Send JSON lines to stderr at ``level``; call once at process start."""
    global _PROCESS  # noqa: PLW0603 - one name per process, set once at its start
    _PROCESS = process or _PROCESS
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    if process:
        old_factory = logging.getLogRecordFactory()

        def factory(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            record = old_factory(*args, **kwargs)
            record.process_name = process
            return record

        logging.setLogRecordFactory(factory)
    # pika is chatty at INFO about every reconnect attempt; its errors still show.
    logging.getLogger("pika").setLevel(logging.WARNING)
    # APScheduler logs every run of every job at INFO: several lines a second with a 0.2 s relay.
    logging.getLogger("apscheduler").setLevel(logging.WARNING)
