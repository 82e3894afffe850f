"""The implementation of :mod:`flask_idempotency.jobs` (see its documentation)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import math
import typing as t
from time import monotonic, sleep

import sqlalchemy as sa
from flask import Flask

from .. import _telemetry as telemetry
from .._context import app_state, resolve_app
from .._contract import REPLAYED_HEADER
from .._request.steps import RECOVERY_ENVIRON_KEY, RecoveryRun
from .._storage import (
    IN_PROGRESS,
    OUTBOX_TABLE_NAME,
    Record,
    inbox,
    outbox_table,
    release_verdict,
)
from .._storage import outbox as outbox_sql
from .._storage.dialects import dialect_of
from .._storage.locks import JobLocks
from .reconcile import reconcile_record

logger = logging.getLogger("flask_idempotency")


KeepGoing = t.Callable[[], bool]


def _always() -> bool:
    return True


def positive(name: str, value: int) -> None:
    """Refuse a count below 1 (or not an int), which an engine would read as no
    limit (SQLite's ``LIMIT -1``) or refuse mid-run, and a batch loop as never done."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a whole number of at least 1, not {value!r}")


@dataclasses.dataclass
class PurgeReport:
    """What one run of :func:`purge_expired` did."""

    deleted: int = 0  #: records deleted (or, with ``dry_run``, that would be)
    batches: int = 0  #: transactions used
    inbox_deleted: int = 0  #: expired inbox ids deleted (or, with ``dry_run``, that would be)
    inbox_batches: int = 0  #: transactions used for the inbox
    #: published outbox events past ``IDEMPOTENCY_OUTBOX_RETENTION`` deleted
    #: (or, with ``dry_run``, that would be)
    outbox_deleted: int = 0
    outbox_batches: int = 0  #: transactions used for the outbox

    def __str__(self) -> str:
        text = f"deleted {self.deleted} expired record(s) in {self.batches} batch(es)"
        if self.inbox_deleted:
            text += f"; {self.inbox_deleted} expired inbox id(s) in {self.inbox_batches} batch(es)"
        if self.outbox_deleted:
            text += (
                f"; {self.outbox_deleted} published outbox event(s) in "
                f"{self.outbox_batches} batch(es)"
            )
        return text


#: Cleanup's default pause after each full batch, as a multiple of the time the
#: batch took: 1.0 works half the time. Measured (bench/cleanup.py, BENCHMARKS.md):
#: the writers meanwhile wait on no lock of the cleanup's (it skips locked rows, and
#: theirs are new), they wait for the cores and the WAL its batches keep busy.
PURGE_PAUSE = 1.0


def _in_batches(
    delete: t.Callable[[], int], size: int, keep_going: KeepGoing, pause: float
) -> tuple[int, int, bool]:
    """Run ``delete`` (one batch in its own transaction; the number it deleted)
    until a batch comes back short or ``keep_going()`` says stop: rows deleted,
    batches, and whether to go on. After each full batch, sleep ``pause`` times
    as long as it took."""
    deleted = batches = 0
    while True:
        started = monotonic()
        count = delete()
        took = monotonic() - started
        batches += 1
        deleted += count
        if count < size:
            return deleted, batches, True
        if not keep_going():
            return deleted, batches, False
        # The batch's own duration measures the load it competes with: a busy
        # database (cores, WAL, disk) slows the batch and lengthens its pause,
        # so the cleanup yields the more the busier the writers are.
        if pause:
            sleep(took * pause)


def purge_expired(
    app: Flask | None = None,
    *,
    batch_size: int | None = None,
    dry_run: bool = False,
    keep_going: KeepGoing = _always,
    pause: float = PURGE_PAUSE,
) -> PurgeReport:
    """Delete expired records in batches, each its own short transaction.

    Writers are never blocked for longer than one batch, and several cleaners can
    run at once: on PostgreSQL each skips the rows another holds. Stops when a
    batch comes back short, or when ``keep_going()`` says so (the scheduler's
    lock renewal). ``dry_run`` only counts. ``batch_size`` defaults to
    ``IDEMPOTENCY_PURGE_BATCH``. Each batch starts at the latest expiry the
    previous one deleted. Expired ids of the inbox
    (:mod:`flask_idempotency.inbox`) are deleted the same way, after the
    records, and then outbox events published more than
    ``IDEMPOTENCY_OUTBOX_RETENTION`` ago
    (:func:`flask_idempotency.relay.purge_published`; pending and parked
    events stay), each when its table exists. A ``batch_size`` below 1 raises
    :class:`ValueError` (before anything is deleted).

    After each full batch the cleanup pauses ``pause`` times as long as the
    batch took (by default as long: it works at most half the time, and
    yields more the slower a busy database makes its batches), so that the
    requests writing meanwhile keep their latency; ``pause=0`` deletes flat
    out (a maintenance window). A negative, infinite or NaN ``pause`` raises
    :class:`ValueError` (before anything is deleted).
    """
    if batch_size is not None:
        positive("batch_size", batch_size)
    if isinstance(pause, bool) or not isinstance(pause, int | float) or not 0 <= pause < math.inf:
        raise ValueError(f"pause must be a finite number of at least 0, not {pause!r}")
    app = resolve_app(app)
    report = PurgeReport()
    with app.app_context():
        state = app_state(app)
        size = batch_size or state.settings.purge_batch
        engine = state.db.engine
        with engine.connect() as conn:
            has_inbox = inbox.table_exists(conn)
            has_outbox = sa.inspect(conn).has_table(OUTBOX_TABLE_NAME)
        outbox = outbox_table(state.db.metadata)

        # Expiry is judged by the database's clock (state.now), read in each
        # batch's transaction: a host whose clock runs ahead cannot purge a
        # record still inside its retention window.
        def outbox_cutoff(conn: sa.Connection) -> dt.datetime:
            return state.now(conn) - state.settings.outbox_retention

        if dry_run:
            with engine.connect() as conn:
                now = state.now(conn)
                report.deleted = state.store.count_expired(conn, now)
                if has_inbox:
                    report.inbox_deleted = inbox.count_expired(conn, now)
                if has_outbox:
                    report.outbox_deleted = outbox_sql.count_purgeable(
                        conn, outbox, outbox_cutoff(conn)
                    )
            return report
        # Where the previous batch ended (its latest expires_at): the next one
        # starts there, not at the oldest entry of the expires_at index, which
        # still holds those of the records deleted so far until vacuum.
        after: list[dt.datetime | None] = [None]

        @contextlib.contextmanager
        def own_batch() -> t.Iterator[sa.Connection]:
            # A batch's own transaction, committed without waiting for its flush
            # where the engine allows it (Dialect.defer_flush): here, not in the
            # batch's statements, which a caller may run in a transaction of its
            # own whose other writes must stay durable.
            with engine.begin() as conn:
                dialect_of(conn).defer_flush(conn)
                yield conn

        def records() -> int:
            with own_batch() as conn:
                batch = state.store.purge_batch(conn, state.now(conn), size, after=after[0])
            after[0] = batch.last
            return batch.rows

        def inbox_ids() -> int:
            with own_batch() as conn:
                return inbox.purge_batch(conn, state.now(conn), size)

        def published() -> int:
            with own_batch() as conn:
                return outbox_sql.purge_published_batch(conn, outbox, outbox_cutoff(conn), size)

        report.deleted, report.batches, going = _in_batches(records, size, keep_going, pause)
        if has_inbox and going:
            report.inbox_deleted, report.inbox_batches, going = _in_batches(
                inbox_ids, size, keep_going, pause
            )
        if has_outbox and going:
            report.outbox_deleted, report.outbox_batches, going = _in_batches(
                published, size, keep_going, pause
            )
    if report.deleted or report.inbox_deleted or report.outbox_deleted:
        logger.info("cleanup: %s", report)
        telemetry.job_rows("cleanup", report.deleted + report.inbox_deleted + report.outbox_deleted)
    return report


@dataclasses.dataclass
class RecoveryReport:
    """What one run of :func:`recover_abandoned` did, by record."""

    #: driven to completion from the stored request, or (a view that committed
    #: work of its own, then never finished) with the failure its commit stored
    completed: int = 0
    released: int = 0  #: deleted, so the client's next retry runs again
    skipped: int = 0  #: finished or reclaimed by someone else meanwhile
    kept: int = 0  #: left for the client's retry (finished steps, or derived keys handed out)
    #: left alone: their sealed data does not open (encryption at rest), each logged
    unreadable: int = 0

    def __str__(self) -> str:
        text = (
            f"completed {self.completed}, released {self.released}, kept {self.kept}, "
            f"skipped {self.skipped}"
        )
        return f"{text}, unreadable {self.unreadable}" if self.unreadable else text


def _quoted(key: str) -> str:
    """The key as a Structured Field string, safe whatever characters it has."""
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _rerun(app: Flask, record: Record) -> bool | None:
    """Re-run the stored request through the app; ``True`` if it completed,
    ``None`` if someone else finished or holds it, ``False`` if it failed."""
    assert record.request_method is not None
    assert record.request_path is not None
    settings = app_state(app).settings
    headers = {settings.header: _quoted(record.key)}
    if record.request_content_type:
        headers["Content-Type"] = record.request_content_type
    client = app.test_client()
    run = RecoveryRun(
        record.scope, record.request_hash, record.rules_version, record.request_digest
    )
    # An app context of its own, as a served request has: its own session, ended
    # (and its locks freed) when the re-run is over, not shared with the job's.
    with app.app_context():
        response = client.open(
            record.request_path,
            method=record.request_method,
            data=record.request_body or b"",
            headers=headers,
            environ_overrides={RECOVERY_ENVIRON_KEY: run},
        )
    if "reconciled" in run.told:
        return True  # the app's reconcile hook rebuilt its answer (answered 409: not run)
    if response.status_code == 409:
        return None
    if response.status_code < 400 and response.headers.get(REPLAYED_HEADER) != "true":
        return True
    logger.warning(
        "recovery of %r in scope %r answered %d", record.key, record.scope, response.status_code
    )
    return False


def recover_abandoned(
    app: Flask | None = None, *, limit: int = 100, keep_going: KeepGoing = _always
) -> RecoveryReport:
    """Move in-progress records whose lease has ended forward, so none stays stuck.

    A record of a route declared with ``recover=True`` is driven to completion:
    its stored request is re-run through the app with the same key and scope,
    resuming from its recovery points, and the response is stored for the
    client's retry. A record whose view committed work of its own is completed
    with the answer the app's reconcile hook rebuilds (``reconcile=``), else
    with the answer that commit stored (500 ``failed-after-commit``): the
    operation happened and never runs again. Any other abandoned record, or
    one whose re-run fails, is released (deleted), so the client's next retry
    runs the view again, unless it holds recovery points: then it is kept (its
    lease has ended), and the client's retry resumes after its finished steps.
    What it releases, it releases by the one rule every entry point follows
    (the CLI's ``release`` too): never a live lease, recovery points or a
    committed outcome. At most ``limit`` records per call (below 1:
    :class:`ValueError`).
    """
    positive("limit", limit)
    app = resolve_app(app)
    report = RecoveryReport()
    with app.app_context():
        state = app_state(app)
        engine = state.db.engine
        # Leases are judged by the database's clock (state.now), read in each
        # transaction: a host whose clock runs ahead cannot see a live lease as
        # over and release an operation that is running.
        with engine.connect() as conn:
            abandoned = state.store.find_abandoned(conn, state.now(conn), limit)
        for record in abandoned:
            if not keep_going():
                break
            if record.view_committed:
                # The operation happened: never re-run nor released, but
                # completed with the answer the app's reconcile hook rebuilds,
                # else with the one the view's commit stored (clear columns
                # only: settled even when its sealed ones do not open).
                if reconcile_record(app, record).rebuilt:
                    report.completed += 1
                    continue
                with engine.begin() as conn:
                    settled = state.store.settle_committed(
                        conn,
                        record.scope,
                        record.key,
                        record.fencing_token,
                        state.now(conn),
                        retention=record.retention,
                    )
                if settled:
                    report.completed += 1
                else:
                    report.skipped += 1
                continue
            if record.unreadable is not None:
                # Neither re-run (its request is sealed) nor released (its
                # points may say the operation must resume): it waits for its
                # key to be configured again, or for its expiry.
                logger.error("lease recovery left a record alone: %s", record.unreadable)
                report.unreadable += 1
                continue
            outcome = _rerun(app, record) if record.recoverable else False
            if outcome is True:
                report.completed += 1
                continue
            if outcome is None:
                report.skipped += 1
                continue
            with engine.begin() as conn:
                # A failed re-run reclaimed the record (new token) before it
                # failed: release what is there now, if still abandoned.
                current = (
                    state.store.load(conn, record.scope, record.key, unreadable_ok=True)
                    if record.recoverable
                    else record
                )
                # The rule every entry point follows (the CLI's release too):
                # never a live lease, recovery points or a committed outcome.
                now = state.now(conn)
                released = (
                    current is not None
                    and release_verdict(current, now).allowed
                    and state.store.delete_releasable(conn, current, now)
                )
            if released:
                report.released += 1
            elif (
                current is not None
                and current.status == IN_PROGRESS
                and not current.lease_live(now)
            ):
                # Left for the client's retry: finished steps, or derived keys
                # handed out (a kept operation, see Flow._keep_operation).
                report.kept += 1
            else:
                report.skipped += 1
        state.db.session.remove()
    if abandoned:
        logger.info("lease recovery: %s", report)
        telemetry.job_rows("lease_recovery", report.completed + report.released)
    return report


#: The metrics' ``idempotency.job`` of the built-in jobs; an app's own keep their names.
JOB_NAMES = {"purge": "cleanup", "recover": "lease_recovery", "relay": "outbox_relay"}


def job_intervals(app: Flask) -> dict[str, dt.timedelta]:
    """The built-in jobs ``app`` schedules (by lock name), with their intervals:
    the outbox relay only with an ``IDEMPOTENCY_PUBLISHER``."""
    settings = app_state(app).settings
    every = {"purge": settings.purge_every, "recover": settings.recover_every}
    if app.config.get("IDEMPOTENCY_PUBLISHER") is not None:
        every["relay"] = settings.relay_every
    return every


def job_runs(app: Flask) -> dict[str, dict[str, t.Any]] | None:
    """When each job last ran, in any process (the job locks' table, which every
    scheduled run goes through: the in-process schedulers of several app
    processes, a separate ``flask idempotency scheduler``; the commands run by
    hand take no lock and are not counted), by lock
    name: ``job`` (the name the metrics use), ``every_s`` (this app's interval;
    ``None`` for a job it does not schedule), ``last_started_at``,
    ``last_finished_at`` (ISO 8601, the database's clock; ``None``: never) and
    ``running`` (its lock is held now). ``None`` when the table does not exist.
    One small read, for operators."""
    state = app_state(app)
    every = job_intervals(app)
    locks = JobLocks(state.job_lock_table)
    with state.db.engine.connect() as conn:
        if not sa.inspect(conn).has_table(state.job_lock_table.name):
            return None
        now = state.now(conn)
        runs = locks.runs(conn)
    found: dict[str, dict[str, t.Any]] = {}
    for name in [*every, *sorted(set(runs) - set(every))]:
        started, finished, until = runs.get(name, (None, None, None))
        interval = every.get(name)
        found[name] = {
            "job": JOB_NAMES.get(name, name),
            "every_s": interval.total_seconds() if interval is not None else None,
            "last_started_at": started.isoformat() if started is not None else None,
            "last_finished_at": finished.isoformat() if finished is not None else None,
            "running": until is not None and until > now,
        }
    return found
