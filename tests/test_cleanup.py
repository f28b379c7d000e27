"""cleanup: archive, then delete, old processed and rejected callback rows; never anything else."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import func, select, update

from compensator import cleanup
from payments.escalation.review import escalate
from payments.inbound.callbacks import process_callback, reject_callback, store_callback
from payments.infra import retention
from payments.infra.backoff import RetryPolicy
from payments.infra.db import utcnow
from payments.infra.schema import ledger_entry, ledger_event, payment_callback_log, processed_event
from payments.providers import build_providers
from payments.runtime import build_runtime
from payments.states import CallbackStatus
from tests.stack import Stack, db_url
from tests.support import create_payment, make_settings, sandbox_event, signed

OLD = timedelta(days=100)


def _runtime(engine, tmp_path, **overrides):  # noqa: ANN001, ANN003, ANN202
    archive_dir = tmp_path / "archive"
    settings = make_settings(database_url=db_url(engine), archive_dir=str(archive_dir), **overrides)
    return build_runtime(settings, engine=engine)


def _rows(engine) -> dict[int, dict]:  # noqa: ANN001
    with engine.connect() as conn:
        return {r.id: dict(r._mapping) for r in conn.execute(select(payment_callback_log))}


def _count(engine, table) -> int:  # noqa: ANN001
    with engine.connect() as conn:
        return conn.execute(select(func.count()).select_from(table)).scalar_one()


def _stored(engine, age: timedelta, status: CallbackStatus | None = None) -> int:  # noqa: ANN001
    """A callback received ``age`` ago; processed for real (status 1), rejected for real (3), or set to ``status``."""
    settings = make_settings()
    received = utcnow() - age
    if status is CallbackStatus.REJECTED:
        log_id = store_callback(engine, provider="sandbox", body=b"{}", headers={}, remote_addr=None, now=received)
        assert reject_callback(engine, log_id, "invalid_signature: test")
        return log_id
    # Signed when it was received: processing verifies against the receipt time.
    body, headers = signed(
        sandbox_event(create_payment(engine)), timestamp=int(received.replace(tzinfo=UTC).timestamp())
    )
    log_id = store_callback(
        engine, provider="sandbox", body=body, headers=headers, remote_addr="10.0.0.9", now=received
    )
    if status is CallbackStatus.PROCESSED:
        assert process_callback(engine, build_providers(settings), log_id, RetryPolicy()).value == "applied"
    elif status is not None:
        with engine.begin() as conn:
            conn.execute(update(payment_callback_log).where(payment_callback_log.c.id == log_id).values(status=status))
    return log_id


def test_it_no_ops_on_an_empty_database(engine, tmp_path):
    assert cleanup.run_once(_runtime(engine, tmp_path)) == 0
    assert not (tmp_path / "archive").exists()


def test_it_archives_and_deletes_only_old_processed_and_rejected_rows(engine, tmp_path):
    old_done = _stored(engine, OLD, CallbackStatus.PROCESSED)
    old_rejected = _stored(engine, OLD, CallbackStatus.REJECTED)
    unfinished = {
        _stored(engine, OLD): "pending",
        _stored(engine, OLD, CallbackStatus.FAILED): "failed",
        _stored(engine, OLD, CallbackStatus.GAVE_UP): "gave up",
    }
    young = {
        _stored(engine, timedelta(days=20), CallbackStatus.PROCESSED),
        _stored(engine, timedelta(days=20), CallbackStatus.REJECTED),
    }
    reviewed = _stored(engine, OLD, CallbackStatus.PROCESSED)
    with engine.begin() as conn:  # a manual review names it: its evidence stays
        escalate(
            conn,
            kind="conflicting_report",
            subject=f"callback:{reviewed}",
            reason="t",
            now=utcnow(),
            callback_log_id=reviewed,
        )
    before = _rows(engine)
    ledger = (_count(engine, ledger_event), _count(engine, ledger_entry), _count(engine, processed_event))

    deleted = cleanup.run_once(_runtime(engine, tmp_path))

    after = _rows(engine)
    assert deleted == 2 and set(before) - set(after) == {old_done, old_rejected}
    for log_id in [*unfinished, *young, reviewed]:
        assert after[log_id] == before[log_id]  # untouched, byte for byte
    assert (_count(engine, ledger_event), _count(engine, ledger_entry), _count(engine, processed_event)) == ledger
    # Every deleted row is in an archive, exactly as it was, and reads back.
    for log_id in (old_done, old_rejected):
        assert retention.find_archived(tmp_path / "archive", log_id) == before[log_id]
    assert bytes(retention.find_archived(tmp_path / "archive", old_done)["callback_data"]) == bytes(
        before[old_done]["callback_data"]
    )


def test_retention_of_zero_days_keeps_a_kind(engine, tmp_path):
    done = _stored(engine, OLD, CallbackStatus.PROCESSED)
    rejected = _stored(engine, OLD, CallbackStatus.REJECTED)
    assert cleanup.run_once(_runtime(engine, tmp_path, callback_retention_days=0)) == 1
    assert set(_rows(engine)) == {done} and rejected not in _rows(engine)


def test_it_works_in_small_batches_one_file_each_with_its_sha256(engine, tmp_path):
    ids = [_stored(engine, OLD, CallbackStatus.REJECTED) for _ in range(5)]
    assert cleanup.run_once(_runtime(engine, tmp_path, cleanup_batch_size=2)) == 5
    archives = sorted((tmp_path / "archive").glob("*.jsonl.gz"))
    assert len(archives) == 3 and all(p.with_name(p.name + ".sha256").exists() for p in archives)
    assert sorted(r["id"] for p in archives for r in retention.read_archive(p)) == ids
    assert not list((tmp_path / "archive").glob("*.tmp"))


def test_a_damaged_archive_is_refused(engine, tmp_path):
    _stored(engine, OLD, CallbackStatus.REJECTED)
    cleanup.run_once(_runtime(engine, tmp_path))
    (archive,) = (tmp_path / "archive").glob("*.jsonl.gz")
    data = gzip.decompress(archive.read_bytes()).replace(b"invalid_signature", b"invalid_signaturX")
    archive.write_bytes(gzip.compress(data))
    with pytest.raises(retention.ArchiveCorrupt):
        list(retention.read_archive(archive))
    archive.with_name(archive.name + ".sha256").unlink()
    with pytest.raises(retention.ArchiveCorrupt):
        list(retention.read_archive(archive))


def test_dry_run_counts_and_changes_nothing(mariadb, tmp_path):
    _stored(mariadb, OLD, CallbackStatus.PROCESSED)
    _stored(mariadb, OLD, CallbackStatus.REJECTED)
    _stored(mariadb, OLD, CallbackStatus.REJECTED)
    before = _rows(mariadb)
    archive_dir = tmp_path / "archive"
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), ARCHIVE_DIR=str(archive_dir)) as stack:
        done = stack.run("-m", "compensator", "cleanup", "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "1 processed callback rows due" in done.stdout and "2 rejected callback rows due" in done.stdout
    assert _rows(mariadb) == before and not archive_dir.exists()


def test_a_crash_between_archive_and_delete_loses_nothing_and_duplicates_harmlessly(mariadb, tmp_path):
    ids = [_stored(mariadb, OLD, CallbackStatus.PROCESSED) for _ in range(3)]
    before = _rows(mariadb)
    archive_dir = tmp_path / "archive"
    with Stack(tmp_path, DATABASE_URL=db_url(mariadb), ARCHIVE_DIR=str(archive_dir)) as stack:
        killed = stack.run("-m", "compensator", "cleanup", "--once", FAILPOINTS="cleanup.after_archive")
        assert killed.returncode == -9, killed.stderr
        # Archived and fsynced, not deleted: every row still in the database, the archive complete.
        assert _rows(mariadb) == before
        (first,) = archive_dir.glob("*.jsonl.gz")
        assert [r["id"] for r in retention.read_archive(first)] == ids
        done = stack.run("-m", "compensator", "cleanup", "--once")
    assert done.returncode == 0 and "cleanup: 3" in done.stdout, done.stderr
    assert _rows(mariadb) == {}
    archives = sorted(archive_dir.glob("*.jsonl.gz"))
    assert len(archives) == 2  # the rows twice, identical: keyed by id, nothing lost, nothing contradicting
    by_id: dict[int, list[dict]] = {}
    for path in archives:
        for row in retention.read_archive(path):
            by_id.setdefault(row["id"], []).append(row)
    assert sorted(by_id) == ids
    assert all(copies == [before[i], before[i]] for i, copies in by_id.items())


_value = st.one_of(st.none(), st.integers(-(2**62), 2**62), st.text(max_size=30))


@given(
    body=st.binary(max_size=200),
    extras=st.dictionaries(st.sampled_from(["provider", "result", "headers", "order_no"]), _value),
    when=st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1)),
)
def test_an_archive_line_reads_back_as_the_row_it_was(body, extras, when):
    row = {"id": 7, "callback_data": body, "create_time": when, "update_time": when, "last_retry_time": None, **extras}
    assert retention.decode_row(retention.encode_row(row)) == row


def test_archives_are_private_to_their_owner_whatever_the_umask_or_directory_had(engine, tmp_path):
    import os
    import stat

    _stored(engine, OLD, CallbackStatus.REJECTED)
    archive_dir = tmp_path / "archive"
    archive_dir.mkdir(mode=0o755)
    os.chmod(archive_dir, 0o755)  # made by hand, world-listable
    previous = os.umask(0o000)  # the loosest umask a service manager could start us with
    try:
        assert cleanup.run_once(_runtime(engine, tmp_path)) == 1
    finally:
        os.umask(previous)
    assert stat.S_IMODE(archive_dir.stat().st_mode) == 0o700
    written = sorted(archive_dir.iterdir())
    assert len(written) == 2  # the archive and its .sha256
    for path in written:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name


def test_deliveries_refused_for_their_source_have_their_own_shorter_retention(engine, tmp_path):
    received = utcnow() - timedelta(days=10)

    def refused() -> int:
        reason = "source_not_allowed: source 198.51.100.7 is outside SANDBOX_SOURCE_CIDRS"
        return store_callback(
            engine,
            provider="sandbox",
            body=b"{}",
            headers={},
            remote_addr="198.51.100.7",
            now=received,
            rejected=reason,
        )

    first = refused()
    rejected = store_callback(engine, provider="sandbox", body=b"{}", headers={}, remote_addr=None, now=received)
    assert reject_callback(engine, rejected, "invalid_signature: test")

    runtime = _runtime(engine, tmp_path, rejected_retention_days=30, refused_retention_days=7)
    assert cleanup.dry_run(runtime) == {"processed": 0, "rejected": 0, "refused": 1}
    assert cleanup.run_once(runtime) == 1
    assert set(_rows(engine)) == {rejected}  # a signature rejection may yet be re-verified: kept 30 days
    assert retention.find_archived(tmp_path / "archive", first)["remote_addr"] == "198.51.100.7"
    # And the other way round: refused rows kept longer than rejected ones are not swept with them.
    second = refused()
    assert cleanup.run_once(_runtime(engine, tmp_path, rejected_retention_days=5, refused_retention_days=0)) == 1
    assert set(_rows(engine)) == {second}
