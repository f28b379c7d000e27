"""The alert rules file (ALERT_RULES_FILE, TOML): thresholds, windows, cooldowns, severities and channels.

``parse_rules`` is pure (text in, validated ``RuleSet`` out) and every error
names the file, the rule and the field, so a typo stops the process at start
with one line instead of silently disabling an alert. The file has two tables:

- ``[defaults]``: ``severity``, ``cooldown_seconds``, ``channels`` for rules
  that do not set them, and the routing of alerts raised by a rule the file
  does not list;
- ``[rules.<name>]``: one per rule, with ``threshold``, ``window_seconds``,
  ``sustain_seconds``, ``min_sample``, ``cooldown_seconds``, ``severity``,
  ``channels``, ``enabled`` and a free-text ``description``. What ``threshold``
  means (a count, a rate) is the rule's own; the shipped file says for each.
  ``group`` and ``group_wait_seconds`` make related alerts one notice (see
  ``payments/escalation/notifications.py``), and ``mentions`` names who the chat robots
  @-mention when the rule's alert fires;
- ``[mentions.<severity>]`` (optional): who is @-mentioned for every alert
  of that severity, besides the rule's own ``mentions``.

Which rules may appear, and which fields each needs, is the evaluator
registry's business (``payments/escalation/evaluators.py``: ``validate``,
passed in as ``check``; ``evaluators.rules_for`` is the checked load).
``cooldown_seconds = 0`` means one notification per incident and no reminders.
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from payments.errors import ConfigError
from payments.escalation.notify import CHANNEL_NAMES, Mentions

log = logging.getLogger("paysync.alerts.rules")

DEFAULT_RULES_FILE = Path(__file__).resolve().parent.parent.parent / "ops" / "alert_rules.toml"
"""The commented default shipped in the repository, used when ALERT_RULES_FILE is empty."""
SEVERITIES = ("info", "warning", "critical")
MIN_COOLDOWN_SECONDS = 60
"""Reminders more often than this would be noise, not information."""
_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class Rule:
    """One alert rule, as the file says it (with the defaults filled in)."""

    name: str
    severity: str = "warning"
    channels: tuple[str, ...] = ()
    cooldown_seconds: int = 3600
    sustain_seconds: int = 0
    threshold: float | None = None
    window_seconds: int | None = None
    min_sample: int | None = None
    enabled: bool = True
    description: str = ""
    group: str | None = None
    """Alerts of rules with the same group that fire within ``group_wait_seconds`` are one notice."""
    group_wait_seconds: int = 0
    """How long the first notice of a group waits for the rest of its cause (0: only alerts planned together)."""
    mentions: Mentions = field(default_factory=Mentions)
    """Who the chat robots @-mention when this rule's alert fires (besides ``[mentions.<severity>]``)."""


@dataclass(frozen=True)
class RuleSet:
    """Every rule of one file, by name, and the routing for alerts of rules it does not list."""

    rules: Mapping[str, Rule] = field(default_factory=dict)
    defaults: Rule = field(default_factory=lambda: Rule(name="defaults"))
    source: str = "<rules>"
    severity_mentions: Mapping[str, Mentions] = field(default_factory=dict)
    """``[mentions.<severity>]``: who is @-mentioned for every alert of that severity."""

    def mentions(self, rule: str, severity: str) -> Mentions:
        """Everyone to @-mention for an alert of ``rule`` at ``severity``: the severity's people and the rule's."""
        return self.severity_mentions.get(severity, Mentions()).union(self.route(rule).mentions)

    def get(self, name: str) -> Rule | None:
        """The rule called ``name``, if the file has it."""
        return self.rules.get(name)

    def route(self, name: str) -> Rule:
        """How to notify about an alert of rule ``name``: its own entry, else the defaults."""
        return self.rules.get(name) or replace(self.defaults, name=name)


_FIELDS = {
    "description": "text",
    "threshold": "number",
    "window_seconds": "seconds",
    "sustain_seconds": "seconds",
    "cooldown_seconds": "seconds",
    "min_sample": "count",
    "severity": "severity",
    "channels": "channels",
    "enabled": "bool",
    "group": "name",
    "group_wait_seconds": "seconds",
    "mentions": "mentions",
}
_DEFAULT_FIELDS = ("severity", "cooldown_seconds", "channels", "group_wait_seconds")
MENTION_FIELDS = {
    "dingtalk_mobiles": "mobiles",
    "dingtalk_user_ids": "ids",
    "dingtalk_all": "bool",
    "wecom_user_ids": "ids",
    "wecom_mobiles": "mobiles",
    "wecom_all": "bool",
    "feishu_open_ids": "ids",
    "feishu_all": "bool",
}
"""What a mentions table may hold: each robot's own way of naming people (payments/escalation/notify/__init__.py:
Mentions)."""
_MOBILE = re.compile(r"\+?[0-9][0-9-]{4,19}")
_ID = re.compile(r"[A-Za-z0-9_.@-]{1,64}")


def _mentions(source: str, where: str, value: Any) -> Mentions:
    if not isinstance(value, dict):
        raise _fail(source, where, 'must be a table such as { dingtalk_mobiles = ["13800000000"] }')
    out: dict[str, Any] = {}
    for key, item in value.items():
        kind = MENTION_FIELDS.get(key)
        if kind is None:
            raise _fail(source, where, f"unknown field {key!r} (fields: {', '.join(MENTION_FIELDS)})")
        if kind == "bool":
            if not isinstance(item, bool):
                raise _fail(source, f"{where}.{key}", "must be true or false")
            out[key] = item
            continue
        pattern = _MOBILE if kind == "mobiles" else _ID
        if not isinstance(item, list) or not all(isinstance(v, str) and pattern.fullmatch(v) for v in item):
            what = "phone numbers" if kind == "mobiles" else "ids (letters, digits, _ . @ -)"
            raise _fail(source, f"{where}.{key}", f"must be a list of {what}")
        out[key] = tuple(item)
    return Mentions(**out)


def _fail(source: str, where: str, why: str) -> ConfigError:
    return ConfigError(f"alert rules {source}: {where}: {why}")


def _value(source: str, where: str, key: str, value: Any) -> Any:
    kind = _FIELDS[key]
    here = f"{where}: {key}"
    if kind == "text":
        if not isinstance(value, str):
            raise _fail(source, here, "must be a string")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise _fail(source, here, "must be true or false")
        return value
    if kind == "name":
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise _fail(source, here, "must be lower-case letters, digits and _ (at most 64)")
        return value
    if kind == "mentions":
        return _mentions(source, here, value)
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise _fail(source, here, f"must be a number >= 0, got {value!r}")
        return value
    if kind in ("seconds", "count"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(source, here, f"must be a whole number, got {value!r}")
        low = 1 if kind == "count" or key == "window_seconds" else 0
        if value < low or value > 366 * 86400:
            raise _fail(source, here, f"must be between {low} and {366 * 86400}, got {value}")
        if key == "cooldown_seconds" and 0 < value < MIN_COOLDOWN_SECONDS:
            raise _fail(source, here, f"must be 0 (no reminders) or at least {MIN_COOLDOWN_SECONDS}, got {value}")
        return value
    if kind == "severity":
        if value not in SEVERITIES:
            raise _fail(source, here, f"must be one of {', '.join(SEVERITIES)}, got {value!r}")
        return value
    # channels
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise _fail(source, here, 'must be a list of channel names such as ["email", "sms"]')
    for channel in value:
        if channel not in CHANNEL_NAMES:
            raise _fail(source, here, f"unknown channel {channel!r} (channels: {', '.join(CHANNEL_NAMES)})")
    if len(set(value)) != len(value):
        raise _fail(source, here, "names a channel twice")
    return tuple(value)


def _table(source: str, where: str, table: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(source, where, "must be a table")
    out = {}
    for key, value in table.items():
        if key not in allowed:
            raise _fail(source, where, f"unknown field {key!r} (fields: {', '.join(allowed)})")
        out[key] = _value(source, where, key, value)
    return out


def parse_rules(text: str, source: str = "<rules>") -> RuleSet:
    """Parse and check a rules file's text; ConfigError naming the file, rule and field if anything is off."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"alert rules {source}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"defaults", "rules", "mentions"})
    if unknown:
        raise _fail(
            source, unknown[0], "unknown table (a rules file has [defaults], [rules.<name>] and [mentions.<severity>])"
        )
    mentions_table = data.get("mentions", {})
    if not isinstance(mentions_table, dict):
        raise _fail(source, "mentions", "must be tables [mentions.<severity>]")
    severity_mentions = {}
    for severity, table in mentions_table.items():
        if severity not in SEVERITIES:
            raise _fail(source, f"[mentions.{severity}]", f"must be one of {', '.join(SEVERITIES)}")
        severity_mentions[severity] = _mentions(source, f"[mentions.{severity}]", table)
    defaults = Rule(name="defaults", **_table(source, "[defaults]", data.get("defaults", {}), _DEFAULT_FIELDS))
    rules_table = data.get("rules", {})
    if not isinstance(rules_table, dict):
        raise _fail(source, "rules", "must be tables [rules.<name>]")
    inherited = {k: getattr(defaults, k) for k in _DEFAULT_FIELDS}
    rules = {}
    for name, table in rules_table.items():
        where = f"rule {name}"
        if not _NAME.fullmatch(name):
            raise _fail(source, where, "a rule name is lower-case letters, digits and _ (at most 64)")
        rules[name] = Rule(name=name, **{**inherited, **_table(source, where, table, tuple(_FIELDS))})
    return RuleSet(rules=rules, defaults=defaults, source=source, severity_mentions=severity_mentions)


def rules_path(settings: Any) -> str:
    """The file ``settings`` names, or the shipped default."""
    return settings.alert_rules_file or str(DEFAULT_RULES_FILE)


Check = Callable[[RuleSet], None]
"""Validates a parsed RuleSet beyond its syntax (the evaluators' registry: which rules exist); ConfigError if not."""


def load_rules(path: str, check: Check | None = None) -> RuleSet:
    """Read, parse and (with ``check``, e.g. ``evaluators.validate``) validate the rules file at ``path``.

    Read again only when the file changes (mtime or size), so thresholds can
    be tuned without a restart. A file that cannot be read or is invalid
    raises ConfigError the first time; once a good version was loaded, a bad
    edit is logged once and the last good rules stay in force, so a typo made
    while running does not switch alerting off. The check is the caller's:
    this module sits below the evaluators and does not know which rules exist.
    """
    try:
        stat = os.stat(path)
        version = (stat.st_mtime_ns, stat.st_size)
    except OSError as exc:
        version, error = None, ConfigError(f"ALERT_RULES_FILE {path}: cannot read it ({exc.strerror})")
    key = (path, check)
    with _lock:
        seen = _seen.get(key)
        if seen is not None and seen[0] == version:
            result = seen[1]
        else:
            result = _read(path, check) if version is not None else error
            _seen[key] = (version, result)
            if isinstance(result, RuleSet):
                _good[key] = result
            elif key in _good:
                log.error("%s; keeping the rules loaded before", result)
    if isinstance(result, RuleSet):
        return result
    if key in _good:
        return _good[key]
    raise result


_lock = threading.Lock()
_seen: dict[tuple[str, Check | None], tuple[tuple[int, int] | None, RuleSet | ConfigError]] = {}
_good: dict[tuple[str, Check | None], RuleSet] = {}


def _read(path: str, check: Check | None) -> RuleSet | ConfigError:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return ConfigError(f"ALERT_RULES_FILE {path}: cannot read it ({exc})")
    try:
        rules = parse_rules(text, source=path)
        if check is not None:
            check(rules)
    except ConfigError as exc:
        return exc
    return rules


def for_settings(settings: Any, check: Check | None = None) -> RuleSet:
    """The rules ``settings`` point at (cached while the file is unchanged); ``check`` as for ``load_rules``."""
    return load_rules(rules_path(settings), check)
