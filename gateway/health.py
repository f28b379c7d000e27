"""``/healthz`` (liveness, no dependencies) and ``/readyz`` (database reachable).

``/readyz`` is what a load balancer health-checks (deploy/haproxy). It checks
the database only, through DATABASE_URL (on a cluster: the writer behind
HAProxy), because a gateway that cannot store a callback must not take one.
The broker is reported, never required: a callback the broker does not take
is swept from the database, so a broker failover, however long, takes no
gateway out of the rotation. A database failover takes every gateway out at
once, and then the load balancer itself answers 503, which providers retry,
as they would the gateways' own 503.
"""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, jsonify
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from gateway import ext

bp = Blueprint("health", __name__)
log = logging.getLogger("paysync.gateway.health")


@bp.get("/healthz")
def healthz() -> Any:
    """The process is up and serving; checks nothing else."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Any:
    """Ready when the database answers; the broker's state is reported but not required."""
    publisher = ext("publisher")
    stats = publisher.stats
    body: dict[str, Any] = {
        "checks": {"database": "required", "broker": "reported"},
        "broker": publisher.state,
        # This worker's fast-path counters: failures and drops only delay processing until the sweep.
        "publisher": {
            "published": stats.published,
            "confirmed": stats.confirmed,
            "failed": stats.failed,
            "dropped": stats.dropped,
            "reconnects": stats.reconnects,
            "retried": getattr(stats, "retried", 0),
            "node": getattr(stats, "node", None),
            "last_error": stats.last_error,
        },
    }
    try:
        with ext("engine").connect() as conn:
            conn.execute(text("SELECT 1"))
        body["database"] = "ok"
        status = 200
    except SQLAlchemyError as exc:
        log.warning("readiness: database unreachable (%s)", type(exc).__name__)
        body["database"] = "unreachable"
        status = 503
    body["status"] = "ready" if status == 200 else "not_ready"
    response = jsonify(body)
    response.status_code = status
    return response
