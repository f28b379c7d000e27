"""The merchant's Idempotency-Key, for every POST that creates something (``POST /payments``, ``POST …/refunds``).

``run`` is the whole protocol. ONE transaction claims the key (an
``idempotency_request`` row), does the caller's work and stores its answer
(status ``done``): a retry with the same key and the same request gets that
answer again, byte for byte; with another request (another digest), 422. A
second request with the same key while the first is in that transaction waits
on the key's row (the UNIQUE index) until the first commits, milliseconds, and
then gets its answer; it never does the work again. A request whose work
raises (a validation the database must answer, such as "this refund is more
than is left") writes nothing, the key included, so the merchant's retry is
judged afresh.

Work whose final answer is known only after it committed (``run``'s ``then``:
a QR code asked of the provider) commits with the key ``started``: a request
with the same key meanwhile gets 409. A claim left ``started`` by a process
that died is taken over after ``lock_seconds``. (Until this version the key
was claimed in a transaction of its own first; such a claim, left by a process
that died, is taken over the same way.)

Keys live in a ``scope`` (the endpoint family): the same key string may be
used once for a payment and once for a refund.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, select, update

from payments.errors import PaysyncError
from payments.infra.db import insert_ignore, utcnow
from payments.infra.schema import idempotency_request

log = logging.getLogger("paysync.idempotency")

MAX_KEY_LENGTH = 255

# Built once, values at execute time: building a statement and its cache key per request cost as much
# interpreter time as running it (POST /payments, GIL profile).
_CLAIM = insert_ignore(idempotency_request)
_STORE_ANSWER = update(idempotency_request).where(
    idempotency_request.c.scope == bindparam("p_scope"),
    idempotency_request.c.idempotency_key == bindparam("p_key"),
    idempotency_request.c.status == "started",
    idempotency_request.c.locked_at == bindparam("p_token"),
)
"""The SET columns are the execute parameters named as columns (the p_ ones are the WHERE's)."""


class InvalidRequest(PaysyncError):
    """The request is malformed or cannot be granted; nothing was written."""

    code = "invalid_request"
    permanent = True
    http_status = 400

    def __init__(self, message: str, code: str | None = None, http_status: int | None = None) -> None:
        super().__init__(message)
        if code:
            self.code = code
        if http_status:
            self.http_status = http_status


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"{name} is not valid JSON")


def request_object(raw: bytes) -> dict[str, Any]:
    """A merchant request body as a JSON object (pure), numbers with a fraction or exponent read as exact Decimals.

    Never floats: ``8388607.0`` must not pass through binary floating point
    on its way to being an amount (invariant 7). NaN and Infinity are refused.
    """
    try:
        data = json.loads(raw, parse_float=Decimal, parse_constant=_reject_constant)
    except InvalidRequest:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly deep nesting
        raise InvalidRequest("body must be a JSON object", "invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("body must be a JSON object", "invalid_json")
    return data


def minor_units(value: object) -> int | None:
    """``value`` (from ``request_object``) as an integer amount, or None when it is not one.

    JSON Schema's "integer", which the OpenAPI document publishes, is any
    number with no fractional part: ``1000``, ``1000.0`` and ``1e3`` all
    stand for 1000, exactly (they were parsed as Decimal, so there is no
    rounding at any size). ``1000.5``, strings and booleans are not amounts.
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, Decimal) and value.is_finite() and value == value.to_integral_value():
        # Clamped to 2**63, beyond every amount paysync takes: 1e999999999 is integral too, and not worth building.
        return int(value) if value.adjusted() < 19 else (2**63 if value > 0 else -(2**63))
    return None


class IdempotencyConflict(InvalidRequest):
    """The key is in use: by a request still in flight (409) or by a different request (422)."""


@dataclass(frozen=True)
class Answer:
    """An HTTP answer: status and JSON text; ``replayed`` when it is the stored first answer."""

    status: int
    body: str
    replayed: bool = False


@dataclass(frozen=True)
class Stored:
    """What the caller's work produced: the answer to store, and the payment it concerns."""

    status: int
    body: str
    payment_id: str | None = None


def check_key(key: str | None) -> str:
    """The Idempotency-Key header, or InvalidRequest if it is missing or unusable."""
    if key is None or not key.strip():
        raise InvalidRequest("the Idempotency-Key header is required", "idempotency_key_missing")
    if len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise InvalidRequest(
            f"Idempotency-Key must be at most {MAX_KEY_LENGTH} printable characters", "idempotency_key_invalid"
        )
    return key


def run(
    engine: Engine,
    *,
    scope: str,
    key: str,
    digest: str,
    lock_seconds: float,
    work: Callable[[Connection], Stored],
    then: Callable[[Stored], Stored] | None = None,
    now: datetime | None = None,
) -> Answer:
    """Answer a request under the merchant's ``key`` (module docstring); ``work`` runs in the answer's transaction.

    ``work`` writes what the request creates and returns the answer to store;
    anything it raises rolls back, the key's claim with it.

    With ``then``, the work commits with its answer kept on the claim (still
    ``started``, so a concurrent request gets 409), ``then`` runs after that
    commit and gives the final answer, which is stored as the one to replay.
    From that commit on the key is never freed: a retry after a crash takes
    over the work's own answer instead of doing the work again.
    """
    now = now or utcnow()
    token = now
    try:
        with engine.begin() as conn:
            if not _claim(conn, scope, key, digest, now):
                raise _Taken()
            stored = work(conn)
            if not _store(conn, scope, key, token, stored, "started" if then else "done", now):
                raise RuntimeError("the claim made in this transaction is gone")
    except _Taken:
        answer_or_token = _existing(engine, scope, key, digest, lock_seconds, now)
        if isinstance(answer_or_token, Answer):
            return answer_or_token
        token = answer_or_token  # a claim whose request died: ours now
        try:
            with engine.begin() as conn:
                stored = work(conn)
                if not _store(conn, scope, key, token, stored, "started" if then else "done", now):
                    # Our takeover expired and yet another request took the key over: let that one finish.
                    raise in_progress()
        except BaseException:
            _release(engine, scope, key, token)
            raise
    if then is None:
        return Answer(stored.status, stored.body)
    final = then(stored)
    with engine.begin() as conn:
        if not _store(conn, scope, key, token, final, "done", utcnow()):
            raise in_progress()  # taken over past lock_seconds: the retry answered with the work's own answer
    return Answer(final.status, final.body)


def _store(conn: Connection, scope: str, key: str, token: datetime, stored: Stored, status: str, now: datetime) -> bool:
    """Put ``stored`` on our claim (``done``: the answer to replay); False if the claim is no longer ours."""
    params = {
        "p_scope": scope,
        "p_key": key,
        "p_token": token,
        "status": status,
        "response_status": stored.status,
        "response_body": stored.body,
        "payment_id": stored.payment_id,
        "updated_at": now,
    }
    return conn.execute(_STORE_ANSWER, params).rowcount == 1


def in_progress() -> IdempotencyConflict:
    """The 409 for a key whose first request has not finished."""
    return IdempotencyConflict("a request with this Idempotency-Key is in progress", "request_in_progress", 409)


class _Taken(Exception):  # noqa: N818 - control flow, not an error
    """The key is on file already (committed by another request): see what it holds."""


def _claim(conn: Connection, scope: str, key: str, digest: str, now: datetime) -> bool:
    """Take the key for this request in the caller's transaction; False if it is on file already.

    A request holding the same key in an uncommitted transaction makes this
    wait for it (the UNIQUE index), then see its row or its absence.
    """
    return bool(
        conn.execute(
            _CLAIM,
            {
                "scope": scope,
                "idempotency_key": key,
                "request_digest": digest,
                "status": "started",
                "locked_at": now,
                "created_at": now,
                "updated_at": now,
            },
        ).rowcount
    )


def _existing(
    engine: Engine, scope: str, key: str, digest: str, lock_seconds: float, now: datetime
) -> Answer | datetime:
    """For a key already on file: its stored answer, a takeover lock token, or IdempotencyConflict."""
    t = idempotency_request
    with engine.begin() as conn:
        row = conn.execute(select(t).where(t.c.scope == scope, t.c.idempotency_key == key)).first()
        if row is None:  # released by a request that failed; try again from the top
            raise in_progress()
        if row.request_digest != digest:
            raise IdempotencyConflict(
                "this Idempotency-Key was used with a different request", "idempotency_key_reuse", 422
            )
        if row.status == "done":
            return Answer(row.response_status, row.response_body, replayed=True)
        if now - row.locked_at < timedelta(seconds=lock_seconds):
            raise in_progress()
        if row.response_body is not None:
            # The first request's work committed (``run`` with ``then``) but it never stored its final answer:
            # the work's own answer becomes the one to replay; doing the work again would do it twice.
            taken = conn.execute(
                update(t)
                .where(t.c.id == row.id, t.c.status == "started", t.c.locked_at == row.locked_at)
                .values(status="done", updated_at=now)
            ).rowcount
            if not taken:
                raise in_progress()
            return Answer(row.response_status, row.response_body, replayed=True)
        # The first request died mid-way (its transaction never committed): take over.
        taken = conn.execute(
            update(t)
            .where(t.c.id == row.id, t.c.status == "started", t.c.locked_at == row.locked_at)
            .values(locked_at=now, updated_at=now)
        ).rowcount
    if not taken:
        raise in_progress()
    return now


def _release(engine: Engine, scope: str, key: str, token: datetime) -> None:
    """Forget a key whose request failed before committing, so the merchant's retry can proceed at once."""
    t = idempotency_request
    try:
        with engine.begin() as conn:
            conn.execute(
                t.delete().where(
                    t.c.scope == scope, t.c.idempotency_key == key, t.c.status == "started", t.c.locked_at == token
                )
            )
    except Exception:  # noqa: BLE001 - the lock timeout releases it anyway
        log.warning("could not release idempotency key after a failed request")
