"""Reconciliation: a provider's settlement file for one day, line by line, against our payments, refunds and ledger.

One run (``reconcile``), streamed so a file of any size takes flat memory:

1. **Keep the file.** The bytes (downloaded through the adapter's streaming
   ``settlement()`` into a temporary file, or read from ``--file``) are
   hashed; ``settlement_file`` records provider, day, SHA-256, size, source
   and import time, UNIQUE on (provider, day, sha256): the same bytes are one
   file however often they are imported.
2. **Read, store, match in batches** of BATCH_LINES records (the first few
   smaller, ``batch_sizes``): the provider's parser (``PARSERS``) yields
   ``payments.providers.settlement.SettlementLine`` records; each is stored unchanged
   in ``settlement_line`` (``INSERT IGNORE`` on (file, line number): a second
   import adds nothing, a crashed one resumes),
   then matched to a local payment or refund by the provider's transaction id,
   then by our number, and classified by the pure ``classify``. Reading and
   storing run one batch ahead in a thread of their own (``read_ahead``), so
   the parser's Python work overlaps the database's work on the batch before;
   a batch is committed before it is matched.
3. **Act on what does not agree, never overwriting:**
   - a local Created/Pending/Unknown the provider settled (or failed) is moved
     by the state machine (``_resolve``), with the reconciliation item as the
     source (``status_source = reconciliation:<item id>``);
   - anything the state machine cannot take (a Failed payment the provider
     settled, a success the provider failed, another amount or currency, money
     we have no record of) posts a ``ReconciliationAdjusted`` event that moves
     the provider receivable to what the provider says, the difference into
     ``suspense:reconciliation``, and is escalated: a manual review and an
     alert, once per subject (``_escalate``, through ``review.escalate``).
4. **Local only:** successes we confirmed that day that no current settlement
   file names are items too, escalated once per payment or refund (the
   database's anti-joins, LOCAL_ONLY_WORKERS pages at once).
5. **Fees:** the day's fees (fee columns and fee lines) are booked as one
   ``FeeCharged`` event per currency (a cross-currency line's fee in its
   settlement currency).
6. **Currency conversions:** a line the provider settled in another currency
   (a EUR charge reaching a USD balance) is matched on the charge's own amount
   and currency; the conversion is booked on its own as ``FxConverted`` (the
   EUR leaves the receivable, the USD comes in, each against
   ``clearing:fx_conversion``), the difference to what earlier runs booked.
7. A ``reconciliation_run`` row holds the summary: count and amounts per
   currency for every category, fees, and what was resolved, adjusted and
   escalated.

Re-running a day is safe: every ledger posting is the *difference* between
what the provider's file says and what the ledger already holds for that
subject (so a second run posts nothing, and a corrected file posts only the
correction), and ledger dedupe keys are UNIQUE. Runs take the named lock
LOCK_NAME, so one compensator reconciles at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from itertools import islice
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import Connection, Engine, and_, func, insert, literal, null, or_, select, update

from payments.escalation.review import escalate
from payments.infra.db import insert_ignore_columns, utcnow
from payments.infra.schema import (
    RECON_AMOUNT_MISMATCH,
    RECON_CATEGORIES,
    RECON_FEE,
    RECON_IGNORED,
    RECON_LOCAL_ONLY,
    RECON_MATCHED,
    RECON_PROVIDER_ONLY,
    RECON_RESOLVED,
    RECON_STATUS_MISMATCH,
    RECON_UNREADABLE,
    TS,
    UNEXPLAINED,
    ledger_entry,
    ledger_event,
    payment,
    reconciliation_item,
    reconciliation_run,
    refund,
    settlement_file,
    settlement_line,
)
from payments.lifecycle.transitions import apply_decision
from payments.money import ledger
from payments.providers.alipay import bill as alipay_bill
from payments.providers.base import Provider
from payments.providers.sandbox import bill as sandbox_bill
from payments.providers.settlement import (
    CHARGE,
    FAILED,
    FEE,
    INFO,
    INVALID,
    REFUND,
    SUCCEEDED,
    Parser,
    SettlementLine,
    checked,
)
from payments.providers.stripe import bill as stripe_bill
from payments.providers.wechatpay import bill as wechatpay_bill
from payments.states import (
    TERMINAL,
    Decision,
    PaymentStatus,
    ReconciliationRunStatus,
    SettlementFileStatus,
    Verdict,
    decide,
)

log = logging.getLogger("paysync.reconcile")

PARSERS: dict[str, tuple[str, Parser]] = {
    "sandbox": (sandbox_bill.FORMAT, sandbox_bill.parse),
    "alipay": (alipay_bill.FORMAT, alipay_bill.read_settlement),
    "wechatpay": (wechatpay_bill.FORMAT, wechatpay_bill.read_settlement),
    "stripe": (stripe_bill.FORMAT, stripe_bill.read_settlement),
}
"""Provider name -> (format name, pure parser) of its settlement files; a new provider's bill parser is one line."""

DAY_ZONES: dict[str, tzinfo] = {
    "alipay": alipay_bill.BEIJING,
    "wechatpay": wechatpay_bill.BEIJING,
}
"""Provider -> the time zone its settlement days are counted in (default UTC): Alipay and WeChat Pay bill by
Beijing days, so their day D is [D-1 16:00, D 16:00) UTC, and so is the local-only pass's day."""

ACCOUNTS: dict[str, tuple[str, ...]] = {
    "sandbox": ("sandbox", "sandbox_legacy"),
}
"""Provider -> the ``payment.provider`` values its file covers (default: itself). sandbox_legacy is the same account."""

BATCH_LINES = 5000
"""Records read, stored and matched per transaction (the first few batches smaller: ``batch_sizes``)."""
LOCAL_ONLY_WORKERS = 2
"""Pages of the local-only pass queried at once (MariaDB; SQLite: one)."""
LOCK_NAME = "paysync.reconcile"
"""Named database lock: one reconciliation at a time across every compensator."""


class ReconcileError(Exception):
    """A run could not be done (unknown provider, no parser, another run holds the lock); nothing was changed."""


def accounts_for(provider: str) -> tuple[str, ...]:
    """Local provider names whose payments a provider's settlement file covers."""
    return ACCOUNTS.get(provider, (provider,))


def parser_for(provider: str) -> tuple[str, Parser]:
    """The (format, parser) of a provider's settlement files."""
    try:
        return PARSERS[provider]
    except KeyError:
        raise ReconcileError(f"no settlement parser for provider {provider!r}") from None


# ------------------------------------------------------------------------------------------- the file


@dataclass
class Source:
    """A settlement file ready to read: a seekable binary stream, its digest and where it came from."""

    stream: BinaryIO
    sha256: str
    size: int
    source: str
    """download, or file:<path>."""

    def close(self) -> None:
        """Close the stream (a downloaded file's temporary copy disappears)."""
        self.stream.close()


def download(provider: Provider, day: date, timeout: float) -> Source:
    """Stream the provider's file for ``day`` into a temporary file, hashing it; ProviderUnavailable passes up.

    Only a whole file is returned: a transfer that breaks off raises before anything is imported.
    """
    spool = tempfile.TemporaryFile(prefix="paysync-settlement-")  # noqa: SIM115 - Source.close closes it
    digest, size = hashlib.sha256(), 0
    try:
        for chunk in provider.settlement(day.isoformat(), timeout):
            digest.update(chunk)
            size += len(chunk)
            spool.write(chunk)
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return Source(spool, digest.hexdigest(), size, "download")


def open_file(path: str | Path) -> Source:
    """A settlement file on disk (``--file``), hashed; OSError passes up."""
    path = Path(path).resolve()
    stream = open(path, "rb")  # noqa: SIM115 - Source.close closes it
    digest, size = hashlib.sha256(), 0
    while chunk := stream.read(1 << 20):
        digest.update(chunk)
        size += len(chunk)
    stream.seek(0)
    return Source(stream, digest.hexdigest(), size, f"file:{path}"[:500])


# ------------------------------------------------------------------------------------------- pure matching


@dataclass(frozen=True)
class Local:
    """Our payment or refund as matching sees it."""

    kind: str
    """payment or refund."""
    row: Mapping[str, Any]

    @property
    def key(self) -> str:
        """Our business number: payment_id or refund_id."""
        return self.row["refund_id"] if self.kind == "refund" else self.row["payment_id"]

    @property
    def provider_reference(self) -> str | None:
        """The provider's id of it, if we know it."""
        return self.row["provider_refund_id"] if self.kind == "refund" else self.row["provider_transaction_id"]


@dataclass(frozen=True)
class Finding:
    """What one settlement line says about our books, and what to do about it."""

    category: str
    resolve_to: PaymentStatus | None = None
    """A report for the state machine (local Created/Pending/Unknown)."""
    adjust: bool = False
    """Post the difference between the provider's view and ours as ReconciliationAdjusted."""
    escalate: bool = False
    """A person must look: a manual review and an alert, once per subject."""
    reason: str = ""


def classify(line: SettlementLine, local: Local | None, accounts: Sequence[str]) -> Finding:
    """What a (checked) settlement line means for ``local``, the record it was matched to (pure).

    The order matters: a line we cannot read, a fee, then identity (is it
    ours at all?), then money (amount and currency), then status.
    """
    if line.kind == INVALID:
        return Finding(RECON_UNREADABLE, escalate=True, reason=line.error or "unreadable")
    if line.kind == FEE:
        return Finding(RECON_FEE)
    moved = line.status == SUCCEEDED
    foreign = None
    if local is None:
        foreign = "we hold no record of it"
    elif local.row["provider"] not in accounts:
        foreign = f"our {local.kind} {local.key} belongs to provider {local.row['provider']}"
    elif line.provider_reference and local.provider_reference and line.provider_reference != local.provider_reference:
        foreign = f"our {local.kind} {local.key} is the provider's {local.provider_reference}: a second transaction"
    if foreign:
        if not moved:
            return Finding(RECON_IGNORED, reason=f"failed at the provider and {foreign}")
        return Finding(RECON_PROVIDER_ONLY, adjust=True, escalate=True, reason=f"the provider settled it; {foreign}")
    assert local is not None
    if line.amount_minor != local.row["amount_minor"] or line.currency != local.row["currency"]:
        return Finding(
            RECON_AMOUNT_MISMATCH,
            adjust=True,
            escalate=True,
            reason=(
                f"the provider has {line.amount_minor} {line.currency}, "
                f"we have {local.row['amount_minor']} {local.row['currency']}"
            ),
        )
    status = PaymentStatus(local.row["status"])
    report = PaymentStatus.SUCCEEDED if moved else PaymentStatus.FAILED
    if status == report:
        return Finding(RECON_MATCHED)
    if status in TERMINAL:
        return Finding(
            RECON_STATUS_MISMATCH,
            adjust=True,
            escalate=True,
            reason=f"the provider reports {line.status}, our {local.kind} is {status.value}",
        )
    return Finding(RECON_RESOLVED, resolve_to=report, reason=f"{status.value} -> {report.value} by the settlement")


def provider_view(line: SettlementLine) -> dict[str, int]:
    """What the line says the provider holds for us because of this transaction, by currency (pure)."""
    if line.status != SUCCEEDED or line.kind not in (CHARGE, REFUND) or line.currency is None:
        return {}
    amount = int(line.amount_minor or 0)
    return {line.currency: amount if line.kind == CHARGE else -amount}


def conversion_view(line: SettlementLine) -> dict[str, int]:
    """What the provider's conversion of a settled line did to the receivable, by currency (pure; {} if none).

    A charge in EUR settled in USD takes the EUR it added out and puts the USD in; a refund the other way.
    """
    if line.status != SUCCEEDED or line.kind not in (CHARGE, REFUND) or not line.settlement_currency:
        return {}
    sign = 1 if line.kind == CHARGE else -1
    return {
        line.currency: -sign * int(line.amount_minor or 0),
        line.settlement_currency: sign * int(line.settlement_amount_minor or 0),
    }


def differences(theirs: Mapping[str, int], ours: Mapping[str, int]) -> dict[str, int]:
    """theirs - ours, by currency, without the zeros (pure)."""
    out = {c: theirs.get(c, 0) - ours.get(c, 0) for c in sorted(set(theirs) | set(ours))}
    return {c: d for c, d in out.items() if d}


def subject_of(provider: str, line: SettlementLine) -> str:
    """The transaction a line is about, as the key of its adjustments and escalations."""
    reference = line.provider_reference or f"ours:{line.merchant_reference}"
    subject = f"{provider}:{line.kind}:{reference}"
    if len(subject) > 140:  # keep dedupe keys inside their column; still one key per transaction
        subject = f"{provider}:{line.kind}:sha256:{hashlib.sha256(reference.encode()).hexdigest()[:40]}"
    return subject


# ------------------------------------------------------------------------------------------- the summary


@dataclass
class Tally:
    """Counts, and amounts per currency, of each category in one run."""

    categories: dict[str, dict[str, Any]] = field(default_factory=dict)
    fees: dict[str, int] = field(default_factory=dict)
    """Fees in the file, by currency."""
    fees_booked: dict[str, int] = field(default_factory=dict)
    """FeeCharged posted by this run (the difference to what earlier runs booked for the day)."""
    resolved: int = 0
    adjustments: int = 0
    reviews: int = 0
    conversions: dict[str, int] = field(default_factory=dict)
    """FxConverted posted by this run: what they moved in the receivable, by currency."""

    def add(self, category: str, line: SettlementLine | None, local: Local | None) -> None:
        """Count one item."""
        entry = self.categories.setdefault(category, {"count": 0, "amounts": {}})
        entry["count"] += 1
        if line is not None and line.currency and line.amount_minor is not None:
            money = entry["amounts"].setdefault(line.currency, {"provider": 0, "local": 0})
            money["provider"] += line.amount_minor
        if local is not None:
            money = entry["amounts"].setdefault(local.row["currency"], {"provider": 0, "local": 0})
            money["local"] += int(local.row["amount_minor"])

    def add_matched(self, line: SettlementLine) -> None:
        """Count one matched line: the record holds the line's amount and currency."""
        entry = self.categories.setdefault(RECON_MATCHED, {"count": 0, "amounts": {}})
        entry["count"] += 1
        money = entry["amounts"].setdefault(line.currency, {"provider": 0, "local": 0})
        money["provider"] += line.amount_minor
        money["local"] += line.amount_minor

    def count(self, category: str) -> int:
        """Items of ``category``."""
        return self.categories.get(category, {}).get("count", 0)

    def as_dict(self) -> dict[str, Any]:
        """The reconciliation_run.summary JSON: every category (zero ones too), fees, actions."""
        return {
            "categories": {c: self.categories.get(c, {"count": 0, "amounts": {}}) for c in RECON_CATEGORIES},
            "fees": self.fees,
            "fees_booked": self.fees_booked,
            "resolved": self.resolved,
            "adjustments": self.adjustments,
            "reviews": self.reviews,
            "fx_converted": self.conversions,
        }


@dataclass
class Report:
    """What one run did: the file, the run row, the tally."""

    provider: str
    day: date
    run_id: int | None = None
    status: str = ReconciliationRunStatus.RUNNING
    file_id: int | None = None
    sha256: str | None = None
    size: int | None = None
    source: str | None = None
    file_seen_before: bool = False
    line_count: int = 0
    new_lines: int = 0
    skipped: str | None = None
    """Why the run did nothing (daily job: file unchanged since a completed run)."""
    tally: Tally = field(default_factory=Tally)

    @property
    def unexplained(self) -> int:
        """Items a person must look at."""
        return sum(self.tally.count(c) for c in UNEXPLAINED)

    def as_dict(self) -> dict[str, Any]:
        """For ``--format json``."""
        return {
            "provider": self.provider,
            "date": self.day.isoformat(),
            "run_id": self.run_id,
            "status": self.status,
            "skipped": self.skipped,
            "file": {
                "id": self.file_id,
                "sha256": self.sha256,
                "size": self.size,
                "source": self.source,
                "seen_before": self.file_seen_before,
                "lines": self.line_count,
                "new_lines": self.new_lines,
            },
            "unexplained": self.unexplained,
            **self.tally.as_dict(),
        }


def describe(report: Report) -> str:
    """The text report of ``reconcile``."""
    head = f"reconciliation {report.provider} {report.day.isoformat()}"
    if report.skipped:
        return f"{head}: skipped ({report.skipped})"
    seen = " (imported before: no new lines)" if report.file_seen_before and not report.new_lines else ""
    out = [
        f"{head}: run {report.run_id} {report.status}",
        f"  file {report.file_id} sha256 {report.sha256} {report.size} bytes from {report.source}{seen}",
        f"  {report.line_count} lines read, {report.new_lines} stored",
        f"  {'category':<16} {'count':>9}  amounts (provider / local)",
    ]
    summary = report.tally.as_dict()
    for category, entry in summary["categories"].items():
        amounts = "; ".join(f"{c} {m['provider']} / {m['local']}" for c, m in sorted(entry["amounts"].items()))
        out.append(f"  {category:<16} {entry['count']:>9}  {amounts}")
    fees = ", ".join(f"{c} {v}" for c, v in sorted(summary["fees"].items())) or "none"
    booked = ", ".join(f"{c} {v}" for c, v in sorted(summary["fees_booked"].items())) or "nothing new"
    out.append(f"  fees {fees}; FeeCharged booked: {booked}")
    if summary["fx_converted"]:
        moved = ", ".join(f"{c} {v:+d}" for c, v in sorted(summary["fx_converted"].items()))
        out.append(f"  currency conversions booked (FxConverted): {moved}")
    out.append(
        f"  resolved {summary['resolved']}, adjustments {summary['adjustments']}, reviews opened {summary['reviews']}, "
        f"unexplained items {report.unexplained}"
    )
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- a run


def day_bounds(day: date, zone: tzinfo = UTC) -> tuple[datetime, datetime]:
    """Naive UTC start of ``day`` (counted in ``zone``) and of the next day."""
    start = datetime.combine(day, time(0), zone).astimezone(UTC).replace(tzinfo=None)
    return start, start + timedelta(days=1)


def reconcile(
    engine: Engine,
    provider: str,
    day: date,
    source: Source,
    *,
    started_by: str = "manual",
    skip_unchanged: bool = False,
) -> Report:
    """Import ``source`` as ``provider``'s settlement file for ``day`` and reconcile it (module docstring).

    The caller holds LOCK_NAME. With ``skip_unchanged`` (the daily job), a
    file already reconciled by a completed run is not reconciled again.
    SettlementFormatError (not this provider's format) fails the run and passes up.
    """
    fmt, parse = parser_for(provider)
    report = Report(provider, day, sha256=source.sha256, size=source.size, source=source.source)
    report.file_id, report.file_seen_before = _register_file(engine, provider, day, fmt, source)
    if skip_unchanged and report.file_seen_before and _completed_run(engine, report.file_id):
        report.skipped = f"file {report.file_id} ({source.sha256[:12]}…) already reconciled"
        report.status = "skipped"
        return report
    report.run_id = _start_run(engine, provider, day, report.file_id, started_by)
    try:
        run = _Run(engine, provider, day, report)
        batches = _stored_batches(engine, report.file_id, _checked_batches(parse(source.stream), BATCH_LINES))
        for batch, stored in read_ahead(batches):
            run.batch(batch, stored)
        _finish_import(engine, report)
        run.local_only()
        run.book_fees()
    except BaseException as exc:
        _end_run(engine, report, ReconciliationRunStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
        raise
    _end_run(engine, report, ReconciliationRunStatus.COMPLETED)
    log.info(
        "reconciled %s %s: %s lines, %s unexplained",
        provider,
        day.isoformat(),
        report.line_count,
        report.unexplained,
        extra={"run_id": report.run_id, "summary": report.tally.as_dict()},
    )
    return report


def _checked_batches(lines: Iterable[SettlementLine], size: int) -> Iterator[list[SettlementLine]]:
    """Checked lines in batches of at most ``size``, the first ones smaller (``batch_sizes``)."""
    iterator = iter(lines)
    for limit in batch_sizes(size):
        batch = list(islice(iterator, limit))
        if not batch:
            return
        yield [checked(line) for line in batch]


def batch_sizes(size: int) -> Iterator[int]:
    """size/8, size/4, size/2, then ``size`` for ever: matching starts after a small first batch, not a full one.

    The pipeline (``read_ahead``) overlaps one batch's storing with the one
    before's matching; the first batch has nothing to overlap with, so it is
    kept short, and the batches grow to ``size`` while the pipeline fills.
    """
    limit = max(1, size // 8)
    while limit < size:
        yield limit
        limit *= 2
    while True:
        yield size


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], workers: int) -> Iterator[Any]:
    """``fn(item)`` for each item, in order, up to ``workers`` of them running at once in threads of their own.

    At most ``workers`` results wait at any time, so memory stays bounded;
    the first error is raised where its result was due.
    """
    if workers <= 1:
        yield from map(fn, items)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="reconcile-worker") as pool:
        running: deque[Future[Any]] = deque()
        try:
            for item in items:
                running.append(pool.submit(fn, item))
                if len(running) >= workers:
                    yield running.popleft().result()
            while running:
                yield running.popleft().result()
        finally:
            for future in running:
                future.cancel()


def _stored_batches(
    engine: Engine, file_id: int, batches: Iterable[list[SettlementLine]]
) -> Iterator[tuple[list[SettlementLine], int]]:
    """Each batch stored unchanged in ``settlement_line`` in a transaction of its own: (batch, lines new).

    Committed before the batch is matched (matching reads the stored lines);
    ``INSERT IGNORE`` on (file, line number), so a second import adds nothing
    and a crashed one resumes.
    """
    for batch in batches:
        with engine.begin() as conn:
            stored = insert_ignore_columns(conn, settlement_line, _line_columns(file_id, batch))
        yield batch, stored


_DONE = object()


def read_ahead(items: Iterator[Any], depth: int = 1) -> Iterator[Any]:
    """``items``, produced by a thread of their own up to ``depth`` ahead of the caller.

    Reading and parsing the next batch is Python work; storing and matching
    this one is mostly the database's. Overlapped, a run takes about the
    longer of the two instead of their sum, and memory stays bounded by
    ``depth`` + 2 batches. An exception in ``items`` (a file that is not the
    provider's format) is raised here, at the point it was reached; a caller
    that stops early (its own exception) stops the thread too.
    """
    ready: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stopped = threading.Event()

    def put(item: Any) -> bool:
        while not stopped.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            put((_DONE, exc))
            return
        put((_DONE, None))

    thread = threading.Thread(target=produce, name="reconcile-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            item, error = ready.get()
            if item is _DONE:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stopped.set()
        thread.join()


def _register_file(engine: Engine, provider: str, day: date, fmt: str, source: Source) -> tuple[int, bool]:
    """The settlement_file row for these bytes: (id, True if it existed already)."""
    key = (
        settlement_file.c.provider == provider,
        settlement_file.c.settlement_date == day,
        settlement_file.c.sha256 == source.sha256,
    )
    with engine.begin() as conn:
        existing = conn.execute(select(settlement_file.c.id).where(*key)).scalar()
        if existing is not None:
            return int(existing), True
        now = utcnow()
        result = conn.execute(
            insert(settlement_file).values(
                provider=provider,
                settlement_date=day,
                format=fmt,
                source=source.source,
                sha256=source.sha256,
                size_bytes=source.size,
                status=SettlementFileStatus.IMPORTING,
                created_at=now,
            )
        )
        return int(result.inserted_primary_key[0]), False


def _completed_run(engine: Engine, file_id: int) -> bool:
    with engine.connect() as conn:
        return (
            conn.execute(
                select(reconciliation_run.c.id)
                .where(
                    reconciliation_run.c.settlement_file_id == file_id,
                    reconciliation_run.c.status == ReconciliationRunStatus.COMPLETED,
                )
                .limit(1)
            ).first()
            is not None
        )


def _start_run(engine: Engine, provider: str, day: date, file_id: int, started_by: str) -> int:
    with engine.begin() as conn:
        result = conn.execute(
            insert(reconciliation_run).values(
                provider=provider,
                settlement_date=day,
                settlement_file_id=file_id,
                started_by=started_by,
                status=ReconciliationRunStatus.RUNNING,
                line_count=0,
                new_lines=0,
                resolved=0,
                adjustments=0,
                reviews=0,
                started_at=utcnow(),
            )
        )
        return int(result.inserted_primary_key[0])


def _finish_import(engine: Engine, report: Report) -> None:
    """Mark the file imported; older files of the same day are superseded by it."""
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            update(settlement_file)
            .where(settlement_file.c.id == report.file_id, settlement_file.c.status == SettlementFileStatus.IMPORTING)
            .values(status=SettlementFileStatus.IMPORTED, line_count=report.line_count, imported_at=now)
        )
        conn.execute(
            update(settlement_file)
            .where(
                settlement_file.c.provider == report.provider,
                settlement_file.c.settlement_date == report.day,
                settlement_file.c.id != report.file_id,
                settlement_file.c.superseded_at.is_(None),
            )
            .values(superseded_at=now)
        )
        # A file imported again after a newer one replaces it as the day's current file.
        conn.execute(update(settlement_file).where(settlement_file.c.id == report.file_id).values(superseded_at=None))


def _end_run(engine: Engine, report: Report, status: str, error: str | None = None) -> None:
    report.status = status
    tally = report.tally
    with engine.begin() as conn:
        conn.execute(
            update(reconciliation_run)
            .where(reconciliation_run.c.id == report.run_id)
            .values(
                status=status,
                line_count=report.line_count,
                new_lines=report.new_lines,
                resolved=tally.resolved,
                adjustments=tally.adjustments,
                reviews=tally.reviews,
                summary=json.dumps(tally.as_dict(), sort_keys=True),
                error=error[:500] if error else None,
                finished_at=utcnow(),
            )
        )


def _line_row(file_id: int, line: SettlementLine) -> dict[str, Any]:
    """One line's ``settlement_line`` row (``_line_columns`` holds the same values column by column)."""
    return {
        "settlement_file_id": file_id,
        "line_no": line.line_no,
        "kind": line.kind,
        "status": line.status,
        "provider_reference": line.provider_reference,
        "merchant_reference": line.merchant_reference,
        "amount_minor": line.amount_minor,
        "fee_minor": line.fee_minor if line.kind not in (INFO, INVALID) else None,
        "currency": line.currency,
        "occurred_at": line.occurred_at,
        "parse_error": line.error,
        "raw": line.raw,
        "settlement_amount_minor": line.settlement_amount_minor,
        "settlement_currency": line.settlement_currency,
        "exchange_rate": line.exchange_rate,
    }


def _line_columns(file_id: int, lines: Sequence[SettlementLine]) -> dict[str, list[Any]]:
    """The ``settlement_line`` rows of ``lines``, column by column (``insert_ignore_columns``)."""
    return {
        "settlement_file_id": [file_id] * len(lines),
        "line_no": [line.line_no for line in lines],
        "kind": [line.kind for line in lines],
        "status": [line.status for line in lines],
        "provider_reference": [line.provider_reference for line in lines],
        "merchant_reference": [line.merchant_reference for line in lines],
        "amount_minor": [line.amount_minor for line in lines],
        "fee_minor": [line.fee_minor if line.kind not in (INFO, INVALID) else None for line in lines],
        "currency": [line.currency for line in lines],
        "occurred_at": [line.occurred_at for line in lines],
        "parse_error": [line.error for line in lines],
        "raw": [line.raw for line in lines],
        "settlement_amount_minor": [line.settlement_amount_minor for line in lines],
        "settlement_currency": [line.settlement_currency for line in lines],
        "exchange_rate": [line.exchange_rate for line in lines],
    }


_PAYMENT_COLUMNS = (
    payment.c.id,
    payment.c.payment_id,
    payment.c.order_no,
    payment.c.amount_minor,
    payment.c.currency,
    payment.c.provider,
    payment.c.provider_transaction_id,
    payment.c.status,
)
_REFUND_COLUMNS = (
    refund.c.id,
    refund.c.refund_id,
    refund.c.payment_id,
    refund.c.amount_minor,
    refund.c.currency,
    refund.c.provider,
    refund.c.provider_refund_id,
    refund.c.status,
)
_KINDS = {
    CHARGE: ("payment", payment, _PAYMENT_COLUMNS, payment.c.provider_transaction_id, payment.c.payment_id),
    REFUND: ("refund", refund, _REFUND_COLUMNS, refund.c.provider_refund_id, refund.c.refund_id),
}
"""Line kind -> (local kind, table, columns read, provider reference column, our number column)."""


class _Run:
    """The matching half of one run: batches of lines in, items and effects out."""

    def __init__(self, engine: Engine, provider: str, day: date, report: Report) -> None:
        self.engine = engine
        self.provider = provider
        self.day = day
        self.report = report
        self.accounts = accounts_for(provider)
        self.tally = report.tally

    # --- lines ---------------------------------------------------------------------------------

    def batch(self, lines: list[SettlementLine], stored: int) -> None:
        """Match one stored batch (``stored``: its new lines); agreeing lines written here, the rest act one by one."""
        report = self.report
        now = utcnow()
        acting: list[tuple[SettlementLine, Local | None, Finding]] = []
        report.new_lines += stored
        report.line_count += len(lines)
        with self.engine.begin() as conn:
            for line in lines:
                if line.kind in (CHARGE, REFUND, FEE) and line.fee_minor:
                    currency = line.fee_currency
                    self.tally.fees[currency] = self.tally.fees.get(currency, 0) + line.fee_minor
            agreeing = self._write_agreeing(conn, lines, now)
            rest = [line for line in lines if line.kind != INFO and line.line_no not in agreeing]
            found = self._match(conn, rest)
            items = []
            for line in rest:
                local = found.get(line.line_no)
                finding = classify(line, local, self.accounts)
                if finding.resolve_to or finding.adjust or finding.escalate:
                    acting.append((line, local, finding))
                    continue
                items.append(self._item(line, local, finding, "none", now, with_details=False))
                self.tally.add(finding.category, line, local)
            if items:
                conn.execute(insert(reconciliation_item), items)
            self._book_conversions(conn, rest, found, now)
        for line, local, finding in acting:
            self._act(line, local, finding, report.new_lines > 0)

    def _write_agreeing(self, conn: Connection, lines: Sequence[SettlementLine], now: datetime) -> set[int]:
        """The common case in the database: lines whose record (by the provider's id) agrees in every field.

        Exactly the lines ``classify`` finds ``matched`` when matched by the
        provider's id (a test holds the two together); their items are copied
        from the stored line and the record by INSERT … SELECT instead of
        being read into Python and written back. Returns their line numbers.

        The provider's ids are UNIQUE on our side, so each line joins at most
        one record: when every line of a kind was copied (the usual case),
        the copy's row count names them all and no second query is needed.
        """
        if not lines:
            return set()
        low, high = lines[0].line_no, lines[-1].line_no
        agreeing: set[int] = set()
        for line_kind, (kind, table, _columns, ref_column, _key) in _KINDS.items():
            candidates = [item.line_no for item in lines if item.kind == line_kind]
            if not candidates:
                continue
            line = settlement_line
            source = line.join(table, ref_column == line.c.provider_reference)
            where = and_(
                line.c.settlement_file_id == self.report.file_id,
                line.c.line_no >= low,
                line.c.line_no <= high,
                line.c.kind == line_kind,
                # A converted line's item carries the conversion in its details, and its FxConverted is booked.
                line.c.settlement_currency.is_(None),
                table.c.provider.in_(self.accounts),
                table.c.amount_minor == line.c.amount_minor,
                table.c.currency == line.c.currency,
                or_(
                    and_(line.c.status == SUCCEEDED, table.c.status == PaymentStatus.SUCCEEDED.value),
                    and_(line.c.status == FAILED, table.c.status == PaymentStatus.FAILED.value),
                ),
            )
            copied = {
                "run_id": literal(self.report.run_id),
                "category": literal(RECON_MATCHED),
                "kind": line.c.kind,
                "settlement_file_id": line.c.settlement_file_id,
                "line_no": line.c.line_no,
                "payment_id": table.c.payment_id,
                "refund_id": table.c.refund_id if kind == "refund" else null(),
                "provider_reference": line.c.provider_reference,
                "merchant_reference": line.c.merchant_reference,
                "currency": line.c.currency,
                "provider_amount_minor": line.c.amount_minor,
                "local_amount_minor": table.c.amount_minor,
                "fee_minor": line.c.fee_minor,
                "provider_status": line.c.status,
                "local_status": table.c.status,
                "action": literal("none"),
                "created_at": literal(now, TS),
            }
            written = conn.execute(
                insert(reconciliation_item).from_select(
                    list(copied), select(*copied.values()).select_from(source).where(where)
                )
            ).rowcount
            if not written:
                continue
            if written == len(candidates):
                numbers = set(candidates)
            else:  # some lines of the kind disagree: which were copied (agreeing records are terminal, so unchanged)
                numbers = set(conn.execute(select(line.c.line_no).select_from(source).where(where)).scalars())
                if written != len(numbers):  # a bug if so
                    raise RuntimeError(f"agreeing lines changed under the run: {written} written, {len(numbers)} found")
            agreeing |= numbers
            for item in lines:
                if item.line_no in numbers:
                    self.tally.add_matched(item)
        return agreeing

    def _match(self, conn: Connection, lines: Sequence[SettlementLine]) -> dict[int, Local]:
        """line_no -> our record, by the provider's transaction id first, then by our number."""
        found: dict[int, Local] = {}
        for line_kind, (kind, _table, columns, ref_column, key_column) in _KINDS.items():
            subset = [line for line in lines if line.kind == line_kind]
            if not subset:
                continue
            refs = sorted({line.provider_reference for line in subset if line.provider_reference})
            by_ref = {r[ref_column.name]: r for r in _rows(conn, columns, ref_column, refs)}
            keys = sorted(
                {
                    line.merchant_reference
                    for line in subset
                    if line.merchant_reference and line.provider_reference not in by_ref
                }
            )
            by_key = {r[key_column.name]: r for r in _rows(conn, columns, key_column, keys)}
            for line in subset:
                row = by_ref.get(line.provider_reference) or by_key.get(line.merchant_reference)
                if row is not None:
                    found[line.line_no] = Local(kind, row)
        return found

    def _item(
        self,
        line: SettlementLine | None,
        local: Local | None,
        finding: Finding,
        action: str,
        now: datetime,
        *,
        with_details: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        kind = line.kind if line is not None else (CHARGE if local and local.kind == "payment" else REFUND)
        details = {"reason": finding.reason, **(extra or {})} if with_details and (finding.reason or extra) else None
        if line is not None and line.settlement_currency:
            # The item's currency and amounts are the charge's; what reached the balance, and its fee, are these.
            details = {
                **(details or {}),
                "settlement": {
                    "amount_minor": line.settlement_amount_minor,
                    "currency": line.settlement_currency,
                    "exchange_rate": line.exchange_rate,
                    "fee_minor": line.fee_minor,
                },
            }
        return {
            "run_id": self.report.run_id,
            "category": finding.category,
            "kind": kind,
            "settlement_file_id": self.report.file_id if line is not None else None,
            "line_no": line.line_no if line is not None else None,
            "payment_id": local.row["payment_id"] if local is not None else None,
            "refund_id": local.row["refund_id"] if local is not None and local.kind == "refund" else None,
            "provider_reference": line.provider_reference if line is not None else local.provider_reference,
            "merchant_reference": line.merchant_reference if line is not None else local.key,
            "currency": line.currency if line is not None else local.row["currency"],
            "provider_amount_minor": line.amount_minor if line is not None else None,
            "local_amount_minor": int(local.row["amount_minor"]) if local is not None else None,
            "fee_minor": line.fee_minor if line is not None and line.kind not in (INFO, INVALID) else None,
            "provider_status": line.status if line is not None else None,
            "local_status": local.row["status"] if local is not None else None,
            "action": action,
            "manual_review_id": None,
            "details": json.dumps(details, sort_keys=True, default=str) if details else None,
            "created_at": now,
        }

    def _act(self, line: SettlementLine, local: Local | None, finding: Finding, new_file: bool) -> None:
        """One line that needs more than an item: its own transaction, our record locked and read again."""
        with self.engine.begin() as conn:
            now = utcnow()
            if local is not None:
                local = _lock(conn, local)
                finding = classify(line, local, self.accounts)
            if finding.resolve_to is not None and local is not None:
                decision = decide(PaymentStatus(local.row["status"]), finding.resolve_to)
                if decision.verdict == Verdict.APPLY:
                    item_id = _insert_item(conn, self._item(line, local, finding, "resolved", now))
                    _resolve(conn, local, decision, item_id, line.provider_reference, now)
                    self.tally.resolved += 1
                    self.tally.add(finding.category, line, local)
                    return
                finding = Finding(RECON_MATCHED, reason=decision.reason)
            plan = None
            if finding.adjust:
                plan = self._plan_adjustment(conn, line, local if finding.category != RECON_PROVIDER_ONLY else None)
            action = "adjusted" if plan and plan.deltas else "none"
            extra = {"adjustment": plan.deltas} if plan and plan.deltas else None
            item_id = _insert_item(conn, self._item(line, local, finding, action, now, extra=extra))
            if plan and plan.deltas:
                self.tally.adjustments += len(_post_adjustments(conn, plan, item_id, self.report, now))
            # An unreadable line is escalated when its file is first stored; re-runs of that file are not news.
            if finding.escalate and (finding.category != RECON_UNREADABLE or new_file):
                # Unreadable lines have no transaction to name: one review per file, counting them.
                unreadable = finding.category == RECON_UNREADABLE
                subject = (
                    f"{self.provider}:file:{self.report.file_id}" if unreadable else subject_of(self.provider, line)
                )
                self._escalate(conn, finding, subject, item_id, local)
            self.tally.add(finding.category, line, local)

    def _plan_adjustment(self, conn: Connection, line: SettlementLine, local: Local | None) -> _Adjustment:
        """What the provider says minus what the ledger holds for the line's transaction (ours only if linked)."""
        subject = subject_of(self.provider, line)
        prefix = f"{ledger.RECONCILIATION_ADJUSTED}:{subject}:"
        held = _adjusted(conn, prefix)
        if local is not None:
            for currency, amount in _confirmed(conn, local).items():
                held[currency] = held.get(currency, 0) + amount
        says = provider_view(line)
        return _Adjustment(
            subject=subject,
            prefix=prefix,
            line=line,
            local=local,
            account_provider=local.row["provider"] if local is not None else self.provider,
            says=says,
            held=held,
            deltas=differences(says, held),
        )

    def _book_conversions(
        self, conn: Connection, lines: Sequence[SettlementLine], found: Mapping[int, Local], now: datetime
    ) -> None:
        """FxConverted for each converted line: what the conversion says minus what earlier runs booked for it.

        Independent of the line's category: whatever the receivable holds for the transaction in its own currency
        (a confirmation, or an adjustment to the provider's view), the provider converted the line's amount.
        """
        for line in lines:
            says = conversion_view(line)
            if not says:
                continue
            local = found.get(line.line_no)
            # As classify reads identity: a record of another provider, or a second transaction, is not this one.
            ours = (
                local is not None
                and local.row["provider"] in self.accounts
                and not (
                    line.provider_reference
                    and local.provider_reference
                    and local.provider_reference != line.provider_reference
                )
            )
            account = local.row["provider"] if ours else self.provider
            subject = subject_of(self.provider, line)
            prefix = f"{ledger.FX_CONVERTED}:{subject}:"
            held = _provider_lines(conn, ledger_event.c.dedupe_key.startswith(prefix, autoescape=True))
            deltas = differences(says, held)
            count = _count_prefix(conn, prefix) if deltas else 0
            for currency, delta in deltas.items():
                count += 1
                ledger.append(
                    conn,
                    event_type=ledger.FX_CONVERTED,
                    dedupe_key=f"{prefix}{count}",
                    amount_minor=abs(delta),
                    currency=currency,
                    source_type="reconciliation_run",
                    source_id=str(self.report.run_id),
                    now=now,
                    entries=ledger.conversion_entries(account, delta),
                    payment_id=local.row["payment_id"] if ours else None,
                    refund_id=local.key if ours and local.kind == "refund" else None,
                    details={
                        "subject": subject,
                        "delta": delta,
                        "amount_minor": line.amount_minor,
                        "currency": line.currency,
                        "settlement_amount_minor": line.settlement_amount_minor,
                        "settlement_currency": line.settlement_currency,
                        "exchange_rate": line.exchange_rate,
                        "settlement_file_id": self.report.file_id,
                        "line_no": line.line_no,
                    },
                )
                self.tally.conversions[currency] = self.tally.conversions.get(currency, 0) + delta

    # --- local only --------------------------------------------------------------------------

    def local_only(self) -> None:
        """Our successes confirmed on the day that no current settlement file names: one escalated item each.

        The database does the anti-join and hands back only the unsettled
        records. Pages are fixed ranges of BATCH_LINES confirmations (keyset
        on the confirmation's time and id), so no one query scans the whole
        day however few of them are unsettled.
        """
        start, end = day_bounds(self.day, DAY_ZONES.get(self.provider, UTC))
        with self.engine.connect() as conn:
            files = current_files(conn, self.provider, self.day)
        # The pages' anti-joins are the database's work and nothing else runs now: LOCAL_ONLY_WORKERS of them at
        # once, on connections of their own; the few records they find are written here, in page order.
        workers = 1 if self.engine.dialect.name == "sqlite" else LOCAL_ONLY_WORKERS
        for kind in ("payment", "refund"):
            event_type = "PaymentConfirmed" if kind == "payment" else "RefundConfirmed"

            def unsettled(page: tuple[Any, Any], kind: str = kind) -> list[Mapping[str, Any]]:
                with self.engine.connect() as conn:
                    query = self._unsettled_query(kind, files, start, end, *page)
                    return list(conn.execute(query).mappings().all())

            for rows in ordered_map(unsettled, self._pages(event_type, start, end), workers):
                if rows:
                    self._local_only_items(kind, rows)

    def _pages(self, event_type: str, start: datetime, end: datetime) -> Iterator[tuple[Any, Any]]:
        """(after, upto) keys of the day's confirmations, BATCH_LINES a page; the last page's upto is None."""
        after: tuple[datetime, int] | None = None
        while True:
            with self.engine.connect() as conn:
                upto = _page_end(conn, event_type, start, end, after, BATCH_LINES)
            yield after, upto
            if upto is None:
                return
            after = upto

    def _local_only_items(self, kind: str, rows: Sequence[Mapping[str, Any]]) -> None:
        with self.engine.begin() as conn:
            for row in rows:
                local = Local(kind, {k: v for k, v in row.items() if k not in ("confirmed_at", "event_id")})
                finding = Finding(
                    RECON_LOCAL_ONLY,
                    escalate=True,
                    reason=f"our {kind} {local.key} succeeded; no settlement file of {self.provider} has it",
                )
                item_id = _insert_item(conn, self._item(None, local, finding, "none", utcnow()))
                self._escalate(conn, finding, f"{self.provider}:{kind}:{local.key}", item_id, local)
                self.tally.add(RECON_LOCAL_ONLY, None, local)

    def _unsettled_query(
        self,
        kind: str,
        files: Sequence[int],
        start: datetime,
        end: datetime,
        after: tuple[datetime, int] | None,
        upto: tuple[datetime, int] | None,
    ) -> Any:
        """Succeeded records confirmed in [start, end), after ``after`` up to ``upto``, no current file names."""
        line_kind = CHARGE if kind == "payment" else REFUND
        _, table, columns, ref_column, key_column = _KINDS[line_kind]
        event = ledger_event
        line = settlement_line
        # Anti-joins, each an index-only probe per record (the file ids are constants). As NOT EXISTS, MariaDB
        # turned the checks into IN-subqueries and, on stale statistics after a fresh import, materialised every
        # current line for every page: 1.7 s a page of 5,000 at 100,000 lines instead of 35 ms.
        files = list(files)
        ours = line.alias("named_as_ours")
        theirs = line.alias("named_as_theirs")
        named = and_(
            ours.c.merchant_reference == key_column, ours.c.kind == line_kind, ours.c.settlement_file_id.in_(files)
        )
        # A NULL provider id joins no line, so the record counts as not named by the provider's id.
        by_ref = and_(
            theirs.c.provider_reference == ref_column,
            theirs.c.kind == line_kind,
            theirs.c.settlement_file_id.in_(files),
        )
        event_key = event.c.payment_id if kind == "payment" else event.c.refund_id
        query = (
            select(event.c.created_at.label("confirmed_at"), event.c.id.label("event_id"), *columns)
            .select_from(event.join(table, key_column == event_key).outerjoin(ours, named).outerjoin(theirs, by_ref))
            .where(
                event.c.event_type == ("PaymentConfirmed" if kind == "payment" else "RefundConfirmed"),
                event.c.created_at >= start,
                event.c.created_at < end,
                table.c.status == PaymentStatus.SUCCEEDED.value,
                table.c.provider.in_(self.accounts),
                ours.c.id.is_(None),
                theirs.c.id.is_(None),
            )
        )
        return query.where(*_key_range(after, upto))

    # --- fees -------------------------------------------------------------------------------------

    def book_fees(self) -> None:
        """One FeeCharged per currency: the day's fees in this file minus what earlier runs booked for the day."""
        with self.engine.begin() as conn:
            for currency, total in sorted(self.tally.fees.items()):
                prefix = f"{ledger.FEE_CHARGED}:{self.provider}:{self.day.isoformat()}:{currency}:"
                booked = _fees_booked(conn, prefix)
                delta = total - booked
                if not delta:
                    continue
                ledger.append(
                    conn,
                    event_type=ledger.FEE_CHARGED,
                    dedupe_key=f"{prefix}{_count_prefix(conn, prefix) + 1}",
                    amount_minor=abs(delta),
                    currency=currency,
                    source_type="reconciliation_run",
                    source_id=str(self.report.run_id),
                    now=utcnow(),
                    entries=ledger.fee_entries(self.provider, delta),
                    details={
                        "settlement_file_id": self.report.file_id,
                        "day": self.day.isoformat(),
                        "fees_in_file": total,
                        "booked_before": booked,
                    },
                )
                self.tally.fees_booked[currency] = delta

    # --- the narrow seams to the state machine and the manual queue ------------------------------

    def _escalate(self, conn: Connection, finding: Finding, subject: str, item_id: int, local: Local | None) -> None:
        """Once per subject: a manual review and an alert for what reconciliation cannot decide."""
        review_id = _escalate(conn, finding, subject, item_id, local, self.provider, self.day)
        if review_id is not None:
            self.tally.reviews += 1


@dataclass(frozen=True)
class _Adjustment:
    """ReconciliationAdjusted events to post for one line's transaction."""

    subject: str
    prefix: str
    line: SettlementLine
    local: Local | None
    account_provider: str
    says: dict[str, int]
    held: dict[str, int]
    deltas: dict[str, int]


def _post_adjustments(conn: Connection, plan: _Adjustment, item_id: int, report: Report, now: datetime) -> list[int]:
    """One ReconciliationAdjusted per currency of ``plan.deltas``, numbered on from the subject's earlier ones."""
    local = plan.local
    count = _count_prefix(conn, plan.prefix)
    posted = []
    for currency, delta in plan.deltas.items():
        count += 1
        posted.append(
            ledger.append(
                conn,
                event_type=ledger.RECONCILIATION_ADJUSTED,
                dedupe_key=f"{plan.prefix}{count}",
                amount_minor=abs(delta),
                currency=currency,
                source_type="reconciliation",
                source_id=str(item_id),
                now=now,
                entries=ledger.adjustment_entries(plan.account_provider, delta),
                payment_id=local.row["payment_id"] if local is not None else None,
                refund_id=local.key if local is not None and local.kind == "refund" else None,
                details={
                    "subject": plan.subject,
                    "delta": delta,
                    "provider_says": plan.says.get(currency, 0),
                    "ledger_held": plan.held.get(currency, 0),
                    "settlement_file_id": report.file_id,
                    "line_no": plan.line.line_no,
                    "run_id": report.run_id,
                },
            )
        )
    return posted


def _resolve(
    conn: Connection, local: Local, decision: Decision, item_id: int, provider_reference: str | None, now: datetime
) -> PaymentStatus:
    """The one place reconciliation moves a status: the state machine's decision, written by transitions."""
    return apply_decision(
        conn,
        local.kind,  # type: ignore[arg-type]
        local.row,
        decision,
        source=f"reconciliation:{item_id}",
        now=now,
        provider_reference=provider_reference,
        failure_code="failed_per_settlement" if decision.target == PaymentStatus.FAILED else None,
        details={"reconciliation_item_id": item_id},
    )


def _escalate(
    conn: Connection,
    finding: Finding,
    subject: str,
    item_id: int,
    local: Local | None,
    provider: str,
    day: date,
) -> int | None:
    """The one place reconciliation hands something to a person; the review id if this opened it.

    ``review.escalate`` gives the once-per-subject guarantee: while the
    review of (``reconciliation_<category>``, ``subject``) is open, a re-run
    of the day updates it and raises no second alert; the item links to the
    review either way.
    """
    payment_id = local.row["payment_id"] if local is not None else None
    refund_id = local.key if local is not None and local.kind == "refund" else None
    reason = f"reconciliation {provider} {day.isoformat()}: {finding.category}: {finding.reason}"
    escalation = escalate(
        conn,
        kind=f"reconciliation_{finding.category}",
        subject=subject,
        reason=reason,
        now=utcnow(),
        payment_id=payment_id,
        refund_id=refund_id,
        details={"reconciliation_item_id": item_id, "provider": provider, "day": day.isoformat()},
    )
    conn.execute(
        update(reconciliation_item)
        .where(reconciliation_item.c.id == item_id)
        .values(action="review", manual_review_id=escalation.review_id)
    )
    if not escalation.first:
        return None
    extra = {"reconciliation_item_id": item_id, "manual_review_id": escalation.review_id}
    log.warning("reconciliation: %s", reason, extra=extra)
    return escalation.review_id


# ------------------------------------------------------------------------------------------- queries


def _rows(conn: Connection, columns: Sequence[Any], column: Any, values: Sequence[str]) -> list[Mapping[str, Any]]:
    if not values:
        return []
    return list(conn.execute(select(*columns).where(column.in_(list(values)))).mappings())


def _lock(conn: Connection, local: Local) -> Local:
    table = payment if local.kind == "payment" else refund
    row = conn.execute(select(table).where(table.c.id == local.row["id"]).with_for_update()).mappings().one()
    return Local(local.kind, dict(row))


def _insert_item(conn: Connection, item: dict[str, Any]) -> int:
    return int(conn.execute(insert(reconciliation_item).values(**item)).inserted_primary_key[0])


def _provider_lines(conn: Connection, where: Any) -> dict[str, int]:
    rows = conn.execute(
        select(ledger_entry.c.currency, func.sum(ledger_entry.c.amount_minor))
        .join(ledger_event, ledger_event.c.id == ledger_entry.c.ledger_event_id)
        .where(where, ledger_entry.c.account.startswith("assets:provider:", autoescape=True))
        .group_by(ledger_entry.c.currency)
    ).all()
    return {currency: int(total) for currency, total in rows if total}


def _confirmed(conn: Connection, local: Local) -> dict[str, int]:
    """What the ledger's confirmation of ``local`` put into a provider receivable, by currency."""
    if local.kind == "payment":
        where = and_(
            ledger_event.c.payment_id == local.key,
            ledger_event.c.refund_id.is_(None),
            ledger_event.c.event_type == "PaymentConfirmed",
        )
    else:
        where = and_(ledger_event.c.refund_id == local.key, ledger_event.c.event_type == "RefundConfirmed")
    return _provider_lines(conn, where)


def _adjusted(conn: Connection, prefix: str) -> dict[str, int]:
    """What earlier adjustments of one subject put into a provider receivable, by currency."""
    return _provider_lines(conn, ledger_event.c.dedupe_key.startswith(prefix, autoescape=True))


def _fees_booked(conn: Connection, prefix: str) -> int:
    total = conn.execute(
        select(func.coalesce(func.sum(ledger_entry.c.amount_minor), 0))
        .join(ledger_event, ledger_event.c.id == ledger_entry.c.ledger_event_id)
        .where(
            ledger_event.c.dedupe_key.startswith(prefix, autoescape=True),
            ledger_entry.c.account == ledger.EXPENSE_FEES,
        )
    ).scalar_one()
    return int(total)


def _count_prefix(conn: Connection, prefix: str) -> int:
    return conn.execute(
        select(func.count()).where(ledger_event.c.dedupe_key.startswith(prefix, autoescape=True))
    ).scalar_one()


FILE_WINDOW_DAYS = 31
"""Settlement files this many days either side of a day can name its transactions (time zones, late completion)."""


def current_files(conn: Connection, provider: str | None, day: date, window_days: int = FILE_WINDOW_DAYS) -> list[int]:
    """Ids of the current (not superseded) settlement files of ``provider`` (None: all) for days around ``day``."""
    f = settlement_file
    query = select(f.c.id).where(
        f.c.superseded_at.is_(None),
        f.c.settlement_date >= day - timedelta(days=window_days),
        f.c.settlement_date <= day + timedelta(days=window_days),
    )
    if provider is not None:
        query = query.where(f.c.provider == provider)
    return list(conn.execute(query.order_by(f.c.id)).scalars())


def _key_range(after: tuple[datetime, int] | None, upto: tuple[datetime, int] | None) -> list[Any]:
    """Ledger events with (created_at, id) in (after, upto]."""
    event = ledger_event
    where = []
    if after is not None:
        where.append(or_(event.c.created_at > after[0], and_(event.c.created_at == after[0], event.c.id > after[1])))
    if upto is not None:
        where.append(or_(event.c.created_at < upto[0], and_(event.c.created_at == upto[0], event.c.id <= upto[1])))
    return where


def _page_end(
    conn: Connection,
    event_type: str,
    start: datetime,
    end: datetime,
    after: tuple[datetime, int] | None,
    size: int,
) -> tuple[datetime, int] | None:
    """The key of the ``size``-th confirmation after ``after`` (an index-only read), or None if fewer remain."""
    row = conn.execute(
        select(ledger_event.c.created_at, ledger_event.c.id)
        .where(
            ledger_event.c.event_type == event_type,
            ledger_event.c.created_at >= start,
            ledger_event.c.created_at < end,
            *_key_range(after, None),
        )
        .order_by(ledger_event.c.created_at, ledger_event.c.id)
        .offset(size - 1)
        .limit(1)
    ).first()
    return (row[0], row[1]) if row is not None else None
