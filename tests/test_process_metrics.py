"""Process metrics: every gunicorn worker counts, and the consumer and compensator serve their own.

Run as real processes (gunicorn, ``python -m consumer``, ``python -m compensator``)
against MariaDB and RabbitMQ: what is under test is exactly the part a unit
test cannot see (workers forking, the multiprocess directory, the ports).
"""

from __future__ import annotations

import os
import signal

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from payments.inbound.callbacks import store_callback
from payments.infra import metrics
from tests.stack import Stack, db_url, post, publish_deliveries, worker_pids
from tests.support import create_payment, free_port, sandbox_event, signed, wait_until

pytestmark = pytest.mark.mariadb


def scrape(port: int, **kwargs) -> dict[tuple[str, tuple], float]:  # noqa: ANN003
    response = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10, **kwargs)
    assert response.status_code == 200, response.text
    out = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def test_every_gunicorn_worker_counts_and_a_dead_workers_counts_stay(mariadb, tmp_path):
    metrics_dir = tmp_path / "web-metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_1.db").write_bytes(b"left over from an earlier run")
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), WEB_METRICS_DIR=str(metrics_dir)) as stack:
        web, port = stack.start_web(workers=2)
        assert not (metrics_dir / "counter_1.db").exists()  # emptied before the workers started
        sent = 24
        for _ in range(sent):
            body, headers = signed(sandbox_event(create_payment(mariadb)))
            # A fresh connection each time: gunicorn hands them to whichever worker accepts first.
            assert post(port, body, {**headers, "Connection": "close"}).status_code == 200
        pids = {p.name.rsplit("_", 1)[1].removesuffix(".db") for p in metrics_dir.glob("counter_*.db")}
        assert len(pids) == 2, f"both workers took callbacks: {pids}"
        for _ in range(4):  # whichever worker answers the scrape, it reports all of them
            got = scrape(port)
            assert total(got, "paysync_callbacks_received_total", provider="sandbox", outcome="accepted") == sent
            assert total(got, "paysync_callback_ack_seconds_count", provider="sandbox") == sent
            # Applied inline (no broker): receipt-to-applied observed once per callback.
            assert total(got, "paysync_callback_apply_seconds_count", provider="sandbox") == sent
            assert total(got, "paysync_callbacks_processed_total", outcome="applied") == sent
            assert got[("paysync_callbacks", (("status", "processed"),))] == sent  # the database gauges too

        doomed = sorted(worker_pids(web.popen.pid))[0]
        os.kill(doomed, signal.SIGKILL)
        wait_until(lambda: doomed not in worker_pids(web.popen.pid) and len(worker_pids(web.popen.pid)) == 2)
        wait_until(lambda: requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).ok)
        got = scrape(port)
        assert total(got, "paysync_callbacks_received_total", provider="sandbox", outcome="accepted") == sent
    # The master's on_exit leaves an operator's directory in place (a private one it removes).
    assert metrics_dir.exists()


def test_the_compensator_serves_its_counters_on_its_port(mariadb, tmp_path):
    payment_id = create_payment(mariadb)
    body, headers = signed(sandbox_event(payment_id))
    store_callback(mariadb, provider="sandbox", body=body, headers=headers, remote_addr=None)
    port = free_port()
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), COMPENSATOR_METRICS_PORT=str(port)) as stack:
        stack.start("compensator")

        def applied() -> bool:
            try:
                return total(scrape(port), "paysync_callbacks_processed_total", outcome="applied") == 1
            except requests.ConnectionError:
                return False

        wait_until(applied, timeout=30, message="the compensator counted the applied callback")
        got = scrape(port)
        assert total(got, "paysync_callback_apply_seconds_count", provider="sandbox") == 1
        # Same rule as the gateway: a source outside METRICS_ALLOW_CIDRS needs the ops token.
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), COMPENSATOR_METRICS_PORT=str(port), METRICS_ALLOW_CIDRS="") as s:
        s.start("compensator", "compensator-token-only")
        wait_until(lambda: _answers(port), timeout=30, message="metrics port")
        assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 403
        ops = "Bearer " + _dev_ops_token()
        assert requests.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": ops}, timeout=5).ok


def test_the_consumer_serves_its_counters_on_its_port(mariadb, amqp_url, amqp_queue, tmp_path):
    payment_id = create_payment(mariadb)
    body, headers = signed(sandbox_event(payment_id))
    log_id = store_callback(mariadb, provider="sandbox", body=body, headers=headers, remote_addr=None)
    port = free_port()
    env = {"DATABASE_URL": db_url(mariadb), "AMQP_URL": amqp_url, "AMQP_QUEUE": amqp_queue}
    with Stack(tmp_path, **env, CONSUMER_METRICS_PORT=str(port)) as stack:
        stack.start("consumer")
        wait_until(lambda: _answers(port), timeout=30, message="consumer metrics port")
        publish_deliveries(amqp_url, amqp_queue, mariadb, [log_id])
        wait_until(
            lambda: total(scrape(port), "paysync_consumer_messages_total", action="ack") == 1,
            timeout=30,
            message="the consumer counted the message",
        )
        got = scrape(port)
        assert total(got, "paysync_callbacks_processed_total", outcome="applied") == 1
        assert total(got, "paysync_callback_apply_seconds_count") == 1


def _answers(port: int) -> bool:
    try:
        requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
        return True
    except requests.ConnectionError:
        return False


def _dev_ops_token() -> str:
    from payments.infra.settings import DEV_DEFAULTS

    return DEV_DEFAULTS["ops_token"][0]


def test_the_metrics_server_applies_the_source_and_token_rule():
    registry = CollectorRegistry()
    Counter("paysync_test_things", "things", registry=registry).inc(3)
    open_server = metrics.serve("127.0.0.1", 0, ("127.0.0.0/8",), ("tok-123",), registry)
    closed_server = metrics.serve("127.0.0.1", 0, (), ("tok-123",), registry)
    try:
        assert scrape(open_server.port)[("paysync_test_things_total", ())] == 3
        refused = requests.get(f"http://127.0.0.1:{closed_server.port}/metrics", timeout=5)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "forbidden"
        wrong = requests.get(
            f"http://127.0.0.1:{closed_server.port}/metrics", headers={"Authorization": "Bearer nope"}, timeout=5
        )
        assert wrong.status_code == 403
        got = scrape(closed_server.port, headers={"Authorization": "Bearer tok-123"})
        assert got[("paysync_test_things_total", ())] == 3
    finally:
        open_server.close()
        closed_server.close()


def test_a_taken_port_is_logged_not_fatal(caplog):
    from tests.support import make_settings

    first = metrics.serve("127.0.0.1", 0, ("127.0.0.0/8",), ())
    try:
        assert metrics.serve_for(make_settings(), first.port, "compensator") is None
        assert "metrics not served" in caplog.text
        assert metrics.serve_for(make_settings(), 0, "compensator") is None  # 0: off
    finally:
        first.close()


def test_the_processes_metrics_ports_take_the_metrics_token_and_honour_trusted_proxies():
    from tests.support import make_settings

    token = "mtr_Zt4pK8wQm2xR7vLn9cBs3hJd6fGy"
    settings = make_settings(
        metrics_token=(token,), metrics_allow_cidrs=("192.0.2.0/24",), trusted_proxies=("127.0.0.0/8",)
    )
    server = metrics.serve_for(settings, free_port(), "compensator")
    assert server is not None
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert requests.get(url, timeout=5).status_code == 403  # loopback is a proxy here, and names nobody
        assert requests.get(url, headers={"X-Forwarded-For": "203.0.113.7"}, timeout=5).status_code == 403
        assert requests.get(url, headers={"X-Forwarded-For": "192.0.2.5"}, timeout=5).status_code == 200
        assert requests.get(url, headers={"Authorization": f"Bearer {token}"}, timeout=5).status_code == 200
    finally:
        server.close()
