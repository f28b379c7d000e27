"""Process metrics: what each process did, counted where it happens (Prometheus counters and histograms).

Two kinds of number reach Prometheus:

- database counts (rows by status, backlog age, Unknown payments, …) are read
  by the gateway at scrape time (``payments.ops.monitoring``, ``gateway.metrics``):
  the same whichever process or worker answers;
- events (callbacks received, acknowledgement and apply latency, processing
  outcomes, publish failures, provider calls, alert notifications) are counted
  here, in the process where they happen, and exposed by that process: the
  gateway's ``/metrics`` (gunicorn workers aggregated by prometheus-client's
  multiprocess mode, see ``gateway/gunicorn_conf.py``), the consumer on
  CONSUMER_METRICS_PORT, the compensator on COMPENSATOR_METRICS_PORT.

Every helper here is an in-memory increment (a few microseconds; an mmap write
in multiprocess mode) and never touches the database: hot paths call them at
their edges. Label values are bounded sets (provider names we route, outcome
enums, channel names), never ids or free text.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram, make_wsgi_app

from payments.infra.sources import client_address, in_networks

log = logging.getLogger("paysync.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds, for one request or one call: acknowledgement and provider-call latency."""
APPLY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 21600.0)
"""Seconds from receipt to applied: milliseconds on the fast path, minutes to hours through retries."""

CALLBACKS_RECEIVED = Counter(
    "paysync_callbacks_received",
    "callback deliveries answered by the gateway, by provider and outcome "
    "(accepted, rejected, too_large, unavailable, error)",
    ["provider", "outcome"],
)
CALLBACKS_REFUSED = Counter(
    "paysync_callbacks_refused",
    "callback deliveries refused before verification, by provider and reason "
    "(source_not_allowed: stored small; rate_limited: answered 429, not stored)",
    ["provider", "reason"],
)
CALLBACK_ACK_SECONDS = Histogram(
    "paysync_callback_ack_seconds",
    "time from a callback request's arrival to its answer (store, verify, publish, inline)",
    ["provider"],
    buckets=LATENCY_BUCKETS,
)
CALLBACKS_PROCESSED = Counter(
    "paysync_callbacks_processed",
    "process_callback outcomes (applied, noop, duplicate, conflict, rejected, retry, gave_up, skipped, missing)",
    ["outcome"],
)
CALLBACKS_FAILED = Counter(
    "paysync_callbacks_failed",
    "callback rows whose processing failed for the first time (retried or gave up at once): each row counted once, "
    "however often it is retried, so a failure ratio over received callbacks stays within 100%",
)
CALLBACK_APPLY_SECONDS = Histogram(
    "paysync_callback_apply_seconds",
    "time from a callback's receipt (its create_time) to the transaction that applied it",
    ["provider"],
    buckets=APPLY_BUCKETS,
)
PUBLISH_FAILURES = Counter(
    "paysync_callback_publish_failures",
    "callback messages not confirmed by the broker (dropped, unconfirmed, lost); the sweep still processes the rows",
    ["reason"],
)
CONSUMER_MESSAGES = Counter(
    "paysync_consumer_messages",
    "broker messages handled by the consumer, by action (ack, dead_letter, requeue)",
    ["action"],
)
PROVIDER_CALLS = Counter(
    "paysync_provider_calls",
    "calls to payment providers, by provider, operation and outcome (Succeeded, Failed, Unknown, NotFound, …)",
    ["provider", "operation", "outcome"],
)
PROVIDER_CALL_SECONDS = Histogram(
    "paysync_provider_call_seconds",
    "latency of calls to payment providers",
    ["provider", "operation"],
    buckets=LATENCY_BUCKETS,
)
ALERT_NOTIFICATIONS = Counter(
    "paysync_alert_notifications",
    "alert notification attempts by channel and outcome (sent, failed: will retry, gave_up)",
    ["channel", "outcome"],
)
CLEANUP_ROWS = Counter(
    "paysync_cleanup_rows",
    "callback rows archived and deleted by the cleanup job, by kind (processed, rejected)",
    ["kind"],
)


_children: dict[tuple[Any, ...], Any] = {}


def _child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, cached: ``labels()`` takes a lock and validates on every call (hot paths)."""
    key = (metric, *labels)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*labels)  # a race at worst looks the same child up twice
    return child


def callback_answered(provider: str, status: int, seconds: float) -> None:
    """Count one answered callback request (outcome from its HTTP status) and its latency."""
    if status < 300:
        outcome = "accepted"
    elif status == 413:
        outcome = "too_large"
    elif status == 503:
        outcome = "unavailable"
    elif status < 500:
        outcome = "rejected"
    else:
        outcome = "error"
    _child(CALLBACKS_RECEIVED, provider, outcome).inc()
    _child(CALLBACK_ACK_SECONDS, provider).observe(seconds)


def callback_refused(provider: str, reason: str) -> None:
    """Count one delivery refused for where it came from (``source_not_allowed``) or how often (``rate_limited``)."""
    _child(CALLBACKS_REFUSED, provider, reason).inc()


def callback_processed(outcome: str) -> None:
    """Count one ``process_callback`` outcome."""
    _child(CALLBACKS_PROCESSED, outcome).inc()


def callback_failed_first() -> None:
    """Count one callback row failing for the first time (``record_failure`` on a row never retried before)."""
    CALLBACKS_FAILED.inc()


def callback_applied(provider: str, received: datetime, now: datetime) -> None:
    """Observe receipt-to-applied latency for a callback applied at ``now`` (both naive UTC)."""
    _child(CALLBACK_APPLY_SECONDS, provider).observe(max(0.0, (now - received).total_seconds()))


def consumer_message(action: str) -> None:
    """Count one broker message the consumer handled."""
    _child(CONSUMER_MESSAGES, action).inc()


def publish_failed(reason: str, count: int = 1) -> None:
    """Count callback messages the broker did not take."""
    PUBLISH_FAILURES.labels(reason).inc(count)


def provider_call(provider: str, operation: str, outcome: str, seconds: float | None) -> None:
    """Count one finished provider call (``seconds`` None when the adapter measured nothing)."""
    PROVIDER_CALLS.labels(provider, operation, outcome).inc()
    if seconds is not None:
        PROVIDER_CALL_SECONDS.labels(provider, operation).observe(seconds)


def notification(channel: str, outcome: str) -> None:
    """Count one alert notification attempt."""
    ALERT_NOTIFICATIONS.labels(channel, outcome).inc()


def allowed(
    remote_addr: str | None,
    authorization: str,
    cidrs: Iterable[str],
    tokens: Iterable[str],
    *,
    forwarded_for: str | None = None,
    trusted_proxies: Iterable[str] = (),
) -> bool:
    """The /metrics rule: the client inside ``cidrs``, or ``Authorization: Bearer`` one of ``tokens``.

    The client is the peer, or the one a peer in ``trusted_proxies`` names in
    X-Forwarded-For (``payments.infra.sources.client_address``): behind a proxy the
    peer is the proxy, and an allow-list of it would let every client in.
    """
    client = client_address(remote_addr, forwarded_for, tuple(trusted_proxies))
    if in_networks(client, tuple(cidrs)):
        return True
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    matches = [hmac.compare_digest(given.encode(), token.encode()) for token in tokens if token]
    return any(matches)


def scrape_tokens(settings: Any) -> tuple[str, ...]:
    """The bearer tokens that may scrape: METRICS_TOKEN (scrape only) and OPS_TOKEN (which may do anything anyway)."""
    return tuple(settings.metrics_token) + tuple(settings.ops_token)


def guarded_app(
    app: Callable, cidrs: Iterable[str], tokens: Iterable[str], trusted_proxies: Iterable[str] = ()
) -> Callable:
    """Wrap a WSGI app so only allowed sources or a scrape token reach it (403 JSON otherwise)."""
    cidrs, tokens, trusted = tuple(cidrs), tuple(tokens), tuple(trusted_proxies)

    def guarded(environ: dict[str, Any], start_response: Callable) -> Iterable[bytes]:
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        forwarded = environ.get("HTTP_X_FORWARDED_FOR")
        if allowed(
            environ.get("REMOTE_ADDR"), authorization, cidrs, tokens, forwarded_for=forwarded, trusted_proxies=trusted
        ):
            return app(environ, start_response)
        body = b'{"error": {"code": "forbidden", "message": "metrics are for allowed sources or a metrics token"}}'
        start_response("403 Forbidden", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    return guarded


class MetricsServer:
    """This process's registry over HTTP on ``bind:port`` in a daemon thread (the consumer's, the compensator's)."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self.server = server
        self.thread = thread

    @property
    def port(self) -> int:
        """The port actually bound (useful when 0 asked the OS for one)."""
        return int(self.server.server_port)

    def close(self) -> None:
        """Stop serving and release the port."""
        self.server.shutdown()
        self.server.server_close()


def serve(
    bind: str,
    port: int,
    cidrs: Iterable[str],
    tokens: Iterable[str],
    registry: CollectorRegistry = REGISTRY,
    trusted_proxies: Iterable[str] = (),
) -> MetricsServer:
    """Serve ``registry`` on ``bind:port`` (raises OSError when the port is taken)."""
    from wsgiref.simple_server import make_server

    from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

    app = guarded_app(make_wsgi_app(registry), cidrs, tokens, trusted_proxies)
    server = make_server(bind, port, app, ThreadingWSGIServer, handler_class=_SilentHandler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread)


def serve_for(settings: Any, port: int, process: str) -> MetricsServer | None:
    """Start the process's metrics endpoint when ``port`` is set (0: off); a taken port is logged, not fatal."""
    if not port:
        return None
    try:
        server = serve(
            settings.metrics_bind_address,
            port,
            settings.metrics_allow_cidrs,
            scrape_tokens(settings),
            trusted_proxies=settings.trusted_proxies,
        )
    except OSError as exc:
        # Metrics are for watching: a clash (two compensators on one host) must not stop the work itself.
        log.error("%s: metrics not served on %s:%s (%s)", process, settings.metrics_bind_address, port, exc)
        return None
    log.info("%s: metrics on http://%s:%s/metrics", process, settings.metrics_bind_address, server.port)
    return server
