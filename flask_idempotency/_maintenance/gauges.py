"""What the observable gauges report, read from one app's database: the
records (live, in flight, past their lease), the outbox (unpublished, parked,
the oldest unpublished event's age) and the inbox (ids kept), each table when
it exists. :mod:`flask_idempotency._telemetry` decides when to read (at most
once per ``IDEMPOTENCY_METRICS_INTERVAL`` per process) and what a failure
means (no figures for that interval).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t
import weakref

import sqlalchemy as sa
from flask import Flask

from .. import _telemetry as telemetry
from .._context import app_state
from .._storage import INBOX_TABLE_NAME, OUTBOX_TABLE_NAME, as_utc, outbox_table
from .._storage import inbox as inbox_sql
from .._storage import outbox as outbox_sql
from .._telemetry import figures


def watch(app: Flask) -> None:
    """Report ``app``'s figures through the gauges (``init_app``, once per app).

    The read holds the app weakly (a process may make and drop apps: tests)
    and runs in its app context, on its engine: after a fork, the child's
    reads are its own."""
    state = app_state(app)
    try:
        with app.app_context():
            url: sa.URL | None = state.db.engine.url
    except Exception:  # no database configured yet: the app's own id tells it apart
        url = None
    table = state.store.table.name
    identity = f"{url.render_as_string(hide_password=True) if url else id(app)}|{table}"
    namespace = url.database if url is not None else None
    reference = weakref.ref(app)

    def read() -> dict[str, float] | None:
        found = reference()
        return None if found is None else read_figures(found)

    telemetry.watch_database(
        identity,
        namespace,
        read,
        state.settings.metrics_interval.total_seconds(),
        alive=lambda: reference() is not None,
        # The bound readiness waits for the database: the same judgement.
        timeout=state.settings.ready_timeout.total_seconds(),
    )


@dataclasses.dataclass(frozen=True)
class KeyStats:
    """The record table's figures at one moment (:meth:`Idempotency.stats`).

    ``live``, ``in_progress`` and ``past_lease`` are what the gauges
    ``idempotency.records.live``, ``.in_flight`` and ``.past_lease`` report: one
    query, judged by the database's clock.
    """

    #: Records within their retention (completed, in progress, or erased tombstones).
    live: int
    #: Of those, the ones in progress (a request running, or abandoned).
    in_progress: int
    #: Of those in progress, the ones whose lease has ended: abandoned, awaiting
    #: a retry or the lease recovery job.
    past_lease: int
    #: Records past their retention, not yet deleted by cleanup.
    expired_awaiting_cleanup: int
    #: When the oldest live record in progress was created (``None``: none).
    oldest_in_progress: dt.datetime | None
    #: The database's time the figures were read at.
    read_at: dt.datetime

    @property
    def completed(self) -> int:
        """Live records completed (replayed to a retry)."""
        return self.live - self.in_progress


def key_stats(app: Flask) -> KeyStats:
    """``app``'s record table figures (raises on a database error, a missing table too)."""
    with app.app_context():
        state = app_state(app)
        with state.db.engine.connect() as conn:
            now = state.now(conn)
            live, in_progress, past_lease = state.store.live_counts(conn, now)
            return KeyStats(
                live=live,
                in_progress=in_progress,
                past_lease=past_lease,
                expired_awaiting_cleanup=state.store.count_expired(conn, now),
                oldest_in_progress=state.store.oldest_in_progress(conn, now),
                read_at=now,
            )


def read_figures(app: Flask) -> dict[str, float]:
    """One snapshot of ``app``'s figures, by gauge name (raises on a database error)."""
    with app.app_context():
        state = app_state(app)
        with state.db.engine.connect() as conn:
            # The database's clock, as the recovery job's: the stuck-lease alert
            # reads "past their lease" from here, whatever this host's clock says.
            # The same query as key_stats' first three figures.
            now = state.now(conn)
            live, in_flight, past_lease = state.store.live_counts(conn, now)
            found: dict[str, float] = {
                figures.RECORDS_LIVE: live,
                figures.RECORDS_IN_FLIGHT: in_flight,
                figures.RECORDS_PAST_LEASE: past_lease,
            }
            inspector = sa.inspect(conn)
            if inspector.has_table(OUTBOX_TABLE_NAME):
                counts = outbox_sql.counts(conn, outbox_table(state.db.metadata))
                found[figures.OUTBOX_UNPUBLISHED] = counts.pending
                found[figures.OUTBOX_PARKED] = counts.parked
                found[figures.OUTBOX_OLDEST_AGE] = _age(now, counts.oldest)
            if inspector.has_table(INBOX_TABLE_NAME):
                found[figures.INBOX_ROWS] = inbox_sql.stats(conn, now)["inbox_processed"]
        return found


def _age(now: dt.datetime, oldest: t.Any) -> float:
    if oldest is None:
        return 0.0
    return max(0.0, (now - t.cast(dt.datetime, as_utc(oldest))).total_seconds())
