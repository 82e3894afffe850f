"""Erasure (``idem.erase``, ``flask idempotency erase``): a scope's records,
or one key's, made tombstones, and their outbox events emptied, in bounded
batches, each its own short transaction (:mod:`.._storage.erasure` has the
statements and what they re-check)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
import typing as t

import sqlalchemy as sa
from flask import Flask

from .._context import AppState, app_state, resolve_app
from .._storage import outbox as outbox_sql
from .._storage import outbox_table
from .._storage.erasure import (
    Batch,
    after_erasure,
    already_erased,
    erase_events,
    erase_records,
    overwriting,
    rewrite_tables,
)
from .jobs import positive

logger = logging.getLogger("flask_idempotency")

#: ``settle=``: seconds, a timedelta, or ``None`` (no second pass).
Settle = dt.timedelta | float | None


class Options(t.TypedDict, total=False):
    """:meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>`'s keyword arguments."""

    #: Rows per transaction (default ``IDEMPOTENCY_PURGE_BATCH``).
    batch: int | None
    #: Seconds or a timedelta to wait before the second pass; ``None``: none.
    settle: Settle


#: The most rows one batch takes (``batch=``, ``--batch``).
MAX_ERASE_BATCH = 10_000


@dataclasses.dataclass(frozen=True)
class ErasureReport:
    """What one erasure did (:meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>`).

    Counts of this run only: a second run over the same scope erases nothing
    new and reports 0 (tombstones are not counted again)."""

    #: Records made tombstones.
    erased: int = 0
    #: Records left as they were: in progress under a live lease (running now),
    #: or changed between the batch's read and its update. Run it again later.
    skipped: int = 0
    #: Outbox events (published or parked) whose payload and headers were erased.
    events_erased: int = 0
    #: Outbox events left as they were: pending (the relay must publish them
    #: first), or changed meanwhile. Run it again once the relay has sent them.
    events_skipped: int = 0
    #: Transactions used, records' and events' together.
    batches: int = 0
    #: Tombstones the scope (or key) already held when this run began.
    already_erased: int = 0
    #: Of :attr:`erased`, the records the second pass (``settle=``) erased:
    #: created before the erasure began, by requests still running then.
    settled: int = 0

    @property
    def complete(self) -> bool:
        """Nothing was skipped: everything found was erased."""
        return self.skipped == 0 and self.events_skipped == 0

    @property
    def matched(self) -> int:
        """Records of the scope (or key) this run found, tombstones included: 0
        means the scope names nothing kept (check its exact spelling)."""
        return self.erased + self.skipped + self.already_erased

    def __str__(self) -> str:
        settled = f" ({self.settled} by the second pass)" if self.settled else ""
        return (
            f"erased {self.erased} record(s){settled}, skipped {self.skipped} (in progress), "
            f"{self.already_erased} already erased; erased {self.events_erased} outbox "
            f"event(s), skipped {self.events_skipped} (pending); in {self.batches} batch(es)"
        )


def _checked_text(name: str, value: t.Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, not {value!r}")
    return value


def erase(
    app: Flask | None,
    scope: str,
    key: str | None = None,
    *,
    batch: int | None = None,
    settle: Settle = None,
) -> ErasureReport:
    """Erase the records of ``scope`` (only ``key``'s, when given) and the outbox
    events they own; see :meth:`Idempotency.erase <flask_idempotency.Idempotency.erase>`.
    An empty scope or key, a batch below 1 or above :data:`MAX_ERASE_BATCH`, or a
    negative ``settle``, raises :class:`ValueError` before anything is erased.

    ``settle`` (seconds or a timedelta): after the first pass, wait that long and
    erase again the scope's records created before the erasure began (on the
    database's clock) that were not tombstones yet: a request already running
    when the erasure started is invisible to it until it commits."""
    _checked_text("scope", scope)
    if key is not None:
        _checked_text("key", key)
    if batch is not None:
        positive("batch", batch)
        if batch > MAX_ERASE_BATCH:
            raise ValueError(f"batch must be at most {MAX_ERASE_BATCH}, not {batch!r}")
    wait = _seconds(settle)
    app = resolve_app(app)
    with app.app_context():
        state = app_state(app)
        size = batch or state.settings.purge_batch
        with state.db.engine.connect() as conn:
            started = state.now(conn)
            already = already_erased(conn, state.store.table, scope, key)
        erased, skipped, batches = _records(state, scope, key, size)
        settled = 0
        if wait is not None:
            time.sleep(wait)
            settled, skipped, more = _records(state, scope, key, size, before=started)
            erased, batches = erased + settled, batches + more
        events_erased, events_skipped, event_batches = _events(state, scope, key, size)
        after_erasure(state.db.engine)
    report = ErasureReport(
        erased, skipped, events_erased, events_skipped, batches + event_batches, already, settled
    )
    which = "" if key is None else f" key {key!r}"
    logger.info("erasure of scope %r%s: %s", scope, which, report)
    if report.matched == 0 and report.events_erased == 0:
        logger.warning("erasure: no record of scope %r%s (check its exact spelling)", scope, which)
    return report


def reclaim(app: Flask | None) -> list[str]:
    """Rewrite the record table (and the outbox's, when it exists) so that no
    erased row version stays in the database's files: SQLite ``VACUUM``,
    PostgreSQL ``VACUUM FULL`` (which locks each table while it runs),
    MariaDB/MySQL ``OPTIMIZE TABLE``. The tables rewritten, by name."""
    app = resolve_app(app)
    with app.app_context():
        state = app_state(app)
        engine = state.db.engine
        tables = [state.store.table]
        outbox = outbox_table(state.db.metadata)
        with engine.connect() as conn:
            if sa.inspect(conn).has_table(outbox.name, schema=outbox.schema):
                tables.append(outbox)
        rewrite_tables(engine, tables)
    return [table.name for table in tables]


def _seconds(settle: Settle) -> float | None:
    if settle is None:
        return None
    seconds = settle.total_seconds() if isinstance(settle, dt.timedelta) else settle
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"settle must be seconds (>= 0) or a timedelta, not {settle!r}")
    return float(seconds)


def _records(
    state: AppState, scope: str, key: str | None, size: int, before: dt.datetime | None = None
) -> tuple[int, int, int]:
    """The records' batches, each in its own transaction, judged by the database's
    clock; with freed space overwritten where the engine can (SQLite)."""
    erased = skipped = batches = 0
    after: str | None = None
    table = state.store.table
    while True:
        with state.db.engine.begin() as conn, overwriting(conn):
            now = state.now(conn)
            done = erase_records(conn, table, scope, key, now, size, after, created_before=before)
        batches += 1
        erased, skipped = erased + done.erased, skipped + done.skipped
        if done.last is None:
            return erased, skipped, batches
        after = done.last


def _events(state: AppState, scope: str, key: str | None, size: int) -> tuple[int, int, int]:
    """The outbox's batches, when the table exists; an outbox without the owner
    columns (an earlier release's) cannot say which events an operation owns:
    a WARNING says so, and none is erased."""
    table = outbox_table(state.db.metadata)
    engine = state.db.engine
    with engine.connect() as conn:
        if not sa.inspect(conn).has_table(table.name, schema=table.schema):
            return 0, 0, 0
        absent = outbox_sql.absent_columns(conn, table)
    if absent.intersection(outbox_sql.OWNER):
        logger.warning(
            "erasure: %s has no owner columns (an earlier release's table): its events "
            "were not erased; add the columns (see the changelog) and erase again",
            table.name,
        )
        return 0, 0, 0
    erased = skipped = batches = 0
    after: int | None = None
    trace = outbox_sql.TRACE_CONTEXT not in absent
    while True:
        with engine.begin() as conn, overwriting(conn):
            done: Batch = erase_events(conn, table, scope, key, size, after, trace_context=trace)
        batches += 1
        erased, skipped = erased + done.erased, skipped + done.skipped
        if done.last is None:
            return erased, skipped, batches
        after = done.last
