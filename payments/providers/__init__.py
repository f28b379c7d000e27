"""Provider adapters, by the name used in URLs and the ``provider`` columns.

A provider exists only when its configuration enables it
(``payments.infra.settings.PROVIDERS``: its secrets are set). One that is not
enabled has no callback route (404, nothing stored) and cannot be named in
POST /payments (400). A new adapter adds its factory to ``FACTORIES`` and its
settings to ``payments.infra.settings.PROVIDERS``.

The providers wing owns each provider's folder (``<name>/``: adapter,
signing, money, bill parser), the adapter interface (``base``) and the
settlement-line interface the bill parsers share (``settlement``). It may
import the kernel and ``payments.infra``; the wings above call it.
"""

from __future__ import annotations

from collections.abc import Callable

from payments.errors import UnknownProvider
from payments.infra.settings import Settings, enabled_providers, validate_stripe
from payments.providers.base import Provider
from payments.providers.sandbox.adapter import LegacySandboxProvider, SandboxProvider

FACTORIES: dict[str, Callable[[Settings], Provider]] = {
    "sandbox": lambda s: _sandbox(SandboxProvider, s),
    "sandbox_legacy": lambda s: _sandbox(LegacySandboxProvider, s),
    "alipay": lambda s: _alipay(s),
    "wechatpay": lambda s: _wechatpay(s),
    "stripe": lambda s: _stripe(s),
}
"""How to build each adapter from the settings, by provider name."""


def _sandbox(cls: type[SandboxProvider], s: Settings) -> Provider:
    # SANDBOX_API_KEY is a list for rotation on the platform's side; paysync presents the first.
    api_key = s.sandbox_api_key[0] if s.sandbox_api_key else ""
    return cls(s.sandbox_webhook_secret, s.callback_tolerance_seconds, s.sandbox_api_url, api_key)


def _alipay(settings: Settings) -> Provider:
    # Imported here: only a configured merchant loads its keys (read and parsed once, at start).
    from payments.providers.alipay import adapter as alipay

    return alipay.from_settings(settings)


def _wechatpay(settings: Settings) -> Provider:
    from payments.providers.wechatpay.adapter import WechatPayProvider

    return WechatPayProvider.from_settings(settings)


def _stripe(settings: Settings) -> Provider:
    from payments.providers.stripe.adapter import StripeProvider

    return StripeProvider.from_settings(settings)


def _validate_alipay(settings: Settings) -> None:
    from payments.providers.alipay import adapter

    adapter.validate(settings)


def _validate_wechatpay(settings: Settings) -> None:
    from payments.providers.wechatpay import adapter

    adapter.validate(settings)


def _validate_stripe(settings: Settings) -> None:
    validate_stripe(settings, production=settings.paysync_env == "production")


VALIDATORS: dict[str, Callable[[Settings], None]] = {
    "alipay": _validate_alipay,
    "wechatpay": _validate_wechatpay,
    "stripe": _validate_stripe,
}
"""What each provider checks of its settings beyond their values (key files readable, keys strong, certificates in
date, a live key in production); ConfigError naming the variable. A provider without an entry has nothing more."""


def validate(settings: Settings) -> None:
    """Ask every enabled provider to check its own settings (the start-up step, ``payments.runtime``)."""
    for name in enabled_providers(settings):
        check = VALIDATORS.get(name)
        if check is not None:
            check(settings)


def build_providers(settings: Settings) -> dict[str, Provider]:
    """The adapters this configuration enables, keyed by provider name."""
    return {name: FACTORIES[name](settings) for name in enabled_providers(settings) if name in FACTORIES}


def get_provider(providers: dict[str, Provider], name: str) -> Provider:
    """The adapter for ``name``, or UnknownProvider."""
    try:
        return providers[name]
    except KeyError:
        raise UnknownProvider(f"unknown provider {name[:32]!r}") from None
