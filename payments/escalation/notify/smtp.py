"""Email over SMTP: a plain-text message, sent with STARTTLS (default), implicit TLS or no TLS, and AUTH.

``build_message`` is pure: an RFC 5322 message with ``Date``, a ``Message-ID``
per notification (``<alert-<id>-<kind>-<n>@<from domain>>``, so a retry has the
same id and mail clients drop duplicates) and, for reminders and the resolved
notice, ``In-Reply-To``/``References`` pointing at the firing mail: a mail
client shows one incident as one thread. ``Auto-Submitted: auto-generated``
(RFC 3834) keeps vacation responders from answering it.

``SmtpChannel.send`` is the I/O: connect (``SMTP_TLS=implicit``: TLS from the
first byte, port 465), EHLO, STARTTLS (``starttls``, port 587) with
certificate and host name verification against the system's CAs or
SMTP_CA_FILE, AUTH when SMTP_USERNAME is set, send. A 5xx reply or a refused
login is permanent; a 4xx reply, a timeout or a refused connection is
retried. A message some recipients refused but others took counts as sent.
"""

from __future__ import annotations

import email.policy
import smtplib
import ssl
from collections.abc import Sequence
from email.message import EmailMessage
from email.utils import formatdate, make_msgid

from payments.errors import NotificationFailed
from payments.escalation.notify import FIRING, TEST, Notice, render
from payments.infra.logs import scrub

NAME = "email"
STARTTLS = "starttls"
IMPLICIT = "implicit"
OFF = "off"
TLS_MODES = (STARTTLS, IMPLICIT, OFF)
POLICY = email.policy.SMTP.clone(max_line_length=998)
"""RFC 5322's hard line limit: the default 78 folds a subject that fits in 78 onto its own line after "Subject:"."""


def _domain(address: str) -> str:
    return address.rpartition("@")[2].strip("> ") or "paysync.invalid"


def message_id(notice: Notice, domain: str, kind: str | None = None) -> str:
    """The Message-ID of ``notice`` (or of its alert's ``kind`` notification)."""
    kind = kind or notice.kind
    repeat = notice.repeat if kind == notice.kind else 0
    return f"<alert-{notice.alert_id or 0}-{kind}-{repeat}@{domain}>"


def build_message(notice: Notice, sender: str, recipients: Sequence[str]) -> EmailMessage:
    """The mail for ``notice``."""
    msg = EmailMessage(policy=POLICY)
    msg["Subject"] = render.summary(notice, 200)
    msg["From"] = sender
    msg["To"] = ", ".join(recipients)
    msg["Date"] = formatdate(usegmt=True)
    domain = _domain(sender)
    if notice.kind == TEST:
        msg["Message-ID"] = make_msgid("paysync-test", domain=domain)
    else:
        msg["Message-ID"] = message_id(notice, domain)
        if notice.kind != FIRING:
            first = message_id(notice, domain, FIRING)
            msg["In-Reply-To"] = first
            msg["References"] = first
    msg["Auto-Submitted"] = "auto-generated"
    msg["X-Paysync-Alert"] = f"{notice.rule}; kind={notice.kind}; severity={notice.severity}"
    msg.set_content(render.plain_text(notice))
    return msg


def tls_context(ca_file: str = "") -> ssl.SSLContext:
    """A verifying client context: the system's CAs, or only those in ``ca_file``."""
    return ssl.create_default_context(cafile=ca_file or None)


class SmtpChannel:
    """Sends each notice as one mail to every recipient."""

    name = NAME

    def __init__(
        self,
        host: str,
        port: int,
        sender: str,
        recipients: Sequence[str],
        *,
        tls: str = STARTTLS,
        username: str = "",
        password: str = "",
        ca_file: str = "",
        timeout: float = 10.0,
    ) -> None:
        if tls not in TLS_MODES:
            raise ValueError(f"tls must be one of {TLS_MODES}")
        self.host, self.port, self.sender, self.recipients = host, port, sender, tuple(recipients)
        self.tls, self.username, self._password, self.ca_file, self.timeout = tls, username, password, ca_file, timeout

    def send(self, notice: Notice) -> str:
        """Connect, secure, log in, send; one connection per notice (alerts are rare)."""
        msg = build_message(notice, self.sender, self.recipients)
        try:
            refused = self._deliver(msg)
        except smtplib.SMTPAuthenticationError as exc:
            raise NotificationFailed(f"{NAME}: login refused ({exc.smtp_code})", permanent=True) from None
        except smtplib.SMTPRecipientsRefused as exc:
            codes = sorted({code for code, _ in exc.recipients.values()})
            raise NotificationFailed(
                f"{NAME}: every recipient refused ({codes})", permanent=all(c >= 500 for c in codes)
            ) from None
        except smtplib.SMTPResponseException as exc:
            text = scrub(exc.smtp_error.decode("utf-8", "replace") if isinstance(exc.smtp_error, bytes) else "")
            raise NotificationFailed(
                f"{NAME}: server said {exc.smtp_code} {text[:120]}", permanent=exc.smtp_code >= 500
            ) from None
        except ssl.SSLCertVerificationError as exc:
            raise NotificationFailed(f"{NAME}: certificate not trusted ({exc.verify_message})") from None
        except (smtplib.SMTPException, OSError) as exc:
            raise NotificationFailed(f"{NAME}: {type(exc).__name__}") from None
        taken = len(self.recipients) - len(refused)
        return f"sent to {taken} of {len(self.recipients)} recipient(s) via {self.host}:{self.port}"

    def _deliver(self, msg: EmailMessage) -> dict:
        if self.tls == IMPLICIT:
            smtp: smtplib.SMTP = smtplib.SMTP_SSL(
                self.host, self.port, timeout=self.timeout, context=tls_context(self.ca_file)
            )
        else:
            smtp = smtplib.SMTP(self.host, self.port, timeout=self.timeout)
        with smtp:
            smtp.ehlo()
            if self.tls == STARTTLS:
                smtp.starttls(context=tls_context(self.ca_file))
                smtp.ehlo()
            if self.username:
                smtp.login(self.username, self._password)
            return smtp.send_message(msg, from_addr=self.sender, to_addrs=list(self.recipients))

    def close(self) -> None:
        """Nothing held between notices."""
