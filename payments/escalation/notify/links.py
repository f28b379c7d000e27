"""Where a notice sends its reader: the console page of its subject and the rule's runbook.

A link is only a link when it can work: without OPS_CONSOLE_URL the notice
names the console path and the runbook's file in the repository as text.
Runbooks are ``docs/runbooks/<rule>.md`` (one per rule; the Prometheus rules'
``runbook_url`` uses the same paths); the console serves them at
``/ops/runbooks/<rule>``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from payments.escalation.notify import FIRING, REPEAT, TEST, Mentions, Notice
from payments.escalation.notify.render import CONSOLE, RUNBOOK

RUNBOOKS_DIR = Path(__file__).resolve().parent.parent.parent.parent / "docs" / "runbooks"
"""One markdown page per alert rule: what it means, what to check, what to do."""


def runbook_path(rule: str) -> str:
    """The runbook's path in the repository."""
    return f"docs/runbooks/{rule}.md"


def console_path(notice: Notice) -> str:
    """The console page of the notice's subject: its manual review if it has one, else the alert."""
    review_id = notice.details.get("manual_review_id")
    if isinstance(review_id, int):
        return f"/ops/reviews/{review_id}"
    return f"/ops/alerts/{notice.alert_id}" if notice.alert_id else ""


def links(notice: Notice, console_url: str = "", runbook_url: str = "") -> tuple[tuple[str, str], ...]:
    """(label, target) pairs for ``notice``: a URL where one is configured, a path (plain text) where not."""
    if notice.kind == TEST:
        return ()
    out = []
    page = console_path(notice)
    if page:
        out.append((CONSOLE, f"{console_url}{page}" if console_url else page))
    if runbook_url:
        out.append((RUNBOOK, f"{runbook_url.rstrip('/')}/{notice.rule}.md"))
    elif console_url:
        out.append((RUNBOOK, f"{console_url}/ops/runbooks/{notice.rule}"))
    else:
        out.append((RUNBOOK, runbook_path(notice.rule)))
    return tuple(out)


def dress(notice: Notice, mentions: Mentions, console_url: str = "", runbook_url: str = "") -> Notice:
    """``notice`` with its links, and its @-mentions if it tells people an alert fires (not when it resolved)."""
    return replace(
        notice,
        links=links(notice, console_url, runbook_url),
        mentions=mentions if notice.kind in (FIRING, REPEAT) else Mentions(),
    )
