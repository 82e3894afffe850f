"""The outbox relay: publishes committed events, in id order, at least once.

:func:`relay_once` runs one batch in a transaction of its own:

1. select the pending rows (unpublished, not parked, due) ``ORDER BY id LIMIT
   batch``; on PostgreSQL and MySQL/MariaDB ``FOR UPDATE SKIP LOCKED``, so
   relays running at once take disjoint batches and never publish one event at
   the same time; on SQLite the transaction first takes the database's write
   lock (SQLite has one writer), so a second relay waits for the first to
   commit and then sees the rows as published;
2. publish each row through the publisher, holding those row locks;
3. mark the published rows (``published_at``), and the failed ones with
   ``attempts + 1``, ``last_error`` and an exponential backoff
   (``next_attempt_at``; parked, ``failed_at``, after
   ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS``; never for :class:`BrokerUnavailable`,
   which also ends the batch), and commit.

Every run selects all pending rows: there is no high-water mark over ids, so
an event whose transaction took its id early and committed late (after events
with higher ids were published) is published by the next run.

Delivery is at least once. A relay that dies after the broker took an event
and before its commit leaves the row unpublished (the marking never committed,
and the row lock went with the connection), so the next run publishes it
again. No order of "publish" and "mark" avoids that without a transaction
spanning the broker and the database; consumers deduplicate on ``event_id``.
Order: one relay publishes in id order within and across runs, except that
an event waiting out its backoff lets later events pass it. Several relays at
once take disjoint batches and publish them side by side, so a later event can
reach the broker first: a consumer that needs one entity's events in order
checks a version or sequence of its own, or the app runs a single relay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import importlib
import logging
import os
import select
import typing as t

import sqlalchemy as sa
from flask import Flask

from . import signals
from .models import MYSQL_DIALECTS, as_utc, outbox_table
from .outbox import CHANNEL, OutboxEvent, on_commit, remove_on_commit
from .state import app_state

logger = logging.getLogger("flask_idempotency")

#: Backoff after the n-th failure: BASE * 2**(n-1), at most CAP.
BACKOFF_BASE = dt.timedelta(seconds=1)
BACKOFF_CAP = dt.timedelta(minutes=10)


class BrokerUnavailable(Exception):
    """Raised by a publisher when the broker cannot be reached (connection
    refused, lost, timed out): the failure is not the event's.

    The relay then stops the batch (the next events would only wait on the same
    broker), backs the event off as for any failure, and never parks an event
    for it: after an outage the events flow again without an operator.
    """


class Publisher(t.Protocol):
    """What the relay publishes through.

    ``publish(event)`` returns once the event is safely handed over (for a
    broker: confirmed), and raises on any failure; the relay then retries it
    later. Raise :class:`BrokerUnavailable` when the broker is unreachable
    rather than the event refused. ``event`` has ``topic``, ``event_id``,
    ``payload`` (decoded JSON) and ``headers`` (a dict); see
    :class:`~flask_idempotency.outbox.OutboxEvent`.
    """

    def publish(self, event: OutboxEvent) -> None: ...


def backoff(attempts: int) -> dt.timedelta:
    """The wait after the ``attempts``-th failed publish."""
    factor: int = 2 ** max(0, min(attempts - 1, 30))
    return min(BACKOFF_CAP, BACKOFF_BASE * factor)


def resolve_publisher(value: t.Any) -> Publisher | None:
    """``IDEMPOTENCY_PUBLISHER``: an object with ``publish``, or ``"module:attr"``
    naming one, or a class or factory called without arguments to make one."""
    if value is None:
        return None
    if isinstance(value, str):
        module, _, attr = value.partition(":")
        if not attr:
            raise ValueError(f"IDEMPOTENCY_PUBLISHER must be 'module:attribute', got {value!r}")
        value = getattr(importlib.import_module(module), attr)
        if isinstance(value, type) or (not hasattr(value, "publish") and callable(value)):
            value = value()
    if not hasattr(value, "publish"):
        raise TypeError(f"IDEMPOTENCY_PUBLISHER has no publish(event) method: {value!r}")
    return t.cast(Publisher, value)


def app_publisher(app: Flask) -> Publisher | None:
    """The publisher configured on ``app`` (``IDEMPOTENCY_PUBLISHER``), resolved once."""
    cache = app.extensions.setdefault("idempotency_publisher", {})
    raw = app.config.get("IDEMPOTENCY_PUBLISHER")
    if cache.get("raw") is not raw or "publisher" not in cache:
        cache["raw"], cache["publisher"] = raw, resolve_publisher(raw)
    return t.cast("Publisher | None", cache["publisher"])


@dataclasses.dataclass(frozen=True)
class RelayRun:
    """What one batch of the relay did (:func:`relay_batch`)."""

    batch: int  #: the most rows the batch could take
    taken: int  #: pending rows it took (locked, tried or not)
    published: int  #: events published and marked
    failed: int  #: publishes that raised (backed off, or parked)
    broker_unavailable: bool  #: it ended early on :class:`BrokerUnavailable`

    @property
    def more(self) -> bool:
        """Whether a next batch at once may find work: this one was full (a
        failed publish does not make it short) and the broker answered."""
        return self.taken >= self.batch and not self.broker_unavailable


def relay_once(app: Flask, publisher: Publisher | None = None, *, batch: int = 100) -> int:
    """Publish one batch of pending events; the number published.

    ``publisher`` defaults to the app's ``IDEMPOTENCY_PUBLISHER``. See the
    module for the locking and the at-least-once guarantee. To drain the
    outbox, loop on :func:`relay_batch` while :attr:`RelayRun.more`: fewer
    published than ``batch`` does not mean nothing is left (a failed publish).
    """
    return relay_batch(app, publisher, batch=batch).published


def relay_batch(app: Flask, publisher: Publisher | None = None, *, batch: int = 100) -> RelayRun:
    """:func:`relay_once`, telling what the batch did."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    with app.app_context():
        state = app_state(app)
        if publisher is None:
            publisher = app_publisher(app)
            if publisher is None:
                raise RuntimeError("no outbox publisher: set IDEMPOTENCY_PUBLISHER")
        table = outbox_table(state.db.metadata)
        engine = state.db.engine
        max_attempts = state.settings.outbox_max_attempts
        with engine.connect() as conn:
            if engine.dialect.name in MYSQL_DIALECTS:
                # InnoDB's REPEATABLE READ would take next-key (gap) locks over
                # the range scanned, up to the index's end when fewer than a
                # batch are pending: every emit (an insert at the end) would
                # wait for this batch to be published. READ COMMITTED locks the
                # selected rows only.
                conn = conn.execution_options(isolation_level="READ COMMITTED")
            taken, published, parked, failed, unavailable = _run_batch(
                conn, table, state.clock, publisher, batch, max_attempts, engine.dialect.name
            )
        for ev in published:
            signals.event_published.send(app, event=ev)
        for ev, error in parked:
            logger.error("outbox event %s parked after %d attempts: %s", ev.id, max_attempts, error)
            signals.event_parked.send(app, event=ev, error=error)
        return RelayRun(batch, taken, len(published), failed, unavailable)


#: How long a SQLite relay holds the rows it publishes outside a transaction:
#: another relay takes them only after this, so a relay that dies mid-batch
#: delays that batch by as much (a batch that takes longer to publish may be
#: published by two relays at once; at least once still holds).
SQLITE_PUBLISH_LEASE = dt.timedelta(minutes=5)


def _run_batch(
    conn: sa.Connection,
    table: sa.Table,
    clock: t.Callable[[], dt.datetime],
    publisher: Publisher,
    batch: int,
    max_attempts: int,
    dialect: str,
) -> tuple[int, list[OutboxEvent], list[tuple[OutboxEvent, str]], int, bool]:
    """Select, publish and mark one batch: rows taken, published, parked,
    failures, and whether the broker was unreachable.

    PostgreSQL and MySQL/MariaDB hold the batch's rows locked (``SKIP LOCKED``)
    in one transaction while publishing: emits insert other rows and never
    wait. SQLite has one lock for the whole database, so holding it while a
    broker answers would stop every writer: there the batch is taken in a short
    transaction (its rows leased for :data:`SQLITE_PUBLISH_LEASE`), published
    outside any transaction, and marked in a second one.
    """
    now = clock()
    query = (
        sa.select(table)
        .where(
            table.c.published_at.is_(None),
            table.c.failed_at.is_(None),
            sa.or_(table.c.next_attempt_at.is_(None), table.c.next_attempt_at <= now),
        )
        .order_by(table.c.id)
        .limit(batch)
    )
    if dialect == "sqlite":
        with conn.begin():
            # Take SQLite's write lock now (a write starts the write transaction
            # even when it matches nothing): a second relay waits here instead
            # of reading the same rows.
            conn.execute(sa.update(table).where(sa.false()).values(attempts=table.c.attempts))
            events = [OutboxEvent.from_row(row) for row in conn.execute(query)]
            if events:
                conn.execute(
                    sa.update(table)
                    .where(table.c.id.in_([ev.id for ev in events]))
                    .values(next_attempt_at=now + SQLITE_PUBLISH_LEASE)
                )
        published, failures = _publish(events, publisher)
        with conn.begin():
            parked = _mark(conn, table, clock(), published, failures, max_attempts)
            tried = {ev.id for ev in published} | {ev.id for ev, _, _ in failures}
            untried = [ev.id for ev in events if ev.id not in tried]
            if untried:  # left after an unreachable broker: due again, not leased
                conn.execute(
                    sa.update(table).where(table.c.id.in_(untried)).values(next_attempt_at=None)
                )
    else:
        with conn.begin():
            events = [
                OutboxEvent.from_row(row)
                for row in conn.execute(query.with_for_update(skip_locked=True))
            ]
            published, failures = _publish(events, publisher)
            parked = _mark(conn, table, clock(), published, failures, max_attempts)
    unavailable = bool(failures) and not failures[-1][2]
    return len(events), published, parked, len(failures), unavailable


#: (event, error, whether the failure counts towards parking)
_Failure = tuple[OutboxEvent, str, bool]


def _publish(
    events: list[OutboxEvent], publisher: Publisher
) -> tuple[list[OutboxEvent], list[_Failure]]:
    """Publish ``events`` in order: those published, and the failures."""
    published: list[OutboxEvent] = []
    failures: list[_Failure] = []
    for ev in events:
        try:
            publisher.publish(ev)
        except BrokerUnavailable as exc:
            logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, exc)
            failures.append((ev, f"{type(exc).__name__}: {exc}"[:4000], False))
            # The rest of the batch stays as it is, due: the next run tries the
            # next event (this one backs off), one attempt per run while the
            # broker is away instead of one per event.
            break
        except Exception as exc:
            logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, exc)
            failures.append((ev, f"{type(exc).__name__}: {exc}"[:4000], True))
        else:
            published.append(ev)
    return published, failures


def _mark(
    conn: sa.Connection,
    table: sa.Table,
    done_at: dt.datetime,
    published: list[OutboxEvent],
    failures: list[_Failure],
    max_attempts: int,
) -> list[tuple[OutboxEvent, str]]:
    """Mark the published events, back off (or park) the failed ones; the parked."""
    parked: list[tuple[OutboxEvent, str]] = []
    if published:
        conn.execute(
            sa.update(table)
            .where(table.c.id.in_([ev.id for ev in published]))
            .values(published_at=done_at)
        )
    for ev, error, counts in failures:
        attempts = ev.attempts + 1
        values: dict[str, t.Any] = {
            "attempts": attempts,
            "last_error": error,
            "next_attempt_at": done_at + backoff(attempts),
        }
        if counts and attempts >= max_attempts:
            values["failed_at"] = done_at
            parked.append((ev, error))
        conn.execute(sa.update(table).where(table.c.id == ev.id).values(**values))
    return parked


def retry_parked(app: Flask) -> int:
    """Un-park every parked event (attempts reset, due now); the number un-parked."""
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        with state.db.engine.begin() as conn:
            result = conn.execute(
                sa.update(table)
                .where(table.c.failed_at.is_not(None), table.c.published_at.is_(None))
                .values(failed_at=None, attempts=0, next_attempt_at=None)
            )
            return int(result.rowcount)


def purge_published_batch(
    conn: sa.Connection, table: sa.Table, cutoff: dt.datetime, limit: int
) -> int:
    """Delete up to ``limit`` events published before ``cutoff``, in ``conn``'s
    transaction; the number deleted. Pending and parked events are never deleted.

    The batch is read without locks and deleted by primary key: published rows
    are never locked by a relay, and a plain read takes no range locks on
    MySQL/MariaDB that an emit (an insert at the end of the ids) would wait on.
    Two cleaners at once may pick the same ids; the second deletes none of them.
    """
    ids = list(
        conn.execute(
            sa.select(table.c.id)
            .where(table.c.published_at.is_not(None), table.c.published_at < cutoff)
            .order_by(table.c.id)
            .limit(limit)
        ).scalars()
    )
    if not ids:
        return 0
    # Only the published rows, whatever happened since the read.
    published = table.c.published_at.is_not(None)
    return int(conn.execute(sa.delete(table).where(table.c.id.in_(ids), published)).rowcount)


def count_purgeable(conn: sa.Connection, table: sa.Table, cutoff: dt.datetime) -> int:
    """How many events were published before ``cutoff`` (what a purge would delete)."""
    stmt = sa.select(sa.func.count()).where(
        table.c.published_at.is_not(None), table.c.published_at < cutoff
    )
    return int(conn.execute(stmt).scalar_one())


def purge_published(
    app: Flask, older_than: dt.timedelta | None = None, *, batch: int = 1000
) -> int:
    """Delete events published more than ``older_than`` ago (default
    ``IDEMPOTENCY_OUTBOX_RETENTION``), ``batch`` rows per transaction; the number
    deleted. Pending and parked events are never deleted. (Consumers that
    deduplicate on ``event_id`` do not need the rows.) The cleanup job does the
    same (:func:`flask_idempotency.jobs.purge_expired`)."""
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        if older_than is None:
            older_than = state.settings.outbox_retention
        cutoff = state.clock() - older_than
        total = 0
        while True:
            with state.db.engine.begin() as conn:
                deleted = purge_published_batch(conn, table, cutoff, batch)
            total += deleted
            if deleted < batch:
                return total


def outbox_stats(app: Flask) -> dict[str, t.Any]:
    """The outbox for an operator: ``outbox_pending`` (unpublished, not parked),
    ``outbox_retrying`` (of those, the ones that failed at least once: a broker
    outage shows here), ``outbox_oldest_age_s`` (seconds since the oldest
    pending event was written; ``None`` when none), ``outbox_parked`` (given up
    on: ``flask idempotency outbox-retry``) and ``outbox_published`` (kept until
    ``IDEMPOTENCY_OUTBOX_RETENTION`` has passed)."""
    with app.app_context():
        state = app_state(app)
        table = outbox_table(state.db.metadata)
        c = table.c
        pending = sa.and_(c.published_at.is_(None), c.failed_at.is_(None))
        parked_now = sa.and_(c.published_at.is_(None), c.failed_at.is_not(None))

        def count(condition: sa.ColumnElement[bool]) -> t.Any:
            # COUNT(CASE ...) rather than FILTER, which MySQL/MariaDB lack.
            return sa.func.count(sa.case((condition, 1)))

        with state.db.engine.connect() as conn:
            row = conn.execute(
                sa.select(
                    count(pending),
                    count(sa.and_(pending, c.attempts > 0)),
                    sa.func.min(sa.case((pending, c.created_at))),
                    count(parked_now),
                    count(c.published_at.is_not(None)),
                )
            ).one()
        depth, retrying, oldest, parked, published = row
        age = None
        if oldest is not None:
            age = (state.clock() - t.cast(dt.datetime, as_utc(oldest))).total_seconds()
        return {
            "outbox_pending": int(depth),
            "outbox_retrying": int(retrying),
            "outbox_oldest_age_s": age,
            "outbox_parked": int(parked),
            "outbox_published": int(published),
        }


class Listener:
    """How a relay waits between runs: at most ``timeout``, less when there is work.

    On PostgreSQL with psycopg2 it LISTENs on ``idempotency_outbox`` on a
    connection of its own (autocommit, detached from the pool), so commits in
    any process wake it; a commit that carried events in this process wakes it
    too (:func:`~flask_idempotency.outbox.on_commit`), on every engine. With
    ``wake=False`` it does neither and only waits out the timeout (polling
    alone). :meth:`interrupt` (safe in a signal handler) ends a wait at once.
    """

    def __init__(self, app: Flask, *, wake: bool = True) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._raw: t.Any = None
        self._conn: t.Any = None
        if not wake:
            return
        on_commit(self.interrupt)
        with app.app_context():
            engine = app_state(app).db.engine
        if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg2":
            try:
                raw = engine.raw_connection()
                conn: t.Any = raw.driver_connection
                raw.detach()  # its own: never back to the pool LISTENing
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"LISTEN {CHANNEL}")
                self._raw, self._conn = raw, conn
            except Exception:
                logger.warning("outbox relay: LISTEN failed; polling only", exc_info=True)

    @property
    def listening(self) -> bool:
        """Whether it LISTENs on PostgreSQL (commits in other processes wake it)."""
        return self._conn is not None

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: until woken); ``True`` when
        woken by a notification, a commit here or :meth:`interrupt`.

        Raises when the LISTEN connection fails (the caller may make a new
        Listener)."""
        waitables: list[t.Any] = [self._read]
        if self._conn is not None:
            waitables.append(self._conn)
        readable, _, _ = select.select(waitables, [], [], timeout)
        if self._read in readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._read, 4096):
                    pass
        if self._conn is not None and self._conn in readable:
            self._conn.poll()
            self._conn.notifies.clear()
        return bool(readable)

    def interrupt(self) -> None:
        """End the current or next :meth:`wait` now."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"x")

    def close(self) -> None:
        """Stop listening (the LISTEN connection is closed) and free the pipe."""
        remove_on_commit(self.interrupt)
        if self._raw is not None:
            with contextlib.suppress(Exception):
                self._raw.close()
        self._raw = self._conn = None
        if self._read >= 0:
            # -1 first: a late interrupt() then writes nowhere, not into a
            # file that reuses the number.
            read, write, self._read, self._write = self._read, self._write, -1, -1
            os.close(read)
            os.close(write)
