"""Settings: read once from the environment into one frozen object.

Nothing else in paysync reads ``os.environ``. Every setting has a default that
works on one machine (SQLite in ``var/``, no broker, the sandbox platform on
localhost), and a bad value stops the process at start with a message that
names the variable.

This module parses values and judges them as values (ranges, formats, the
strength of secrets). What only a capability can judge (a provider's key
files, the alert rules and channels' templates) each capability checks
itself, asked by the start-up step ``payments.runtime.check_deployment``:
settings sit on the infra floor and import no wing above it.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

from payments.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parent.parent.parent
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


def _amqp_url(name: str, raw: str) -> str:
    """One AMQP URL or several (the nodes of one cluster), comma-separated; each is checked on its own."""
    import urllib.parse

    parts = [part.strip() for part in raw.split(",") if part.strip()]
    for number, part in enumerate(parts, 1):
        which = f"{name} (node {number} of {len(parts)})" if len(parts) > 1 else name
        _url(which, part, ("amqp://", "amqps://"))
        try:
            parsed = urllib.parse.urlsplit(part)
            port = parsed.port  # raises on a port that is not a number in range
        except ValueError as exc:
            raise ConfigError(f"{which} is not a valid URL: {str(exc).split(':')[0]}") from None
        if not parsed.hostname:
            raise ConfigError(f"{which} names no host")
        if port == 0:
            raise ConfigError(f"{which} has port 0")
        if parsed.path.count("/") > 1:
            raise ConfigError(f"{which}: the vhost must be one path segment (a '/' in it is written %2F)")
    return ",".join(parts)


def _database_url(name: str, raw: str) -> str:
    value = _url(name, raw, ("sqlite", "mysql", "mariadb")) or DEFAULT_DATABASE_URL
    if value.startswith(("mysql", "mariadb")):
        from sqlalchemy.engine import make_url

        from payments.infra.db import MYSQL_CHARSET, charset_problem

        try:
            charset = make_url(value).query.get("charset", MYSQL_CHARSET)
        except Exception:  # noqa: BLE001 - the URL itself is malformed: make_engine says so at connect
            return value
        problem = charset_problem(charset)
        if problem:
            raise ConfigError(f"{name} {problem}")
    return value


@dataclass(frozen=True)
class Settings:
    """Every setting paysync reads, with its default (docs/reference/settings.md is generated from these docs)."""

    database_url: str = DEFAULT_DATABASE_URL
    """SQLAlchemy URL (`mysql+pymysql://…` in production; a SQLite file in var/ by default); on MySQL/MariaDB a
    `charset=` other than `utf8mb4` (the default) is refused."""
    amqp_url: str = ""
    """RabbitMQ URL, or the URLs of a cluster's nodes comma-separated (clients use any live one and move to
    another when one is lost); empty means no broker (the compensator alone converges)."""
    broker_message_secret: tuple[str, ...] = ()
    """HMAC key(s) of the callback messages paysync publishes, comma-separated (the first signs, every one
    verifies); required with AMQP_URL. Known to paysync alone: the broker's users never need it."""
    amqp_queue: str = "payment_callbacks"
    """Queue that carries each stored callback delivery from the gateway to the consumer."""
    amqp_quorum_queue: bool = False
    """Declare the queue as a quorum queue (for a RabbitMQ cluster)."""
    paysync_env: str = "production"
    """production (the default: refuses weak secrets) or development (dev defaults, one warning)."""
    port: int = 8000
    """Port the gateway listens on."""
    web_bind_address: str = ""
    """Address the gateway (gunicorn) listens on; empty: 127.0.0.1 in development, 0.0.0.0 in production."""
    web_workers: int = 2
    """gunicorn worker processes for the gateway."""
    web_threads: int = 16
    """Request threads per gateway worker (gunicorn gthread); a stalled client holds one for the read timeout."""
    web_read_timeout_seconds: float = 5.0
    """A client that sends nothing for this long in the middle of a request is dropped (SO_RCVTIMEO)."""
    merchant_api_token: tuple[str, ...] = ()
    """Bearer token(s) of the merchant API, comma-separated for rotation: every one is accepted; in production ≥ 24
    characters, ≥ 8 distinct, and no value shared with another secret setting."""
    ops_token: tuple[str, ...] = ()
    """Bearer token(s) of `/ops/…` (and of `/metrics` from outside METRICS_ALLOW_CIDRS); in production ≥ 24
    characters, 8 distinct, none shared with another secret setting."""
    ops_readonly_token: tuple[str, ...] = ()
    """Token(s) that log in to the ops console to read only (no replay, no review actions); empty: no such role. Once
    set, held to the production rules of MERCHANT_API_TOKEN (no development default either), and none may equal an
    OPS_TOKEN."""
    metrics_token: tuple[str, ...] = ()
    """Bearer token(s) that may scrape `/metrics` (gateway, consumer, compensator) and nothing else: give Prometheus
    this, not OPS_TOKEN; empty: none. Once set, held to the production rules of the other tokens and shared with
    none."""
    metrics_allow_cidrs: tuple[str, ...] = ("127.0.0.0/8", "::1/128")
    """Sources that may scrape /metrics without a token (comma-separated CIDRs; the client as TRUSTED_PROXIES
    names it; empty: token only). Loopback by default: a private range holds every other tenant of the network."""
    metrics_settled_cache_seconds: float = 60.0
    """/metrics reads the counts of settled rows (millions) at most this often per gateway worker."""
    consumer_metrics_port: int = 9101
    """Port of the consumer's own /metrics (its counters and histograms); 0 or empty: not served. The default is
    the one ops/prometheus/prometheus.yml scrapes (a port already taken is logged, and the consumer works on)."""
    compensator_metrics_port: int = 9102
    """Port of the compensator's own /metrics; 0 or empty: not served (default: prometheus.yml's)."""
    metrics_bind_address: str = "127.0.0.1"
    """Address the consumer's and compensator's metrics ports listen on (METRICS_ALLOW_CIDRS applies too)."""
    web_metrics_dir: str = ""
    """prometheus-client multiprocess directory of the gateway's workers; empty: a private temporary one per gunicorn
    master (emptied at start, removed at exit)."""
    callback_retention_days: int = 90
    """cleanup archives, then deletes, processed callback rows (status 1) older than this; 0: keep them."""
    rejected_retention_days: int = 30
    """cleanup archives, then deletes, rejected callback rows (status 3) older than this; 0: keep them."""
    archive_dir: str = str(PROJECT_ROOT / "var" / "archive")
    """Where cleanup writes its gzip JSON-lines archives (each with a .sha256 file)."""
    cleanup_batch_size: int = 500
    """Rows archived and deleted per cleanup transaction."""
    cleanup_interval_seconds: float = 3600.0
    """How often the compensator runs cleanup."""
    sandbox_webhook_secret: tuple[str, ...] = ()
    """Secret(s) that verify the sandbox platform's notifications (every one is accepted: rotation; the platform
    signs with the first of the same variable); with SANDBOX_API_KEY it enables the `sandbox` provider; ≥ 24
    characters in production."""
    sandbox_api_url: str = "http://127.0.0.1:8100"
    """Where paysync calls the sandbox payment platform."""
    sandbox_source_cidrs: tuple[str, ...] = ()
    """Networks sandbox notifications may come from (empty: any), as for the real providers."""
    sandbox_api_key: tuple[str, ...] = ()
    """API key paysync presents to the sandbox platform (``Authorization: Bearer …``), like a provider's secret
    key; comma-separated, the first is presented (the sandbox accepts every listed one: rotation)."""
    callback_max_body_bytes: int = 256 * 1024
    """Callback bodies larger than this are refused with 413 and not stored."""
    callback_source_rate: float = 100.0
    """Callback POSTs a second one source address (IPv6: its /64) may make, per gateway worker; past the burst: 429,
    nothing stored (a provider retries it). 0: no limit."""
    callback_source_burst: int = 400
    """How many callback POSTs one source may make at once before CALLBACK_SOURCE_RATE holds it back."""
    refused_source_rate: float = 1.0
    """Deliveries refused for their source (outside the provider's *_SOURCE_CIDRS) one address may have stored a second,
    per gateway worker; past the burst: 429 and nothing stored. 0: no limit."""
    refused_source_burst: int = 20
    """How many refused deliveries of one source are stored at once before REFUSED_SOURCE_RATE holds it back."""
    refused_body_bytes: int = 4096
    """Of a delivery refused for its source, the first this many bytes of the body are kept (with its headers)."""
    refused_retention_days: int = 7
    """cleanup archives, then deletes, deliveries refused for their source older than this; 0: keep them."""
    callback_tolerance_seconds: int = 300
    """How old a signed callback timestamp may be (replay protection)."""
    callback_process_inline: bool | None = None
    """The gateway processes each callback before acknowledging it (after storing and publishing it); unset: true
    when there is no broker, false with one."""
    callback_inline_budget_seconds: float = 2.0
    """How long inline processing may hold the acknowledgement; past it the row is left to consumer and sweep."""
    publish_timeout_seconds: float = 0.5
    """Upper bound on any broker connect or publish attempt from the gateway."""
    publish_linger_seconds: float = 0.02
    """How long the gateway's publisher waits after a callback for others to share its message (0: publish at once).
    The answer to the provider never waits for it; only the consumer's fast path starts this much later."""
    publish_batch_max: int = 100
    """Most callbacks the gateway packs into one broker message (`{"deliveries": [...]}`, each entry the message of
    one delivery, the whole no larger than a message of one delivery may be); 1: a message per callback, the format
    before batching."""
    consumer_prefetch: int = 100
    """Unacknowledged messages the consumer holds at once (two batches: the next arrives while one is processed)."""
    consumer_batch_size: int = 50
    """Messages the consumer processes in one transaction (set-wise, or a savepoint each) and answers with one ack;
    1: one transaction per message. Only a backlog fills a batch: a lone message is processed at once."""
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
    """Chunks of claimed callback rows (up to 50 each, processed like a consumer's batch) one compensator processes
    at once (1–8), each in its own transaction and connection."""
    compensator_lease_seconds: float = 120.0
    """A claimed batch of callback rows is invisible to other sweeps this long (longer if the rate limit needs it)."""
    evaluate_alerts_interval_seconds: float = 15.0
    """How often evaluate_alerts runs."""
    publish_events_interval_seconds: float = 1.0
    """How often publish_events runs: events reach the merchant within about this long."""
    events_lease_seconds: float = 120.0
    """A claimed domain event is invisible to other publish_events runs this long (a dead run gives it back after);
    at least 2 × MERCHANT_WEBHOOK_TIMEOUT_SECONDS + 30."""
    retry_base_seconds: float = 2.0
    """First retry delay of a failed callback, outbox send or event delivery: base × 2^(n-1), capped at
    RETRY_MAX_SECONDS, with equal jitter."""
    retry_max_seconds: float = 3600.0
    """Cap on one retry delay."""
    alert_rules_file: str = ""
    """TOML file of alert rules (thresholds, windows, sustain, cooldowns, severities, channels); empty:
    ops/alert_rules.toml. Replaces ALERT_BACKLOG_* and ALERT_FAILURE_*, which are refused now."""
    ops_console_url: str = ""
    """Public base URL of the gateway serving /ops (e.g. https://pay.example.com): notices link to the console page
    of their subject and to /ops/runbooks/<rule>. Empty: notices name the page and the runbook path, with no link."""
    alert_runbook_url: str = ""
    """Base URL the runbooks are published under (…/docs/runbooks/, <rule>.md appended); empty: the console's
    /ops/runbooks/<rule> when OPS_CONSOLE_URL is set."""
    alert_notify_max_attempts: int = 8
    """Failed attempts at one notification on one channel before it gives up (alert_channel_failing fires)."""
    alert_notify_retry_base_seconds: float = 15.0
    """First retry delay of a failed notification: base × 2^(n-1), capped at ALERT_NOTIFY_RETRY_MAX_SECONDS, with
    equal jitter (or the service's Retry-After if longer)."""
    alert_notify_retry_max_seconds: float = 600.0
    """Cap on one notification retry delay."""
    alert_channel_timeout_seconds: float = 10.0
    """Timeout of one send on one channel (connect and each read)."""
    smtp_host: str = ""
    """SMTP server for the email channel; with SMTP_FROM and SMTP_TO it enables the channel."""
    smtp_port: int = 587
    """SMTP port: 587 for STARTTLS, 465 for implicit TLS, 25 for none."""
    smtp_tls: str = "starttls"
    """starttls (upgrade after EHLO), implicit (TLS from the first byte) or off; certificates are always verified."""
    smtp_username: str = ""
    """SMTP AUTH user; with SMTP_PASSWORD (both or neither)."""
    smtp_password: str = ""
    """SMTP AUTH password: one value (commas are legal in passwords), never logged; needs TLS."""
    smtp_from: str = ""
    """Sender address of alert mails."""
    smtp_to: tuple[str, ...] = ()
    """Comma-separated recipient addresses of the email channel's alert mails."""
    smtp_ca_file: str = ""
    """PEM bundle to verify the SMTP server's certificate with instead of the system's CAs (a private CA)."""
    sms_gateway_url: str = ""
    """Generic HTTP SMS gateway; with SMS_RECIPIENTS it enables the sms channel."""
    sms_gateway_template: str = '{"to": "{{phone}}", "text": "{{text}}"}'
    """JSON body sent to the SMS gateway; placeholders `{{phone}}` or `{{phones}}`, `{{text}}`, `{{title}}`,
    `{{message}}`, `{{rule}}`, `{{severity}}`, `{{kind}}` (an unknown one stops the process)."""
    sms_gateway_token: tuple[str, ...] = ()
    """Bearer token(s) for the gateway, comma-separated (the first is sent); empty: no Authorization header."""
    sms_recipients: tuple[str, ...] = ()
    """Comma-separated phone numbers the sms channel texts."""
    aliyun_sms_access_key_id: str = ""
    """Aliyun AccessKey ID for dysmsapi SendSms; the five ALIYUN_SMS_* settings below enable aliyun_sms."""
    aliyun_sms_access_key_secret: tuple[str, ...] = ()
    """The AccessKey secret(s), comma-separated (the first signs)."""
    aliyun_sms_sign_name: str = ""
    """Approved SMS signature name (签名名称)."""
    aliyun_sms_template_code: str = ""
    """Approved template code (SMS_…)."""
    aliyun_sms_template_param: str = '{"rule": "{{rule}}", "status": "{{kind}}"}'
    """JSON object for the template's ${variables}: placeholders {{text}}, {{title}}, {{rule}}, {{severity}}, …"""
    aliyun_sms_phone_numbers: tuple[str, ...] = ()
    """Comma-separated phone numbers aliyun_sms texts (one SendSms call for all)."""
    aliyun_sms_endpoint: str = "https://dysmsapi.aliyuncs.com"
    """Where SendSms is called (a local fake in tests)."""
    dingtalk_webhook_url: str = ""
    """DingTalk group robot webhook (…/robot/send?access_token=…); enables the dingtalk channel."""
    dingtalk_secret: tuple[str, ...] = ()
    """The robot's signing secret(s) (SEC…), comma-separated (the first signs); empty: unsigned."""
    feishu_webhook_url: str = ""
    """Feishu/Lark custom bot webhook (…/open-apis/bot/v2/hook/…); enables the feishu channel."""
    feishu_secret: tuple[str, ...] = ()
    """The bot's signing secret(s), comma-separated (the first signs); empty: unsigned."""
    wecom_webhook_url: str = ""
    """WeCom group robot webhook (…/cgi-bin/webhook/send?key=…); enables the wecom channel."""
    slack_webhook_url: str = ""
    """Slack incoming webhook (https://hooks.slack.com/services/…); enables the slack channel."""
    alert_webhook_url: str = ""
    """Generic alert webhook (Standard Webhooks signed JSON); with ALERT_WEBHOOK_SECRET enables the webhook channel."""
    alert_webhook_secret: tuple[str, ...] = ()
    """whsec_<base64> secret(s) of the alert webhook, comma-separated (the first signs)."""
    merchant_max_amount: int = 100_000_000
    """Largest amount POST /payments accepts, in minor units."""
    idempotency_lock_seconds: float = 60.0
    """A POST /payments still in flight after this long may be taken over by a retry with the same key."""
    charge_inline_budget_seconds: float = 3.0
    """How long POST /payments waits for the charge to a payer-scans provider (Alipay, WeChat Pay) to return its QR
    code, sent at once through the relay's own path; past it the answer is Created and the relay finishes. 0: off."""
    provider_timeout_seconds: float = 10.0
    """Read timeout of one outbound provider call; past it the outcome is Unknown. A claimed relay or query row is
    leased for its wait at the rate limiter (2 × RELAY_CONCURRENCY / PROVIDER_RATE_LIMIT) + 2 × this + 3 s."""
    provider_rate_limit: float = 50.0
    """Outbound calls per second to one provider, per compensator process (and per gateway process, inline charges)."""
    relay_interval_seconds: float = 0.2
    """How long an idle relay run polls (every 50 ms) before the next begins: the relay runs back to back in a thread
    of the compensator, not on the scheduler, so it never logs APScheduler's "maximum number of running instances"
    for itself."""
    relay_concurrency: int = 256
    """Provider calls relay_outbox keeps in flight at once: cheap slots (a thread asleep on a socket), so
    calls hanging until their timeout do not starve the rest."""
    relay_provider_concurrency: int = 192
    """Of those, at most this many to one provider at once (what one platform is asked to bear)."""
    relay_db_concurrency: int = 8
    """Of those, at most this many in a database transaction at once (preparing a call or applying its answer);
    the rest wait their turn holding no connection. A few keep a small database busy: more only queue for the
    connection pool and the interpreter lock, and every transaction takes longer."""
    relay_max_seconds: float = 30.0
    """One relay_outbox run stops claiming after this long; the next run begins when it ends."""
    query_interval_seconds: float = 1.0
    """How often query_unresolved looks for payments to query."""
    query_pending_after_seconds: float = 60.0
    """A payment Pending (provider said processing) this long is queried."""
    query_base_seconds: float = 2.0
    """First delay before querying an Unknown payment; doubles per attempt, with jitter."""
    query_max_seconds: float = 600.0
    """Cap on one query delay."""
    query_not_found_grace_seconds: float = 60.0
    """A query's NotFound this soon after the last send ended is not believed yet: no re-send (nor ever after a send
    the provider answered Pending). Counted from the end of the last call that may have reached the provider (its
    recorded end; with none recorded, in flight or its process killed, the end of its lease), never from when it was
    prepared: a request can wait for a slot and hang until its timeout after that; a send answered 429, or recorded
    as never sent, did nothing and starts no grace."""
    provider_key_lifetime_seconds: float = 82800.0
    """How long a provider that dedupes by idempotency key (Stripe, the sandbox) is taken to remember a payment's or
    refund's key, counted from its creation (60 to 86400; 23 h by default). Past it the key is never sent again: a
    lost outcome is queried instead, and a NotFound past the grace, or a provider that cannot be queried, goes to the
    manual queue (Stripe keeps a key about 24 h, after which the same key makes a new charge)."""
    hint_query_interval_seconds: float = 60.0
    """An unverified notification brings its payment's query forward at most once this often (per payment)."""
    hint_queries_per_minute: int = 60
    """At most this many queries a minute are brought forward by unverified notifications, per provider."""
    trusted_proxies: tuple[str, ...] = ()
    """Networks of our own proxies in front of the gateway: only their X-Forwarded-For is believed (the rightmost hop
    not in this list is the client: what source checks judge, what is stored as the callback's remote address, and
    the client the ops console counts failed logins for), and only their X-Forwarded-Proto makes the ops cookie
    Secure."""
    payment_deadline_seconds: int = 86400
    """A payment unresolved this long after creation goes to manual review with an alert."""
    refund_deadline_seconds: int = 86400
    """A refund unresolved this long after it was requested goes to manual review with an alert."""
    breaker_failure_threshold: int = 5
    """Consecutive Unknowns (timeouts, 5xx) from one provider that open its circuit breaker."""
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
    merchant_webhook_secret: tuple[str, ...] = ()
    """whsec_<base64> secret(s) of those webhooks, comma-separated (the first signs); required with the URL."""
    merchant_webhook_timeout_seconds: float = 15.0
    """Timeout of one webhook POST; a timeout counts as a failed attempt."""
    events_exchange: str = "paysync.events"
    """RabbitMQ topic exchange domain events are published to (routing key = event type)."""
    event_delivery_max_attempts: int = 25
    """Failed attempts at one destination before an event gives up into the manual queue."""
    event_delivery_deadline_seconds: int = 3 * 86400
    """An event not delivered this long after it was written gives up into the manual queue."""
    alipay_app_id: str = ""
    """Our Alipay application id (APPID); with the two key settings it enables the "alipay" provider."""
    alipay_app_private_key_file: str = ""
    """PEM file of our RSA2 application private key (signs every openapi request)."""
    alipay_public_key_files: tuple[str, ...] = ()
    """Comma-separated PEM files of Alipay's public keys (rotation: every listed key is accepted)."""
    alipay_gateway_url: str = "https://openapi.alipay.com/gateway.do"
    """Alipay's openapi gateway (production by default); the fake's `http://127.0.0.1:PORT/gateway.do` in tests."""
    alipay_notify_url: str = ""
    """Our public POST /callbacks/alipay URL, sent as notify_url with each precreate; empty: none sent."""
    alipay_source_cidrs: tuple[str, ...] = ()
    """Comma-separated networks Alipay notifications may come from; empty: any source."""
    alipay_order_expire_seconds: int = 7200
    """A precreate's absolute `time_expire`, counted from the payment's creation (60 s – 15 days); past it an unpaid
    order is closed at Alipay and Failed."""
    alipay_seller_id: str = ""
    """Our Alipay account's user id (PID, 2088 + 12 digits); when set, a notify naming another seller_id is refused."""
    alipay_bill_max_bytes: int = 1 << 30
    """Largest trade-bill zip a download may bring (1 MiB – 1 TiB); past it the download stops, the day is not
    reconciled, and the alert `settlement_too_large` fires."""
    alipay_app_cert_file: str = ""
    """Certificate mode: PEM file of our application's public-key certificate (`appCertPublicKey_<APPID>.crt`); its
    SN is sent as `app_cert_sn`; needs ALIPAY_ROOT_CERT_FILE."""
    alipay_root_cert_file: str = ""
    """Certificate mode: PEM file of Alipay's root certificate chain (`alipayRootCert.crt`); its SN is sent as
    `alipay_root_cert_sn`; needs ALIPAY_APP_CERT_FILE."""
    seal_interval_seconds: float = 2.0
    """How often seal_ledger chains newly committed ledger events."""
    reconcile_time: str = "02:30"
    """UTC time of day (HH:MM) the compensator reconciles the providers' settlement files."""
    reconcile_days_back: int = 3
    """The daily reconciliation fetches the last N days' files (yesterday included); unchanged ones are skipped."""
    log_level: str = "INFO"
    """Python logging level name of every process; logs are JSON lines on stderr, with secrets and card-like numbers
    scrubbed."""
    failpoints: str = ""
    """Test-only: comma-separated failpoint names at which the process SIGKILLs itself
    (payments/infra/failpoints.py)."""
    wechatpay_mchid: str = ""
    """WeChat Pay merchant number (商户号); setting any WECHATPAY_* key below enables the wechatpay provider."""
    wechatpay_appid: str = ""
    """The APPID bound to the merchant number, sent with every Native order."""
    wechatpay_apiv3_key: str = ""
    """The 32-character APIv3 key: decrypts notification resources (AEAD_AES_256_GCM)."""
    wechatpay_merchant_private_key_file: str = ""
    """PEM file of the merchant API certificate's private key (apiclient_key.pem): signs our requests."""
    wechatpay_merchant_serial: str = ""
    """Serial number of the merchant API certificate (serial_no in our Authorization header)."""
    wechatpay_platform_keys: tuple[tuple[str, str], ...] = ()
    """Comma-separated `ID=path.pem`: a platform certificate serial with its certificate, or a `PUB_KEY_ID_…` with
    its public key; all accepted (rotation)."""
    wechatpay_api_base: str = "https://api.mch.weixin.qq.com"
    """Where paysync calls WeChat Pay API v3 (a fake platform in tests)."""
    wechatpay_notify_url: str = ""
    """Our public POST /callbacks/wechatpay URL, sent as notify_url with orders and refunds (required when enabled)."""
    wechatpay_order_expire_seconds: int = 7200
    """time_expire of a Native order, counted from the payment's creation (WeChat's code_url lives 2 hours)."""
    wechatpay_source_cidrs: tuple[str, ...] = ()
    """Networks WeChat Pay notifications may come from; empty: any source."""
    stripe_api_key: str = ""
    """Stripe secret key (`sk_live_…`/`sk_test_…`) or restricted key (`rk_…`), sent as Bearer; with
    STRIPE_WEBHOOK_SECRETS it enables stripe (production refuses a test-mode key)."""
    stripe_webhook_secrets: tuple[str, ...] = ()
    """The endpoint's whsec_… signing secrets, comma-separated; every listed one verifies (rotation)."""
    stripe_api_base: str = "https://api.stripe.com"
    """Where paysync calls the Stripe API (a fake platform in tests)."""
    stripe_source_cidrs: tuple[str, ...] = ()
    """Networks Stripe webhooks may come from; empty: any source (the gateway's source check reads it)."""

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
    def call_lease_seconds(self) -> float:
        """How long a claimed relay or query row stays leased: its wait for the rate limiter, a full call, slack.

        The relay and the query job share one token bucket per provider in a
        process, so up to twice RELAY_CONCURRENCY calls may be queued ahead of
        a claimed row. The prepare step renews the lease for the call itself.
        """
        wait = 2 * self.relay_concurrency / self.provider_rate_limit
        return wait + self.call_seconds

    @property
    def gateway_bind_address(self) -> str:
        """WEB_BIND_ADDRESS, else loopback in development (its tokens are public) and every address in production."""
        if self.web_bind_address:
            return self.web_bind_address
        return "127.0.0.1" if self.paysync_env == "development" else "0.0.0.0"  # noqa: S104 - production serves

    @property
    def call_seconds(self) -> float:
        """How much of a lease one provider call needs once it goes out (two timeouts, slack): the rest is the wait."""
        return self.provider_timeout_seconds * 2 + 3.0

    @property
    def effective_interval_seconds(self) -> float:
        """The sweep interval: short without a broker so callbacks still apply within seconds."""
        if self.has_broker:
            return self.compensator_interval_seconds
        return min(self.compensator_interval_seconds, 1.0)


_PARSERS = {
    "database_url": lambda n, v: _database_url(n, v),
    "amqp_url": _amqp_url,
    "broker_message_secret": lambda n, v: _secrets(n, v),
    "amqp_queue": lambda n, v: v.strip() or "payment_callbacks",
    "amqp_quorum_queue": _bool,
    "paysync_env": lambda n, v: _env(n, v),
    "port": lambda n, v: _int(n, v, 1, 65535),
    "web_bind_address": lambda n, v: _bind_address(n, v) if v.strip() else "",
    "web_workers": lambda n, v: _int(n, v, 1, 64),
    "web_threads": lambda n, v: _int(n, v, 1, 256),
    "web_read_timeout_seconds": lambda n, v: _float(n, v, 0.1, 300),
    "merchant_api_token": lambda n, v: _secrets(n, v),
    "ops_token": lambda n, v: _secrets(n, v),
    "ops_readonly_token": lambda n, v: _secrets(n, v),
    "metrics_token": lambda n, v: _secrets(n, v),
    "metrics_allow_cidrs": lambda n, v: _cidrs(n, v),
    "metrics_settled_cache_seconds": lambda n, v: _float(n, v, 0, 3600),
    "consumer_metrics_port": lambda n, v: _int(n, v.strip() or "0", 0, 65535),
    "compensator_metrics_port": lambda n, v: _int(n, v.strip() or "0", 0, 65535),
    "metrics_bind_address": lambda n, v: _bind_address(n, v),
    "web_metrics_dir": lambda n, v: v.strip(),
    "callback_retention_days": lambda n, v: _int(n, v, 0, 36500),
    "rejected_retention_days": lambda n, v: _int(n, v, 0, 36500),
    "archive_dir": lambda n, v: v.strip() or str(PROJECT_ROOT / "var" / "archive"),
    "cleanup_batch_size": lambda n, v: _int(n, v, 1, 10000),
    "cleanup_interval_seconds": lambda n, v: _float(n, v, 1, 7 * 86400),
    "sandbox_webhook_secret": lambda n, v: _secrets(n, v),
    "sandbox_api_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "sandbox_source_cidrs": lambda n, v: _cidrs(n, v),
    "sandbox_api_key": lambda n, v: _secrets(n, v),
    "callback_max_body_bytes": lambda n, v: _int(n, v, 1024, 16 * 1024 * 1024),
    "callback_source_rate": lambda n, v: _float(n, v, 0, 1_000_000),
    "callback_source_burst": lambda n, v: _int(n, v, 1, 1_000_000),
    "refused_source_rate": lambda n, v: _float(n, v, 0, 1_000_000),
    "refused_source_burst": lambda n, v: _int(n, v, 1, 1_000_000),
    "refused_body_bytes": lambda n, v: _int(n, v, 0, 256 * 1024),
    "refused_retention_days": lambda n, v: _int(n, v, 0, 36500),
    "callback_tolerance_seconds": lambda n, v: _int(n, v, 1, 86400),
    "callback_process_inline": lambda n, v: _bool(n, v) if v.strip() else None,
    "callback_inline_budget_seconds": lambda n, v: _float(n, v, 0.01, 25),
    "publish_timeout_seconds": lambda n, v: _float(n, v, 0.01, 30),
    "publish_linger_seconds": lambda n, v: _float(n, v, 0, 1),
    "publish_batch_max": lambda n, v: _int(n, v, 1, 1000),
    "consumer_prefetch": lambda n, v: _int(n, v, 1, 10000),
    "consumer_batch_size": lambda n, v: _int(n, v, 1, 1000),
    "compensator_interval_seconds": lambda n, v: _float(n, v, 0.1, 86400),
    "compensator_grace_seconds": lambda n, v: _float(n, v, 0, 86400),
    "compensator_batch_size": lambda n, v: _int(n, v, 1, 10000),
    "compensator_max_retries": lambda n, v: _int(n, v, 1, 1000),
    "compensator_rate_limit": lambda n, v: _float(n, v, 0.1, 1_000_000),
    "compensator_concurrency": lambda n, v: _int(n, v, 1, 8),
    "compensator_lease_seconds": lambda n, v: _float(n, v, 1, 86400),
    "evaluate_alerts_interval_seconds": lambda n, v: _float(n, v, 0.1, 86400),
    "publish_events_interval_seconds": lambda n, v: _float(n, v, 0.05, 86400),
    "events_lease_seconds": lambda n, v: _float(n, v, 1, 86400),
    "retry_base_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "retry_max_seconds": lambda n, v: _float(n, v, 0.001, 7 * 86400),
    "alert_rules_file": lambda n, v: v.strip(),
    "ops_console_url": lambda n, v: _url(n, v, ("http://", "https://")).rstrip("/"),
    "alert_runbook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "alert_notify_max_attempts": lambda n, v: _int(n, v, 1, 100),
    "alert_notify_retry_base_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "alert_notify_retry_max_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "alert_channel_timeout_seconds": lambda n, v: _float(n, v, 0.1, 120),
    "smtp_host": lambda n, v: v.strip(),
    "smtp_port": lambda n, v: _int(n, v, 1, 65535),
    "smtp_tls": lambda n, v: _choice(n, v, ("starttls", "implicit", "off")),
    "smtp_username": lambda n, v: v.strip(),
    "smtp_password": lambda n, v: v,
    "smtp_from": lambda n, v: _email(n, v),
    "smtp_to": lambda n, v: tuple(_email(n, item) for item in _list(v)),
    "smtp_ca_file": lambda n, v: v.strip(),
    "sms_gateway_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "sms_gateway_template": lambda n, v: _json_template(n, v),
    "sms_gateway_token": lambda n, v: _secrets(n, v),
    "sms_recipients": lambda n, v: _phones(n, v),
    "aliyun_sms_access_key_id": lambda n, v: _matching(n, v, _ACCESS_KEY_ID, "an AccessKey ID (letters and digits)"),
    "aliyun_sms_access_key_secret": lambda n, v: _secrets(n, v),
    "aliyun_sms_sign_name": lambda n, v: v.strip(),
    "aliyun_sms_template_code": lambda n, v: _matching(n, v, _TEMPLATE_CODE, "a template code such as SMS_123456"),
    "aliyun_sms_template_param": lambda n, v: _json_template(n, v),
    "aliyun_sms_phone_numbers": lambda n, v: _phones(n, v),
    "aliyun_sms_endpoint": lambda n, v: _url(n, v, ("http://", "https://")) or "https://dysmsapi.aliyuncs.com",
    "dingtalk_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "dingtalk_secret": lambda n, v: _secrets(n, v),
    "feishu_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "feishu_secret": lambda n, v: _secrets(n, v),
    "wecom_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "slack_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "alert_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "alert_webhook_secret": lambda n, v: _webhook_secrets(n, v),
    "merchant_max_amount": lambda n, v: _int(n, v, 1, 2**62),
    "idempotency_lock_seconds": lambda n, v: _float(n, v, 1, 86400),
    "charge_inline_budget_seconds": lambda n, v: _float(n, v, 0, 30),
    "provider_timeout_seconds": lambda n, v: _float(n, v, 0.05, 300),
    "provider_rate_limit": lambda n, v: _float(n, v, 0.1, 1_000_000),
    "relay_interval_seconds": lambda n, v: _float(n, v, 0.01, 3600),
    "relay_concurrency": lambda n, v: _int(n, v, 1, 1024),
    "relay_provider_concurrency": lambda n, v: _int(n, v, 1, 1024),
    "relay_db_concurrency": lambda n, v: _int(n, v, 1, 256),
    "relay_max_seconds": lambda n, v: _float(n, v, 0.1, 3600),
    "query_interval_seconds": lambda n, v: _float(n, v, 0.05, 3600),
    "query_pending_after_seconds": lambda n, v: _float(n, v, 0, 86400),
    "query_base_seconds": lambda n, v: _float(n, v, 0.001, 86400),
    "query_max_seconds": lambda n, v: _float(n, v, 0.001, 7 * 86400),
    "query_not_found_grace_seconds": lambda n, v: _float(n, v, 0, 86400),
    "provider_key_lifetime_seconds": lambda n, v: _float(n, v, 60, 86400),
    "hint_query_interval_seconds": lambda n, v: _float(n, v, 0, 86400),
    "hint_queries_per_minute": lambda n, v: _int(n, v, 0, 1_000_000),
    "trusted_proxies": lambda n, v: _cidrs(n, v),
    "payment_deadline_seconds": lambda n, v: _int(n, v, 1, 90 * 86400),
    "refund_deadline_seconds": lambda n, v: _int(n, v, 1, 90 * 86400),
    "breaker_failure_threshold": lambda n, v: _int(n, v, 1, 100_000),
    "breaker_open_seconds": lambda n, v: _float(n, v, 0.01, 86400),
    "breaker_max_open_seconds": lambda n, v: _float(n, v, 0.01, 7 * 86400),
    "breaker_query_budget": lambda n, v: _int(n, v, 0, 100_000),
    "sandbox_legacy_enabled": _bool,
    "merchant_webhook_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "merchant_webhook_secret": lambda n, v: _webhook_secrets(n, v),
    "merchant_webhook_timeout_seconds": lambda n, v: _float(n, v, 0.1, 60),
    "events_exchange": lambda n, v: v.strip() or "paysync.events",
    "event_delivery_max_attempts": lambda n, v: _int(n, v, 1, 1000),
    "event_delivery_deadline_seconds": lambda n, v: _int(n, v, 1, 90 * 86400),
    "alipay_app_id": lambda n, v: _app_id(n, v),
    "alipay_app_private_key_file": lambda n, v: v.strip(),
    "alipay_public_key_files": lambda n, v: _list(v),
    "alipay_gateway_url": lambda n, v: _url(n, v, ("http://", "https://")) or "https://openapi.alipay.com/gateway.do",
    "alipay_notify_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "alipay_source_cidrs": lambda n, v: _cidrs(n, v),
    "alipay_order_expire_seconds": lambda n, v: _int(n, v, 60, 15 * 86400),
    "alipay_seller_id": lambda n, v: _matching(n, v, _ALIPAY_PID, "Alipay's 16-digit user id (2088…)"),
    "alipay_bill_max_bytes": lambda n, v: _int(n, v, 1 << 20, 1 << 40),
    "alipay_app_cert_file": lambda n, v: v.strip(),
    "alipay_root_cert_file": lambda n, v: v.strip(),
    "seal_interval_seconds": lambda n, v: _float(n, v, 0.1, 3600),
    "reconcile_time": lambda n, v: _time_of_day(n, v),
    "reconcile_days_back": lambda n, v: _int(n, v, 1, 90),
    "log_level": lambda n, v: _log_level(n, v),
    "failpoints": lambda n, v: v.strip(),
    "wechatpay_mchid": lambda n, v: _matching(n, v, _MCHID, "digits, at most 32"),
    "wechatpay_appid": lambda n, v: _matching(n, v, _APPID, "letters and digits, at most 32"),
    "wechatpay_apiv3_key": lambda n, v: _apiv3_key(n, v),
    "wechatpay_merchant_private_key_file": lambda n, v: v.strip(),
    "wechatpay_merchant_serial": lambda n, v: _matching(n, v, _HEX_SERIAL, "a hexadecimal certificate serial"),
    "wechatpay_platform_keys": lambda n, v: _platform_keys(n, v),
    "wechatpay_api_base": lambda n, v: (_url(n, v, ("http://", "https://")) or "https://api.mch.weixin.qq.com").rstrip(
        "/"
    ),
    "wechatpay_notify_url": lambda n, v: _url(n, v, ("http://", "https://")),
    "wechatpay_order_expire_seconds": lambda n, v: _int(n, v, 60, 7 * 86400),
    "wechatpay_source_cidrs": lambda n, v: _cidrs(n, v),
    "stripe_api_key": lambda n, v: _stripe_api_key(n, v),
    "stripe_webhook_secrets": lambda n, v: _stripe_webhook_secrets(n, v),
    "stripe_api_base": lambda n, v: (_url(n, v, ("http://", "https://")) or "https://api.stripe.com").rstrip("/"),
    "stripe_source_cidrs": lambda n, v: _cidrs(n, v),
}

_MCHID = re.compile(r"[0-9]{1,32}", re.ASCII)
_APPID = re.compile(r"[0-9A-Za-z_]{1,32}", re.ASCII)
_ALIPAY_PID = re.compile(r"2088[0-9]{12}", re.ASCII)
_HEX_SERIAL = re.compile(r"[0-9A-Fa-f]{1,64}", re.ASCII)
_PUB_KEY_ID = re.compile(r"PUB_KEY_ID_[0-9A-Za-z_]{1,64}", re.ASCII)
_ACCESS_KEY_ID = re.compile(r"[0-9A-Za-z]{1,64}", re.ASCII)
_TEMPLATE_CODE = re.compile(r"SMS_[0-9]{1,32}", re.ASCII)
_PHONE = re.compile(r"\+?[0-9]{5,20}", re.ASCII)
_EMAIL = re.compile(r"[^@\s,<>]+@[^@\s,<>]+\.[^@\s,<>]+")


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower() or choices[0]
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {raw[:32]!r}")
    return value


def _email(name: str, raw: str) -> str:
    value = raw.strip()
    if value and not _EMAIL.fullmatch(value):
        raise ConfigError(f"{name} must be plain addresses such as ops@example.com, got {value[:64]!r}")
    return value


def _phones(name: str, raw: str) -> tuple[str, ...]:
    phones = tuple(p.replace(" ", "").replace("-", "") for p in _list(raw))
    for phone in phones:
        if not _PHONE.fullmatch(phone):
            raise ConfigError(f"{name} must be comma-separated phone numbers (+8613800000000), got {phone[:24]!r}")
    return phones


def _json_template(name: str, raw: str) -> str:
    # The placeholders a template may use are its channel's business: escalation.notify.channels.validate checks
    # them at start-up (runtime.check_deployment). Here an empty value means the default template.
    if not raw.strip():
        return getattr(Settings, name.lower())
    return raw.strip()


_STRIPE_API_KEY = re.compile(r"(sk|rk)_(live|test)_[0-9A-Za-z]{16,247}", re.ASCII)
_STRIPE_WEBHOOK_SECRET = re.compile(r"whsec_[0-9A-Za-z+/=_-]{16,250}", re.ASCII)


def _stripe_api_key(name: str, raw: str) -> str:
    value = raw.strip()
    # Say what is wrong and how long the value is, never the value (invariant 9).
    if value and not _STRIPE_API_KEY.fullmatch(value):
        raise ConfigError(
            f"{name} must be a Stripe secret key sk_live_…/sk_test_… (or restricted rk_…) with at least 16 "
            f"characters after the prefix; got {len(value)} characters"
        )
    return value


def _stripe_webhook_secrets(name: str, raw: str) -> tuple[str, ...]:
    secrets: list[str] = []
    for position, item in enumerate((part.strip() for part in raw.split(",")), start=1):
        if not item:
            continue
        if not _STRIPE_WEBHOOK_SECRET.fullmatch(item):
            raise ConfigError(
                f"{name}: entry {position} must be an endpoint signing secret whsec_… with at least 16 characters "
                f"after the prefix; got {len(item)} characters"
            )
        if item in secrets:
            raise ConfigError(f"{name}: entry {position} repeats an earlier secret")
        secrets.append(item)
    return tuple(secrets)


def _matching(name: str, raw: str, pattern: re.Pattern[str], what: str) -> str:
    value = raw.strip()
    if value and not pattern.fullmatch(value):
        raise ConfigError(f"{name} must be {what}, got {value[:40]!r}")
    return value


def _apiv3_key(name: str, raw: str) -> str:
    value = raw.strip()
    # AES-256 takes the key's 32 ASCII characters as its 32 bytes; say the length, never the key.
    if value and (len(value.encode()) != 32 or not value.isascii() or not value.isprintable()):
        raise ConfigError(f"{name} must be the 32-character APIv3 key, got {len(value.encode())} bytes")
    return value


def _platform_keys(name: str, raw: str) -> tuple[tuple[str, str], ...]:
    pairs: list[tuple[str, str]] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        key_id, sep, path = (s.strip() for s in item.partition("="))
        if not sep or not key_id or not path:
            raise ConfigError(f"{name} entries must be ID=path.pem, got {item[:80]!r}")
        if not (_HEX_SERIAL.fullmatch(key_id) or _PUB_KEY_ID.fullmatch(key_id)):
            raise ConfigError(f"{name}: {key_id[:40]!r} is neither a certificate serial (hex) nor a PUB_KEY_ID_… id")
        if any(key_id.upper() == known.upper() for known, _ in pairs):
            raise ConfigError(f"{name}: {key_id} is listed twice")
        pairs.append((key_id, path))
    return tuple(pairs)


def _env(name: str, raw: str) -> str:
    value = raw.strip().lower() or "production"
    if value not in ("production", "development"):
        raise ConfigError(f"{name} must be 'production' or 'development', got {raw[:32]!r}")
    return value


def _secrets(name: str, raw: str) -> tuple[str, ...]:
    """A comma-separated list of secrets (rotation): every value is accepted, the first signs."""
    if not raw.strip():
        return ()
    values = tuple(v.strip() for v in raw.split(","))
    if not all(values):
        # Never echo the value: it is a secret.
        raise ConfigError(f"{name} has an empty entry in its comma-separated list")
    return values


def _cidrs(name: str, raw: str) -> tuple[str, ...]:
    """Comma-separated networks (a bare address is a /32 or /128), kept as normalised CIDR strings."""
    networks = []
    for value in (v.strip() for v in raw.split(",") if v.strip()):
        try:
            # strict: 10.0.0.1/8 is a typo for some network, and an allow-list must not guess which.
            networks.append(str(ipaddress.ip_network(value, strict=True)))
        except ValueError as exc:
            raise ConfigError(f"{name} must be comma-separated CIDRs such as 10.0.0.0/8: {exc}") from None
    return tuple(networks)


def _webhook_secrets(name: str, raw: str) -> tuple[str, ...]:
    values = _secrets(name, raw)
    from payments.infra.webhook_signing import MIN_SECRET_BYTES, decode_secret

    for value in values:
        try:
            decode_secret(value, min_bytes=MIN_SECRET_BYTES)
        except ConfigError as exc:  # name the variable, never echo the secret
            raise ConfigError(f"{name}: {exc}") from None
    return values


def _list(raw: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in raw.split(",") if item.strip())


def _app_id(name: str, raw: str) -> str:
    value = raw.strip()
    if value and (len(value) > 32 or not value.isascii() or not value.isalnum()):
        raise ConfigError(f"{name} must be the application id Alipay assigned (up to 32 letters and digits)")
    return value


def _time_of_day(name: str, raw: str) -> str:
    value = raw.strip()
    match = re.fullmatch(r"(\d{2}):(\d{2})", value)
    if not match or int(match[1]) > 23 or int(match[2]) > 59:
        raise ConfigError(f"{name} must be a UTC time of day HH:MM such as 02:30, got {raw!r}")
    return value


def _bind_address(name: str, raw: str) -> str:
    value = raw.strip() or "127.0.0.1"
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{name} must be an IP address to listen on (0.0.0.0 for every one), got {raw!r}") from None
    return value


def _log_level(name: str, raw: str) -> str:
    value = raw.strip().upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise ConfigError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {raw!r}")
    return value


def env_name(field_name: str) -> str:
    """The environment variable that sets a field: its name in upper case."""
    return field_name.upper()


DEV_DEFAULTS: dict[str, tuple[str, ...]] = {
    "merchant_api_token": ("dev-merchant-token",),
    "ops_token": ("dev-ops-token",),
    "sandbox_webhook_secret": ("whsec_dev_sandbox",),
    "sandbox_api_key": ("sk_sandbox_dev_key",),
    "broker_message_secret": ("dev-broker-message-secret",),
}
"""Secrets PAYSYNC_ENV=development fills in when they are not set; production refuses every one of them."""

MIN_SECRET_LENGTH = 24
"""Shortest secret production accepts (characters)."""

MIN_SECRET_DISTINCT = 8
"""Fewest distinct characters a secret production accepts may have (``aaaa…`` is long, not strong)."""

ALWAYS_REQUIRED_SECRETS = ("merchant_api_token", "ops_token")
"""Secrets every deployment needs, whatever providers it enables."""

OPTIONAL_SECRETS = ("ops_readonly_token", "metrics_token")
"""Secrets a deployment may leave empty; once set, production holds them to the same rules."""


@dataclass(frozen=True)
class ProviderSettings:
    """How one provider is enabled by configuration."""

    sources: str
    """The setting of the networks its notifications may come from (required: a provider cannot skip the check)."""
    secrets: tuple[str, ...] = ()
    """Its secret strings (field names): in production each must be strong (see ``_weakness``)."""
    required: tuple[str, ...] = ()
    """Its other settings that must all be given once any of its settings is (ids, key files)."""
    switch: str | None = None
    """A boolean setting that must also be true (an optional variant of another provider)."""

    @property
    def settings(self) -> tuple[str, ...]:
        """Every setting that enables the provider: any of them set, and all must be."""
        return self.required + tuple(f for f in self.secrets if f not in self.required)


PROVIDERS: dict[str, ProviderSettings] = {
    "sandbox": ProviderSettings(sources="sandbox_source_cidrs", secrets=("sandbox_webhook_secret", "sandbox_api_key")),
    # The same platform reached another way: the same notifications, from the same networks.
    "sandbox_legacy": ProviderSettings(
        sources="sandbox_source_cidrs",
        secrets=("sandbox_webhook_secret", "sandbox_api_key"),
        switch="sandbox_legacy_enabled",
    ),
    "alipay": ProviderSettings(
        sources="alipay_source_cidrs",
        required=("alipay_app_id", "alipay_app_private_key_file", "alipay_public_key_files"),
    ),
    "wechatpay": ProviderSettings(
        sources="wechatpay_source_cidrs",
        secrets=("wechatpay_apiv3_key",),
        required=(
            "wechatpay_mchid",
            "wechatpay_appid",
            "wechatpay_apiv3_key",
            "wechatpay_merchant_private_key_file",
            "wechatpay_merchant_serial",
            "wechatpay_platform_keys",
            "wechatpay_notify_url",
        ),
    ),
    "stripe": ProviderSettings(
        sources="stripe_source_cidrs",
        secrets=("stripe_api_key", "stripe_webhook_secrets"),
    ),
}
"""Every provider paysync knows, and the settings that enable it. A new adapter adds its line here (and, for what
a value check cannot see, its validator to ``payments.providers.VALIDATORS``)."""


def source_cidrs(settings: Settings, provider: str) -> tuple[str, ...]:
    """The networks ``provider``'s notifications may come from (empty: any); KeyError for a provider not in PROVIDERS.

    Looked up in PROVIDERS, never guessed from the provider's name: a guess
    with a default would let a provider whose setting is named otherwise skip
    the check unseen (``sandbox_legacy`` did).
    """
    return getattr(settings, PROVIDERS[provider].sources)


def enabled_providers(settings: Settings) -> list[str]:
    """The providers this configuration enables, in PROVIDERS order (see ProviderSettings)."""
    enabled = []
    for name, spec in PROVIDERS.items():
        if spec.switch and not getattr(settings, spec.switch):
            continue
        if any(getattr(settings, f) for f in spec.settings):
            enabled.append(name)
    return enabled


def check_complete(settings: Settings) -> None:
    """A provider with some of its settings given and others not is refused in either environment."""
    for name in enabled_providers(settings):
        spec = PROVIDERS[name]
        missing = [env_name(f) for f in spec.settings if not getattr(settings, f)]
        if missing:
            given = ", ".join(env_name(f) for f in spec.settings if getattr(settings, f))
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(
                f"{', '.join(missing)} {verb} required: provider {name} is partly configured ({given} set)"
            )


_ISSUED_PREFIX = re.compile(r"^(whsec_|[sr]k_(live|test)_)")


def _values(settings: Settings, field_name: str) -> tuple[str, ...]:
    """A secret setting's values: a rotation list as it is, a single-value secret as a list of one."""
    value = getattr(settings, field_name)
    # A str is iterable too: looping over it would judge each character as a secret of its own.
    return (value,) if isinstance(value, str) else tuple(value)


def _weakness(settings: Settings, field_name: str) -> str | None:
    """Why a secret setting would not do in production, or None."""
    values = tuple(v for v in _values(settings, field_name) if v)
    if not values:
        return "is empty"
    if any(v in DEV_DEFAULTS.get(field_name, ()) for v in values):
        return "is a development default"
    if any(len(v) < MIN_SECRET_LENGTH for v in values):
        return f"is shorter than {MIN_SECRET_LENGTH} characters"
    # Judged after a platform's own prefix (whsec_, sk_live_…): its letters are the same in every key.
    if any(len(set(_ISSUED_PREFIX.sub("", v))) < MIN_SECRET_DISTINCT for v in values):
        return f"has fewer than {MIN_SECRET_DISTINCT} distinct characters"
    return None


def _shared(settings: Settings, names: list[str]) -> list[tuple[str, str]]:
    """(setting, why) for each secret setting that holds a value another one holds too (names only, never values)."""
    owners: dict[str, str] = {}
    problems = []
    for name in names:
        for value in dict.fromkeys(v for v in _values(settings, name) if v):
            first = owners.setdefault(value, name)
            if first != name:
                problems.append((env_name(name), f"repeats a value of {env_name(first)}"))
                break
    return problems


def check_secrets(settings: Settings) -> str | None:
    """Refuse (ConfigError) secrets that must not run in production; in development return the one warning, if any.

    The values' part of ``payments.runtime.check_deployment``. Checked:
    MERCHANT_API_TOKEN, OPS_TOKEN, OPS_READONLY_TOKEN and METRICS_TOKEN (the
    last two when set), BROKER_MESSAGE_SECRET (with a broker) and the
    secrets of every enabled provider are set, not a development default, at
    least MIN_SECRET_LENGTH characters long with at least MIN_SECRET_DISTINCT
    distinct characters (every value of a rotation list), and no value is
    shared by two of them (one secret for two roles makes either holder the
    other). A provider with some of its secrets set and others empty is refused
    in either environment.
    """
    enabled = enabled_providers(settings)
    check_complete(settings)
    if settings.sandbox_legacy_enabled and "sandbox_legacy" not in enabled:
        raise ConfigError("SANDBOX_LEGACY_ENABLED=true needs SANDBOX_WEBHOOK_SECRET and SANDBOX_API_KEY")
    if settings.has_broker and not settings.broker_message_secret:
        # In either environment: every unsigned message would be dead-lettered, so no fast path at all.
        raise ConfigError("BROKER_MESSAGE_SECRET is required when AMQP_URL is set (it signs the callback messages)")
    names = list(ALWAYS_REQUIRED_SECRETS) + [f for f in OPTIONAL_SECRETS if getattr(settings, f)]
    if settings.has_broker:
        names.append("broker_message_secret")  # signs the callback messages (payments.inbound.delivery)
    for name in enabled:
        names += [f for f in PROVIDERS[name].secrets if f not in names]
    problems = [(env_name(f), why) for f in names if (why := _weakness(settings, f))]
    problems += _shared(settings, names)
    if not problems:
        return None
    listed = ", ".join(f"{name} {why}" for name, why in problems)
    if settings.paysync_env == "production":
        raise ConfigError(
            f"{problems[0][0]} {problems[0][1]}: PAYSYNC_ENV=production needs secrets of at least "
            f"{MIN_SECRET_LENGTH} characters ({MIN_SECRET_DISTINCT} distinct), not development defaults, "
            "one for each setting"
            + (f" (also: {', '.join(n + ' ' + w for n, w in problems[1:])})" if len(problems) > 1 else "")
        )
    return f"PAYSYNC_ENV=development, not for real money: {listed}"


_RULES_HINT = "set it in ALERT_RULES_FILE (default ops/alert_rules.toml)"
RETIRED_SETTINGS = {
    "ALERT_BACKLOG_THRESHOLD": f"the backlog alert's threshold is rule callback_backlog's threshold; {_RULES_HINT}",
    "ALERT_BACKLOG_SECONDS": f"the backlog alert's duration is rule callback_backlog's sustain_seconds; {_RULES_HINT}",
    "ALERT_FAILURE_RATE": f"the failure-rate alert's threshold is rule callback_failure_rate's; {_RULES_HINT}",
    "ALERT_FAILURE_WINDOW_SECONDS": f"rule callback_failure_rate's window_seconds replaces it; {_RULES_HINT}",
    "ALERT_FAILURE_MIN_SAMPLE": f"rule callback_failure_rate's min_sample replaces it; {_RULES_HINT}",
}
"""Settings that existed once and are refused now, with where their value went (a silent ignore would change alerts)."""


def load_settings(environ: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment; raise ConfigError naming the bad variable.

    Parsing only: ``check_secrets`` judges the secrets and ``payments.runtime.check_deployment``
    asks each capability to check its own settings. In development a
    secret that is not set takes its DEV_DEFAULTS value; in production it stays
    empty (and a provider whose secret is empty is not enabled).
    """
    environ = os.environ if environ is None else environ
    retired = sorted(RETIRED_SETTINGS.keys() & environ.keys())
    if retired:
        raise ConfigError(f"{retired[0]} is no longer read: {RETIRED_SETTINGS[retired[0]]}")
    values = {}
    for f in fields(Settings):
        name = env_name(f.name)
        if name in environ:
            values[f.name] = _PARSERS[f.name](name, environ[name])
    if values.get("paysync_env") == "development":
        for field_name, default in DEV_DEFAULTS.items():
            values.setdefault(field_name, default)
    settings = Settings(**values)
    if settings.retry_max_seconds < settings.retry_base_seconds:
        raise ConfigError("RETRY_MAX_SECONDS must be >= RETRY_BASE_SECONDS")
    if settings.query_max_seconds < settings.query_base_seconds:
        raise ConfigError("QUERY_MAX_SECONDS must be >= QUERY_BASE_SECONDS")
    if settings.breaker_max_open_seconds < settings.breaker_open_seconds:
        raise ConfigError("BREAKER_MAX_OPEN_SECONDS must be >= BREAKER_OPEN_SECONDS")
    if settings.events_lease_seconds < 2 * settings.merchant_webhook_timeout_seconds + 30:
        # publish_events stops starting deliveries once the slowest one could outlive the lease.
        raise ConfigError("EVENTS_LEASE_SECONDS must be >= 2 * MERCHANT_WEBHOOK_TIMEOUT_SECONDS + 30")
    check_complete(settings)
    if set(settings.ops_readonly_token) & set(settings.ops_token):
        # One token in both lists would make its holder's role a matter of which list is read first.
        raise ConfigError("OPS_READONLY_TOKEN repeats a value of OPS_TOKEN: the read-only role needs its own token")
    if settings.merchant_webhook_url and not settings.merchant_webhook_secret:
        raise ConfigError("MERCHANT_WEBHOOK_SECRET (whsec_…) is required when MERCHANT_WEBHOOK_URL is set")
    if settings.alert_notify_retry_max_seconds < settings.alert_notify_retry_base_seconds:
        raise ConfigError("ALERT_NOTIFY_RETRY_MAX_SECONDS must be >= ALERT_NOTIFY_RETRY_BASE_SECONDS")
    return settings


def validate_stripe(settings: Settings, *, production: bool) -> None:
    """The production check for Stripe (ConfigError naming the variable and the reason); a no-op when not enabled.

    Everything ``load_settings`` refuses, plus, in production: a test-mode key
    (it charges nobody, so a production process using it is misconfigured) and
    an API base that is not https.
    """
    if "stripe" not in enabled_providers(settings):
        return
    check_complete(settings)
    _stripe_api_key("STRIPE_API_KEY", settings.stripe_api_key)
    _stripe_webhook_secrets("STRIPE_WEBHOOK_SECRETS", ",".join(settings.stripe_webhook_secrets))
    if not production:
        return
    if settings.stripe_api_key.split("_", 2)[1] == "test":
        raise ConfigError("STRIPE_API_KEY is a test-mode key (…_test_…); production needs a live key")
    if not settings.stripe_api_base.startswith("https://"):
        raise ConfigError("STRIPE_API_BASE must be https:// in production")
