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
from datetime import UTC, datetime

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}

# Card numbers: 13-19 digits, optionally grouped by spaces or dashes, wherever they stand (also glued
# to letters, as in "pay_4111111111111111"). Only runs that pass the Luhn check are redacted, so
# millisecond timestamps and other long numbers stay readable.
_PAN = re.compile(r"(?<!\d)(?:\d[ -]?){12,18}\d(?!\d)")


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
    digits = re.sub(r"[ -]", "", match.group(0))
    return "[REDACTED-PAN]" if luhn_valid(digits) else match.group(0)


_SCRUBBERS = [
    (
        re.compile(
            r"(?i)\b(cvv|cvc|cvv2|password|passwd|secret|api[_-]?key|token|authorization)(\"?\s*[:=]\s*\"?)[^\s\",}]+"
        ),
        r"\1\2[REDACTED]",
    ),
    (re.compile(r"(?i)(v1=)[0-9a-f]{16,}"), r"\1[REDACTED]"),
    (re.compile(r"(?i)(bearer\s+)[^\s\"]+"), r"\1[REDACTED]"),
    (re.compile(r"://([^:/@\s]+):[^@/\s]+@"), r"://\1:[REDACTED]@"),
]


def scrub(text: str) -> str:
    """Remove anything that looks like a card number, secret or signature."""
    text = _PAN.sub(_redact_pan, text)
    for pattern, replacement in _SCRUBBERS:
        text = pattern.sub(replacement, text)
    return text


class JsonFormatter(logging.Formatter):
    """Format a record as one JSON line: time, level, logger, message, extras, exception."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat().replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return scrub(json.dumps(doc, default=str, ensure_ascii=False))


def setup_logging(level: str = "INFO", process: str | None = None) -> None:
    """Send JSON lines to stderr at ``level``; call once at process start."""
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
