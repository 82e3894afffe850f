"""The inbox's statements: insert an id, read and renew it, and the cleanup and
operator queries.

What differs per engine is one :class:`_Dialect` each, found by
:func:`_dialect`: the insert is conflict-tolerant (``ON CONFLICT DO NOTHING``
on PostgreSQL and SQLite, ``INSERT IGNORE`` on MySQL/MariaDB) and returns the
row it wrote where the engine has ``RETURNING``; elsewhere a plain insert in a
savepoint, whose duplicate-key error means "exists". The read of an existing id
locks it on MySQL/MariaDB; cleanup's batch is ``FOR UPDATE SKIP LOCKED`` on
PostgreSQL and MySQL/MariaDB.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session

from .schema import INBOX_TABLE_NAME, MYSQL_DIALECTS, _text, inbox_table
from .store import changed_one, conflict_tolerant_inserts, text_param

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
#: Per dialect, the insert that returns the row it wrote (nothing for a duplicate).
_INSERTS = {
    name: insert.returning(_C.consumer)
    for name, insert in conflict_tolerant_inserts(_TABLE, _VALUES, ["consumer", "event_id"]).items()
}
#: The insert that raises on a duplicate, for engines without a returning one.
_PLAIN_INSERT = sa.insert(_TABLE).values(_VALUES)
_READ = sa.select(_C.expires_at).where(*_THIS)
_READ_LOCKING = _READ.with_for_update(read=True)
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


@dataclasses.dataclass(frozen=True)
class _Dialect:
    """The inbox's statements on one engine."""

    #: The conflict-tolerant insert returning the row it wrote, if the engine has one.
    insert: t.Any
    #: The read of an id's expiry.
    read: t.Any
    #: Whether cleanup's batch skips the rows another cleaner has locked.
    skip_locked: bool
    #: Whether cleanup deletes the batch in one statement (else reads its keys first).
    delete_by_subquery: bool


_DIALECTS = {
    "postgresql": _Dialect(_INSERTS["postgresql"], _READ, True, True),
    "sqlite": _Dialect(_INSERTS["sqlite"], _READ, False, True),
    # The read locks on MySQL, so that it sees the latest row whatever the snapshot.
    **{name: _Dialect(_INSERTS[name], _READ_LOCKING, True, False) for name in MYSQL_DIALECTS},
}
_OTHER = _Dialect(None, _READ, False, False)


def _dialect(name: str) -> _Dialect:
    return _DIALECTS.get(name, _OTHER)


def insert(session: AnySession, dialect: sa.Dialect, params: dict[str, t.Any]) -> bool:
    """Insert the id (``params``: consumer, event_id, processed_at, expires_at);
    whether this insert wrote the row (``False``: it was there). ``dialect`` is
    the session's engine's."""
    stmt = _dialect(dialect.name).insert
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
    stmt = _dialect(dialect.name).read
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
    dialect = _dialect(conn.dialect.name)
    batch = sa.select(_C.consumer, _C.event_id).where(gone).order_by(_C.expires_at).limit(limit)
    if dialect.skip_locked:
        batch = batch.with_for_update(skip_locked=True)
    pair = sa.tuple_(_C.consumer, _C.event_id)
    if dialect.delete_by_subquery:
        return int(conn.execute(sa.delete(_TABLE).where(pair.in_(batch), gone)).rowcount)
    keys = [tuple(row) for row in conn.execute(batch)]
    if not keys:
        return 0
    return int(conn.execute(sa.delete(_TABLE).where(pair.in_(keys), gone)).rowcount)


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
