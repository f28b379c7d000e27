"""JSON templates with ``{{placeholder}}`` strings: how SMS gateways and Aliyun's TemplateParam get their text.

A template is JSON whose string values may hold placeholders. Parsing checks
the JSON and that every placeholder is one this use knows, so a typo stops the
process at start rather than sending ``{{txet}}`` to a phone. Rendering
substitutes inside strings (so values are JSON-escaped when the result is
dumped); a string that is exactly ``"{{phones}}"`` becomes the list of phone
numbers, for gateways that take an array.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

PLACEHOLDER = re.compile(r"\{\{\s*([a-z_]+)\s*\}\}")
NOTICE_FIELDS = ("text", "title", "message", "rule", "severity", "kind", "link")
"""What a notice fills in: ``text`` is the one-line summary an SMS carries (with the console link when there is
one), ``link`` the console link alone (empty without OPS_CONSOLE_URL)."""
PHONE_FIELDS = ("phone", "phones")


def parse(raw: str, allowed: Iterable[str]) -> Any:
    """The template as JSON; ValueError naming the problem if it is not JSON or names an unknown placeholder."""
    try:
        template = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(template, dict):
        raise ValueError("must be a JSON object")
    known = set(allowed)
    unknown = sorted(set(placeholders(template)) - known)
    if unknown:
        raise ValueError(f"unknown placeholder {{{{{unknown[0]}}}}} (known: {', '.join(sorted(known))})")
    return template


def placeholders(template: Any) -> list[str]:
    """Every placeholder name the template uses, in order of appearance."""
    if isinstance(template, str):
        return PLACEHOLDER.findall(template)
    if isinstance(template, dict):
        return [name for key, value in template.items() for name in placeholders(key) + placeholders(value)]
    if isinstance(template, list):
        return [name for item in template for name in placeholders(item)]
    return []


def render(template: Any, values: Mapping[str, str], phones: list[str] | None = None) -> Any:
    """``template`` with its placeholders filled from ``values`` (``{{phones}}`` from ``phones``)."""
    merged = dict(values)
    if phones is not None:
        merged["phones"] = ",".join(phones)

    def fill(node: Any) -> Any:
        if isinstance(node, str):
            whole = PLACEHOLDER.fullmatch(node.strip())
            if whole and whole.group(1) == "phones" and phones is not None:
                return list(phones)
            return PLACEHOLDER.sub(lambda m: merged.get(m.group(1), ""), node)
        if isinstance(node, dict):
            return {PLACEHOLDER.sub(lambda m: merged.get(m.group(1), ""), k): fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(item) for item in node]
        return node

    return fill(template)
