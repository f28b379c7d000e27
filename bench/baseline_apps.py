"""The two baselines ``bench/ingest.py`` runs beside the gateway, under the same gunicorn settings.

``bare_app`` answers 200 and does nothing: the ceiling of Flask + gunicorn
the gateway's gunicorn workers on this machine. ``insert_app`` reads the body, INSERTs it into
one table and COMMITs, through the same engine settings as the gateway
(``payments.infra.db.make_engine``): the floor of any design that stores the raw
delivery before acknowledging it. Started with
``python -m gunicorn -c gateway/gunicorn_conf.py bench.baseline_apps:bare_app``
(or ``:insert_app``) and the environment of the gateway.
"""

from __future__ import annotations

from flask import Flask, Response, request
from sqlalchemy import text

from payments.infra.db import make_engine, utcnow
from payments.infra.settings import load_settings


def _bare() -> Flask:
    app = Flask("bench_bare")

    @app.post("/callbacks/<provider_name>")
    def receive(provider_name: str) -> Response:
        request.get_data(cache=False)
        return Response(b'{"received":true}', 200, content_type="application/json")

    return app


def _insert_only() -> Flask:
    app = Flask("bench_insert_only")
    engine = make_engine(load_settings().database_url)
    statement = text("INSERT INTO bench_insert_only (body, create_time) VALUES (:body, :now)")

    @app.post("/callbacks/<provider_name>")
    def receive(provider_name: str) -> Response:
        body = request.get_data(cache=False)
        with engine.begin() as conn:
            conn.execute(statement, {"body": body, "now": utcnow()})
        return Response(b'{"received":true}', 200, content_type="application/json")

    return app


bare_app = _bare()
insert_app = _insert_only()
