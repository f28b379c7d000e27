"""The sandbox platform's own settings, read from its environment.

The sandbox is an outside party: it does not share paysync's settings object
and validates its own knobs. The variable names are the ones the docs and
the Procfile have always used (``SANDBOX_PORT``, ``SANDBOX_CALLBACK_URL``,
``SANDBOX_FAULTS``, …), so a shared ``.env`` keeps working; a bad value stops
the sandbox at start with one line naming the variable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from sandbox.faults import Faults, parse_faults

DEFAULT_DB_PATH = str(Path(__file__).resolve().parent.parent / "var" / "sandbox.db")
DEV_API_KEY = "sk_sandbox_dev_key"  # noqa: S105 - the development default, documented in docs/providers/sandbox.md
"""The API key the sandbox accepts when SANDBOX_API_KEY is not set (paysync's adapter sends the same default)."""
DEV_WEBHOOK_SECRET = "whsec_dev_sandbox"  # noqa: S105 - the development default, documented in docs/providers/sandbox.md
"""The secret that signs notifications when SANDBOX_WEBHOOK_SECRET is not set."""


class SandboxConfigError(ValueError):
    """A sandbox setting is malformed; the sandbox must not start."""


@dataclass(frozen=True)
class SandboxSettings:
    """Everything ``python -m sandbox`` reads, with its default."""

    host: str = "127.0.0.1"
    """SANDBOX_HOST: the address to bind (0.0.0.0 to reach it from other hosts)."""
    port: int = 8100
    """SANDBOX_PORT."""
    callback_url: str = "http://127.0.0.1:8000/callbacks/sandbox"
    """SANDBOX_CALLBACK_URL: where notifications are POSTed."""
    db_path: str = DEFAULT_DB_PATH
    """SANDBOX_DB_PATH: the platform's SQLite file (":memory:" keeps its state in memory)."""
    fee_rate: Decimal = Decimal("0.006")
    """SANDBOX_FEE_RATE: fee on a succeeded charge in settlement files, as a fraction."""
    faults: Faults = field(default_factory=Faults)
    """SANDBOX_FAULTS (a JSON object of knobs) over SANDBOX_SEED."""
    webhook_secret: str = DEV_WEBHOOK_SECRET
    """SANDBOX_WEBHOOK_SECRET: signs notifications (the first of a comma-separated list)."""
    webhook_max_attempts: int = 8
    """SANDBOX_WEBHOOK_MAX_ATTEMPTS: delivery attempts of one notification before giving up."""
    webhook_backoff_seconds: float = 1.0
    """SANDBOX_WEBHOOK_BACKOFF_SECONDS: first retry delay; doubles each attempt, with jitter."""
    threads: int = 256
    """SANDBOX_THREADS: request threads of the one gunicorn gthread worker (hanging faults park threads)."""
    api_keys: tuple[str, ...] = (DEV_API_KEY,)
    """SANDBOX_API_KEY: the keys /v1/* accepts as ``Authorization: Bearer …`` (comma-separated for rotation)."""
    log_level: str = "INFO"
    """LOG_LEVEL."""


def _int(name: str, raw: str, minimum: int, maximum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise SandboxConfigError(f"{name} must be a whole number, got {raw[:40]!r}") from None
    if not minimum <= value <= maximum:
        raise SandboxConfigError(f"{name} must be between {minimum} and {maximum}, got {value}")
    return value


def _float(name: str, raw: str, minimum: float, maximum: float) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise SandboxConfigError(f"{name} must be a number, got {raw[:40]!r}") from None
    if not minimum <= value <= maximum:  # also refuses NaN
        raise SandboxConfigError(f"{name} must be between {minimum:g} and {maximum:g}, got {raw[:40]!r}")
    return value


def _url(name: str, raw: str) -> str:
    value = raw.strip()
    if not value.startswith(("http://", "https://")):
        raise SandboxConfigError(f"{name} must start with http:// or https://")
    return value


def _rate(name: str, raw: str) -> Decimal:
    # Decimal, not float: the rate multiplies money.
    try:
        value = Decimal(raw.strip())
    except InvalidOperation:
        raise SandboxConfigError(f"{name} must be a decimal fraction such as 0.006, got {raw[:40]!r}") from None
    if not value.is_finite() or not 0 <= value < 1:
        raise SandboxConfigError(f"{name} must be >= 0 and < 1, got {raw[:40]!r}")
    return value


def _keys(name: str, raw: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in raw.split(",") if k.strip())
    if not keys:
        raise SandboxConfigError(f"{name} must name at least one key")
    return keys


def _log_level(name: str, raw: str) -> str:
    value = raw.strip().upper()
    if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
        raise SandboxConfigError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {raw[:40]!r}")
    return value


def load_settings(environ: Mapping[str, str] | None = None) -> SandboxSettings:
    """Build SandboxSettings from the environment; raise SandboxConfigError naming the bad variable."""
    env = os.environ if environ is None else environ
    values: dict = {}

    def given(name: str) -> str | None:
        raw = env.get(name)
        return raw if raw is not None and raw.strip() else None

    if (raw := given("SANDBOX_HOST")) is not None:
        values["host"] = raw.strip()
    if (raw := given("SANDBOX_PORT")) is not None:
        values["port"] = _int("SANDBOX_PORT", raw, 1, 65535)
    if (raw := given("SANDBOX_CALLBACK_URL")) is not None:
        values["callback_url"] = _url("SANDBOX_CALLBACK_URL", raw)
    if (raw := given("SANDBOX_DB_PATH")) is not None:
        values["db_path"] = raw.strip()
    if (raw := given("SANDBOX_FEE_RATE")) is not None:
        values["fee_rate"] = _rate("SANDBOX_FEE_RATE", raw)
    seed = None
    if (raw := given("SANDBOX_SEED")) is not None:
        seed = _int("SANDBOX_SEED", raw, -(2**63), 2**63 - 1)
    try:
        values["faults"] = parse_faults((env.get("SANDBOX_FAULTS") or "").strip(), base=Faults(seed=seed))
    except ValueError as exc:
        raise SandboxConfigError(f"SANDBOX_FAULTS: {exc}") from None
    if (raw := given("SANDBOX_WEBHOOK_SECRET")) is not None:
        values["webhook_secret"] = _keys("SANDBOX_WEBHOOK_SECRET", raw)[0]
    if (raw := given("SANDBOX_WEBHOOK_MAX_ATTEMPTS")) is not None:
        values["webhook_max_attempts"] = _int("SANDBOX_WEBHOOK_MAX_ATTEMPTS", raw, 1, 100)
    if (raw := given("SANDBOX_WEBHOOK_BACKOFF_SECONDS")) is not None:
        values["webhook_backoff_seconds"] = _float("SANDBOX_WEBHOOK_BACKOFF_SECONDS", raw, 0.001, 3600)
    if (raw := given("SANDBOX_THREADS")) is not None:
        values["threads"] = _int("SANDBOX_THREADS", raw, 1, 2048)
    if (raw := given("SANDBOX_API_KEY")) is not None:
        values["api_keys"] = _keys("SANDBOX_API_KEY", raw)
    if (raw := given("LOG_LEVEL")) is not None:
        values["log_level"] = _log_level("LOG_LEVEL", raw)
    return SandboxSettings(**values)
