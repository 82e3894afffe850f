"""The relay's statements on the outbox, each in a short transaction of its own:
take and lease a batch, mark published, back off or park, give back
(:class:`Leases`). The emit's insert and the operator's queries are in
:mod:`.outbox`.

What differs per engine is asked of its dialect: the take is ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL and MySQL/MariaDB (under READ COMMITTED on
MySQL/MariaDB), in the order the pending index gives
(:meth:`~.dialects.Dialect.pending_order`); on SQLite it first takes the
database's write lock.
"""

from __future__ import annotations

import datetime as dt
import typing as t

import sqlalchemy as sa

from .dialects import Dialect, dialect_for
from .outbox import absent_columns
from .sql import database_now

_R = t.TypeVar("_R")
_E = t.TypeVar("_E")


class _Statements(t.NamedTuple):
    """The relay's statements on one table and engine, with their parameters."""

    take: sa.Select[t.Any]  #: the batch, chosen and locked: ``now``, ``batch``
    lease: sa.Update  #: the batch leased: ``ids``, ``until``
    mark: sa.Update  #: published: ``ids``, ``at``


#: Where a table's relay statements are kept (:meth:`Leases._statements`).
_STATEMENTS = "flask_idempotency.relay_statements"


class _Kept(t.NamedTuple):
    """A table's relay statements, by engine (dialect name, absent columns)."""

    table: sa.Table
    by_engine: dict[tuple[str, frozenset[str]], _Statements]


def _build(dialect: Dialect, table: sa.Table, absent: frozenset[str]) -> _Statements:
    c = table.c
    columns: list[t.Any] = [table]
    if absent:  # an outbox from an earlier release
        columns = [column for column in c if column.name not in absent]
    due = c.next_attempt_at <= sa.bindparam("now", type_=c.next_attempt_at.type)
    take = (
        sa.select(*columns)
        .where(
            c.published_at.is_(None),
            c.failed_at.is_(None),
            sa.or_(c.next_attempt_at.is_(None), due),
        )
        .order_by(*dialect.pending_order(table))
        .limit(sa.bindparam("batch", type_=sa.Integer()))
    )
    mine = dialect.among(c.id, "ids")
    return _Statements(
        take=dialect.skip_locked_take(take),
        lease=sa.update(table)
        .where(mine)
        .values(next_attempt_at=sa.bindparam("until", type_=c.next_attempt_at.type)),
        # Not fenced by the lease: the broker has them, whoever holds the rows now.
        mark=sa.update(table)
        .where(mine, c.published_at.is_(None))
        .values(published_at=sa.bindparam("at", type_=c.published_at.type)),
    )


class Leases:
    """The relay's statements, each in a short transaction of its own: take and
    lease a batch, mark published, back off or park, give back.

    "Now", for leases and backoffs, is the database's clock, which every relay
    on every host reads, unless ``database_clock`` is false (an app given its
    own clock, as tests do): then ``clock``.
    """

    def __init__(
        self,
        engine: sa.Engine,
        table: sa.Table,
        clock: t.Callable[[], dt.datetime],
        *,
        database_clock: bool,
    ) -> None:
        self.engine, self.table, self.clock = engine, table, clock
        self.database_clock = database_clock
        self.dialect = dialect_for(engine.dialect.name)

    def _now(self, conn: sa.Connection) -> dt.datetime:
        return database_now(conn) if self.database_clock else self.clock()

    def _statements(self, conn: sa.Connection) -> _Statements:
        """The take's, the lease's and the mark's statements for this table on
        this engine, built once: building a Core statement and its cache key
        each batch cost more CPU than the batch of one event the LISTEN path
        publishes."""
        absent = absent_columns(conn, self.table)
        kept: _Kept | None = self.table.info.get(_STATEMENTS)
        if kept is None or kept.table is not self.table:
            # A copy of a table (Table.to_metadata) shares its info's values:
            # the copy gets statements of its own.
            kept = self.table.info[_STATEMENTS] = _Kept(self.table, {})
        key = (self.dialect.name, absent)
        found = kept.by_engine.get(key)
        if found is None:  # two threads at once may both build: the same statements
            found = kept.by_engine[key] = _build(self.dialect, self.table, absent)
        return found

    def take(
        self, batch: int, lease: dt.timedelta, make: t.Callable[[t.Any], _E]
    ) -> tuple[dt.datetime, list[_E]]:
        """Lease up to ``batch`` pending rows in id order, in a transaction of
        their own; the lease's end and the rows, each made into ``make(row)``
        (in the transaction: a row ``make`` refuses leases nothing).

        Run once more on a new connection when the pooled one turns out closed
        by the server (an idle timeout between runs, a restart)."""
        try:
            return self._take_once(batch, lease, make)
        except sa.exc.DBAPIError as exc:
            if not exc.connection_invalidated:
                raise
        return self._take_once(batch, lease, make)

    def _take_once(
        self, batch: int, lease: dt.timedelta, make: t.Callable[[t.Any], _E]
    ) -> tuple[dt.datetime, list[_E]]:
        dialect = self.dialect
        with self.engine.connect() as conn:
            if dialect.take_isolation is not None:
                # Where the default would lock more than the rows taken (MySQL's
                # gap locks): every emit would wait for this take.
                conn = conn.execution_options(isolation_level=dialect.take_isolation)
            with conn.begin():
                # SQLite: its write lock first, so a second relay waits here
                # instead of reading the same rows.
                dialect.lock_writers(conn, self.table, "attempts")
                statements = self._statements(conn)
                now = self._now(conn)
                leased_until = now + lease
                rows = list(conn.execute(statements.take, {"now": now, "batch": batch}))
                taken = [make(row) for row in rows]
                if rows:
                    ids = [int(row.id) for row in rows]
                    conn.execute(statements.lease, {"ids": ids, "until": leased_until})
        return leased_until, taken

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

    def _mine(self) -> sa.ColumnElement[bool]:
        """The rows ``ids`` are still this batch's: unpublished, their lease the
        one it took (``leased``)."""
        c = self.table.c
        return sa.and_(
            self.dialect.among(c.id, "ids"),
            c.published_at.is_(None),
            c.next_attempt_at == sa.bindparam("leased", type_=c.next_attempt_at.type),
        )

    def mark_published(self, ids: list[int]) -> None:
        """Mark the rows ``ids`` published (at the app's clock)."""
        self._write(self._published, ids)

    def _published(self, conn: sa.Connection, ids: list[int]) -> None:
        conn.execute(self._statements(conn).mark, {"ids": ids, "at": self.clock()})

    def fail(
        self,
        row_id: int,
        leased_until: dt.datetime,
        *,
        attempts: int,
        error: str,
        delay: dt.timedelta,
        park: bool,
    ) -> bool:
        """Record a failed publish of the leased row ``row_id``: ``attempts``,
        ``error`` and due again ``delay`` from now, parked too when ``park``;
        whether the row was still this batch's (and so was written)."""
        return self._write(self._fail, row_id, leased_until, attempts, error, delay, park)

    def _fail(
        self,
        conn: sa.Connection,
        row_id: int,
        leased_until: dt.datetime,
        attempts: int,
        error: str,
        delay: dt.timedelta,
        park: bool,
    ) -> bool:
        now = self._now(conn)
        values: dict[str, t.Any] = {
            "attempts": attempts,
            "last_error": error,
            "next_attempt_at": now + delay,
        }
        if park:
            values["failed_at"] = now
        result = conn.execute(
            sa.update(self.table).where(self._mine()).values(**values),
            {"ids": [row_id], "leased": leased_until},
        )
        return bool(result.rowcount == 1)

    def fail_many(
        self,
        failures: t.Sequence[tuple[int, int, str, dt.timedelta, bool]],
        leased_until: dt.datetime,
    ) -> list[bool]:
        """:meth:`fail` for each ``(row_id, attempts, error, delay, park)``, in
        one transaction; whether each row was still this batch's."""
        return self._write(self._fail_many, failures, leased_until)

    def _fail_many(
        self,
        conn: sa.Connection,
        failures: t.Sequence[tuple[int, int, str, dt.timedelta, bool]],
        leased_until: dt.datetime,
    ) -> list[bool]:
        return [
            self._fail(conn, row_id, leased_until, attempts, error, delay, park)
            for row_id, attempts, error, delay, park in failures
        ]

    def give_back(self, ids: list[int], leased_until: dt.datetime, error: str | None) -> None:
        """Make leased rows due at once, their attempts unchanged (``error``, when
        given, kept as their ``last_error``)."""
        self._write(self._give_back, ids, leased_until, error)

    def _give_back(
        self,
        conn: sa.Connection,
        ids: list[int],
        leased_until: dt.datetime,
        error: str | None,
    ) -> None:
        values: dict[str, t.Any] = {"next_attempt_at": None}
        if error is not None:
            values["last_error"] = error
        conn.execute(
            sa.update(self.table).where(self._mine()).values(**values),
            {"ids": ids, "leased": leased_until},
        )
