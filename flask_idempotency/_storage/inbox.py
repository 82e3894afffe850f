"""The inbox's statements: insert an id, read and renew it, and the cleanup and
operator queries.

What differs per engine is asked of its dialect object (:mod:`.dialects`):
the insert is conflict-tolerant (``ON CONFLICT DO NOTHING``
on PostgreSQL and SQLite, ``INSERT IGNORE`` on MySQL/MariaDB) and returns the
row it wrote where the engine has ``RETURNING``; elsewhere a plain insert in a
savepoint, whose duplicate-key error means "exists". The read of an existing id
locks it on MySQL/MariaDB; cleanup's batch is ``FOR UPDATE SKIP LOCKED`` on
PostgreSQL and MySQL/MariaDB.
"""

from __future__ import annotations

import datetime as dt
import functools
import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session

from .dialects import dialect_for, dialect_of
from .schema import INBOX_TABLE_NAME, _text, inbox_table
from .sql import changed_one, text_param

# The statements are built on a table of our own: the SQL is the same whatever
# metadata the app's table lives on.
_TABLE = inbox_table(sa.MetaData())
_C = _TABLE.c

_THIS = (_C.consumer == text_param("w_consumer"), _C.event_id == text_param("w_event_id"))
_VALUES = {
    "consumer": text_param("consumer"),
    "event_id": text_param("event_id"),
    "processed_at": sa.bindparam("processed_at"),
    "expires_at": sa.bindparam("expires_at"),
}
#: The insert that raises on a duplicate, for engines without a returning one.
_PLAIN_INSERT = sa.insert(_TABLE).values(_VALUES)
_READ = sa.select(_C.expires_at).where(*_THIS)
# An id kept past its window counts as new: the delivery that takes it over does
# the work. The UPDATE re-checks the expiry on the latest row (a concurrent
# taker's commit makes it fail), so only one delivery wins.
_RENEW = (
    sa.update(_TABLE)
    .where(*_THIS, _C.expires_at <= sa.bindparam("w_now"))
    .values(processed_at=sa.bindparam("processed_at"), expires_at=sa.bindparam("expires_at"))
)
_RENEW_RETURNING = _RENEW.returning(_C.consumer)

AnySession = t.Union[Session, "scoped_session[t.Any]"]


@functools.cache
def _insert(name: str) -> t.Any | None:
    """The engine's conflict-tolerant insert returning the row it wrote (nothing
    for a duplicate), if it has one; built once per engine."""
    stmt = dialect_for(name).conflict_tolerant_insert(_TABLE, _VALUES, ["consumer", "event_id"])
    return None if stmt is None else stmt.returning(_C.consumer)


@functools.cache
def _read(name: str) -> t.Any:
    """The read of an id's expiry: a locking one on MySQL, so that it sees the
    latest row whatever the snapshot."""
    return dialect_for(name).read_latest(_READ)


def insert(session: AnySession, dialect: sa.Dialect, params: dict[str, t.Any]) -> bool:
    """Insert the id (``params``: consumer, event_id, processed_at, expires_at);
    whether this insert wrote the row (``False``: it was there). ``dialect`` is
    the session's engine's."""
    stmt = _insert(dialect.name)
    if stmt is not None and dialect.insert_returning:
        # Whether the row is ours is what the insert returns, never a row count.
        return session.execute(stmt, params).first() is not None
    # No RETURNING here (MySQL): the insert in a savepoint, a duplicate is
    # "exists" (an error the statement itself raises).
    try:
        with session.begin_nested():
            session.execute(_PLAIN_INSERT, params)
        return True
    except sa.exc.IntegrityError:
        return False


def read_expiry(
    session: AnySession, dialect: sa.Dialect, consumer: str, event_id: str
) -> dt.datetime | None:
    """When the kept id expires, as read (``None``: no such row, or it has none).

    Takes no write lock: on MySQL every delivery waiting on the id holds a
    shared lock on it after INSERT IGNORE, and a write by each would deadlock
    them. It locks for reading on MySQL, so that it sees the latest row
    whatever the snapshot."""
    stmt = _read(dialect.name)
    value = session.execute(stmt, {"w_consumer": consumer, "w_event_id": event_id}).scalar()
    return t.cast("dt.datetime | None", value)


def renew(session: AnySession, dialect: sa.Dialect, params: dict[str, t.Any]) -> bool:
    """Take over an expired id (``params``: processed_at, expires_at, w_consumer,
    w_event_id, w_now); whether this delivery won it (a concurrent taker's
    commit makes it fail)."""
    return changed_one(session, _RENEW_RETURNING if dialect.update_returning else _RENEW, params)


def purge_batch(conn: sa.Connection, now: dt.datetime, limit: int) -> int:
    """Delete up to ``limit`` expired ids in one transaction; the number deleted.

    As :meth:`.Store.purge_batch`: on PostgreSQL and MySQL/MariaDB the batch is
    chosen ``FOR UPDATE SKIP LOCKED`` (cleaners skip each other's rows), and
    the delete re-checks the expiry, so an id renewed meanwhile stays.
    """
    gone = _C.expires_at <= now
    key = [_C.consumer, _C.event_id]
    batch = sa.select(*key).where(gone).order_by(_C.expires_at).limit(limit)
    return dialect_of(conn).delete_batch(conn, _TABLE, key, batch, gone).rows


def count_expired(conn: sa.Connection, now: dt.datetime) -> int:
    """How many processed ids are past their window and await cleanup."""
    stmt = sa.select(sa.func.count()).select_from(_TABLE).where(_C.expires_at <= now)
    return int(conn.execute(stmt).scalar_one())


def table_exists(conn: sa.Connection) -> bool:
    """Whether the database has the inbox table (an app that upgraded without
    migrating has not: cleanup leaves the inbox alone then)."""
    return bool(sa.inspect(conn).has_table(INBOX_TABLE_NAME))


def stats(conn: sa.Connection, now: dt.datetime) -> dict[str, t.Any]:
    """The inbox for an operator: ``inbox_processed`` (ids kept, expired or not),
    ``inbox_by_consumer`` (the same per consumer name) and ``inbox_expired``
    (past their window, awaiting cleanup)."""
    by_consumer = {
        t.cast(str, _text(name)): int(n)
        for name, n in conn.execute(
            sa.select(_C.consumer, sa.func.count()).group_by(_C.consumer).order_by(_C.consumer)
        )
    }
    return {
        "inbox_processed": sum(by_consumer.values()),
        "inbox_by_consumer": by_consumer,
        "inbox_expired": count_expired(conn, now),
    }
