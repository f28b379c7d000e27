"""Settings: read once from the environment into one frozen object.

Nothing else in paysync reads ``os.environ``. Every setting has a default that
works on one machine (SQLite in ``var/``, no broker, the sandbox platform on
localhost), and a bad value stops the process at start with a message that
names the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from payments.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATABASE_URL = f"sqlite:///{PROJECT_ROOT / 'var' / 'paysync.db'}"


def _int(name: str, raw: str, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be a whole number, got {raw!r}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")
    return value


def _float(name: str, raw: str, minimum: float | None = None, maximum: float | None = None) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if value != value:  # NaN
        raise ConfigError(f"{name} must be a number, got {raw!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be <= {maximum}, got {value}")
    return value


def _bool(name: str, raw: str) -> bool:
    # Strict on purpose: "yes", "1" or a typo must not silently mean False.
    value = raw.strip().lower()
    if value == "true":
        return True
    if value == "false":
        return False
    raise ConfigError(f"{name} must be 'true' or 'false', got {raw!r}")


def _url(name: str, raw: str, schemes: tuple[str, ...]) -> str:
    value = raw.strip()
    if value and not value.startswith(schemes):
        raise ConfigError(f"{name} must start with one of {', '.join(schemes)}, got {value.split(':')[0]!r}:…")
    return value


@dataclass(frozen=True)
class Settings:
    """Every setting paysync reads, with its default. See README "Settings"."""

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL; mysql+pymysql://… in production, SQLite file by default."""
    amqp_url: str = ""
    """RabbitMQ URL; empty means no broker (the compensator alone converges)."""
    amqp_queue: str = "payment_callbacks"
    """Queue that carries each stored callback delivery from the gateway to the consumer."""
    amqp_quorum_queue: bool = False
    """Declare the queue as a quorum queue (for a RabbitMQ cluster)."""
    port: int = 8000
    """Port the gateway listens on."""
    web_workers: int = 2
    """gunicorn worker processes for the gateway."""
    merchant_api_token: str = "dev-merchant-token"
    """Bearer token for the merchant API (POST /payments)."""
    ops_token: str = "dev-ops-token"
    """Bearer token for /ops/…."""
    sandbox_webhook_secret: str = "whsec_dev_sandbox"
    """Shared secret that verifies the sandbox platform's notifications."""
    sandbox_api_url: str = "http://127.0.0.1:8100"
    """Where paysync calls the sandbox payment platform."""
    sandbox_api_key: str = "sk_sandbox_dev_key"
    """API key paysync presents to the sandbox platform (``Authorization: Bearer …``), like a provider's secret key."""
    callback_max_body_bytes: int = 256 * 1024
    """Callback bodies larger than this are refused with 413 and not stored."""
    callback_tolerance_seconds: int = 300
    """How old a signed callback timestamp may be (replay protection)."""
    callback_process_inline: bool | None = None
    """The gateway processes each callback before acknowledging it; None (unset): true when there is no broker."""
    callback_inline_budget_seconds: float = 2.0
    """How long inline processing may hold the acknowledgement; past it the row is left to consumer and sweep."""
    publish_timeout_seconds: float = 0.5
    """Upper bound on any broker connect or publish attempt from the gateway."""
    consumer_prefetch: int = 50
    """Unacknowledged messages the consumer holds at once."""
    compensator_interval_seconds: float = 10.0
    """How often the callback sweep runs (1 s when there is no broker)."""
    compensator_grace_seconds: float = 60.0
    """Rows younger than this are left to the consumer (0 when there is no broker)."""
    compensator_batch_size: int = 100
    """Rows claimed per sweep batch."""
    compensator_max_retries: int = 10
    """Failed attempts before a callback row gives up into the manual queue (status 4)."""
    compensator_rate_limit: float = 1000.0
    """Upper bound on callback rows processed per second by one compensator."""
    compensator_concurrency: int = 4
    """Callback rows one compensator processes at once (each in its own transaction and connection)."""
    retry_base_seconds: float = 2.0
    """First retry delay; doubles each attempt, with jitter."""
    retry_max_seconds: float = 3600.0
    """Cap on one retry delay."""
    alert_backlog_threshold: int = 100
    """Backlog alert: more than this many rows with status 0/2 …"""
    alert_backlog_seconds: int = 300
    """… continuously for this long."""
    alert_failure_rate: float = 0.05
    """Failure-rate alert: more than this share of recent callbacks failed …"""
    alert_failure_window_seconds: int = 600
    """… over this window."""
    alert_failure_min_sample: int = 20
    """No failure-rate alert on fewer callbacks than this in the window."""
    merchant_max_amount: int = 100_000_000
    """Largest amount POST /payments accepts, in minor units."""
    idempotency_lock_seconds: float = 60.0
    """A POST /payments still in flight after this long may be taken over by a retry with the same key."""
    provider_timeout_seconds: float = 10.0
    """Read timeout of one outbound provider call; past it the outcome is Unknown."""
    provider_rate_limit: float = 50.0
    """Outbound calls per second to one provider, per compensator process."""
    relay_interval_seconds: float = 0.2
    """How often relay_outbox polls for ChargeRequested rows (keeps creation-to-provider latency low)."""
    relay_concurrency: int = 8
    """Provider calls relay_outbox keeps in flight at once (a hanging call holds one slot, not the queue)."""
    relay_max_seconds: float = 30.0
    """One relay_outbox run stops claiming after this long (the scheduler starts the next one)."""
    query_interval_seconds: float = 1.0
    """How often query_unresolved looks for payments to query."""
    query_pending_after_seconds: float = 60.0
    """A payment Pending (provider said processing) this long is queried."""
    query_base_seconds: float = 2.0
    """First delay before querying an Unknown payment; doubles per attempt, with jitter."""
    query_max_seconds: float = 600.0
    """Cap on one query delay."""
    payment_deadline_seconds: int = 86400
    """A payment unresolved this long after creation goes to manual review with an alert."""
    breaker_failure_threshold: int = 5
    """Consecutive timeouts/5xx from one provider that open its circuit breaker."""
    breaker_open_seconds: float = 5.0
    """First pause once the breaker opens; doubles on every failed probe, with jitter."""
    breaker_max_open_seconds: float = 300.0
    """Cap on one breaker pause."""
    breaker_query_budget: int = 5
    """Queries one query_unresolved run may send to a provider whose breaker is open."""
    sandbox_legacy_enabled: bool = False
    """Register "sandbox_legacy": the sandbox called without idempotency keys or queries (tests, demos)."""
    merchant_webhook_url: str = ""
    """Where publish_events POSTs domain events (Standard Webhooks); empty: no webhook."""
    merchant_webhook_secret: str = ""
    """whsec_<base64> secret that signs those webhooks; required when MERCHANT_WEBHOOK_URL is set."""
    merchant_webhook_timeout_seconds: float = 15.0
    """Timeout of one webhook POST; a timeout counts as a failed attempt."""
    events_exchange: str = "paysync.events"
    """RabbitMQ topic exchange domain events are published to (routing key = event type)."""
    event_delivery_max_attempts: int = 25
    """Failed attempts at one destination before an event gives up into the manual queue."""
    event_delivery_deadline_seconds: int = 3 * 86400
    """An event not delivered this long after it was written gives up into the manual queue."""
    log_level: str = "INFO"
    """Python logging level name."""
    failpoints: str = ""
    """Test-only: comma-separated failpoint names at which the process SIGKILLs itself (payments/failpoints.py)."""

    @property
    def has_broker(self) -> bool:
        """True when a RabbitMQ URL is configured."""
        return bool(self.amqp_url)

    @property
    def process_inline(self) -> bool:
        """Whether the gateway processes callbacks in the request (CALLBACK_PROCESS_INLINE, default: no broker)."""
        return (not self.has_broker) if self.callback_process_inline is None else self.callback_process_inline

    @property
    def effective_grace_seconds(self) -> float:
        """The sweep's grace period: none without a broker, since nobody else will process."""
        return self.compensator_grace_seconds if self.has_broker else 0.0

    @property
    def effective_interval_seconds(self) -> float:
        """The sweep interval: short without a broker so callbacks still apply within seconds."""
        if self.has_broker:
            return self.compensator_interval_seconds
        return min(self.compensator_interval_seconds, 1.0)


_PARSERS = {
    "database_url": lambda n, v: _url(n, v, ("sqlite", "mysql", "mariadb")) or DEFAULT_DATABASE_URL,
    "amqp_url": lambda n, v: _url(n, v, ("amqp://", "amqps://")),
    "amqp_queue": lambda n, v: v.strip() or "payment_callbacks",
    "amqp_quorum_queue": _bool,
    "port": lambda n, v: _int(n, v, 1, 65535),
    "web_workers": lambda n, v: _int(n, v, 1, 64),
    "merchant_api_token": lambda n, v: v,
    "ops_token": lambda n, v: v,
    "sandbox_webhook_secret": lambda n, v: v,
    "sandbox_api_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "sandbox_api_key": lambda n, v: v.strip(),
    "callback_max_body_bytes": lambda n, v: _int(n, v, 1024, 16 * 1024 * 1024),
    "callback_tolerance_seconds": lambda n, v: _int(n, v, 1, 86400),
    "callback_process_inline": lambda n, v: _bool(n, v) if v.strip() else None,
    "callback_inline_budget_seconds": lambda n, v: _float(n, v, 0.01, 25),
    "publish_timeout_seconds": lambda n, v: _float(n, v, 0.01, 30),
    "consumer_prefetch": lambda n, v: _int(n, v, 1, 10000),
    "compensator_interval_seconds": lambda n, v: _float(n, v, 0.1, 86400),
    "compensator_grace_seconds": lambda n, v: _float(n, v, 0, 86400),
    "compensator_batch_size": lambda n, v: _int(n, v, 1, 10000),
    "compensator_max_retries": lambda n, v: _int(n, v, 1, 1000),
    "compensator_rate_limit": lambda n, v: _float(n, v, 0.1, 1_000_000),
    "compensator_concurrency": lambda n, v: _int(n, v, 1, 8),
    "retry_base_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "retry_max_seconds": lambda n, v: _float(n, v, 0.001, 7 * 86400),
    "alert_backlog_threshold": lambda n, v: _int(n, v, 0),
    "alert_backlog_seconds": lambda n, v: _int(n, v, 0),
    "alert_failure_rate": lambda n, v: _float(n, v, 0, 1),
    "alert_failure_window_seconds": lambda n, v: _int(n, v, 1),
    "alert_failure_min_sample": lambda n, v: _int(n, v, 1),
    "merchant_max_amount": lambda n, v: _int(n, v, 1, 2**62),
    "idempotency_lock_seconds": lambda n, v: _float(n, v, 1, 86400),
    "provider_timeout_seconds": lambda n, v: _float(n, v, 0.05, 300),
    "provider_rate_limit": lambda n, v: _float(n, v, 0.1, 1_000_000),
    "relay_interval_seconds": lambda n, v: _float(n, v, 0.01, 3600),
    "relay_concurrency": lambda n, v: _int(n, v, 1, 256),
    "relay_max_seconds": lambda n, v: _float(n, v, 0.1, 3600),
    "query_interval_seconds": lambda n, v: _float(n, v, 0.05, 3600),
    "query_pending_after_seconds": lambda n, v: _float(n, v, 0, 86400),
    "query_base_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "query_max_seconds": lambda n, v: _float(n, v, 0.001, 7 * 86400),
    "payment_deadline_seconds": lambda n, v: _int(n, v, 1, 90 * 86400),
    "breaker_failure_threshold": lambda n, v: _int(n, v, 1, 100_000),
    "breaker_open_seconds": lambda n, v: _float(n, v, 0.01, 86400),
    "breaker_max_open_seconds": lambda n, v: _float(n, v, 0.01, 7 * 86400),
    "breaker_query_budget": lambda n, v: _int(n, v, 0, 100_000),
    "sandbox_legacy_enabled": _bool,
    "merchant_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "merchant_webhook_secret": lambda n, v: _webhook_secret(n, v),
    "merchant_webhook_timeout_seconds": lambda n, v: _float(n, v, 0.1, 60),
    "events_exchange": lambda n, v: v.strip() or "paysync.events",
    "event_delivery_max_attempts": lambda n, v: _int(n, v, 1, 1000),
    "event_delivery_deadline_seconds": lambda n, v: _int(n, v, 1, 90 * 86400),
    "log_level": lambda n, v: _log_level(n, v),
    "failpoints": lambda n, v: v.strip(),
}


def _webhook_secret(name: str, raw: str) -> str:
    value = raw.strip()
    if value:
        from payments.webhook_signing import MIN_SECRET_BYTES, decode_secret

        try:
            decode_secret(value, min_bytes=MIN_SECRET_BYTES)
        except ConfigError as exc:  # name the variable, never echo the secret
            raise ConfigError(f"{name}: {exc}") from None
    return value


def _log_level(name: str, raw: str) -> str:
    value = raw.strip().upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ConfigError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {raw!r}")
    return value


def env_name(field_name: str) -> str:
    """The environment variable that sets a field: its name in upper case."""
    return field_name.upper()


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment; raise ConfigError naming the bad variable."""
    environ = os.environ if environ is None else environ
    values = {}
    for f in fields(Settings):
        name = env_name(f.name)
        if name in environ:
            values[f.name] = _PARSERS[f.name](name, environ[name])
    settings = Settings(**values)
    if settings.retry_max_seconds < settings.retry_base_seconds:
        raise ConfigError("RETRY_MAX_SECONDS must be >= RETRY_BASE_SECONDS")
    if settings.query_max_seconds < settings.query_base_seconds:
        raise ConfigError("QUERY_MAX_SECONDS must be >= QUERY_BASE_SECONDS")
    if settings.breaker_max_open_seconds < settings.breaker_open_seconds:
        raise ConfigError("BREAKER_MAX_OPEN_SECONDS must be >= BREAKER_OPEN_SECONDS")
    if settings.merchant_webhook_url and not settings.merchant_webhook_secret:
        raise ConfigError("MERCHANT_WEBHOOK_SECRET (whsec_…) is required when MERCHANT_WEBHOOK_URL is set")
    return settings
