"""The rules file: the loader on good and bad files, the default file, and what a bad file does to a process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from payments.errors import ConfigError
from payments.escalation import evaluators as alert_evaluators
from payments.escalation import rules as alert_rules
from payments.escalation.rules import DEFAULT_RULES_FILE, parse_rules
from payments.infra.settings import load_settings
from payments.runtime import check_deployment
from tests.support import ROOT, env_for

GOOD = """
[defaults]
severity = "info"
cooldown_seconds = 600
channels = ["slack"]

[rules.callback_backlog]
threshold = 5
sustain_seconds = 60
channels = ["email", "sms"]
severity = "critical"

[rules.callback_failure_rate]
threshold = 0.5
window_seconds = 120
min_sample = 3
cooldown_seconds = 0
"""


def test_a_good_file_gives_its_rules_with_the_defaults_filled_in():
    rules = parse_rules(GOOD, "good.toml")
    backlog = rules.get("callback_backlog")
    assert (backlog.threshold, backlog.sustain_seconds, backlog.channels, backlog.severity) == (
        5,
        60,
        ("email", "sms"),
        "critical",
    )
    assert backlog.cooldown_seconds == 600  # from [defaults]
    rate = rules.get("callback_failure_rate")
    assert (rate.threshold, rate.window_seconds, rate.min_sample, rate.cooldown_seconds) == (0.5, 120, 3, 0)
    assert (rate.channels, rate.severity) == (("slack",), "info")
    # An alert of a rule the file does not list is routed by [defaults].
    assert rules.route("callback_gave_up").channels == ("slack",)
    assert rules.route("callback_gave_up").name == "callback_gave_up"


def test_an_empty_file_is_no_rules_and_alerts_that_are_only_log_lines():
    rules = parse_rules("", "empty.toml")
    assert rules.rules == {} and rules.route("x").channels == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[rules.callback_backlog\nthreshold = 1", "not valid TOML"),
        ("[rule.callback_backlog]\nthreshold = 1", "rule: unknown table"),
        ("[rules.callback_backlog]\ntreshold = 1", "rule callback_backlog: unknown field 'treshold'"),
        ('[rules.callback_backlog]\nthreshold = "100"', "rule callback_backlog: threshold: must be a number >= 0"),
        ("[rules.callback_backlog]\nthreshold = -1", "rule callback_backlog: threshold: must be a number >= 0"),
        ("[rules.callback_backlog]\nthreshold = nan", "rule callback_backlog: threshold: must be a number >= 0"),
        ("[rules.callback_backlog]\nsustain_seconds = 1.5", "rule callback_backlog: sustain_seconds: must be a whole"),
        ("[rules.callback_failure_rate]\nwindow_seconds = 0", "rule callback_failure_rate: window_seconds: must be"),
        ("[rules.callback_backlog]\ncooldown_seconds = 5", "cooldown_seconds: must be 0 (no reminders) or at least 60"),
        ('[rules.callback_backlog]\nseverity = "page"', "rule callback_backlog: severity: must be one of info"),
        ('[rules.callback_backlog]\nchannels = ["pager"]', "rule callback_backlog: channels: unknown channel 'pager'"),
        ('[rules.callback_backlog]\nchannels = "email"', "rule callback_backlog: channels: must be a list"),
        ('[rules.callback_backlog]\nchannels = ["email", "email"]', "channels: names a channel twice"),
        ('[rules.callback_backlog]\nenabled = "no"', "rule callback_backlog: enabled: must be true or false"),
        ("[rules.Backlog]\nthreshold = 1", "rule Backlog: a rule name is lower-case"),
        ("[defaults]\nthreshold = 1", "[defaults]: unknown field 'threshold'"),
        ('[defaults]\nchannels = ["fax"]', "[defaults]: channels: unknown channel 'fax'"),
        ("rules = 3", "rules: must be tables"),
    ],
)
def test_a_bad_file_is_refused_naming_the_file_rule_and_field(text, message):
    with pytest.raises(ConfigError) as info:
        parse_rules(text, "bad.toml")
    assert str(info.value).startswith("alert rules bad.toml: ")
    assert message in str(info.value)


def test_a_rule_nobody_evaluates_and_a_missing_needed_field_are_refused():
    with pytest.raises(ConfigError, match="rule callback_backlogg: no evaluator knows this rule"):
        alert_evaluators.validate(parse_rules("[rules.callback_backlogg]\nthreshold = 1", "f.toml"))
    with pytest.raises(ConfigError, match="rule callback_failure_rate: window_seconds is required"):
        alert_evaluators.validate(parse_rules("[rules.callback_failure_rate]\nthreshold = 0.1", "f.toml"))
    # A disabled rule need not be complete.
    alert_evaluators.validate(parse_rules("[rules.callback_failure_rate]\nenabled = false", "f.toml"))


def test_every_rule_of_the_default_file_is_evaluated_or_raised_elsewhere_and_the_seed_rules_are_as_asked():
    rules = alert_rules.load_rules(str(DEFAULT_RULES_FILE))
    alert_evaluators.validate(rules)
    for name in rules.rules:
        assert (name in alert_evaluators.EVALUATORS) != (name in alert_evaluators.EVALUATED_ELSEWHERE), name
    # Every evaluator and every rule the issue asks for is in the shipped file.
    assert set(alert_evaluators.EVALUATORS) <= set(rules.rules)
    wanted = {
        "callback_backlog",
        "callback_failure_rate",
        "compensation_success_rate",
        "past_deadline",
        "signature_failures",
        "broker_unreachable",
        "provider_circuit_open",
        "reconciliation_unexplained",
        "ledger_chain_stale",
    }
    assert wanted <= set(rules.rules)
    backlog, rate = rules.get("callback_backlog"), rules.get("callback_failure_rate")
    assert (backlog.threshold, backlog.sustain_seconds) == (100, 300)
    assert {"email", "sms"} <= set(backlog.channels)
    assert (rate.threshold, rate.window_seconds) == (0.05, 600)
    assert {"email", "dingtalk", "feishu", "wecom", "slack"} <= set(rate.channels)
    assert all(rule.description for rule in rules.rules.values())


def test_alert_rules_file_points_at_another_file(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text(GOOD)
    settings = load_settings({"PAYSYNC_ENV": "development", "ALERT_RULES_FILE": str(path)})
    assert alert_rules.for_settings(settings).get("callback_backlog").threshold == 5
    # A changed file is read again (a change is seen by mtime and size; the size changes here, so the test
    # does not depend on the clock ticking between two writes).
    path.write_text(GOOD.replace("threshold = 5", "threshold = 17"))
    assert alert_rules.for_settings(settings).get("callback_backlog").threshold == 17


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ALERT_RULES_FILE": "/nonexistent/rules.toml"}, "ALERT_RULES_FILE /nonexistent/rules.toml: cannot read it"),
        ({"ALERT_BACKLOG_THRESHOLD": "500"}, "ALERT_BACKLOG_THRESHOLD is no longer read: "),
        ({"ALERT_FAILURE_WINDOW_SECONDS": "60"}, "window_seconds replaces it"),
    ],
)
def test_settings_refuse_a_missing_rules_file_and_the_retired_alert_settings(environ, message):
    # The retired settings are refused by the settings' parsing, the missing file by the start-up check.
    with pytest.raises(ConfigError, match=message):
        check_deployment(load_settings({"PAYSYNC_ENV": "development", **environ}))


def test_the_settings_parse_a_rules_file_name_and_leave_reading_it_to_the_start_up_check():
    settings = load_settings({"PAYSYNC_ENV": "development", "ALERT_RULES_FILE": "/nonexistent/rules.toml"})
    assert settings.alert_rules_file == "/nonexistent/rules.toml"
    with pytest.raises(ConfigError, match="cannot read it"):
        alert_evaluators.check_alerting(settings)


@pytest.mark.server
def test_a_bad_rules_file_stops_the_compensator_with_one_line(tmp_path):
    path = tmp_path / "rules.toml"
    path.write_text('[rules.callback_backlog]\nthreshold = 100\nchannels = ["email", "pager"]\n')
    done = subprocess.run(
        [sys.executable, "-m", "compensator", "evaluate_alerts", "--once"],
        env=env_for({"ALERT_RULES_FILE": str(path), "DATABASE_URL": f"sqlite:///{tmp_path / 'x.db'}"}),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0] == (
        f"compensator: bad configuration: alert rules {path}: rule callback_backlog: channels: "
        "unknown channel 'pager' (channels: email, sms, aliyun_sms, dingtalk, feishu, wecom, slack, webhook)"
    )


def test_a_bad_edit_while_running_keeps_the_last_good_rules_and_says_so_once(tmp_path, caplog):
    path = tmp_path / "rules.toml"
    path.write_text(GOOD)
    assert alert_rules.load_rules(str(path), alert_evaluators.validate).get("callback_backlog").threshold == 5
    path.write_text(GOOD.replace("threshold = 5", 'threshold = "five"'))
    for _ in range(3):
        assert alert_rules.load_rules(str(path), alert_evaluators.validate).get("callback_backlog").threshold == 5
    errors = [r.getMessage() for r in caplog.records if r.name == "paysync.alerts.rules"]
    assert len(errors) == 1 and "rule callback_backlog: threshold: must be a number" in errors[0]
    path.write_text(GOOD.replace("threshold = 5", "threshold = 19"))
    assert alert_rules.load_rules(str(path), alert_evaluators.validate).get("callback_backlog").threshold == 19
    # A file that names a rule nobody evaluates counts as bad too, for a load checked against the registry.
    path.write_text(GOOD + "\n[rules.no_such_rule]\nthreshold = 1\n")
    assert alert_rules.load_rules(str(path), alert_evaluators.validate).get("callback_backlog").threshold == 19


def _rules_raised_in_code() -> dict[str, str]:
    """Rule name -> where, for every alert the code raises with a literal rule.

    Read from the source: ``alerts.observe(rule="…")``, ``escalate(kind="…")``
    (a review's kind is its alert's rule) and ``outbound_protocol.review(conn, current, "…", …)``.
    """
    import ast

    found: dict[str, str] = {}
    for path in sorted([*(ROOT / "payments").rglob("*.py"), *(ROOT / "compensator").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            literal = None
            if name in ("observe", "escalate"):
                keyword = "rule" if name == "observe" else "kind"
                literal = next((k.value for k in node.keywords if k.arg == keyword), None)
            elif name == "review" and len(node.args) >= 3:
                literal = node.args[2]
            # A choice between two literals (``"unresolved_refund" if … else "unresolved_payment"``) raises either.
            choices = [literal.body, literal.orelse] if isinstance(literal, ast.IfExp) else [literal]
            for choice in choices:
                if isinstance(choice, ast.Constant) and isinstance(choice.value, str):
                    found.setdefault(choice.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_alert_the_code_raises_has_a_routing_entry_in_the_default_file():
    raised = _rules_raised_in_code()
    # The scan sees the raisers core's modules have (a scan that finds nothing would pass for nothing).
    assert {
        "callback_gave_up",
        "conflicting_report",
        "unresolved_payment",
        "provider_answer_needs_review",
        "unresolved_not_resendable",
        "provider_circuit_open",
        "event_delivery_gave_up",
        "event_delivery_failing",
    } <= set(raised)
    rules = alert_rules.load_rules(str(DEFAULT_RULES_FILE))
    known = set(alert_evaluators.EVALUATORS) | set(alert_evaluators.EVALUATED_ELSEWHERE)
    for rule, where in raised.items():
        assert rule in known, f"{where} raises {rule}, which the evaluator registry does not know"
        assert rule in rules.rules, f"{where} raises {rule}, which the default rules file does not route"
        assert rules.rules[rule].channels, rule
