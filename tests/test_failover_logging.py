"""A database failover seen by the compensator and the gateway's readiness check.

The compensator logs one WARNING when its jobs start failing on an
unreachable database and one INFO when it is back, never a traceback per job
per run; ``/readyz`` requires the database and only reports the broker, so a
broker that is gone (every node) takes no gateway out of a load balancer.
"""

from __future__ import annotations

import logging

import pytest

from compensator.__main__ import OUTAGES, outage_of, run_job
from gateway import create_app
from payments.infra.db import make_engine
from payments.runtime import build_runtime
from tests.stack import db_url, target_of, url_via
from tests.support import TcpProxy, make_settings


@pytest.mark.mariadb
def test_a_database_outage_is_one_warning_for_every_job_and_its_end_one_info(mariadb, caplog):
    proxy = TcpProxy(*target_of(db_url(mariadb)))
    engine = make_engine(url_via(db_url(mariadb), proxy.port), connect_args={"connect_timeout": 2})
    runtime = build_runtime(make_settings(database_url=url_via(db_url(mariadb), proxy.port)), engine=engine)
    try:
        assert run_job(runtime, "compensate_callbacks") >= 0
        proxy.cut()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="paysync.compensator"):
            failed = 0
            for _ in range(3):
                for job in ("compensate_callbacks", "relay_outbox", "query_unresolved", "seal_ledger", "cleanup"):
                    failed += run_job(runtime, job) == -1  # some jobs catch a lost database themselves
            assert failed >= 6
            mine = [r for r in caplog.records if r.name == "paysync.compensator"]
            assert [r.levelname for r in mine] == ["WARNING"], [r.getMessage() for r in mine]
            assert "database unavailable" in mine[0].getMessage() and mine[0].exc_info is None
            proxy.restore()
            assert run_job(runtime, "compensate_callbacks") >= 0
            assert run_job(runtime, "query_unresolved") >= 0
            mine = [r for r in caplog.records if r.name == "paysync.compensator"]
        assert [r.levelname for r in mine] == ["WARNING", "INFO"]
        assert "database back after" in mine[1].getMessage()
        assert f"{failed} job runs failed" in mine[1].getMessage()
    finally:
        OUTAGES._since.clear()
        engine.dispose()
        proxy.close()


def test_a_defect_is_still_a_traceback(caplog, monkeypatch):
    from compensator import __main__ as main

    def broken(_runtime):
        raise KeyError("a bug")

    monkeypatch.setattr(main, "_jobs", lambda: {"broken": (broken, lambda rt: 1.0)})
    with caplog.at_level(logging.ERROR, logger="paysync.compensator"):
        assert run_job(None, "broken") == -1
    assert [r.exc_info is not None for r in caplog.records] == [True]
    assert outage_of(KeyError("x")) is None


def test_readyz_requires_the_database_and_only_reports_a_broker_with_every_node_down(engine):
    dead = "amqp://guest:guest@127.0.0.1:9/v,amqp://guest:guest@127.0.0.1:7/v"
    app = create_app(
        make_settings(database_url=db_url(engine), amqp_url=dead, publish_timeout_seconds=0.2), engine=engine
    )
    client = app.test_client()
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.get_json()
    assert body["checks"] == {"database": "required", "broker": "reported"}
    assert (body["database"], body["broker"], body["status"]) == ("ok", "disconnected", "ready")
