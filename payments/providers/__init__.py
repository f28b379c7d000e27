"""Provider adapters, by the name used in URLs and the ``provider`` columns."""

from __future__ import annotations

from payments.errors import UnknownProvider
from payments.providers.base import Provider
from payments.providers.sandbox import LegacySandboxProvider, SandboxProvider
from payments.settings import Settings


def build_providers(settings: Settings) -> dict[str, Provider]:
    """Every configured adapter, keyed by provider name."""
    sandbox = {
        "webhook_secret": settings.sandbox_webhook_secret,
        "tolerance_seconds": settings.callback_tolerance_seconds,
        "api_url": settings.sandbox_api_url,
        "api_key": settings.sandbox_api_key,
    }
    providers: dict[str, Provider] = {"sandbox": SandboxProvider(**sandbox)}
    if settings.sandbox_legacy_enabled:
        providers["sandbox_legacy"] = LegacySandboxProvider(**sandbox)
    return providers


def get_provider(providers: dict[str, Provider], name: str) -> Provider:
    """The adapter for ``name``, or UnknownProvider."""
    try:
        return providers[name]
    except KeyError:
        raise UnknownProvider(f"unknown provider {name[:32]!r}") from None
