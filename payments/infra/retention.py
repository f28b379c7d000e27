"""Retention of callback rows: archive, then delete, settled rows past their age.

Two kinds of row go (``RETAINED``): processed callbacks (status 1) older than
CALLBACK_RETENTION_DAYS and rejected ones (status 3) older than
REJECTED_RETENTION_DAYS, by receipt time. Nothing else is ever deleted here:
not rows at status 0, 2 or 4 (unfinished, or the manual queue's), not a row a
manual review names (its evidence), not the ledger (append-only, refused by
the database itself), and not the ``processed_event`` inbox, which keeps a
replayed event from applying twice after its row is gone. References that
stay behind (``processed_event.callback_log_id``, ``callback:<id>`` in the
ledger and on payments) resolve to the archive: every row is there by id.

One batch is one transaction:

1. lock up to CLEANUP_BATCH_SIZE due rows (``FOR UPDATE SKIP LOCKED``, so
   several compensators share the work and a reverify cannot move a row
   underneath us);
2. write them as one gzip JSON-lines file in ARCHIVE_DIR, fsync it, rename
   it into place, and write its SHA-256 beside it (``<file>.sha256``, the
   ``sha256sum`` format), fsynced too, then fsync the directory;
3. delete exactly those ids, still guarded by their status, and commit.

A crash before 3 commits leaves every row in place and an archive file that
holds copies of them; the next batch archives them again into a new file.
So a row can appear in more than one archive file, always with the same
content (settled rows do not change): ``read_archive`` readers key by ``id``.
Nothing is ever deleted that is not on disk first.

Pure parts (which rows, the line format, the file names) are functions
without I/O; ``archive_batch`` does the I/O.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, delete, exists, func, or_, select

from payments.errors import SourceNotAllowed
from payments.infra import failpoints
from payments.infra.schema import callback_attempt, manual_review, payment_callback_log
from payments.states import CallbackStatus

ARCHIVE_FORMAT = 1
"""Version of the line format (each line carries it as ``_format``)."""


@dataclass(frozen=True)
class Kind:
    """One kind of row retention removes."""

    name: str
    status: CallbackStatus
    days: int
    """Retention in days; 0 keeps the rows forever."""
    refused: bool | None = None
    """Only rows refused for their source (True), only the others (False), or either (None)."""


RETAINED = (CallbackStatus.PROCESSED, CallbackStatus.REJECTED)
"""The only statuses cleanup ever deletes."""


REFUSED_RESULT_PREFIX = f"rejected: {SourceNotAllowed.code}"
"""How the ``result`` of a delivery refused for its source begins (``store_callback``)."""


def kinds(callback_days: int, rejected_days: int, refused_days: int = 0) -> list[Kind]:
    """The kinds to clean for these settings (a kind with 0 days is left alone).

    Deliveries refused for their source are rejected rows (status 3) of their
    own kind: evidence of who knocked, never re-verifiable, so they go sooner
    (REFUSED_RETENTION_DAYS) than rejected deliveries of the provider's own
    networks, which a key fix may yet take back (REJECTED_RETENTION_DAYS).
    """
    return [
        k
        for k in (
            Kind("processed", CallbackStatus.PROCESSED, callback_days),
            Kind("rejected", CallbackStatus.REJECTED, rejected_days, refused=False),
            Kind("refused", CallbackStatus.REJECTED, refused_days, refused=True),
        )
        if k.days > 0
    ]


def refused_clause() -> Any:
    """True for a row stored as refused for its source (its ``result`` says so)."""
    return payment_callback_log.c.result.startswith(REFUSED_RESULT_PREFIX, autoescape=True)


def cutoff(now: datetime, days: int) -> datetime:
    """Rows received before this are due."""
    return now - timedelta(days=days)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    return value


def encode_row(row: Mapping[str, Any]) -> bytes:
    """One archive line: every column; ``callback_data`` base64, times ISO 8601 (naive UTC)."""
    doc = {"_format": ARCHIVE_FORMAT, **{k: _json_value(v) for k, v in row.items()}}
    return json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


_TIMES = ("create_time", "update_time", "last_retry_time", "next_retry_at")


def decode_row(line: bytes) -> dict[str, Any]:
    """The row an archive line holds, with the body as bytes and the times as datetimes again."""
    doc = json.loads(line)
    if doc.pop("_format", None) != ARCHIVE_FORMAT:
        raise ValueError("not a paysync callback archive line")
    doc["callback_data"] = base64.b64decode(doc["callback_data"])
    for name in _TIMES:
        if doc.get(name):
            doc[name] = datetime.fromisoformat(doc[name])
    return doc


def archive_name(kind: str, first_id: int, last_id: int, now: datetime) -> str:
    """``callback-<kind>-<UTC time>-<first id>-<last id>.jsonl.gz``: sortable by time, findable by id range."""
    return f"callback-{kind}-{now.strftime('%Y%m%dT%H%M%S%fZ')}-{first_id}-{last_id}.jsonl.gz"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


ARCHIVE_FILE_MODE = 0o600
"""Archives hold raw callbacks (payers' names, accounts, amounts): readable by the compensator's user only."""
ARCHIVE_DIR_MODE = 0o700
"""… in a directory only that user may list or enter."""


def _private_dir(directory: Path) -> None:
    """Make ``directory`` (and its parents) exist, and ``directory`` itself mode 0700 whatever umask or mode it had."""
    directory.mkdir(mode=ARCHIVE_DIR_MODE, parents=True, exist_ok=True)
    # mkdir's mode passes through the umask, and an existing directory keeps its own: set it, every time.
    if directory.stat().st_mode & 0o777 != ARCHIVE_DIR_MODE:
        os.chmod(directory, ARCHIVE_DIR_MODE)


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600) through a temporary file: fsynced, then renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, ARCHIVE_FILE_MODE)
    with open(fd, "wb") as f:
        # A .tmp left by a crash keeps its old mode through O_CREAT, and the umask may narrow ours: set it.
        os.fchmod(f.fileno(), ARCHIVE_FILE_MODE)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_archive(directory: Path, name: str, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``rows`` as ``directory/name`` plus its ``.sha256`` (0600, in a 0700 directory), both on disk on return."""
    _private_dir(directory)
    # mtime=0: the same rows make the same bytes (and digest), whenever they are archived.
    data = gzip.compress(b"".join(encode_row(r) for r in rows), mtime=0)
    path = directory / name
    _write_durably(path, data)
    _write_durably(path.with_name(name + ".sha256"), f"{hashlib.sha256(data).hexdigest()}  {name}\n".encode())
    _fsync_dir(directory)
    return path


class ArchiveCorrupt(ValueError):
    """An archive file whose SHA-256 does not match its ``.sha256`` (or that has none)."""


def read_archive(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of one archive file, after checking its SHA-256; raise ArchiveCorrupt if it does not match."""
    data = path.read_bytes()
    sidecar = path.with_name(path.name + ".sha256")
    try:
        expected = sidecar.read_text().split()[0]
    except (OSError, IndexError):
        raise ArchiveCorrupt(f"{path.name}: no {sidecar.name}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise ArchiveCorrupt(f"{path.name}: SHA-256 does not match {sidecar.name}")
    for line in gzip.decompress(data).splitlines():
        if line:
            yield decode_row(line)


def find_archived(directory: Path, log_id: int) -> dict[str, Any] | None:
    """The archived row with id ``log_id`` (scanning the files whose id range covers it), or None."""
    for path in sorted(directory.glob("callback-*.jsonl.gz")):
        first, last = (int(part) for part in path.name.removesuffix(".jsonl.gz").rsplit("-", 2)[1:])
        if first <= log_id <= last:
            for row in read_archive(path):
                if row["id"] == log_id:
                    return row
    return None


def _due(kind: Kind, now: datetime) -> Any:
    t = payment_callback_log
    # A row a manual review names is that review's evidence (the ops console shows it): kept.
    reviewed = exists().where(manual_review.c.callback_log_id == t.c.id)
    clauses = [t.c.status == kind.status, t.c.create_time < cutoff(now, kind.days), ~reviewed]
    if kind.refused is not None:
        not_refused = or_(t.c.result.is_(None), ~refused_clause())  # NOT LIKE of a NULL would be NULL: not false
        clauses.append(refused_clause() if kind.refused else not_refused)
    return tuple(clauses)


def count_due(conn: Connection, kind: Kind, now: datetime) -> int:
    """How many rows of ``kind`` are due (for ``--dry-run``)."""
    return conn.execute(select(func.count()).select_from(payment_callback_log).where(*_due(kind, now))).scalar_one()


def archive_batch(engine: Engine, kind: Kind, now: datetime, batch_size: int, directory: Path) -> int:
    """Archive, then delete, one batch of due rows of ``kind`` in one transaction; return how many went."""
    t = payment_callback_log
    with engine.begin() as conn:
        rows = [
            dict(r._mapping)
            for r in conn.execute(
                select(t).where(*_due(kind, now)).order_by(t.c.id).limit(batch_size).with_for_update(skip_locked=True)
            )
        ]
        if not rows:
            return 0
        write_archive(directory, archive_name(kind.name, rows[0]["id"], rows[-1]["id"], now), rows)
        failpoints.hit("cleanup.after_archive")  # on disk, not yet deleted: the crash the docstring describes
        # Guarded by status again: the lock makes it hold, the guard makes the intent plain.
        deleted = conn.execute(delete(t).where(t.c.id.in_([r["id"] for r in rows]), t.c.status == kind.status))
        if deleted.rowcount != len(rows):
            raise RuntimeError(f"cleanup: deleted {deleted.rowcount} of {len(rows)} archived rows; rolled back")
        # A row's attempts go with it: the archived row keeps its last result, and nothing would show the rest.
        conn.execute(delete(callback_attempt).where(callback_attempt.c.callback_log_id.in_([r["id"] for r in rows])))
    return len(rows)
