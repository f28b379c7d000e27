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
balancer (README "Deploying safely").
"""

import socket
import struct

from payments.logs import scrub_logger
from payments.settings import start_process

# Refuses weak secrets in production (exit 2, one line) before any worker forks; warns once in development.
_settings = start_process("web")

bind = f"0.0.0.0:{_settings.port}"
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


def _read_timeout(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


def when_ready(server) -> None:  # noqa: ANN001 - gunicorn's hook signature
    """Scrub gunicorn's own logs; give the listening sockets a receive timeout, which accepted sockets inherit."""
    # Before the workers fork, so theirs are scrubbed too (they do not pass through paysync's formatter).
    scrub_logger("gunicorn.error")
    scrub_logger("gunicorn.access")
    for listener in server.LISTENERS:
        listener.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, _read_timeout(_settings.web_read_timeout_seconds)
        )
