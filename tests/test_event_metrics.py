"""The compensator's event counters: provider calls (with latency) and alert notifications, counted as they happen."""

# ruff: noqa: F811 - pytest fixtures imported from tests.sandbox_process and tests.outbound_support
from __future__ import annotations

from prometheus_client import REGISTRY

from compensator import evaluate_alerts, notify_alerts, relay_outbox
from payments.infra.db import utcnow
from tests.notify_fakes import FakeService
from tests.outbound_support import new_payment, runtime  # noqa: F401
from tests.test_notify_alerts import _backlog
from tests.test_notify_alerts import _runtime as notify_runtime


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_provider_call_is_counted_by_provider_operation_and_outcome_with_its_latency(runtime, sandbox):
    labels = {"provider": "sandbox", "operation": "charge"}
    calls, timed = (
        value("paysync_provider_calls_total", **labels, outcome="Succeeded"),
        value("paysync_provider_call_seconds_count", **labels),
    )
    new_payment(runtime)
    assert relay_outbox.run_once(runtime) == 1
    assert value("paysync_provider_calls_total", **labels, outcome="Succeeded") - calls == 1
    assert value("paysync_provider_call_seconds_count", **labels) - timed == 1
    sandbox.faults(decline_rate=1.0)
    declined = value("paysync_provider_calls_total", **labels, outcome="Failed")
    new_payment(runtime)
    relay_outbox.run_once(runtime)
    assert value("paysync_provider_calls_total", **labels, outcome="Failed") - declined == 1


def test_alert_notifications_are_counted_by_channel_and_outcome(engine, tmp_path):
    sent, failed = (
        value("paysync_alert_notifications_total", channel="slack", outcome="sent"),
        value("paysync_alert_notifications_total", channel="webhook", outcome="failed"),
    )
    with FakeService("slack") as slack:
        runtime = notify_runtime(
            engine,
            tmp_path,
            ["slack", "webhook"],
            slack_webhook_url=slack.url,
            alert_webhook_url="http://127.0.0.1:9/nothing-listens-here",
            alert_webhook_secret=("whsec-test-secret-0123456789",),
        )
        t0 = utcnow()
        _backlog(engine, 3, t0)
        evaluate_alerts.run_once(runtime, now=t0)
        notify_alerts.run_once(runtime, now=t0)
    assert value("paysync_alert_notifications_total", channel="slack", outcome="sent") - sent == 1
    assert value("paysync_alert_notifications_total", channel="webhook", outcome="failed") - failed == 1
