"""What every long-running process needs, built once at start from the settings.

Every process starts the same way: ``start_process`` (the settings parsed,
then ``check_deployment``: a bad setting stops it with one line naming it and
exit code 2, logging set up), then ``build_runtime`` (failpoints armed, the
engine and adapters built). This module stands above every wing of payments/:
the start-up step is where the settings meet the capabilities that judge them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import Engine

from payments import providers
from payments.errors import ConfigError
from payments.escalation.evaluators import check_alerting
from payments.infra import failpoints
from payments.infra.backoff import RetryPolicy
from payments.infra.db import make_engine
from payments.infra.settings import Settings, check_secrets, load_settings
from payments.providers import build_providers
from payments.providers.base import Provider


def check_deployment(settings: Settings) -> str | None:
    """The start-up check: refuse (ConfigError) what must not run; in development return the one warning, if any.

    Settings only parse and judge values (``load_settings``); here each
    capability checks its own: the alert channels and the rules file
    (``check_alerting``), every enabled provider (``providers.validate``: key
    files, certificates, a live Stripe key in production), then the secrets
    (``check_secrets``: set, strong, not shared, not development defaults in
    production).
    """
    check_alerting(settings)
    providers.validate(settings)
    return check_secrets(settings)


def start_process(process: str, environ: Mapping[str, str] | None = None, *, warn: bool = True) -> Settings:
    """Every entry point's first call: load and check the settings, set up logging, warn once in development.

    A bad value prints one line naming the variable to stderr and exits with
    status 2 (no traceback).
    """
    from payments.infra.logs import setup_logging

    try:
        settings = load_settings(environ)
        warning = check_deployment(settings)
    except ConfigError as exc:
        print(f"{process}: bad configuration: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    setup_logging(settings.log_level, process)
    if warning and warn:
        logging.getLogger(f"paysync.{process}").warning(warning)
    return settings


@dataclass(frozen=True)
class Runtime:
    """Settings plus the objects derived from them: engine, provider adapters, retry policy."""

    settings: Settings
    engine: Engine
    providers: dict[str, Provider]
    callback_policy: RetryPolicy


def build_runtime(
    settings: Settings, engine: Engine | None = None, *, pool_size: int = 5, max_overflow: int | None = None
) -> Runtime:
    """Create the engine and adapters for ``settings`` (tests may pass their own engine)."""
    failpoints.arm(settings.failpoints)
    return Runtime(
        settings=settings,
        engine=engine or make_engine(settings.database_url, pool_size=pool_size, max_overflow=max_overflow),
        providers=build_providers(settings),
        callback_policy=RetryPolicy(
            max_retries=settings.compensator_max_retries,
            base_seconds=settings.retry_base_seconds,
            max_seconds=settings.retry_max_seconds,
        ),
    )
