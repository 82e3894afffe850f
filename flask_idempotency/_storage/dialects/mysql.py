"""MySQL and MariaDB.

* The claim is ``INSERT IGNORE``: the values are ours and bounded, so IGNORE
  can only skip the duplicate. No ``RETURNING`` on MySQL (MariaDB has it for
  ``INSERT`` and ``DELETE``): whether the insert won is read back from the
  fencing token, and an ``UPDATE``'s outcome is the matched-row count the
  server sends with its result.
* A duplicate's wait is bounded with ``innodb_lock_wait_timeout`` (row locks)
  and ``lock_wait_timeout`` (a lock on the table: ``LOCK TABLES``, a
  migration's ``ALTER TABLE``), in whole seconds. The variables are per
  connection, not per transaction: they are restored even after a failure, or
  the pooled connection would keep our bound. On MariaDB the claim's batch
  (:meth:`MySQL.claim_batch`) bounds each statement with ``SET STATEMENT ...
  FOR``, which the server undoes after the statement whatever its outcome.
* The record is read with a locking read, so that a REPEATABLE READ snapshot
  taken earlier in the transaction cannot hide the winner's row.
* Scope and key columns are VARBINARY (the default collations fold case and
  ignore trailing spaces): lengths are counted in bytes.
* A statement larger than ``max_allowed_packet`` is answered by dropping the
  connection, so the store refuses one before sending it.
* An outbox event's insert is ``ON DUPLICATE KEY UPDATE`` a no-op (not
  ``INSERT IGNORE``, which would also swallow truncation errors); no
  RETURNING there, so the existing row is read back.
* A queue's take runs under READ COMMITTED: InnoDB's REPEATABLE READ would take
  next-key (gap) locks over the range scanned.
* The readiness probe's write check is a write that touches no row.
"""

from __future__ import annotations

import datetime as dt
import math
import typing as t

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from .. import dberrors
from ..schema import as_utc
from .base import Dialect, Executor, Verdict, millis, write_nothing

# Both bounds: innodb_lock_wait_timeout for row locks, lock_wait_timeout for
# metadata and table locks (LOCK TABLES, a migration's ALTER TABLE), whose
# default is a day. Either gives up with ER_LOCK_WAIT_TIMEOUT (1205).
_SET_WAIT_SQL = (
    "SET @flask_idempotency_wait = @@SESSION.innodb_lock_wait_timeout, "
    "@flask_idempotency_table_wait = @@SESSION.lock_wait_timeout, "
    "SESSION innodb_lock_wait_timeout = {v}, SESSION lock_wait_timeout = {v}"
)
#: Puts back what the wait's bound replaced; sent on its own by a fast path
#: whose batch failed before it got there.
RESTORE_WAIT_SQL = (
    "SET SESSION innodb_lock_wait_timeout = @flask_idempotency_wait, "
    "SESSION lock_wait_timeout = @flask_idempotency_table_wait"
)
_SET_WAIT = sa.text(_SET_WAIT_SQL.format(v=":v"))
_RESTORE_WAIT = sa.text(RESTORE_WAIT_SQL)
#: MariaDB's bound on one statement: set before it, put back after it by the
#: server, failed or not (MariaDB 10.1.2; MySQL has no such statement, and its
#: ``SET_VAR`` hint does not take ``innodb_lock_wait_timeout``).
_FOR_ONE_STATEMENT = (
    "SET STATEMENT innodb_lock_wait_timeout = %(wait)s, lock_wait_timeout = %(wait)s FOR "
)
#: PyMySQL's ``CLIENT.FOUND_ROWS`` (``pymysql.constants.CLIENT``): an
#: ``UPDATE``'s row count is the rows it matched, not those it changed.
_FOUND_ROWS = 1 << 1
_NOW = sa.text("SELECT UTC_TIMESTAMP(6)")
_PACKET_LIMIT = sa.text("SELECT @@max_allowed_packet")
#: How long the no-wait probe of a record waits for a lock on its table, where
#: ``NOWAIT`` does not cover one (MySQL): the least the server takes.
_PROBE_WAIT = dt.timedelta(seconds=1)


def _seconds(wait: dt.timedelta) -> int:
    """The variables take whole seconds, at least 1 (0 would not wait at all)."""
    return max(1, math.ceil(millis(wait) / 1000))


class MySQL(Dialect):
    """MySQL or MariaDB, by SQLAlchemy's ``name`` for it (``mysql``, ``mariadb``)."""

    locking_reads = True
    # MySQL 8 and MariaDB 10.6 know SKIP LOCKED too; neither takes LIMIT in an
    # IN subquery.
    skip_locked = True
    limits_statement_size = True
    # InnoDB's REPEATABLE READ would take next-key (gap) locks over the range a
    # take scans, up to the index's end when fewer than a batch are pending:
    # every insert at the end would wait for the take. READ COMMITTED locks the
    # selected rows only.
    take_isolation = "READ COMMITTED"
    keeping_insert_returns = False

    def reclaim(self, conn: sa.Connection, tables: list[sa.Table]) -> None:
        for table in tables:
            name = conn.dialect.identifier_preparer.format_table(table)
            conn.exec_driver_sql(f"OPTIMIZE TABLE {name}").all()

    def __init__(self, name: str) -> None:
        self.name = name

    def conflict_tolerant_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str]
    ) -> t.Any:
        return sa.insert(table).values(values).prefix_with("IGNORE", dialect=self.name)

    def keeping_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str], returned: t.Any
    ) -> t.Any:
        """``ON DUPLICATE KEY UPDATE`` the key to itself: a no-op on a duplicate,
        and unlike ``INSERT IGNORE`` every other error still raised."""
        stmt = mysql.insert(table).values(**values)
        return stmt.on_duplicate_key_update({column: stmt.inserted[column] for column in key})

    def write_check(self, conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
        return write_nothing(conn, table)

    def now(self, conn: sa.Connection) -> dt.datetime:
        """``UTC_TIMESTAMP(6)``: microseconds, whatever the session's time zone."""
        return t.cast(dt.datetime, as_utc(conn.execute(_NOW).scalar_one()))

    def record_locked(
        self, conn: sa.Connection, query: sa.Select[t.Any], params: dict[str, t.Any]
    ) -> bool | None:
        """``FOR UPDATE NOWAIT`` (MySQL 8, MariaDB 10.3): its lock error at once
        when a transaction holds the row (a duplicate's uncommitted claim
        included), since a lock wait timeout does not say what it waited on.

        The same error comes when the table itself is locked (``LOCK TABLES``,
        a migration's ``ALTER TABLE``), which is no duplicate: then the same
        read with a ``WHERE`` that matches no row, which takes the table's lock
        but no row's, fails too, and its error is raised (a probe that fails
        says "not a duplicate"). MySQL's ``NOWAIT`` covers row locks only: a
        lock on the table is waited for at most :data:`_PROBE_WAIT`."""
        self.set_wait(conn, _PROBE_WAIT)
        try:
            try:
                conn.execute(query.with_for_update(nowait=True), params)
            except sa.exc.DBAPIError as exc:
                conn.rollback()
                if dberrors.classify(exc) is not dberrors.CONFLICT:
                    raise
                conn.execute(query.where(sa.false()).with_for_update(nowait=True), params)
                conn.rollback()
                return True
            conn.rollback()
            return False
        finally:
            self.restore_wait(conn, None, failed=False)

    def claim_batch(
        self, dialect: sa.Dialect, insert: str, read: str, *, bounded: bool, idle_bounded: bool
    ) -> list[str]:
        """The ``INSERT IGNORE`` and the locking read of the record, each bounded
        on its own with ``SET STATEMENT`` on MariaDB: nothing to put back, even
        after a failure, so the statements may also travel one by one where the
        driver's connection takes no multi-statement string. There the insert
        returns its fencing token (``RETURNING``, MariaDB 10.5), only when it
        wrote the row: a new key's claim ends with it (one round trip), a
        taken key's goes on to the read (two). On MySQL the bound is set
        before and put back after the read (:data:`RESTORE_WAIT_SQL`, which
        the fast path sends itself should the batch fail before it). No idle
        bound: the server has none."""
        if not getattr(dialect, "is_mariadb", False):
            if not bounded:
                return [insert, read]
            return [_SET_WAIT_SQL.format(v="%(wait)s"), insert, read, RESTORE_WAIT_SQL]
        if dialect.insert_returning:
            insert += " RETURNING fencing_token"
        if not bounded:
            return [insert, read]
        return [_FOR_ONE_STATEMENT + insert, _FOR_ONE_STATEMENT + read]

    def batch_wait(self, wait: dt.timedelta) -> t.Any:
        return _seconds(wait)

    def set_wait(self, executor: Executor, wait: dt.timedelta) -> t.Any:
        executor.execute(_SET_WAIT, {"v": _seconds(wait)})
        return None  # the previous value waits in a user variable of the session

    def restore_wait(self, executor: Executor, previous: t.Any, *, failed: bool) -> None:
        executor.execute(_RESTORE_WAIT)

    def counts_changed_rows(self, connection: sa.Connection) -> bool:
        """A PyMySQL connection opened without ``CLIENT.FOUND_ROWS``, which
        SQLAlchemy adds to the ``client_flag`` it builds from the URL, but which
        ``connect_args={"client_flag": ...}`` replaces (as when asking for
        multi-statement strings, :mod:`..drivers.pymysql`). (mysqlclient's
        connection does not say: taken as SQLAlchemy opened it.)"""
        flag = getattr(connection.connection.driver_connection, "client_flag", None)
        return isinstance(flag, int) and not flag & _FOUND_ROWS

    def statement_limit(self, executor: Executor) -> int | None:
        return int(executor.execute(_PACKET_LIMIT).scalar_one())

    def text_length(self, value: str) -> int:
        return len(value.encode())
