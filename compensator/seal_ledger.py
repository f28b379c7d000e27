"""Job ``seal_ledger``: seal committed ledger events into a SHA-256 chain, off the hot path.

Writers append ``ledger_event``/``ledger_entry`` rows exactly as before and
never touch the chain, so they never serialise on a chain head. This job,
running every SEAL_INTERVAL_SECONDS under a named database lock (one sealer
at a time across every compensator), appends one ``ledger_seal`` row per
event::

    event_digest = sha256(canonical JSON of the event's columns and its lines, ordered by line id)
    chain_hash   = sha256(prev_hash | seq | ledger_event_id | event_digest)

``seq`` is the chain's own sequence (1, 2, 3, … with no gaps, PRIMARY KEY),
``ledger_event_id`` is UNIQUE (an event is sealed once), and the table is
append-only like the ledger (triggers refuse UPDATE and DELETE). Editing a
sealed event or its lines changes its digest; editing, deleting or
reordering seals breaks the chain; ``python -m compensator verify-ledger``
walks it and reports the first break.

**Commit order, not id order.** AUTO_INCREMENT ids are handed out at INSERT
time but transactions commit in any order: event 41 can become visible after
event 42. A sealer that remembered "sealed up to id 42" would skip 41
forever. So the chain records events in the order the sealer *saw them
committed*, and nothing is skipped for good:

1. New events: the ids above the highest id sealed so far (``max_event_id``
   of the head seal, a running maximum), in id order: an index range.
2. Gaps: every id the sealer steps over while doing that (41, when it seals
   40 and 42) is written to ``ledger_seal_gap`` in the same transaction as the
   seals. Each run first looks for committed events inside the recorded gaps
   and seals them, later in the chain than their ids suggest; a gap is
   dropped once it is LATE_COMMIT_SECONDS (60 s) old, by then a rolled-back
   transaction (its id is burnt for good) or a straggler, but only by the
   run that has just looked into it: every recorded gap is looked into by
   every run, however many there are (MAX_GAP_RANGES at a time) and however
   long the sealer was not running. Looking only at the gaps costs a run a
   few primary-key range probes per page of gaps, however fast events are
   written; the gap list lives in the database, so it survives a restart and
   any compensator holding the lock continues it.
3. Stragglers: a transaction that commits more than a minute after writing
   its event (nothing in paysync holds one open that long) is past its gap.
   The first run in every process, and one run an hour after that, scan the
   whole table for unsealed events, a range of ids at a time, and seal them;
   until then ``verify-ledger`` reports every event unsealed for more than a
   minute, so none goes unnoticed.

A rolled-back transaction burns its id for good; that is a harmless hole in
the ids, never in ``seq``. The chain proves the ledger has not changed since
it was sealed; it cannot prove that nobody with write access rewrote ledger
and chain together, so keep the head hash (the sealer logs it, verify-ledger
prints it) somewhere the database's users cannot write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, func, insert, or_, select

from payments.infra.db import utcnow
from payments.infra.locks import named_lock
from payments.infra.schema import ledger_entry, ledger_event, ledger_seal, ledger_seal_gap
from payments.runtime import Runtime

log = logging.getLogger("paysync.compensator.seal")

GENESIS = "0" * 64
"""prev_hash of the first seal."""
DIGEST_VERSION = "paysync-ledger-seal-v1"
"""Part of every digest: a later change to what a digest covers gets a new name, old seals keep verifying."""
LATE_COMMIT_SECONDS = 60.0
"""How long a gap is watched: a transaction committing this late after its event was stepped over is still sealed."""
MAX_GAP_RANGES = 1000
"""Gap ranges looked into per query (a page of the gap list; a run goes through every page)."""
FULL_SCAN_STEP = 50_000
"""Ids one query of the full scan covers, so none scans the whole table."""
FULL_SCAN_SECONDS = 3600.0
"""How often (and at process start) a run looks for unsealed events across the whole table."""
STALE_SECONDS = 60.0
"""verify-ledger reports an event unsealed for longer than this."""
BATCH = 1000
"""Events sealed per transaction."""
LOCK_NAME = "paysync.seal_ledger"

EVENT_COLUMNS = (
    "id",
    "event_type",
    "payment_id",
    "refund_id",
    "amount_minor",
    "currency",
    "source_type",
    "source_id",
    "dedupe_key",
    "details",
    "created_at",
)
"""What a seal covers of an event: named, so a column added later does not change old digests."""
LINE_COLUMNS = ("id", "account", "amount_minor", "currency")

_last_full_scan: dict[str, float] = {}
"""Database URL -> monotonic time of this process's last full scan."""


# ------------------------------------------------------------------------------------------- pure


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat(timespec="microseconds")
    return value


def event_digest(event: Mapping[str, Any], lines: Sequence[Mapping[str, Any]]) -> str:
    """sha256 of an event's canonical content and its lines (ordered by line id)."""
    body = {
        "v": DIGEST_VERSION,
        "event": [_plain(event[c]) for c in EVENT_COLUMNS],
        "lines": [[_plain(line[c]) for c in LINE_COLUMNS] for line in sorted(lines, key=lambda r: r["id"])],
    }
    canonical = json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def chain_hash(prev_hash: str, seq: int, ledger_event_id: int, digest: str) -> str:
    """The hash of one link: the previous link, the position, the event and its digest."""
    return hashlib.sha256(f"{prev_hash}|{seq}|{ledger_event_id}|{digest}".encode()).hexdigest()


# ------------------------------------------------------------------------------------------- sealing


@dataclass(frozen=True)
class Head:
    """The last seal: where the next one links on."""

    seq: int = 0
    chain_hash: str = GENESIS
    max_event_id: int = 0


def run_once(runtime: Runtime, *, max_seconds: float = 10.0, full_scan: bool | None = None) -> int:
    """Seal every committed, unsealed ledger event (module docstring); return how many were sealed.

    Another compensator holding the lock means it is sealing: this run does nothing.
    """
    engine = runtime.engine
    key = engine.url.render_as_string(hide_password=True)
    if full_scan is None:
        last = _last_full_scan.get(key)
        full_scan = last is None or time.monotonic() - last >= FULL_SCAN_SECONDS
    with named_lock(engine, LOCK_NAME) as locked:
        if not locked:
            log.debug("another sealer holds %s; skipping this run", LOCK_NAME)
            return 0
        sealed = seal(engine, max_seconds=max_seconds, full_scan=full_scan)
    if full_scan:
        _last_full_scan[key] = time.monotonic()
    return sealed


def seal(engine: Engine, *, max_seconds: float = 10.0, full_scan: bool = False, batch: int = BATCH) -> int:
    """Seal late commits (recorded gaps, or the whole table), then new events, in batches; return how many."""
    started = time.monotonic()
    # A gap is dropped only after a look into it that began after it expired: one dropped first, or one left
    # for a later page, would lose an event that committed late inside it (until the next full scan).
    cutoff = utcnow() - timedelta(seconds=LATE_COMMIT_SECONDS)
    if full_scan:
        late = _seal_everywhere(engine, batch)  # covers every gap: they all lie below the head
        with engine.begin() as conn:
            conn.execute(delete(ledger_seal_gap).where(ledger_seal_gap.c.noticed_at < cutoff))
    else:
        late = _seal_gaps(engine, batch, cutoff)
    if late:
        log.warning("sealed %s ledger events that committed after later ones had been sealed", late)
    sealed = late
    while time.monotonic() - started < max_seconds:
        count = _seal_new(engine, batch)
        sealed += count
        if count < batch:
            break
    if sealed:
        with engine.connect() as conn:
            head = read_head(conn)
        log.info("sealed %s ledger events", sealed, extra={"head_seq": head.seq, "head_hash": head.chain_hash})
    return sealed


def read_head(conn: Connection) -> Head:
    """The last seal, or the genesis head of an empty chain."""
    row = conn.execute(
        select(ledger_seal.c.seq, ledger_seal.c.chain_hash, ledger_seal.c.max_event_id)
        .order_by(ledger_seal.c.seq.desc())
        .limit(1)
    ).first()
    return Head(row.seq, row.chain_hash, row.max_event_id) if row else Head()


def holes(after: int, ids: Sequence[int]) -> list[tuple[int, int]]:
    """The id ranges (first, last) missing between ``after`` and each of the ascending ``ids`` (pure)."""
    out = []
    for event_id in ids:
        if event_id > after + 1:
            out.append((after + 1, event_id - 1))
        after = max(after, event_id)
    return out


_EVENT_SELECT = select(*(ledger_event.c[c] for c in EVENT_COLUMNS))
_UNSEALED = _EVENT_SELECT.outerjoin(ledger_seal, ledger_seal.c.ledger_event_id == ledger_event.c.id).where(
    ledger_seal.c.seq.is_(None)
)


def _seal_new(engine: Engine, batch: int) -> int:
    """Seal up to ``batch`` events above the head, in id order; record the ids stepped over as gaps."""
    with engine.begin() as conn:
        head = read_head(conn)
        query = _EVENT_SELECT.where(ledger_event.c.id > head.max_event_id).order_by(ledger_event.c.id).limit(batch)
        events = conn.execute(query).mappings().all()
        if events:
            _append_seals(conn, head, events)
            gaps = holes(head.max_event_id, [e["id"] for e in events])
            if gaps:
                now = utcnow()
                conn.execute(
                    insert(ledger_seal_gap),
                    [{"from_event_id": a, "to_event_id": b, "noticed_at": now} for a, b in gaps],
                )
    return len(events)


def _seal_gaps(engine: Engine, batch: int, cutoff: datetime) -> int:
    """Seal the events that committed inside recorded gaps, every gap, a page of ranges at a time.

    Each page's gaps noticed before ``cutoff`` are dropped right after that page was looked into.
    """
    sealed, after = 0, 0
    while True:
        with engine.connect() as conn:
            page = conn.execute(
                select(
                    ledger_seal_gap.c.id,
                    ledger_seal_gap.c.from_event_id,
                    ledger_seal_gap.c.to_event_id,
                    ledger_seal_gap.c.noticed_at,
                )
                .where(ledger_seal_gap.c.id > after)
                .order_by(ledger_seal_gap.c.id)
                .limit(MAX_GAP_RANGES)
            ).all()
        if not page:
            return sealed
        inside = or_(*(ledger_event.c.id.between(g.from_event_id, g.to_event_id) for g in page))
        while True:
            with engine.begin() as conn:
                events = conn.execute(_UNSEALED.where(inside).order_by(ledger_event.c.id).limit(batch)).mappings().all()
                if events:
                    _append_seals(conn, read_head(conn), events)
            sealed += len(events)
            if len(events) < batch:
                break
        expired = [g.id for g in page if g.noticed_at < cutoff]
        if expired:
            with engine.begin() as conn:
                conn.execute(delete(ledger_seal_gap).where(ledger_seal_gap.c.id.in_(expired)))
        if len(page) < MAX_GAP_RANGES:
            return sealed
        after = page[-1].id


def _seal_everywhere(engine: Engine, batch: int) -> int:
    """Seal every unsealed event below the head, scanning FULL_SCAN_STEP ids per query."""
    with engine.connect() as conn:
        high = read_head(conn).max_event_id
    sealed, low = 0, 0
    while low < high:
        window = and_(ledger_event.c.id > low, ledger_event.c.id <= min(low + FULL_SCAN_STEP, high))
        with engine.begin() as conn:
            events = conn.execute(_UNSEALED.where(window).order_by(ledger_event.c.id).limit(batch)).mappings().all()
            if events:
                _append_seals(conn, read_head(conn), events)
        sealed += len(events)
        if len(events) < batch:
            low += FULL_SCAN_STEP
    return sealed


def _append_seals(conn: Connection, head: Head, events: Sequence[Mapping[str, Any]]) -> None:
    lines_by_event: dict[int, list[Mapping[str, Any]]] = {e["id"]: [] for e in events}
    for line in conn.execute(
        select(ledger_entry.c.ledger_event_id, *(ledger_entry.c[c] for c in LINE_COLUMNS)).where(
            ledger_entry.c.ledger_event_id.in_(list(lines_by_event))
        )
    ).mappings():
        lines_by_event[line["ledger_event_id"]].append(line)
    now = utcnow()
    seq, prev, high = head.seq, head.chain_hash, head.max_event_id
    rows = []
    for event in events:
        seq += 1
        digest = event_digest(event, lines_by_event[event["id"]])
        link = chain_hash(prev, seq, event["id"], digest)
        high = max(high, event["id"])
        rows.append(
            {
                "seq": seq,
                "ledger_event_id": event["id"],
                "event_digest": digest,
                "prev_hash": prev,
                "chain_hash": link,
                "max_event_id": high,
                "sealed_at": now,
            }
        )
        prev = link
    # seq is the PRIMARY KEY: a second sealer racing past the lock fails here and rolls back.
    conn.execute(ledger_seal.insert(), rows)


# ------------------------------------------------------------------------------------------- verifying


@dataclass
class Verification:
    """What walking the chain found."""

    verified: int = 0
    """Seals checked and found intact, from seq 1."""
    head_seq: int = 0
    head_hash: str = GENESIS
    first_break: dict[str, Any] | None = None
    """seq, ledger_event_id and reason of the first broken link; None if the chain is whole."""
    stale_unsealed: int = 0
    """Events older than STALE_SECONDS with no seal."""
    stale_examples: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the chain is whole and nothing old is unsealed."""
        return self.first_break is None and self.stale_unsealed == 0

    def as_dict(self) -> dict[str, Any]:
        """For ``--format json``."""
        return {
            "ok": self.ok,
            "verified": self.verified,
            "head_seq": self.head_seq,
            "head_hash": self.head_hash,
            "first_break": self.first_break,
            "stale_unsealed": self.stale_unsealed,
            "stale_examples": self.stale_examples,
        }


def verify(engine: Engine, *, now: datetime | None = None, batch: int = 2000) -> Verification:
    """Walk the chain from seq 1, recomputing every digest and link; report the first break and stale events.

    Reads in batches of ``batch`` seals, so memory stays flat however long the chain.
    """
    result = Verification()
    prev, expected = GENESIS, 1
    with engine.connect() as conn:
        while result.first_break is None:
            seals = (
                conn.execute(
                    select(ledger_seal).where(ledger_seal.c.seq >= expected).order_by(ledger_seal.c.seq).limit(batch)
                )
                .mappings()
                .all()
            )
            if not seals:
                break
            ids = [s["ledger_event_id"] for s in seals]
            events = {e["id"]: e for e in conn.execute(_EVENT_SELECT.where(ledger_event.c.id.in_(ids))).mappings()}
            lines: dict[int, list[Mapping[str, Any]]] = {i: [] for i in ids}
            for line in conn.execute(
                select(ledger_entry.c.ledger_event_id, *(ledger_entry.c[c] for c in LINE_COLUMNS)).where(
                    ledger_entry.c.ledger_event_id.in_(ids)
                )
            ).mappings():
                lines[line["ledger_event_id"]].append(line)
            for s in seals:
                reason = _check_link(s, expected, prev, events.get(s["ledger_event_id"]), lines[s["ledger_event_id"]])
                if reason:
                    result.first_break = {"seq": s["seq"], "ledger_event_id": s["ledger_event_id"], "reason": reason}
                    break
                result.verified += 1
                result.head_seq, result.head_hash = s["seq"], s["chain_hash"]
                prev, expected = s["chain_hash"], expected + 1
            conn.rollback()  # a long walk should not pin one old snapshot
        cutoff = (now or utcnow()) - timedelta(seconds=STALE_SECONDS)
        stale = (
            select(ledger_event.c.id)
            .outerjoin(ledger_seal, ledger_seal.c.ledger_event_id == ledger_event.c.id)
            .where(ledger_seal.c.seq.is_(None), ledger_event.c.created_at < cutoff)
        )
        result.stale_unsealed = conn.execute(select(func.count()).select_from(stale.subquery())).scalar_one()
        if result.stale_unsealed:
            result.stale_examples = list(conn.execute(stale.order_by(ledger_event.c.id).limit(10)).scalars())
    return result


def _check_link(
    seal: Mapping[str, Any],
    expected_seq: int,
    prev: str,
    event: Mapping[str, Any] | None,
    lines: Sequence[Mapping[str, Any]],
) -> str | None:
    """Why this seal does not hold, or None."""
    if seal["seq"] != expected_seq:
        return f"seal {expected_seq} is missing (the chain jumps to {seal['seq']})"
    if seal["prev_hash"] != prev:
        return "prev_hash is not the previous seal's chain_hash"
    if seal["chain_hash"] != chain_hash(prev, seal["seq"], seal["ledger_event_id"], seal["event_digest"]):
        return "chain_hash does not match the seal's own fields"
    if event is None:
        return f"ledger event {seal['ledger_event_id']} is gone"
    if event_digest(event, lines) != seal["event_digest"]:
        return f"ledger event {seal['ledger_event_id']} or its lines changed after it was sealed"
    return None


def describe(result: Verification) -> str:
    """The text report of ``verify-ledger``."""
    out = []
    if result.first_break:
        b = result.first_break
        out.append(f"ledger chain BROKEN at seal {b['seq']} (ledger event {b['ledger_event_id']}): {b['reason']}")
        out.append(f"{result.verified} seals verified before the break")
    else:
        out.append(f"ledger chain verified: {result.verified} seals, head seq {result.head_seq} {result.head_hash}")
    if result.stale_unsealed:
        examples = ", ".join(str(i) for i in result.stale_examples)
        out.append(
            f"{result.stale_unsealed} ledger events unsealed for more than {STALE_SECONDS:g} s (ids {examples}…)"
        )
    return "\n".join(out)
