"""The outbox's statements: the emit's insert, the operator queries (the relay's
take, lease and marks are in :mod:`.leases`).

What differs per engine is asked of its dialect object (:mod:`.dialects`):

* the emit's insert leaves an existing ``event_id`` as it is
  (:meth:`~.dialects.Dialect.keeping_insert`): ``ON CONFLICT DO NOTHING
  RETURNING id`` on PostgreSQL and SQLite (a returned id: this insert wrote
  the row), ``ON DUPLICATE KEY UPDATE`` a no-op on MySQL/MariaDB, where the
  existing row is always read back, with a locking read that sees the latest
  committed row whatever the snapshot.
"""

from __future__ import annotations

import datetime as dt
import functools
import logging
import typing as t

import sqlalchemy as sa

from .dialects import Dialect, dialect_for
from .notify import NOTIFY
from .schema import ERASED_PAYLOAD, OWNER_KEY, OWNER_SCOPE
from .seal import open_event_text as open_event_text
from .seal import seal_event as seal_event
from .sql import AddedColumns
from .sql import add_column_sql as add_column_sql

_R = t.TypeVar("_R")
_E = t.TypeVar("_E")

logger = logging.getLogger("flask_idempotency")

#: The column a release added to the outbox for traces; an outbox created
#: before it works without it (no trace context stored) until it is added.
TRACE_CONTEXT = "trace_context"
#: The columns a later release added for erasure (the emitting operation); an
#: outbox created before them works without them (events stored without their
#: owner, which erasure then cannot find) until they are added.
OWNER = (OWNER_SCOPE, OWNER_KEY)
#: What each added column's absence costs, for the WARNING that says so.
_WITHOUT = {
    TRACE_CONTEXT: "events are stored and published without their trace context",
    OWNER_SCOPE: "events are stored without their owner, and erasure cannot find them",
    OWNER_KEY: "events are stored without their owner, and erasure cannot find them",
}
#: The columns a release added to an existing outbox, in the order they came.
ADDED_COLUMNS = (TRACE_CONTEXT, *OWNER)

_COLUMNS = AddedColumns(ADDED_COLUMNS, _WITHOUT.__getitem__, prefix="outbox: ")


def add_trace_context_sql(dialect: sa.Dialect, table: sa.Table) -> str:
    """The statement that adds ``trace_context`` to ``table`` on ``dialect``,
    as the table declares it (``TEXT``; ``LONGTEXT`` on MySQL/MariaDB)."""
    return add_column_sql(dialect, table, TRACE_CONTEXT)


def lacking_columns(conn: sa.Connection, table: sa.Table) -> tuple[str, ...]:
    """Of :data:`ADDED_COLUMNS`, those ``table`` lacks on ``conn`` (an outbox
    created by an earlier release), read now; none without the table."""
    return _COLUMNS.lacking(conn, table)


def lacks_trace_context(conn: sa.Connection, table: sa.Table) -> bool:
    """Whether ``table`` exists on ``conn`` without ``trace_context`` (an outbox
    created by a release before traces), read now; ``False`` without the table."""
    return TRACE_CONTEXT in lacking_columns(conn, table)


def absent_columns(conn: sa.Connection, table: sa.Table) -> frozenset[str]:
    """The added columns the outbox behind ``conn`` lacks: read once per engine
    (a column added later is used by processes started after), with one
    WARNING per engine and column naming the statement to run."""
    return _COLUMNS.absent(conn, table)


def has_trace_context(conn: sa.Connection, table: sa.Table) -> bool:
    """Whether the outbox behind ``conn`` has ``trace_context`` (:func:`absent_columns`)."""
    return TRACE_CONTEXT not in absent_columns(conn, table)


def has_owner(conn: sa.Connection, table: sa.Table) -> bool:
    """Whether the outbox behind ``conn`` has its owner columns (:func:`absent_columns`)."""
    return not absent_columns(conn, table).intersection(OWNER)


class OutboxDialect:
    """The emit's statements on one engine (:func:`for_session`)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect

    def insert_event(self, session: t.Any, table: sa.Table, values: dict[str, t.Any]) -> bool:
        """Insert an event through ``session``; whether this insert is known to
        have written the row (``False``: read the existing row,
        :meth:`existing_event`)."""
        dialect = self.dialect
        result = session.execute(dialect.keeping_insert(table, values, ["event_id"], table.c.id))
        # Whether the insert wrote the row is read from what it returned (RETURNING),
        # never from a driver's rowcount; MySQL has no RETURNING here: read the row.
        return dialect.keeping_insert_returns and result.first() is not None

    def existing_event(self, session: t.Any, table: sa.Table, event_id: str) -> t.Any:
        """The ``topic`` and ``payload`` of the event ``event_id``, or ``None``."""
        query = sa.select(table.c.topic, table.c.payload).where(
            table.c.event_id == sa.bindparam("event_id", event_id, type_=sa.String())
        )
        # A locking read sees the latest committed row, which a REPEATABLE READ
        # snapshot taken before that row's commit would not (the insert above
        # already holds its lock).
        return session.execute(self.dialect.read_latest(query, read=False)).first()

    def notify(self, session: t.Any) -> None:
        """Wake LISTENing relays when ``session``'s transaction commits (once per
        transaction is enough; nothing on engines without a channel)."""
        if self.dialect.notifies:
            # PostgreSQL delivers it at the commit, and drops it with a rollback.
            session.execute(NOTIFY)


def for_session(session: t.Any) -> OutboxDialect:
    """The emit's statements on the engine behind ``session`` (a scoped one too)."""
    return _for_dialect(session.get_bind().dialect.name)


@functools.cache
def _for_dialect(name: str) -> OutboxDialect:
    return OutboxDialect(dialect_for(name))


# -- operator queries ---------------------------------------------------------------


def retry_parked(conn: sa.Connection, table: sa.Table) -> int:
    """Un-park every parked event (attempts reset, due now); the number
    un-parked. An erased one stays parked: its payload is gone."""
    result = conn.execute(
        sa.update(table)
        .where(
            table.c.failed_at.is_not(None),
            table.c.published_at.is_(None),
            table.c.payload != ERASED_PAYLOAD,
        )
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


class Counts(t.NamedTuple):
    """The outbox's rows by state (:func:`counts`)."""

    pending: int  #: unpublished, not parked
    retrying: int  #: of those, the ones whose last try failed
    oldest: dt.datetime | None  #: when the oldest pending one was written, as read
    parked: int  #: unpublished, given up on
    published: int  #: published, not yet purged


def counts(conn: sa.Connection, table: sa.Table) -> Counts:
    """The outbox's rows by state, in one query."""
    c = table.c
    pending = sa.and_(c.published_at.is_(None), c.failed_at.is_(None))
    parked_now = sa.and_(c.published_at.is_(None), c.failed_at.is_not(None))

    def count(condition: sa.ColumnElement[bool]) -> t.Any:
        # COUNT(CASE ...) rather than FILTER, which MySQL/MariaDB lack.
        return sa.func.count(sa.case((condition, 1)))

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
    return Counts(int(depth), int(retrying), oldest, int(parked), int(published))
