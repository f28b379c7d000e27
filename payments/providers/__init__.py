"""Provider adapters, by the name used in URLs and the ``provider`` columns."""

from __future__ import annotations

from payments.errors import UnknownProvider
from payments.providers.base import Provider
from payments.providers.sandbox import LegacySandboxProvider, SandboxProvider
from payments.settings import Settings, stripe_enabled


def build_providers(settings: Settings) -> dict[str, Provider]:
    """Every configured adapter, keyed by provider name."""
    providers: dict[str, Provider] = {
        "sandbox": SandboxProvider(
            settings.sandbox_webhook_secret, settings.callback_tolerance_seconds, settings.sandbox_api_url
        ),
    }
    if settings.sandbox_legacy_enabled:
        providers["sandbox_legacy"] = LegacySandboxProvider(
            settings.sandbox_webhook_secret, settings.callback_tolerance_seconds, settings.sandbox_api_url
        )
    if stripe_enabled(settings):
        from payments.providers.stripe import StripeProvider  # only a configured merchant loads it

        providers["stripe"] = StripeProvider.from_settings(settings)
    return providers


def get_provider(providers: dict[str, Provider], name: str) -> Provider:
    """The adapter for ``name``, or UnknownProvider."""
    try:
        return providers[name]
    except KeyError:
        raise UnknownProvider(f"unknown provider {name[:32]!r}") from None
