"""Ops console sessions on the server side: opened at login, looked up on every request, revoked at logout.

The console's cookie is signed, so nobody can make one; but a signed cookie
alone stays good until it expires, logout or not, for whoever copied it. So
each login gets a row in ``ops_session``, found by the SHA-256 of a random
session id the cookie carries (the table alone opens nothing), and a session
counts only while its row is neither expired nor revoked. Framework-free: the
gateway's ``gateway/ops`` calls it with the cookie's values.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Engine, insert, select, update

from payments.infra.db import utcnow
from payments.infra.schema import ops_session


@dataclass(frozen=True)
class OpsSession:
    """One live console session: its row id, what logged in, and who said they were."""

    id: int
    role: str
    actor: str
    token_fingerprint: str

    @property
    def identity(self) -> str:
        """What vouches for the actor, as ops_action.identity records it: the session and its token."""
        return f"console session {self.id} ({self.role}, token {self.token_fingerprint[:12]})"


def _hash(sid: str) -> str:
    return hashlib.sha256(sid.encode()).hexdigest()


def open_session(
    engine: Engine,
    *,
    role: str,
    actor: str,
    token_fingerprint: str,
    remote_addr: str | None,
    lifetime_seconds: int,
    now: datetime | None = None,
) -> tuple[str, OpsSession]:
    """Record a new login; return (the session id for the cookie, the session)."""
    now = now or utcnow()
    sid = secrets.token_urlsafe(32)
    with engine.begin() as conn:
        row_id = conn.execute(
            insert(ops_session).values(
                sid_hash=_hash(sid),
                role=role,
                actor=actor,
                token_fingerprint=token_fingerprint,
                remote_addr=(remote_addr or "")[:64] or None,
                created_at=now,
                expires_at=now + timedelta(seconds=lifetime_seconds),
            )
        ).inserted_primary_key[0]
    return sid, OpsSession(int(row_id), role, actor, token_fingerprint)


def find_session(engine: Engine, sid: str, now: datetime | None = None) -> OpsSession | None:
    """The session ``sid`` names, if it is still live (not expired, not revoked); None otherwise."""
    if not sid:
        return None
    t = ops_session
    with engine.connect() as conn:
        row = conn.execute(
            select(t.c.id, t.c.role, t.c.actor, t.c.token_fingerprint).where(
                t.c.sid_hash == _hash(sid), t.c.revoked_at.is_(None), t.c.expires_at > (now or utcnow())
            )
        ).first()
    return OpsSession(int(row.id), row.role, row.actor, row.token_fingerprint) if row else None


def revoke_session(engine: Engine, sid: str, now: datetime | None = None) -> bool:
    """End the session ``sid`` on the server (logout); True if it was live. A copy of its cookie is then worthless."""
    if not sid:
        return False
    t = ops_session
    with engine.begin() as conn:
        moved = conn.execute(
            update(t).where(t.c.sid_hash == _hash(sid), t.c.revoked_at.is_(None)).values(revoked_at=now or utcnow())
        ).rowcount
    return bool(moved)
