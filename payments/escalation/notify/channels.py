"""Which channels a configuration enables, whether their settings hold together, and building them.

A channel is enabled as soon as any of its ``enabled_by`` settings is set,
and then every one of its ``required`` settings must be (as providers are, in
payments/infra/settings.py): a half-configured channel would look like alerting
works while it sends nothing, so it stops the process instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from payments.errors import ConfigError
from payments.escalation.notify import (
    CHANNEL_NAMES,
    Channel,
    aliyun_sms,
    dingtalk,
    feishu,
    slack,
    sms_http,
    smtp,
    template,
    webhook,
    wecom,
)
from payments.escalation.notify.http import HttpChannel
from payments.escalation.notify.sms_http import SmsGatewayChannel


@dataclass(frozen=True)
class ChannelSpec:
    """The settings of one channel."""

    enabled_by: tuple[str, ...]
    """Any of these set (non-empty) enables the channel …"""
    required: tuple[str, ...]
    """… and then all of these must be set."""
    token_urls: tuple[str, ...] = ()
    """URL settings that carry a credential: production refuses plain http to anything but loopback."""


SPECS: dict[str, ChannelSpec] = {
    "email": ChannelSpec(
        enabled_by=("smtp_host", "smtp_from", "smtp_to", "smtp_username", "smtp_password"),
        required=("smtp_host", "smtp_from", "smtp_to"),
    ),
    "sms": ChannelSpec(
        enabled_by=("sms_gateway_url", "sms_recipients", "sms_gateway_token"),
        required=("sms_gateway_url", "sms_recipients"),
        token_urls=("sms_gateway_url",),
    ),
    "aliyun_sms": ChannelSpec(
        enabled_by=(
            "aliyun_sms_access_key_id",
            "aliyun_sms_access_key_secret",
            "aliyun_sms_sign_name",
            "aliyun_sms_template_code",
            "aliyun_sms_phone_numbers",
        ),
        required=(
            "aliyun_sms_access_key_id",
            "aliyun_sms_access_key_secret",
            "aliyun_sms_sign_name",
            "aliyun_sms_template_code",
            "aliyun_sms_phone_numbers",
        ),
        token_urls=("aliyun_sms_endpoint",),
    ),
    "dingtalk": ChannelSpec(
        enabled_by=("dingtalk_webhook_url", "dingtalk_secret"),
        required=("dingtalk_webhook_url",),
        token_urls=("dingtalk_webhook_url",),
    ),
    "feishu": ChannelSpec(
        enabled_by=("feishu_webhook_url", "feishu_secret"),
        required=("feishu_webhook_url",),
        token_urls=("feishu_webhook_url",),
    ),
    "wecom": ChannelSpec(
        enabled_by=("wecom_webhook_url",), required=("wecom_webhook_url",), token_urls=("wecom_webhook_url",)
    ),
    "slack": ChannelSpec(
        enabled_by=("slack_webhook_url",), required=("slack_webhook_url",), token_urls=("slack_webhook_url",)
    ),
    "webhook": ChannelSpec(
        enabled_by=("alert_webhook_url", "alert_webhook_secret"),
        required=("alert_webhook_url", "alert_webhook_secret"),
        token_urls=("alert_webhook_url",),
    ),
}
assert tuple(SPECS) == CHANNEL_NAMES  # one list of names, kept in step at import


def _env(field_name: str) -> str:
    return field_name.upper()


def enabled_channels(settings: object) -> list[str]:
    """The channels ``settings`` enables, in CHANNEL_NAMES order."""
    return [name for name, spec in SPECS.items() if any(getattr(settings, f) for f in spec.enabled_by)]


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _template(name: str, text: str, allowed: Iterable[str]) -> Any:
    """A channel's JSON template parsed, or ConfigError naming its variable (the settings keep it as text)."""
    try:
        return template.parse(text, allowed)
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def validate(settings: object) -> None:
    """Raise ConfigError naming the variable when an enabled channel's settings do not hold together."""
    # The templates first, as when the settings parsed them: a bad one is refused whether its channel is on or not.
    _template("SMS_GATEWAY_TEMPLATE", settings.sms_gateway_template, sms_http.ALLOWED)
    _template("ALIYUN_SMS_TEMPLATE_PARAM", settings.aliyun_sms_template_param, aliyun_sms.ALLOWED)
    for name in enabled_channels(settings):
        spec = SPECS[name]
        missing = [_env(f) for f in spec.required if not getattr(settings, f)]
        if missing:
            given = ", ".join(_env(f) for f in spec.enabled_by if getattr(settings, f))
            verb = "is" if len(missing) == 1 else "are"
            raise ConfigError(
                f"{', '.join(missing)} {verb} required: alert channel {name} is partly configured ({given} set)"
            )
        if getattr(settings, "paysync_env", "production") == "production":
            for field_name in spec.token_urls:
                url = getattr(settings, field_name)
                if url.startswith("http://") and not _loopback(url):
                    raise ConfigError(
                        f"{_env(field_name)} must be https:// in production: the request carries a credential"
                    )
    s = settings
    if bool(s.smtp_username) != bool(s.smtp_password):
        raise ConfigError("SMTP_USERNAME and SMTP_PASSWORD go together: set both (AUTH) or neither")
    if s.smtp_password and s.smtp_tls == smtp.OFF:
        raise ConfigError("SMTP_PASSWORD needs SMTP_TLS=starttls or implicit: AUTH would send it in clear")
    sms_template = _template("SMS_GATEWAY_TEMPLATE", s.sms_gateway_template, sms_http.ALLOWED)
    if s.sms_gateway_url and not ({"phone", "phones"} & set(template.placeholders(sms_template))):
        raise ConfigError("SMS_GATEWAY_TEMPLATE names no recipient: use {{phone}} (one request each) or {{phones}}")


def build_channels(settings: object) -> dict[str, Channel]:
    """A Channel for every enabled channel, keyed by name (the first secret of a list signs)."""
    s = settings
    timeout = s.alert_channel_timeout_seconds
    built: dict[str, Channel] = {}
    for name in enabled_channels(s):
        if name == "email":
            built[name] = smtp.SmtpChannel(
                s.smtp_host,
                s.smtp_port,
                s.smtp_from,
                s.smtp_to,
                tls=s.smtp_tls,
                username=s.smtp_username,
                password=s.smtp_password,
                ca_file=s.smtp_ca_file,
                timeout=timeout,
            )
        elif name == "sms":
            body = template.parse(s.sms_gateway_template, sms_http.ALLOWED)
            token = s.sms_gateway_token[0] if s.sms_gateway_token else ""
            built[name] = SmsGatewayChannel(s.sms_gateway_url, body, token, s.sms_recipients, timeout)
        elif name == "aliyun_sms":
            param = template.parse(s.aliyun_sms_template_param, aliyun_sms.ALLOWED)
            args = (
                s.aliyun_sms_endpoint,
                s.aliyun_sms_access_key_id,
                s.aliyun_sms_access_key_secret[0],
                s.aliyun_sms_sign_name,
                s.aliyun_sms_template_code,
                param,
                s.aliyun_sms_phone_numbers,
            )
            built[name] = HttpChannel(name, lambda n, a=args: aliyun_sms.build(*a, n), aliyun_sms.check, timeout)
        elif name == "dingtalk":
            url, secret = s.dingtalk_webhook_url, (s.dingtalk_secret or ("",))[0]
            built[name] = HttpChannel(name, lambda n, u=url, k=secret: dingtalk.build(u, k, n), dingtalk.check, timeout)
        elif name == "feishu":
            url, secret = s.feishu_webhook_url, (s.feishu_secret or ("",))[0]
            built[name] = HttpChannel(name, lambda n, u=url, k=secret: feishu.build(u, k, n), feishu.check, timeout)
        elif name == "wecom":
            built[name] = HttpChannel(name, lambda n, u=s.wecom_webhook_url: wecom.build(u, n), wecom.check, timeout)
        elif name == "slack":
            built[name] = HttpChannel(name, lambda n, u=s.slack_webhook_url: slack.build(u, n), slack.check, timeout)
        elif name == "webhook":
            url, secret = s.alert_webhook_url, s.alert_webhook_secret[0]
            built[name] = HttpChannel(name, lambda n, u=url, k=secret: webhook.build(u, k, n), webhook.check, timeout)
    return built
