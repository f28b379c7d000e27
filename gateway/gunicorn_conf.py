"""gunicorn settings for the gateway, taken from paysync's settings.

gunicorn reads this file in its master before any worker starts, so a bad
setting stops ``web`` here: one line naming the variable on stderr and exit
code 2, like every other process (gunicorn reports an exception in its config
file with a traceback and exit 1; SystemExit passes through it).

Slow clients: ``gthread`` workers. A connection costs a thread only while it
has bytes to read; one idle before its first byte waits in the worker's poller
(gunicorn defers it), and one that stalls in the middle of a request (half the
headers, half the body) holds its thread for at most WEB_READ_TIMEOUT_SECONDS:
the listening socket carries SO_RCVTIMEO, which every accepted socket
inherits, so a blocking read gives up and gunicorn closes the connection. With
WEB_THREADS threads per worker, fewer stalled clients than that cannot take a
worker's last thread, and /healthz keeps answering (tests/test_hostile_clients.py).
The timeout is per read: a client trickling a byte every few seconds still
holds a thread, so in front of the internet put a buffering proxy or load
balancer (docs/operations/deploying.md).

Metrics: every worker counts into prometheus-client's multiprocess directory
(WEB_METRICS_DIR, or a private temporary one per master), so ``/metrics``
adds up all the workers whichever one answers. The directory is emptied here,
before any worker starts (files of an earlier run would be added in), a dead
worker's live files are marked in ``child_exit`` (its counts stay, as counters
must), and a private directory is removed on exit. The variable must be set
before a worker imports prometheus_client, which is why it is set here.
"""

import logging
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path

from payments.infra.logs import scrub_every_handler, scrub_logger
from payments.runtime import start_process

# Refuses weak secrets in production (exit 2, one line) before any worker forks; warns once in development.
_settings = start_process("web")


def _metrics_dir() -> tuple[str, bool]:
    """(the multiprocess directory, made by us?), emptied of an earlier run's files."""
    if _settings.web_metrics_dir:
        path = Path(_settings.web_metrics_dir)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):  # only prometheus-client's files: the directory may be shared with others
            stale.unlink()
        return str(path), False
    return tempfile.mkdtemp(prefix="paysync-web-metrics-"), True


_metrics_path, _metrics_private = _metrics_dir()
os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_path  # read by prometheus_client at import, in each worker
os.environ["WEB_METRICS_DIR"] = _metrics_path  # and by the workers' settings: /metrics reads the directory

bind = f"{_settings.gateway_bind_address}:{_settings.port}"
workers = _settings.web_workers
worker_class = "gateway.worker.ThreadWorker"  # gthread, closing connections off the main loop
threads = _settings.web_threads
timeout = 30
graceful_timeout = 20
keepalive = 5
accesslog = None  # the gateway logs what matters; a line per request costs throughput
# gunicorn's control socket has one default path per user; several gateways on one host (tests,
# benchmarks, blue/green) would fight over it, and nothing here uses it.
control_socket_disable = True
# gunicorn's own start-up lines (its version, the worker class, each worker booting: four and more at INFO) are
# noise beside the one line when_ready writes, where a developer starts everything at once (`make run`); in
# production they stay, as operators read worker restarts there. LOG_LEVEL=DEBUG brings them back in development.
loglevel = "warning" if _settings.paysync_env == "development" and _settings.log_level != "DEBUG" else "info"


def _read_timeout(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


def when_ready(server) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """Scrub gunicorn's own logs; give the listening sockets a receive timeout, which accepted sockets inherit."""
    # Before the workers fork, so theirs are scrubbed too (they do not pass through paysync's formatter):
    # the loggers themselves, and every handler writing to the output, whichever logger its records come from.
    scrub_logger("gunicorn.error")
    scrub_logger("gunicorn.access")
    scrub_every_handler()
    for listener in server.LISTENERS:
        listener.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, _read_timeout(_settings.web_read_timeout_seconds)
        )
    logging.getLogger("paysync.web").info(
        "gateway listening on %s (%d workers, %d threads each)",
        ", ".join(str(listener) for listener in server.LISTENERS),
        _settings.web_workers,
        _settings.web_threads,
    )


def post_worker_init(_worker) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """A worker may have set up handlers of its own after the fork (a reopened log file): scrub those too."""
    scrub_every_handler()


def worker_exit(_server, _worker) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """A worker is stopping: its inline-charge pool finishes the sends it runs, then stops (``gateway.shutdown``)."""
    import sys

    wsgi = sys.modules.get("gateway.wsgi")  # only a worker that loaded the app has a pool to stop
    if wsgi is not None:
        from gateway import shutdown

        shutdown(wsgi.app)


def child_exit(_server, worker) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """A worker is gone: its live-gauge files no longer count (its counters and histograms still do)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid, _metrics_path)


def on_exit(_server) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """Remove the private metrics directory (an operator's WEB_METRICS_DIR stays, emptied at the next start)."""
    if _metrics_private:
        shutil.rmtree(_metrics_path, ignore_errors=True)
