"""How the console says money and time to a person at 3 a.m.: major units with the currency, ages, UTC on hover.

Pure functions (and the Jinja filters over them). The stored values stay as
they are, integer minor units and naive UTC times; only the page changes:

- ``¥2,664.00`` for CNY 266400, ``$12.00`` for USD 1200, ``JPY ¥500`` for a
  zero-decimal currency (the code first, so ¥500 is never read as yuan),
  ``CHF 12.50`` for a currency with no symbol here; the exponent is ISO
  4217's (``payments.providers.stripe.money.iso_exponent``, the one the
  ledger uses), and the minor units are in the title, on hover.
- ``4 min ago`` / ``in 3 min``, with ``2026-12-03 14:30:29 UTC`` on hover,
  whole seconds only.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from markupsafe import Markup, escape

from payments.providers.stripe.money import iso_exponent

SYMBOLS = {
    "CNY": "¥",
    "JPY": "¥",
    "USD": "$",
    "EUR": "€",
    "GBP": "£",
    "HKD": "HK$",
    "SGD": "S$",
    "AUD": "A$",
    "CAD": "C$",
    "KRW": "₩",
    "INR": "₹",
    "TWD": "NT$",
}
"""Symbols shown before the amount; a currency not listed is shown by its code."""
UNIQUE_SYMBOLS = frozenset({"CNY", "USD", "EUR", "GBP"})
"""The merchant's everyday currencies whose symbol alone is read right; the others carry their code too."""


def _exponent(currency: str) -> int:
    code = (currency or "").strip().upper()
    return iso_exponent(code) if len(code) == 3 and code.isalpha() and code.isascii() else 2


def major(amount_minor: int, currency: str) -> str:
    """``amount_minor`` of ``currency`` in major units as people write it: ``¥2,664.00``, ``JPY ¥500``, ``CHF 1.50``."""
    code = (currency or "").strip().upper()
    exponent = _exponent(code)
    whole, part = divmod(abs(int(amount_minor)), 10**exponent)
    number = f"{whole:,}" + (f".{part:0{exponent}d}" if exponent else "")
    sign = "-" if int(amount_minor) < 0 else ""
    symbol = SYMBOLS.get(code)
    if symbol is None:
        return f"{sign}{code} {number}".strip()
    if code in UNIQUE_SYMBOLS and exponent:
        return f"{sign}{symbol}{number}"
    return f"{sign}{code} {symbol}{number}"


def money_html(amount_minor: Any, currency: str | None) -> Markup:
    """``major`` in a ``<span class="money">`` whose title gives the minor units; empty for no amount."""
    if amount_minor is None or amount_minor == "":
        return Markup("")
    try:
        value = int(amount_minor)
    except (TypeError, ValueError):
        return escape(str(amount_minor))
    code = (currency or "").strip().upper()
    title = f"{value} minor units{' of ' + code if code else ''}"
    return Markup('<span class="money" title="{}">{}</span>').format(title, major(value, code))


def amounts_html(amounts: Mapping[str, int] | None) -> Markup:
    """Amounts by currency (``{"CNY": 266400, "USD": 1200}``), sorted by code, comma-separated."""
    if not amounts:
        return Markup("")
    return Markup(", ").join(money_html(v, c) for c, v in sorted(amounts.items()))


def parse_time(value: Any) -> datetime | None:
    """A stored time (naive UTC datetime, or the ISO text ``ops_actions`` gives: ``…Z``) as a naive UTC datetime."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return value.astimezone(UTC).replace(tzinfo=None) if value.tzinfo else value
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed.astimezone(UTC).replace(tzinfo=None) if parsed.tzinfo else parsed


def absolute(when: datetime) -> str:
    """``2026-12-03 14:30:29 UTC``: whole seconds, always UTC."""
    return when.strftime("%Y-%m-%d %H:%M:%S UTC")


def relative(when: datetime, now: datetime) -> str:
    """``just now``, ``42 s ago``, ``4 min ago``, ``3 h 5 min ago``, ``2 d 4 h ago``; ``in …`` for the future."""
    seconds = int(round((now - when).total_seconds()))
    future, seconds = seconds < 0, abs(seconds)
    if seconds < 5:
        return "just now"
    return f"in {duration(seconds)}" if future else f"{duration(seconds)} ago"


def duration(seconds: float) -> str:
    """A span as people say it: ``42 s``, ``4 min``, ``3 h 5 min``, ``2 d 4 h`` (two units at most)."""
    seconds = int(round(abs(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min"
    if seconds < 86400:
        hours, minutes = divmod(seconds // 60, 60)
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(seconds // 3600, 24)
    return f"{days} d" + (f" {hours} h" if hours else "")


def time_html(value: Any, now: datetime | None = None, *, empty: str = "–") -> Markup:
    """A ``<time>`` saying how long ago (or how soon), with the absolute UTC time on hover; ``empty`` for none."""
    when = parse_time(value)
    if when is None:
        return escape(empty if value in (None, "") else str(value))
    now = now or datetime.now(UTC).replace(tzinfo=None)
    iso = when.replace(microsecond=0).isoformat() + "Z"
    return Markup('<time datetime="{}" title="{}">{}</time>').format(iso, absolute(when), relative(when, now))
