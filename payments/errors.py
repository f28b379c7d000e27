"""The errors paysync raises on purpose.

Each carries ``permanent``: a permanent error will fail the same way on every
retry (a bad signature, a malformed body), so retry loops stop at once; a
transient one (an order not committed yet, a lost race) is worth retrying.
"""

from __future__ import annotations


class PaysyncError(Exception):
    """Base class; ``code`` is the stable machine-readable name used in JSON errors."""

    code = "internal_error"
    permanent = False


class ConfigError(PaysyncError):
    """A setting is missing or malformed; the process must not start."""

    code = "bad_configuration"
    permanent = True


class CallbackRejected(PaysyncError):
    """A callback failed verification or parsing; it is kept with status 3, never retried."""

    code = "callback_rejected"
    permanent = True
    http_status = 400


class SignatureInvalid(CallbackRejected):
    """The signature is missing, malformed or does not match the body."""

    code = "invalid_signature"
    http_status = 401


class TimestampOutOfTolerance(SignatureInvalid):
    """The signed timestamp is too old or too far in the future (replay protection)."""

    code = "stale_timestamp"


class SourceNotAllowed(CallbackRejected):
    """The delivery came from outside its provider's allowed networks (``<PROVIDER>_SOURCE_CIDRS``)."""

    code = "source_not_allowed"
    http_status = 403


class MalformedCallback(CallbackRejected):
    """The body is signed correctly but is not an event we can read."""

    code = "malformed_callback"
    http_status = 400


class UnsupportedContentType(CallbackRejected):
    """The callback's Content-Type is not one its provider sends."""

    code = "unsupported_content_type"
    http_status = 415


class BodyTooLarge(CallbackRejected):
    """The callback's body is over CALLBACK_MAX_BODY_BYTES: only its first bytes were kept."""

    code = "body_too_large"
    http_status = 413


class UnknownProvider(PaysyncError):
    """No adapter is registered under this provider name."""

    code = "unknown_provider"
    permanent = True


class TargetNotFound(PaysyncError):
    """A callback names a payment or refund we have no row for (yet): the order may commit later."""

    code = "target_not_found"


class StaleTransition(PaysyncError):
    """A guarded UPDATE matched no row: somebody else changed the status first."""

    code = "stale_transition"


class EventIgnored(PaysyncError):
    """A genuine (verified) notification about nothing paysync applies: another integration's object, an event
    type we do not act on. Acknowledged so the provider stops retrying, and recorded as processed with the reason.
    """

    code = "event_ignored"
    permanent = True


class NotificationFailed(PaysyncError):
    """An alert channel did not take a notification; the message is safe to log (no URL, no secret).

    ``permanent`` is set per failure: a channel that says the request itself is
    wrong (bad signature, unknown webhook, archived channel) fails the same way
    on every retry, so its notification gives up at once. ``retry_after`` is
    the service's own wait (HTTP Retry-After), if it gave one.
    """

    code = "notification_failed"

    def __init__(self, message: str, *, permanent: bool = False, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.retry_after = retry_after
