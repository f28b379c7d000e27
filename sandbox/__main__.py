"""``python -m sandbox``: serve the sandbox payment platform on SANDBOX_HOST:SANDBOX_PORT.

gunicorn with ONE worker of the ``gthread`` class and SANDBOX_THREADS threads,
the webhook dispatcher a background thread inside that worker:

- one worker, because the platform's state is one SQLite connection under one
  lock plus the dispatcher's in-flight set: a second process would be a second
  platform;
- threads, because the timeout-after-commit fault parks a request for seconds
  (20% of requests at 3 s and 200 requests/s keep ~120 threads asleep): the
  default 256 threads leave room for the rest;
- keep-alive connections idle up to 75 s (see ``load_config``);
- gunicorn rather than werkzeug's threaded server, because werkzeug closes the
  connection after every response: measured here with wrk (16 connections, no
  faults) gthread with keep-alive answered 553 charges/s against 368 for
  werkzeug, and it brings a graceful SIGTERM for free (docs/providers/sandbox.md).

SIGTERM/SIGINT: the worker stops accepting, finishes the requests in hand
(parked ones included, up to the graceful timeout), stops the dispatcher
(sends in progress finish), closes the database; the process exits 0.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import replace
from typing import Any

from gunicorn.app.base import BaseApplication

from sandbox.app import Platform, build_platform, create_app
from sandbox.config import SandboxConfigError, SandboxSettings, load_settings
from sandbox.faults import Faults
from sandbox.logs import setup_logging

log = logging.getLogger("sandbox")


class SandboxServer(BaseApplication):
    """gunicorn configured from SandboxSettings; the Platform is built inside the worker, after the fork."""

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.platform: Platform | None = None
        super().__init__()

    def load_config(self) -> None:
        """gunicorn settings (see the module docstring for why each)."""
        s = self.settings
        for key, value in {
            "bind": f"{s.host}:{s.port}",
            "workers": 1,
            "worker_class": "gthread",
            "threads": s.threads,
            "worker_connections": max(1000, s.threads * 4),
            # As long as nginx's default (75 s): with 5 s, a client's pooled connection left idle that long was
            # closed by us just as it was reused now and then, a connection error with no answer; paysync must
            # take that as ambiguous, and a charge waited out QUERY_NOT_FOUND_GRACE_SECONDS (60 s) before its
            # re-send (bench/charges.py: 1 to 5 payments of 1,000 took 65 s, in 3 of 6 passes without faults).
            "keepalive": 75,
            "timeout": 30,
            "graceful_timeout": 10,
            "accesslog": None,  # a line per request costs throughput; the store records what matters
            # gunicorn's own start-up lines (version, worker class, worker boot) say less than _when_ready's one
            # line and crowd `make run`'s output: warnings and errors only, unless LOG_LEVEL=DEBUG.
            "loglevel": "debug" if s.log_level == "DEBUG" else "warning",
            "proc_name": "paysync-sandbox",
            # gunicorn's control socket has one default path per user: a second gunicorn (the gateway,
            # another test's sandbox) would take it over. The sandbox needs none.
            "control_socket_disable": True,
            "when_ready": _when_ready,
            "post_worker_init": _post_worker_init,
            "worker_exit": _worker_exit,
        }.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        """Build the platform and its Flask app (in the worker process)."""
        self.platform = build_platform(self.settings)
        return create_app(self.platform)


def _when_ready(server: Any) -> None:
    s = server.app.settings
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host  # noqa: S104
    log.info(
        "sandbox payment platform listening on http://%s:%d (state %s, webhooks to %s)",
        host,
        s.port,
        s.db_path,
        s.callback_url,
    )


def _post_worker_init(worker: Any) -> None:
    platform = worker.app.platform
    if platform is not None and platform.dispatcher is not None:
        platform.dispatcher.start()
        faults = platform.dice.faults
        # Worth a line at start only when a knob is turned: a well-behaved platform is the default.
        turned = replace(faults, seed=None) != Faults()
        log.log(
            logging.INFO if turned else logging.DEBUG, "webhook dispatcher started; fault knobs %s", faults.to_dict()
        )


def _worker_exit(_server: Any, worker: Any) -> None:
    platform = worker.app.platform
    if platform is None:
        return
    if platform.dispatcher is not None:
        platform.dispatcher.stop()
    platform.store.close()
    log.info("sandbox stopped")


def main() -> int:
    """Run until SIGTERM/SIGINT; return the exit code."""
    try:
        settings = load_settings()
    except SandboxConfigError as exc:
        print(f"sandbox: bad configuration: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level)
    SandboxServer(settings).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
