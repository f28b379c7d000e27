"""Text every channel builds its message from: a summary line, labelled fields, plain text and markdown.

Pure functions of a Notice. Channels with their own markup (Slack's mrkdwn,
Feishu's card) take ``fields`` and format them themselves.
"""

from __future__ import annotations

import json
from datetime import datetime

from payments.escalation.notify import RESOLVED, TEST, Notice

KEYWORD = "paysync"
"""In every markdown message's text: DingTalk and Feishu robots with keyword security refuse a message without one
of their keywords (DingTalk errcode 310000, Feishu 19024), and docs/operations/alerts.md tells teams to set this one."""

MAX_DETAIL_CHARS = 200
"""One detail value is cut to this many characters: a notice is read on a phone."""


def when(value: datetime | None) -> str:
    """A stored (naive UTC) time as people read it."""
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value else ""


def summary(notice: Notice, limit: int = 300) -> str:
    """Title and message on one line, at most ``limit`` characters (SMS, subjects, fallbacks)."""
    text = f"{notice.title}: {notice.message}" if notice.kind != RESOLVED else f"{notice.title} (was: {notice.message})"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _detail(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


def is_url(value: str) -> bool:
    """A link target a chat client opens (else a path shown as text: no link that leads nowhere)."""
    return value.startswith(("https://", "http://"))


CONSOLE = "Console"
"""Label of the link to the console page of the notice's subject (the review, the payment or the alert)."""
RUNBOOK = "Runbook"
"""Label of the link to the rule's runbook (docs/runbooks/<rule>.md)."""


def console_link(notice: Notice) -> str:
    """The console URL of the subject, or "" (no OPS_CONSOLE_URL: no link rather than a broken one)."""
    value = dict(notice.links).get(CONSOLE, "")
    return value if is_url(value) else ""


def related(notice: Notice) -> list[str]:
    """One line per other alert of this cause that the notice carries."""
    return [f"#{m.alert_id} {m.rule} ({m.severity}): {' '.join(m.message.split())[:160]}" for m in notice.members]


def fields(notice: Notice) -> list[tuple[str, str]]:
    """(label, value) pairs in reading order; empty values left out."""
    rows = [
        ("Rule", notice.rule),
        ("Severity", notice.severity),
        ("Status", {RESOLVED: "resolved", TEST: "test"}.get(notice.kind, "firing")),
        ("Firing since", when(notice.fired_at)),
        ("Resolved at", when(notice.resolved_at)),
        ("Alert", f"#{notice.alert_id} ({notice.key})" if notice.alert_id else notice.key),
    ]
    rows += [(str(name), _detail(value)) for name, value in sorted(notice.details.items())]
    rows += [(f"Related {i}", line) for i, line in enumerate(related(notice), start=1)]
    rows += list(notice.links)
    return [(label, value) for label, value in rows if value]


def plain_text(notice: Notice) -> str:
    """The notice as plain text: the message, then one ``Label: value`` line per field."""
    width = max(len(label) for label, _ in fields(notice))
    lines = [notice.title, "", notice.message, ""]
    lines += [f"{label + ':':<{width + 1}} {value}" for label, value in fields(notice)]
    lines += ["", "-- paysync alerts (python -m compensator alerts test --channel NAME checks a channel)"]
    return "\n".join(lines) + "\n"


def markdown(notice: Notice) -> str:
    """The notice in the markdown subset DingTalk, WeCom and Feishu (lark_md) all render: heading, bold, list."""
    lines = [f"### {notice.title}", "", notice.message, ""]
    links = dict(notice.links)
    lines += [
        f"- **{label}**: [{value}]({value})" if label in links and is_url(value) else f"- **{label}**: {value}"
        for label, value in fields(notice)
    ]
    # The keyword in the text, not only the title: a robot checks the message's content, and only the test
    # notice's title has it.
    lines += ["", f"{KEYWORD} alerts · {notice.message_id}"]
    return "\n".join(lines)


def cut_utf8(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` of UTF-8 without splitting a character (services count bytes)."""
    encoded = text.encode("utf-8")
    if len(encoded) <= max_bytes:
        return text
    return encoded[: max_bytes - 3].decode("utf-8", errors="ignore") + "…"
