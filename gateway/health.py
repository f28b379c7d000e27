"""``/healthz`` (liveness, no dependencies) and ``/readyz`` (database reachable)."""

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
        "broker": publisher.state,
        # This worker's fast-path counters: failures and drops only delay processing until the sweep.
        "publisher": {
            "published": stats.published,
            "confirmed": stats.confirmed,
            "failed": stats.failed,
            "dropped": stats.dropped,
            "reconnects": stats.reconnects,
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
