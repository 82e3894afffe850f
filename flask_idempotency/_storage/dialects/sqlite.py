"""SQLite: the embedded default for development and demos.

* The claim is ``INSERT ... ON CONFLICT DO NOTHING`` (``RETURNING`` from 3.35).
* A writer waits on another for at most the busy timeout, which the claim sets
  (``PRAGMA busy_timeout``) and puts back afterwards.
* The clock is the app host's, which SQLite reads; milliseconds.
* One writer at a time, and no row locks: a queue's take first takes the
  write lock (:meth:`SQLite.lock_writers`) instead of skipping locked rows.
* The readiness probe's write check is a write that touches no row.
* pysqlite can commit every statement on its own in ways SQLAlchemy does not
  see (:meth:`SQLite.autocommits`), which the store refuses.
"""

from __future__ import annotations

import datetime as dt
import typing as t

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from ..schema import as_utc
from .base import Dialect, Executor, Verdict, millis, write_nothing

# SQLite's 'now' is UTC; %f gives milliseconds (the finest it keeps).
_NOW = sa.text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")


def _driver_connection(executor: Executor) -> t.Any:
    """The ``sqlite3.Connection`` under a session or connection, in its transaction."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    return connection.connection.driver_connection


class SQLite(Dialect):
    name = "sqlite"
    limit_in_subquery = True

    def conflict_tolerant_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str]
    ) -> t.Any:
        return sqlite.insert(table).values(values).on_conflict_do_nothing(index_elements=key)

    def lock_writers(self, conn: sa.Connection, table: sa.Table, column: str) -> None:
        """A write starts the write transaction even when it matches nothing."""
        conn.execute(sa.update(table).where(sa.false()).values({column: table.c[column]}))

    def erase_securely(self, conn: sa.Connection) -> t.Any:
        """``PRAGMA secure_delete=ON``: freed cells and pages are zeroed (its
        upstream default is off); the previous value, for :meth:`restore_erasing`."""
        previous = conn.exec_driver_sql("PRAGMA secure_delete").scalar()
        conn.exec_driver_sql("PRAGMA secure_delete=ON")
        return previous

    def restore_erasing(self, conn: sa.Connection, previous: t.Any) -> None:
        if previous is not None:
            conn.exec_driver_sql(f"PRAGMA secure_delete={int(previous)}")

    def after_erasure(self, conn: sa.Connection) -> None:
        """In WAL mode, the log still holds the pages as they were: checkpoint
        them into the file and truncate the log (``wal_checkpoint(TRUNCATE)``)."""
        if str(conn.exec_driver_sql("PRAGMA journal_mode").scalar()).lower() == "wal":
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")

    def reclaim(self, conn: sa.Connection, tables: list[sa.Table]) -> None:
        conn.exec_driver_sql("VACUUM")

    def skip_locked_take(self, query: sa.Select[t.Any]) -> sa.Select[t.Any]:
        """``query`` itself: the write lock (:meth:`lock_writers`) keeps takers apart."""
        return query

    def write_check(self, conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
        return write_nothing(conn, table)

    def now(self, conn: sa.Connection) -> dt.datetime:
        text = conn.execute(_NOW).scalar_one()
        return t.cast(dt.datetime, as_utc(dt.datetime.fromisoformat(text)))

    def set_wait(self, executor: Executor, wait: dt.timedelta) -> t.Any:
        # Straight on the driver's connection: a PRAGMA there takes
        # microseconds, through SQLAlchemy's statement machinery ten times more.
        raw = _driver_connection(executor)
        previous = raw.execute("PRAGMA busy_timeout").fetchone()[0]
        raw.execute(f"PRAGMA busy_timeout = {int(millis(wait))}")
        return previous

    def restore_wait(self, executor: Executor, previous: t.Any, *, failed: bool) -> None:
        _driver_connection(executor).execute(f"PRAGMA busy_timeout = {int(previous)}")

    def open_transaction(self, connection: sa.Connection) -> None:
        """pysqlite sends ``BEGIN`` only before a write: a first statement that is a
        savepoint would open a transaction of its own, committed at its release.
        (Nothing to do where the app's own settings began it.)"""
        raw = connection.connection.driver_connection
        if raw is not None and not raw.in_transaction:
            raw.execute("BEGIN")

    def autocommits(self, connection: sa.Connection) -> bool:
        """pysqlite's own autocommit, which SQLAlchemy does not see:
        ``connect_args={"isolation_level": None}`` (unless a "begin" listener
        sends BEGIN itself, SQLAlchemy's recipe for SAVEPOINT: then a
        transaction is open by now), or Python 3.12's ``autocommit=True``."""
        raw: t.Any = connection.connection.driver_connection
        return getattr(raw, "autocommit", None) is True or (
            getattr(raw, "isolation_level", "") is None and not raw.in_transaction
        )
