"""``GET /metrics``: Prometheus text format.

The numbers come from the database (``payments.monitoring.snapshot``) at
scrape time, so they are the same whichever gunicorn worker answers and they
cover the consumer's and the compensator's work too, with no per-process
counters to aggregate.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy.exc import SQLAlchemyError

from gateway import ext
from payments.db import utcnow
from payments.monitoring import Snapshot, snapshot
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


@bp.get("/metrics")
def metrics() -> Any:
    """Prometheus exposition of the database snapshot; answers 200 even when the database is down."""
    snap = None
    try:
        with ext("engine").connect() as conn:
            snap = snapshot(conn, utcnow())
    except SQLAlchemyError as exc:
        log.warning("metrics: database unreachable (%s)", type(exc).__name__)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, ext("publisher").state))
    return Response(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
