"""Finding card numbers, CVVs and secrets in captured logs (invariant 9), for the security tests and ``make chaos``.

Written independently of ``payments.infra.logs`` on purpose: a scrubber is not
checked by itself.
"""

from __future__ import annotations

import re
from pathlib import Path

_CARD = re.compile(r"(?<![0-9A-Za-z])[2-6]\d{3}(?:[ .-]?\d){9,15}(?![0-9A-Za-z])")
"""13-19 digits starting like a card network's number, optionally grouped by spaces, dots or dashes."""
_CVV = re.compile(r"(?i)\b(?:cvv2?|cvc2?|csc)\b[\"']?\s*[:=]\s*[\"']?\d{3,4}\b")


def luhn(digits: str) -> bool:
    """True when ``digits`` passes the Luhn checksum every card number carries."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def leaks_in(text: str, secrets: list[str]) -> list[str]:
    """Card numbers (Luhn-valid), CVV values and any of ``secrets`` found in ``text``, described without the value."""
    found = []
    for match in _CARD.finditer(text):
        digits = re.sub(r"\D", "", match.group(0))
        if 13 <= len(digits) <= 19 and luhn(digits):
            found.append(f"card number {digits[:4]}…{digits[-2:]}")
    found += [f"CVV {m.group(0)[:5]}…" for m in _CVV.finditer(text)]
    found += [f"secret {s[:5]}…" for s in secrets if s and s in text]
    return found


def scan_logs(paths: list[Path], secrets: list[str]) -> list[str]:
    """Every leak in every file, as "file: what"."""
    findings = []
    for path in paths:
        try:
            content = path.read_text(errors="replace")
        except OSError:
            continue
        findings += [f"{path.name}: {leak}" for leak in leaks_in(content, secrets)]
    return findings
