"""Connection parameters: one heartbeat and timeout policy for every process that talks to RabbitMQ."""

from __future__ import annotations

import pika

HEARTBEAT_SECONDS = 30
"""Heartbeat negotiated on every connection: a dead peer is noticed within about a minute."""


STACK_FACTOR = 4
"""Bringing the whole connection up (TCP, AMQP handshake, channel) may take this many socket timeouts."""


def parameters(url: str, timeout: float) -> pika.URLParameters:
    """Parameters for ``url``: one connection attempt, TCP connect bounded by ``timeout``.

    The whole bring-up (see ``connect_bound``) and a broker that blocks our
    publishing (a resource alarm) get ``STACK_FACTOR`` times that.
    Reconnecting is the caller's business, with its own backoff.
    """
    params = pika.URLParameters(url)
    params.socket_timeout = timeout
    params.stack_timeout = connect_bound(timeout)
    params.blocked_connection_timeout = connect_bound(timeout)
    params.connection_attempts = 1
    params.heartbeat = HEARTBEAT_SECONDS
    return params


def connect_bound(timeout: float) -> float:
    """The longest connecting can take with ``parameters(url, timeout)``."""
    return timeout * STACK_FACTOR


def connect(url: str, timeout: float) -> pika.BlockingConnection:
    """A blocking connection with these parameters (raises ``pika.exceptions.AMQPError`` or OSError)."""
    return pika.BlockingConnection(parameters(url, timeout))


def unreachable(url: str, timeout: float) -> str | None:
    """Why RabbitMQ at ``url`` cannot be reached now, or None: opens a connection with ``parameters`` and closes it.

    The reason names the error class and pika's text (host and port, never
    the URL's credentials); bounded by ``connect_bound(timeout)``.
    """
    try:
        connection = connect(url, timeout)
    except (pika.exceptions.AMQPError, OSError) as exc:
        # pika's connection errors carry the socket error in args and print as empty strings (their repr says it).
        detail = str(exc) or ", ".join(repr(a) for a in exc.args)
        return f"{type(exc).__name__}: {detail}"[:300] if detail else type(exc).__name__
    try:
        connection.close()
    except (pika.exceptions.AMQPError, OSError):
        pass  # it connected: that is all the probe asks
    return None
