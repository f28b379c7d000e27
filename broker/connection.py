"""Connection parameters: one heartbeat and timeout policy for every process that talks to RabbitMQ.

A URL may name several nodes of one cluster, comma-separated
(``amqp://u:p@rabbit1:5672/v,amqp://u:p@rabbit2:5672/v``): every process
connects to the first live one and, when its connection is lost, to the next
(``Nodes``). Each URL is complete on its own (credentials and vhost too), so
one node can be addressed differently from another.
"""

from __future__ import annotations

import random
import threading

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


def node_urls(url: str) -> list[str]:
    """The node URLs of a (possibly comma-separated) AMQP_URL, in the order given."""
    return [part.strip() for part in url.split(",") if part.strip()]


def where(url: str) -> str:
    """Host and port of one node URL, for logs (never its credentials)."""
    params = pika.URLParameters(url)
    return f"{params.host}:{params.port}"


class Nodes:
    """The nodes of one AMQP_URL, taken in turn: ``current`` to connect to, ``advance`` after losing it.

    Each process starts at a random node, so the clients of a cluster spread over its nodes.
    """

    def __init__(self, url: str) -> None:
        self.urls = node_urls(url)
        self._lock = threading.Lock()
        self._index = random.randrange(len(self.urls)) if self.urls else 0

    def __len__(self) -> int:
        return len(self.urls)

    def current(self) -> str:
        """The node to connect to now."""
        return self.urls[self._index % len(self.urls)]

    def advance(self) -> str:
        """Move to the next node (the current one failed or was lost); return it."""
        with self._lock:
            self._index = (self._index + 1) % len(self.urls)
            return self.urls[self._index]

    def in_turn(self) -> list[str]:
        """Every node once, starting at the current one."""
        start = self._index % len(self.urls)
        return self.urls[start:] + self.urls[:start]


def connect(url: str, timeout: float, nodes: Nodes | None = None) -> pika.BlockingConnection:
    """A blocking connection to the first node of ``url`` that answers, trying each once, in turn.

    With ``nodes`` (kept by the caller across connections) the turn starts
    where the last connection was and ends on the node that answered, so a
    reconnect after a lost connection tries the other nodes first when
    ``nodes.advance()`` was called. Raises the last node's
    ``pika.exceptions.AMQPError`` or OSError when none answers.
    """
    nodes = nodes or Nodes(url)
    last: BaseException | None = None
    for _ in range(len(nodes)):
        try:
            return pika.BlockingConnection(parameters(nodes.current(), timeout))
        except (pika.exceptions.AMQPError, OSError) as exc:
            last = exc
            nodes.advance()
    assert last is not None
    raise last


def _reason(exc: BaseException) -> str:
    # pika's connection errors carry the socket error in args and print as empty strings (their repr says it).
    detail = str(exc) or ", ".join(repr(a) for a in exc.args)
    return f"{type(exc).__name__}: {detail}"[:300] if detail else type(exc).__name__


def unreachable(url: str, timeout: float) -> str | None:
    """Why RabbitMQ at ``url`` cannot be reached now, or None: opens a connection with ``parameters`` and closes it.

    With several nodes, None when any one of them answers; otherwise each
    node's reason. The reason names the error class and pika's text (host and
    port, never the URL's credentials); bounded by ``connect_bound(timeout)``
    per node.
    """
    reasons = []
    for node in node_urls(url):
        try:
            connection = pika.BlockingConnection(parameters(node, timeout))
        except (pika.exceptions.AMQPError, OSError) as exc:
            reasons.append(_reason(exc) if len(node_urls(url)) == 1 else f"{where(node)}: {_reason(exc)}")
            continue
        try:
            connection.close()
        except (pika.exceptions.AMQPError, OSError):
            pass  # it connected: that is all the probe asks
        return None
    return "; ".join(reasons)[:600] or "no node configured"
