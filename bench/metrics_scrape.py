"""Scrape-time benchmark: ``GET /metrics`` with a callback table of ~1M rows on MariaDB.

    .venv/bin/python bench/metrics_scrape.py --rows 1000000 --database-url mysql+pymysql://root@127.0.0.1:3306/paysync_bench

Fills ``payment_callback_log`` of the bench database (emptied first) with
``--rows`` rows, 99.6% processed and 0.1% each pending, failed, rejected and
given up (MariaDB's sequence engine, one INSERT … SELECT), then times
``/metrics`` through the gateway app: cold (the settled counts are read) and
warm (they come from the per-worker cache), beside the uncached full snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import DEFAULT_DATABASE_URL, prepare_database  # the bench directory is on sys.path as a script
from sqlalchemy import text

FILL = """
INSERT INTO payment_callback_log (provider, callback_data, headers, remote_addr, order_no, payment_order_no,
    provider_event_id, event_type, status, result, retry_count, next_retry_at, create_time, update_time)
SELECT 'sandbox', REPEAT('x', 300), '{}', '127.0.0.1', CONCAT('pay_', seq), CONCAT('ch_', seq),
    CONCAT('evt_', seq), 'charge.succeeded',
    CASE seq % 1000 WHEN 0 THEN 0 WHEN 1 THEN 2 WHEN 2 THEN 3 WHEN 3 THEN 4 ELSE 1 END,
    'applied', 0, NOW(6) - INTERVAL (:n - seq) SECOND, NOW(6) - INTERVAL (:n - seq) SECOND, NOW(6)
FROM seq_1_to_{n}
"""


def _ms(values: list[float]) -> str:
    return f"median {statistics.median(values) * 1000:7.1f} ms  max {max(values) * 1000:7.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/metrics_scrape.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL)
    args = parser.parse_args(argv)

    from dataclasses import replace

    from gateway import create_app
    from payments.infra.db import make_engine, utcnow
    from payments.infra.settings import load_settings
    from payments.ops.monitoring import snapshot

    filler = make_engine(args.database_url, pool_size=1, connect_args={"read_timeout": 1800, "write_timeout": 1800})
    try:  # a million rows from a previous run: TRUNCATE is quick where DROP may outlast the usual read timeout
        with filler.begin() as conn:
            conn.execute(text("TRUNCATE TABLE payment_callback_log"))
    except Exception:  # noqa: BLE001, S110 - no database or no table yet: prepare_database makes them
        pass
    engine = prepare_database(args.database_url)
    started = time.perf_counter()
    with filler.begin() as conn:
        conn.execute(text(FILL.replace("{n}", str(int(args.rows)))), {"n": args.rows})
        conn.execute(text("ANALYZE TABLE payment_callback_log"))
    filler.dispose()
    print(f"filled {args.rows} callback rows in {time.perf_counter() - started:.1f} s")

    settings = replace(load_settings({"PAYSYNC_ENV": "development"}), database_url=args.database_url)
    full = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        with engine.connect() as conn:
            snapshot(conn, utcnow())
        full.append(time.perf_counter() - t)
    cold, warm = [], []
    for _ in range(args.repeats):
        client = create_app(settings, engine=engine).test_client()  # a fresh app: an empty cache
        t = time.perf_counter()
        assert client.get("/metrics").status_code == 200
        cold.append(time.perf_counter() - t)
        for _ in range(5):
            t = time.perf_counter()
            assert client.get("/metrics").status_code == 200
            warm.append(time.perf_counter() - t)
    print(f"full snapshot, uncached       {_ms(full)}")
    print(f"/metrics cold (settled read)  {_ms(cold)}")
    print(f"/metrics warm (settled cached, every {settings.metrics_settled_cache_seconds:g} s)  {_ms(warm)}")
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
