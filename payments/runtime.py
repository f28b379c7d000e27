"""What every long-running process needs, built once at start from the settings.

Every process starts the same way: ``payments.infra.settings.start_process`` (a bad
setting stops it with one line naming it and exit code 2, logging set up),
then ``build_runtime`` (failpoints armed, the engine and adapters built).
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

from payments.infra import failpoints
from payments.infra.backoff import RetryPolicy
from payments.infra.db import make_engine
from payments.infra.settings import Settings
from payments.providers import build_providers
from payments.providers.base import Provider


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
