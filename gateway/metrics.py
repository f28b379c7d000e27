"""``GET /metrics``: Prometheus text format, for allowed sources or the ops token.

Two parts. The event counters and histograms of ``payments.infra.metrics``
(callbacks received, ack latency, processing outcomes, …) are this gateway's
own: under gunicorn every worker writes them to the multiprocess directory
(``gateway/gunicorn_conf.py``) and the answering worker adds them all up; run
any other way (tests, ``flask run``) they are this process's registry.

The gauges come from the database at scrape time, so they are the same
whichever gunicorn worker answers and they cover the consumer's and the
compensator's work too, with no per-process counters to aggregate. What can
pile up is read on every scrape (``payments.ops.monitoring.live_counts``, index
ranges over few rows); the counts of settled rows, millions in a busy system,
are cached per worker for METRICS_SETTLED_CACHE_SECONDS.

Only clients inside METRICS_ALLOW_CIDRS (loopback by default) or a request
bearing a METRICS_TOKEN (scrape only) or an OPS_TOKEN get an answer; everyone
else gets 403. The client is the peer, or, when the peer is one of
TRUSTED_PROXIES, the address those proxies forwarded (the rule of
``payments.infra.metrics.allowed``, which the consumer's and compensator's ports
share); X-Forwarded-For from anyone else is not believed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from flask import Blueprint, Response, request
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from sqlalchemy.exc import SQLAlchemyError

from gateway import error_response, ext
from payments.infra.db import utcnow
from payments.infra.metrics import allowed, scrape_tokens
from payments.ops.monitoring import UNKNOWN_AGE_BUCKETS, Settled, Snapshot, combine, live_counts, settled_counts
from payments.states import AlertStatus, CallbackStatus, PaymentStatus

bp = Blueprint("metrics", __name__)
log = logging.getLogger("paysync.gateway.metrics")

CALLBACK_STATUS_NAMES = {s.value: s.name.lower() for s in CallbackStatus}


def _gauge(name: str, doc: str, label: str, values: dict[Any, int], keys: list[Any]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key in keys + [k for k in values if k not in keys]:
        family.add_metric([str(key)], values.get(key, 0))
    return family


class _SnapshotCollector:
    def __init__(self, snap: Snapshot | None, broker_state: str) -> None:
        self.snap = snap
        self.broker_state = broker_state

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        yield GaugeMetricFamily(
            "paysync_database_up", "1 if the database answered this scrape", value=int(bool(self.snap))
        )
        broker = GaugeMetricFamily("paysync_broker_connected", "this gateway worker's broker link", labels=["state"])
        broker.add_metric([self.broker_state], 1)
        yield broker
        s = self.snap
        if s is None:
            return
        callbacks = GaugeMetricFamily("paysync_callbacks", "payment_callback_log rows by status", labels=["status"])
        for code, name in CALLBACK_STATUS_NAMES.items():
            callbacks.add_metric([name], s.callbacks_by_status.get(code, 0))
        yield callbacks
        yield GaugeMetricFamily(
            "paysync_callback_oldest_waiting_seconds",
            "age of the oldest callback with status 0 or 2",
            value=s.oldest_waiting_callback_seconds,
        )
        states = [st.value for st in PaymentStatus]
        yield _gauge("paysync_payments", "payments by status", "status", s.payments_by_status, states)
        yield _gauge("paysync_refunds", "refunds by status", "status", s.refunds_by_status, states)
        yield _gauge(
            "paysync_outbox_pending", "outbox rows waiting to be sent", "event_type", s.outbox_pending_by_type, []
        )
        yield GaugeMetricFamily("paysync_manual_review_open", "open manual review items", value=s.manual_review_open)
        yield _gauge(
            "paysync_alerts",
            "open alerts by status",
            "status",
            s.alerts_by_status,
            [AlertStatus.PENDING.value, AlertStatus.FIRING.value],
        )
        breakers = GaugeMetricFamily(
            "paysync_provider_breaker_open", "1 while a provider's circuit breaker is open", labels=["provider"]
        )
        for provider in s.open_breakers:
            breakers.add_metric([provider], 1)
        yield breakers
        yield GaugeMetricFamily(
            "paysync_outbox_oldest_pending_seconds",
            "outbox lag: age of the oldest pending outbox row",
            value=s.outbox_oldest_pending_seconds,
        )
        ages = [label for label, _ in UNKNOWN_AGE_BUCKETS] + ["older"]
        yield _gauge(
            "paysync_unknown_payments", "Unknown payments by age (younger than)", "age", s.unknown_by_age, ages
        )
        yield GaugeMetricFamily(
            "paysync_unknown_payment_oldest_seconds",
            "age of the oldest Unknown payment",
            value=s.unknown_oldest_seconds,
        )
        items = GaugeMetricFamily(
            "paysync_reconciliation_items",
            "items of each provider's latest completed reconciliation run, by category",
            labels=["provider", "category"],
        )
        for (provider, category), count in sorted(s.reconciliation_items.items()):
            items.add_metric([provider, category], count)
        yield items
        unexplained = GaugeMetricFamily(
            "paysync_reconciliation_unexplained",
            "unexplained items of each provider's latest completed reconciliation run whose review is still open",
            labels=["provider"],
        )
        for provider, count in sorted(s.reconciliation_unexplained.items()):
            unexplained.add_metric([provider], count)
        yield unexplained
        yield _gauge(
            "paysync_past_deadline", "payments and refunds not final after their deadline", "kind", s.past_deadline, []
        )
        open_alerts = GaugeMetricFamily(
            "paysync_alert_open", "open paysync alerts by rule and status (pending, firing)", labels=["rule", "status"]
        )
        for (rule, status), count in sorted(s.open_alerts_by_rule.items()):
            open_alerts.add_metric([rule, status], count)
        yield open_alerts


class _SettledCache:
    """The last settled counts and when they were read; one reader at a time refreshes them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.value: Settled | None = None
        self.read_at = 0.0

    def get(self, conn: Any, max_age: float) -> Settled:
        with self.lock:  # concurrent scrapes wait for one refresh instead of each scanning the index
            if self.value is None or time.monotonic() - self.read_at >= max_age:
                self.value = settled_counts(conn)
                self.read_at = time.monotonic()
            return self.value


def _settled_cache() -> _SettledCache:
    from flask import current_app

    # One per app (tests build many), made on first use; a race at worst makes one twice.
    return current_app.extensions.setdefault("paysync_metrics_settled", _SettledCache())


@bp.get("/metrics")
def metrics() -> Any:
    """Prometheus exposition of the database snapshot; answers 200 even when the database is down."""
    settings = ext("settings")
    forwarded = ",".join(request.headers.getlist("X-Forwarded-For"))
    authorization = request.headers.get("Authorization", "")
    cidrs, tokens = settings.metrics_allow_cidrs, scrape_tokens(settings)
    proxies = settings.trusted_proxies
    if not allowed(request.remote_addr, authorization, cidrs, tokens, forwarded_for=forwarded, trusted_proxies=proxies):
        return error_response("forbidden", "metrics are for allowed sources or a metrics token", 403)
    snap = None
    try:
        with ext("engine").connect() as conn:
            snap = combine(
                live_counts(conn, utcnow()), _settled_cache().get(conn, settings.metrics_settled_cache_seconds)
            )
    except SQLAlchemyError as exc:
        log.warning("metrics: database unreachable (%s)", type(exc).__name__)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, ext("publisher").state))
    return Response(_process_metrics(settings) + generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _process_metrics(settings: Any) -> bytes:
    """The event counters: every gunicorn worker's from the multiprocess directory, else this process's."""
    if not settings.web_metrics_dir:
        return generate_latest(REGISTRY)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=settings.web_metrics_dir)
    return generate_latest(registry)
