"""The outbox for an operator: un-park, purge what was published, count by state."""

from __future__ import annotations

import datetime as dt
import typing as t

from flask import Flask

from .._context import app_state
from .._storage import outbox as outbox_sql
from .._storage.schema import as_utc, outbox_table


def retry_parked(app: Flask) -> int:
    """Un-park every parked event (attempts reset, due now); the number un-parked."""
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        with state.db.engine.begin() as conn:
            return outbox_sql.retry_parked(conn, table)


def purge_published(
    app: Flask, older_than: dt.timedelta | None = None, *, batch: int = 1000
) -> int:
    """Delete events published more than ``older_than`` ago (default
    ``IDEMPOTENCY_OUTBOX_RETENTION``), ``batch`` rows per transaction; the number
    deleted. Pending and parked events are never deleted. (Consumers that
    deduplicate on ``event_id`` do not need the rows.) The cleanup job does the
    same (:func:`flask_idempotency.jobs.purge_expired`). ``batch`` below 1, or
    a negative ``older_than``, raises :class:`ValueError`."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a whole number of at least 1, not {batch!r}")
    if older_than is not None and older_than < dt.timedelta(0):
        raise ValueError(f"older_than must not be negative, not {older_than!r}")
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        if older_than is None:
            older_than = state.settings.outbox_retention
        total = 0
        while True:
            with state.db.engine.begin() as conn:
                # The database's clock, as the cleanup job's (state.now).
                cutoff = state.now(conn) - older_than
                deleted = outbox_sql.purge_published_batch(conn, table, cutoff, batch)
            total += deleted
            if deleted < batch:
                return total


def outbox_stats(app: Flask) -> dict[str, t.Any]:
    """The outbox for an operator: ``outbox_pending`` (unpublished, not parked),
    ``outbox_retrying`` (of those, the ones whose last try failed, counted
    toward parking or not: a broker outage shows here),
    ``outbox_oldest_age_s`` (seconds since the oldest pending event was written;
    ``None`` when none), ``outbox_parked`` (given up on: ``flask idempotency
    outbox-retry``) and ``outbox_published`` (kept until
    ``IDEMPOTENCY_OUTBOX_RETENTION`` has passed)."""
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        with state.db.engine.connect() as conn:
            counts = outbox_sql.counts(conn, table)
        age = None
        if counts.oldest is not None:
            age = (state.clock() - t.cast(dt.datetime, as_utc(counts.oldest))).total_seconds()
        return {
            "outbox_pending": counts.pending,
            "outbox_retrying": counts.retrying,
            "outbox_oldest_age_s": age,
            "outbox_parked": counts.parked,
            "outbox_published": counts.published,
        }
