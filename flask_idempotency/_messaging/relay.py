"""The implementation of :mod:`flask_idempotency.relay` (see its documentation)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import importlib
import logging
import os
import selectors
import time
import typing as t

import sqlalchemy as sa
from flask import Flask

from .. import signals
from .._context import app_state
from .._storage.schema import MYSQL_DIALECTS, as_utc, outbox_table
from .._storage.store import database_now
from ..errors import BrokerUnavailable
from .outbox import CHANNEL, OutboxEvent, on_commit, remove_on_commit

logger = logging.getLogger("flask_idempotency")

#: Backoff after the n-th failure: BASE * 2**(n-1), at most CAP.
BACKOFF_BASE = dt.timedelta(seconds=1)
BACKOFF_CAP = dt.timedelta(minutes=10)


class Publisher(t.Protocol):
    """What the relay publishes through.

    ``publish(event)`` returns once the event is safely handed over (for a
    broker: confirmed), and raises on any failure; the relay then retries it
    later. Raise :class:`BrokerUnavailable` when the broker is unreachable
    rather than the event refused. A publish should end within a bound (a
    timeout) well under half of ``IDEMPOTENCY_OUTBOX_LEASE``: a publish that
    outlasts the lease may meet another relay publishing the same event.
    ``event`` has ``topic``, ``event_id``, ``payload`` (decoded JSON) and
    ``headers`` (a dict); see :class:`~flask_idempotency.outbox.OutboxEvent`.
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
    taken: int  #: pending rows it took (leased, tried or not)
    published: int  #: events published and marked
    failed: int  #: publishes that failed for the event (backed off, or parked; not an outage)
    broker_unavailable: bool  #: it ended early on :class:`BrokerUnavailable`
    #: rows it gave back untried because half its lease had passed
    released: int = 0

    @property
    def more(self) -> bool:
        """Whether a next batch at once may find work: this one was full (a
        failed publish does not make it short) or stopped at half its lease,
        and the broker answered."""
        full = self.taken >= self.batch or self.released > 0
        return full and not self.broker_unavailable


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
        settings = state.settings
        run = _Batch(
            state.db.engine,
            outbox_table(state.db.metadata),
            state.clock,
            settings.outbox_lease,
            settings.outbox_max_attempts,
            database_clock=not state.custom_clock,
        ).run(publisher, batch)
    for ev in run.published:
        signals.event_published.send(app, event=ev)
    for ev, error in run.parked:
        logger.error(
            "outbox event %s parked after %d attempts: %s",
            ev.id,
            settings.outbox_max_attempts,
            error,
        )
        signals.event_parked.send(app, event=ev, error=error)
    return RelayRun(
        batch,
        run.taken,
        len(run.published),
        run.failed,
        run.unavailable,
        run.released,
    )


_R = t.TypeVar("_R")

#: Seconds of publishing after which the events published since the last mark
#: are marked (in one short transaction: a commit per event would cost the
#: relay most of its throughput). A publish that stalls holds back the marks of
#: the events published in the 50 ms before it; a relay that dies leaves them
#: to be sent again once its lease has run out.
MARK_EVERY = 0.05

#: Seconds on a clock that only goes forward: how long a batch has been publishing.
#: (A test may replace it; the lease itself is on the database's clock.)
_elapsed_clock: t.Callable[[], float] = time.monotonic


@dataclasses.dataclass
class _Outcome:
    taken: int = 0
    published: list[OutboxEvent] = dataclasses.field(default_factory=list)
    parked: list[tuple[OutboxEvent, str]] = dataclasses.field(default_factory=list)
    failed: int = 0
    unavailable: bool = False
    released: int = 0


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4000]


class _Batch:
    """One batch: take and lease, publish and mark each, give back the rest."""

    def __init__(
        self,
        engine: sa.Engine,
        table: sa.Table,
        clock: t.Callable[[], dt.datetime],
        lease: dt.timedelta,
        max_attempts: int,
        *,
        database_clock: bool,
    ) -> None:
        self.engine, self.table, self.clock = engine, table, clock
        self.database_clock = database_clock
        self.lease, self.max_attempts = lease, max_attempts
        self.dialect = engine.dialect.name

    def run(self, publisher: Publisher, batch: int) -> _Outcome:
        outcome = _Outcome()
        leased_until, events = self._take(batch)
        outcome.taken = len(events)
        # Half the lease, on this process's own clock: the rest of the lease is
        # the margin for the publish under way when it runs out.
        stop_at = _elapsed_clock() + self.lease.total_seconds() / 2
        unmarked: list[OutboxEvent] = []  # published, their mark not yet written
        since = 0.0  # when the oldest of them was published
        tried = 0  # events[:tried] were published, failed, or given back
        finished = False
        try:
            for ev in events:
                if _elapsed_clock() >= stop_at:
                    outcome.released = len(events) - tried
                    break
                try:
                    publisher.publish(ev)
                except BrokerUnavailable as exc:
                    logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, exc)
                    tried += 1
                    self._write(self._give_back, [ev.id], leased_until, _error_text(exc))
                    outcome.unavailable = True
                    break
                except Exception as exc:
                    logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, exc)
                    tried += 1
                    error = _error_text(exc)
                    if self._write(self._fail, ev, leased_until, error):
                        outcome.parked.append((ev, error))
                    outcome.failed += 1
                else:
                    tried += 1
                    if not unmarked:
                        since = _elapsed_clock()
                    unmarked.append(ev)
                    if _elapsed_clock() - since >= MARK_EVERY:
                        self._flush(unmarked, outcome)
            self._flush(unmarked, outcome)
            if tried < len(events):
                rest = [ev.id for ev in events[tried:]]
                self._write(self._give_back, rest, leased_until, None)
            finished = True
        finally:
            if not finished:
                # Interrupted (any exception, KeyboardInterrupt, SystemExit, a
                # failed mark): mark what the broker took, and make the rest due
                # again at once rather than at the end of the lease, if the
                # database still answers. The event being published then may
                # have reached the broker: it is sent again (at least once).
                with contextlib.suppress(Exception):
                    self._flush(unmarked, outcome)
                with contextlib.suppress(Exception):
                    rest = [ev.id for ev in events[tried:]]
                    if rest:
                        self._write(self._give_back, rest, leased_until, None)
        return outcome

    def _flush(self, unmarked: list[OutboxEvent], outcome: _Outcome) -> None:
        """Mark ``unmarked`` published (one short transaction), and empty it."""
        if unmarked:
            self._write(self._published, [ev.id for ev in unmarked])
            outcome.published.extend(unmarked)
            unmarked.clear()

    def _now(self, conn: sa.Connection) -> dt.datetime:
        """The time leases and backoffs are set and compared in: the database's
        clock, which every relay on every host reads (an app given its own
        clock, as tests do, uses that one)."""
        return database_now(conn) if self.database_clock else self.clock()

    def _pending(self, now: dt.datetime) -> sa.Select[t.Any]:
        c = self.table.c
        return (
            sa.select(self.table)
            .where(
                c.published_at.is_(None),
                c.failed_at.is_(None),
                sa.or_(c.next_attempt_at.is_(None), c.next_attempt_at <= now),
            )
            .order_by(c.id)
        )

    def _take(self, batch: int) -> tuple[dt.datetime, list[OutboxEvent]]:
        """Lease up to ``batch`` pending rows, in a transaction of their own.

        Run once more on a new connection when the pooled one turns out closed
        by the server (an idle timeout between runs, a restart)."""
        try:
            return self._take_once(batch)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        return self._take_once(batch)

    def _take_once(self, batch: int) -> tuple[dt.datetime, list[OutboxEvent]]:
        with self.engine.connect() as conn:
            if self.dialect in MYSQL_DIALECTS:
                # InnoDB's REPEATABLE READ would take next-key (gap) locks over
                # the range scanned, up to the index's end when fewer than a
                # batch are pending: every emit (an insert at the end) would
                # wait for this take. READ COMMITTED locks the selected rows only.
                conn = conn.execution_options(isolation_level="READ COMMITTED")
            with conn.begin():
                if self.dialect == "sqlite":
                    # Take SQLite's write lock now (a write starts the write
                    # transaction even when it matches nothing): a second relay
                    # waits here instead of reading the same rows.
                    conn.execute(
                        sa.update(self.table)
                        .where(sa.false())
                        .values(attempts=self.table.c.attempts)
                    )
                now = self._now(conn)
                leased_until = now + self.lease
                query = self._pending(now).limit(batch)
                if self.dialect != "sqlite":
                    query = query.with_for_update(skip_locked=True)
                events = [OutboxEvent.from_row(row) for row in conn.execute(query)]
                if events:
                    conn.execute(
                        sa.update(self.table)
                        .where(self.table.c.id.in_([ev.id for ev in events]))
                        .values(next_attempt_at=leased_until)
                    )
        return leased_until, events

    def _write(self, step: t.Callable[..., _R], *args: t.Any) -> _R:
        """``step(conn, *args)`` in a short transaction of its own.

        Run once more on a new connection when the first one turns out closed
        by the server while it waited in the pool during a publish (an idle
        timeout, a restart): the statements here may run twice.
        """
        try:
            with self.engine.begin() as conn:
                return step(conn, *args)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        with self.engine.begin() as conn:
            return step(conn, *args)

    def _mine(self, ids: list[int], leased_until: dt.datetime) -> sa.ColumnElement[bool]:
        """The rows are still this batch's: unpublished, their lease the one it took."""
        c = self.table.c
        return sa.and_(c.id.in_(ids), c.published_at.is_(None), c.next_attempt_at == leased_until)

    def _published(self, conn: sa.Connection, ids: list[int]) -> None:
        # Not fenced by the lease: the broker has them, whoever holds the rows now.
        c = self.table.c
        conn.execute(
            sa.update(self.table)
            .where(c.id.in_(ids), c.published_at.is_(None))
            .values(published_at=self.clock())
        )

    def _fail(
        self, conn: sa.Connection, ev: OutboxEvent, leased_until: dt.datetime, error: str
    ) -> bool:
        """Back the event off, or park it; whether it was parked here."""
        now = self._now(conn)
        attempts = ev.attempts + 1
        values: dict[str, t.Any] = {
            "attempts": attempts,
            "last_error": error,
            "next_attempt_at": now + backoff(attempts),
        }
        parks = attempts >= self.max_attempts
        if parks:
            values["failed_at"] = now
        table = self.table
        result = conn.execute(
            sa.update(table).where(self._mine([ev.id], leased_until)).values(**values)
        )
        return parks and result.rowcount == 1

    def _give_back(
        self,
        conn: sa.Connection,
        ids: list[int],
        leased_until: dt.datetime,
        error: str | None,
    ) -> None:
        """Make leased rows due at once, their attempts unchanged."""
        values: dict[str, t.Any] = {"next_attempt_at": None}
        if error is not None:
            values["last_error"] = error
        conn.execute(sa.update(self.table).where(self._mine(ids, leased_until)).values(**values))


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
    ``outbox_retrying`` (of those, the ones whose last try failed, counted
    toward parking or not: a broker outage shows here),
    ``outbox_oldest_age_s`` (seconds since the oldest pending event was written;
    ``None`` when none), ``outbox_parked`` (given up on: ``flask idempotency
    outbox-retry``) and ``outbox_published`` (kept until
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
                    count(sa.and_(pending, sa.or_(c.attempts > 0, c.last_error.is_not(None)))),
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


class RelistenBackoff:
    """How long to wait before listening again after a :meth:`Listener.wait`
    failed: 0.25 s, doubling up to 5 s while each new LISTEN connection fails
    within :attr:`STEADY` seconds of being opened, and 0.25 s again after one
    that lasted longer. A LISTEN connection that fails at once every time (a
    proxy or a server that ends it, a driver that cannot wait on it) then costs
    a few connections a minute instead of one every few milliseconds."""

    FIRST = 0.25
    MOST = 5.0
    STEADY = 10.0

    def __init__(self) -> None:
        self._failures = 0

    def delay(self, failed: Listener) -> float:
        """Seconds to wait before replacing ``failed``, whose wait just raised."""
        if failed.age > self.STEADY:
            self._failures = 0
        self._failures += 1
        return float(min(self.MOST, self.FIRST * 2 ** min(self._failures - 1, 8)))


class Listener:
    """How a relay waits between runs: at most ``timeout``, less when there is work.

    On PostgreSQL with psycopg2 or psycopg 3 it LISTENs on
    ``idempotency_outbox`` on a connection of its own (autocommit, detached from
    the pool), so commits in any process wake it; with another driver it polls.
    A commit that carried events in this process wakes it too
    (:func:`~flask_idempotency.outbox.on_commit`), on every engine. A LISTEN
    that fails leaves it polling (:attr:`listening` false, :attr:`can_listen`
    true): its owner makes a new one now and then (``retrying=True`` logs
    the failures of those at DEBUG). With
    ``wake=False`` it does neither and only waits out the timeout (polling
    alone). :meth:`interrupt` (safe in a signal handler) ends a wait at once.
    It waits with :mod:`selectors` (epoll on Linux), so any number of files
    open in the process is fine.
    """

    def __init__(self, app: Flask, *, wake: bool = True, retrying: bool = False) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._read, selectors.EVENT_READ)
        self._raw: t.Any = None
        self._conn: t.Any = None
        self._conn_fd = -1
        self._driver = ""
        self._born = time.monotonic()
        self._can_listen = False
        if not wake:
            return
        on_commit(self.interrupt)
        with app.app_context():
            engine = app_state(app).db.engine
        driver = engine.dialect.driver
        if engine.dialect.name == "postgresql" and driver in ("psycopg2", "psycopg"):
            self._can_listen = True
            raw: t.Any = None
            try:
                raw = engine.raw_connection()
                conn: t.Any = raw.driver_connection
                raw.detach()  # its own: never back to the pool LISTENing
                conn.rollback()  # out of any transaction the pool left open
                conn.autocommit = True
                with conn.cursor() as cur:
                    cur.execute(f"LISTEN {CHANNEL}")
                fd = conn.fileno()
                self._selector.register(fd, selectors.EVENT_READ)
                self._raw, self._conn, self._conn_fd, self._driver = raw, conn, fd, driver
            except Exception:
                if retrying:  # said when it first failed; one line a try now
                    logger.debug("outbox relay: LISTEN failed again", exc_info=True)
                else:
                    logger.warning(
                        "outbox relay: LISTEN failed; polling, and trying again", exc_info=True
                    )
                if raw is not None:
                    with contextlib.suppress(Exception):
                        raw.driver_connection.close()

    @property
    def listening(self) -> bool:
        """Whether it LISTENs on PostgreSQL (commits in other processes wake it)."""
        return self._conn is not None

    @property
    def can_listen(self) -> bool:
        """Whether it is meant to LISTEN (wake-ups on, PostgreSQL with psycopg2 or
        psycopg 3), whether or not its LISTEN succeeded: one that failed (the
        database away at the time) is worth trying again, one that cannot
        LISTEN (another engine or driver, ``wake=False``) is not."""
        return self._can_listen

    @property
    def age(self) -> float:
        """Seconds since it was made."""
        return time.monotonic() - self._born

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (``None``: until woken); ``True`` when
        woken by a notification, a commit here or :meth:`interrupt`.

        Raises when the LISTEN connection fails (the caller may make a new
        Listener, after :meth:`RelistenBackoff.delay`)."""
        woken = False
        for key, _ in self._selector.select(timeout):
            woken = True
            if key.fd == self._read:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read, 4096):
                        pass
            elif key.fd == self._conn_fd:
                self._drain_notifications()
        return woken

    def _drain_notifications(self) -> None:
        """Read what the server sent and forget the notifications (one is as
        good as many: the relay reads the outbox). Raises when the connection
        is gone, so a closed socket never reads as endless wake-ups."""
        conn = self._conn
        if self._driver == "psycopg2":
            conn.poll()
            conn.notifies.clear()
        else:
            # psycopg 3: libpq's own calls, which never block; Connection.notifies()
            # with a timeout of 0 returns nothing, not an error, once the server
            # has closed the connection.
            pgconn = conn.pgconn
            pgconn.consume_input()
            while pgconn.notifies() is not None:
                pass

    def interrupt(self) -> None:
        """End the current or next :meth:`wait` now."""
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._write, b"x")

    def close(self) -> None:
        """Stop listening (the LISTEN connection is closed) and free the pipe."""
        remove_on_commit(self.interrupt)
        with contextlib.suppress(Exception):
            self._selector.close()
        if self._conn is not None:
            # The driver's connection itself: it is detached, and closing the
            # pool's proxy would first try a rollback on a connection that may
            # be broken, logged as an error.
            with contextlib.suppress(Exception):
                self._conn.close()
        self._raw = self._conn = None
        self._conn_fd = -1
        if self._read >= 0:
            # -1 first: a late interrupt() then writes nowhere, not into a
            # file that reuses the number.
            read, write, self._read, self._write = self._read, self._write, -1, -1
            os.close(read)
            os.close(write)
