"""Alert channels: how a notification about an alert reaches a person.

One module per channel. Each keeps what can be checked without a network
(building the message in the service's documented format, signing it) in pure
functions, apart from the few lines that send it:

| channel | module | what it sends |
|---|---|---|
| ``email`` | ``smtp.py`` | a plain-text mail over SMTP (STARTTLS or implicit TLS, AUTH) |
| ``sms`` | ``sms_http.py`` | a JSON request built from SMS_GATEWAY_TEMPLATE to a generic HTTP SMS gateway |
| ``aliyun_sms`` | ``aliyun_sms.py`` | Aliyun dysmsapi ``SendSms``, RPC-signed (HMAC-SHA1) |
| ``dingtalk`` | ``dingtalk.py`` | a DingTalk group robot markdown message, signed (timestamp + sign) |
| ``feishu`` | ``feishu.py`` | a Feishu/Lark custom bot interactive card, signed (timestamp + sign) |
| ``wecom`` | ``wecom.py`` | a WeCom group robot markdown message |
| ``slack`` | ``slack.py`` | a Slack incoming-webhook message with Block Kit blocks |
| ``webhook`` | ``webhook.py`` | a JSON event signed as Standard Webhooks (payments/infra/webhook_signing.py) |

A channel is enabled by its own settings (``channels.py``), the way a provider
is. ``Channel.send`` either returns a short description of what it did or
raises ``NotificationFailed`` with a message that is safe to log: webhook
URLs carry tokens, so no error text ever includes one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

CHANNEL_NAMES = ("email", "sms", "aliyun_sms", "dingtalk", "feishu", "wecom", "slack", "webhook")
"""Every channel name a rule may route to."""

FIRING = "firing"
"""The first notification of an incident."""
REPEAT = "repeat"
"""A reminder while the alert still fires, once per rule cooldown."""
RESOLVED = "resolved"
"""The alert cleared."""
TEST = "test"
"""``python -m compensator alerts test``: no alert behind it."""
KINDS = (FIRING, REPEAT, RESOLVED, TEST)


@dataclass(frozen=True)
class Mentions:
    """Who a chat robot @-mentions, in each robot's own terms (set per rule and per severity in the rules file).

    DingTalk names people by phone number or user id (``at.atMobiles``,
    ``at.atUserIds``, ``at.isAtAll``; a mobile must also appear as ``@138…``
    in the text); WeCom's markdown by user id (``<@userid>``), its text
    message by phone number (``mentioned_mobile_list``); a Feishu card by
    open_id (``<at id=ou_…></at>``, ``<at id=all></at>``).
    """

    dingtalk_mobiles: tuple[str, ...] = ()
    dingtalk_user_ids: tuple[str, ...] = ()
    dingtalk_all: bool = False
    wecom_user_ids: tuple[str, ...] = ()
    wecom_mobiles: tuple[str, ...] = ()
    wecom_all: bool = False
    feishu_open_ids: tuple[str, ...] = ()
    feishu_all: bool = False

    def union(self, other: Mentions) -> Mentions:
        """Everyone either names (order kept, no one twice)."""

        def both(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(dict.fromkeys((*a, *b)))

        return Mentions(
            dingtalk_mobiles=both(self.dingtalk_mobiles, other.dingtalk_mobiles),
            dingtalk_user_ids=both(self.dingtalk_user_ids, other.dingtalk_user_ids),
            dingtalk_all=self.dingtalk_all or other.dingtalk_all,
            wecom_user_ids=both(self.wecom_user_ids, other.wecom_user_ids),
            wecom_mobiles=both(self.wecom_mobiles, other.wecom_mobiles),
            wecom_all=self.wecom_all or other.wecom_all,
            feishu_open_ids=both(self.feishu_open_ids, other.feishu_open_ids),
            feishu_all=self.feishu_all or other.feishu_all,
        )


@dataclass(frozen=True)
class Member:
    """Another alert of the same cause, carried by one grouped notice."""

    alert_id: int
    rule: str
    severity: str
    message: str
    key: str


@dataclass(frozen=True)
class Notice:
    """One thing to tell people about one alert, in a form every channel renders."""

    kind: str
    rule: str
    severity: str
    message: str
    key: str
    alert_id: int | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    first_seen_at: datetime | None = None
    fired_at: datetime | None = None
    resolved_at: datetime | None = None
    repeat: int = 0
    """For a reminder: its number (1 for the first)."""
    links: tuple[tuple[str, str], ...] = ()
    """(label, URL or path) an operator follows: the console page of the subject, the rule's runbook."""
    mentions: Mentions = field(default_factory=Mentions)
    """Who chat robots @-mention (firing notices only)."""
    members: tuple[Member, ...] = ()
    """The other alerts of this cause that this one notice tells about (``payments/escalation/notifications.py``)."""

    @property
    def message_id(self) -> str:
        """Stable across retries of this notification, so receivers can drop duplicates (no '.' in it)."""
        return f"alert_{self.alert_id or 0}_{self.kind}_{self.repeat}"

    @property
    def title(self) -> str:
        """One line: severity, rule and what happened."""
        if self.kind == RESOLVED:
            return f"[RESOLVED] {self.rule}"
        if self.kind == TEST:
            return "[TEST] paysync alert channel test"
        more = f" (+{len(self.members)} related)" if self.members else ""
        if self.kind == REPEAT:
            return f"[{self.severity.upper()}] {self.rule} still firing (reminder {self.repeat}){more}"
        return f"[{self.severity.upper()}] {self.rule} firing{more}"


class Channel(Protocol):
    """What the notifier needs from a channel."""

    name: str

    def send(self, notice: Notice) -> str:
        """Deliver ``notice``; return what was done (e.g. "sent to 2 recipients"), raise NotificationFailed."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...
