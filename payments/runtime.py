"""What every long-running process needs, built once at start from the settings.

Every process starts the same way (``start_process``): settings read once, a
bad one stops the process with one line naming it and exit code 2 (no
traceback), logging set up, failpoints armed, then the engine and adapters.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass

from sqlalchemy import Engine

from payments import failpoints
from payments.backoff import RetryPolicy
from payments.db import make_engine
from payments.errors import ConfigError
from payments.logs import setup_logging
from payments.providers import build_providers
from payments.providers.base import Provider
from payments.settings import Settings, load_settings

BAD_CONFIGURATION_EXIT = 2
"""Exit code of a process that refused to start on a bad setting."""


@dataclass(frozen=True)
class Runtime:
    """Settings plus the objects derived from them: engine, provider adapters, retry policy."""

    settings: Settings
    engine: Engine
    providers: dict[str, Provider]
    callback_policy: RetryPolicy


def build_runtime(settings: Settings, engine: Engine | None = None, *, pool_size: int = 5) -> Runtime:
    """Create the engine and adapters for ``settings`` (tests may pass their own engine); arm failpoints."""
    failpoints.arm(settings.failpoints)
    return Runtime(
        settings=settings,
        engine=engine or make_engine(settings.database_url, pool_size=pool_size),
        providers=build_providers(settings),
        callback_policy=RetryPolicy(
            max_retries=settings.compensator_max_retries,
            base_seconds=settings.retry_base_seconds,
            max_seconds=settings.retry_max_seconds,
        ),
    )


def settings_or_exit(process: str, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings, or one line ``<process>: bad configuration: …`` on stderr and SystemExit(2)."""
    try:
        return load_settings(environ)
    except ConfigError as exc:
        print(f"{process}: bad configuration: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(BAD_CONFIGURATION_EXIT) from None


def start_process(process: str, *, pool_size: int = 5) -> Runtime:
    """Read the settings (exit 2 on a bad one), set up logging as ``process``, and build the runtime."""
    settings = settings_or_exit(process)
    setup_logging(settings.log_level, process)
    return build_runtime(settings, pool_size=pool_size)
