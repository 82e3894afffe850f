"""PostgreSQL: the production target.

* The claim is ``INSERT ... ON CONFLICT DO NOTHING``; a duplicate waits on the
  unique index for the first request's transaction.
* That wait is bounded with ``lock_timeout``, set transaction-local
  (``set_config(..., true)`` is ``SET LOCAL``: it ends with the transaction
  whatever happens, so a failed statement needs no restore).
* With ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``, a claim also sets
  ``idle_in_transaction_session_timeout`` for the rest of its transaction
  (:func:`idle_bound`): a claim whose app vanished mid-transaction (a host cut
  off, frozen or killed without a word) is ended by the server, not held until
  TCP gives up.
* A transaction that renewed a lease before its ``COMMIT`` is named by
  ``txid_current()``, so that a ``COMMIT`` whose answer was lost can be judged
  (:meth:`PostgreSQL.commit_outcome`).
* A transaction that emitted an outbox event notifies LISTENing relays; a relay
  can LISTEN through psycopg2 or psycopg 3.
* The readiness probe's write check is a lock-free read of the server's state
  and the role's privileges (:meth:`PostgreSQL.write_check`).
"""

from __future__ import annotations

import datetime as dt
import math
import time
import typing as t

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql as pg

from ..schema import as_utc
from .base import READY, Dialect, Executor, Verdict, millis


def idle_bound(param: str) -> str:
    """A select-list expression that sets ``idle_in_transaction_session_timeout``
    to ``param`` for the rest of the transaction (``SET LOCAL``), unless a
    stricter one is in force (the server's, the role's, the app's): it only
    tightens. ``CASE`` evaluates its branches lazily, so ``set_config`` runs
    only when it must; a setting of 0 (off) is not stricter."""
    current = "current_setting('idle_in_transaction_session_timeout')::interval"
    # Text in both places: a driver binding on the server (psycopg 3) sends one
    # parameter, whose type the server must deduce once.
    value = f"CAST({param} AS text)"
    return (
        f"CASE WHEN {current} BETWEEN interval '1 microsecond' AND CAST({value} AS interval) "
        f"THEN NULL ELSE set_config('idle_in_transaction_session_timeout', {value}, true) END"
    )


#: The idle bound alone, as :meth:`PostgreSQL.bound_idle` sends it (``:idle``: "500ms").
SET_IDLE = sa.text(f"SELECT {idle_bound(':idle')}")

_SET_WAIT = sa.text("SELECT current_setting('lock_timeout'), set_config('lock_timeout', :v, true)")
_RESTORE_WAIT = sa.text("SELECT set_config('lock_timeout', :v, true)")

# Where a batched claim keeps the app's lock_timeout while ours applies.
_SAVED_WAIT = "flask_idempotency.saved_lock_timeout"


def batch_bounds(bounded: bool, idle_bounded: bool) -> tuple[str | None, str | None]:
    """The statements around the insert of a claim sent as one batch (drivers
    that bind on the client, ``%(name)s`` parameters): the one that sets the
    bounds (``%(wait)s``, ``%(idle)s``) and the one that puts the app's
    ``lock_timeout`` back after the insert; ``None`` for either not needed.

    The app's ``lock_timeout`` is kept in a custom setting of the transaction
    meanwhile; all of it has ``SET LOCAL`` semantics, so a failure ends both.
    The idle bound is kept to the transaction's end: the claim is held until then.
    """
    bounds: list[str] = []
    if bounded:
        bounds += [
            f"set_config('{_SAVED_WAIT}', current_setting('lock_timeout'), true)",
            "set_config('lock_timeout', %(wait)s, true)",
        ]
    if idle_bounded:
        bounds.append(idle_bound("%(idle)s"))
    before = "SELECT " + ", ".join(bounds) if bounds else None
    after = (
        f"SELECT set_config('lock_timeout', current_setting('{_SAVED_WAIT}'), true)"
        if bounded
        else None
    )
    return before, after


#: The drivers whose connection a relay can LISTEN on and wait for.
LISTEN_DRIVERS = ("psycopg2", "psycopg")

_NOW = sa.text("SELECT clock_timestamp()")
_DEFER_FLUSH = sa.text("SELECT set_config('synchronous_commit', 'off', true)")
_TABLE_BYTES = sa.text("SELECT pg_total_relation_size(CAST(:t AS regclass))")

# Whether a transaction committed (PostgreSQL 10+), and the end of one still open
# whose client gave up on it (backend_xid is the 32-bit xid of the 64-bit id).
_TRANSACTION_STATUS = sa.text("SELECT txid_status(:xid)")
# pg_stat_activity is read once per transaction, then cached: cleared first where
# the caller's transaction may have read it already.
_FRESH_ACTIVITY = sa.text("SELECT pg_stat_clear_snapshot()")
_END_TRANSACTION = sa.text(
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_xid::text = :xid"
)


def _present(statement: str | None) -> list[str]:
    return [] if statement is None else [statement]


def interval(wait: dt.timedelta) -> str:
    """``wait`` as a PostgreSQL setting's value: ``"1500ms"``."""
    return f"{millis(wait)}ms"


class PostgreSQL(Dialect):
    name = "postgresql"
    skip_locked = True
    limit_in_subquery = True
    notifies = True

    def conflict_tolerant_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str]
    ) -> t.Any:
        return pg.insert(table).values(values).on_conflict_do_nothing(index_elements=key)

    def reclaim(self, conn: sa.Connection, tables: list[sa.Table]) -> None:
        # Plain VACUUM leaves a dead tuple's bytes in the page: FULL rewrites it.
        for table in tables:
            conn.exec_driver_sql(
                f"VACUUM FULL {conn.dialect.identifier_preparer.format_table(table)}"
            )

    def among(self, column: sa.ColumnElement[t.Any], name: str) -> sa.ColumnElement[bool]:
        return column == sa.any_(sa.bindparam(name, type_=pg.ARRAY(sa.BigInteger())))

    def pending_order(self, table: sa.Table) -> list[sa.ColumnElement[t.Any]]:
        """Id order spelled as the pending index's columns (NULL in every pending
        row): PostgreSQL does not take ``IS NULL`` as fixing an index's leading
        columns, so ``ORDER BY id`` read every pending row and sorted them for
        each batch (11 ms a take at a 10,000-event backlog, growing with it).
        (MariaDB sorts when asked this way: the base's order stays there.)"""
        c = table.c
        return [c.published_at, c.failed_at, c.id]

    def can_listen(self, driver: str) -> bool:
        return driver in LISTEN_DRIVERS

    def write_check(self, conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
        """Lock-free: a standby, or transactions read-only by default (for the
        server, the database or the role), which the new transaction shows;
        and whether the app's role may INSERT and UPDATE the table, as a claim
        does (a GRANT missing answers every claim 503; a catalog lookup, no
        lock either), granted on the table or on its columns."""
        # The probe's transaction then reads the record's table, whose lock a
        # probe stranded by a partition would hold, and make an operator's
        # ALTER TABLE (and every claim queued behind it) wait: the server ends
        # it once it sits idle as long as the probe may take.
        standby, read_only, may_write, _ = conn.execute(
            sa.text(
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
                "has_any_column_privilege(CAST(:table AS text), 'INSERT') "
                "AND has_any_column_privilege(CAST(:table AS text), 'UPDATE'), "
                + idle_bound(":idle")
            ),
            {
                "idle": f"{max(1, math.ceil(timeout.total_seconds()))}s",
                "table": conn.dialect.identifier_preparer.format_table(table),
            },
        ).one()
        if standby:
            return Verdict(read_only="the server is a standby (pg_is_in_recovery())")
        if read_only == "on":
            return Verdict(read_only="transactions are read-only (default_transaction_read_only)")
        if not may_write:
            return Verdict(forbidden=f"the app's role may not INSERT and UPDATE {table.name}")
        return READY

    def now(self, conn: sa.Connection) -> dt.datetime:
        """``clock_timestamp()``: the time of the call, not of the transaction's start."""
        return t.cast(dt.datetime, as_utc(conn.execute(_NOW).scalar_one()))

    def defer_flush(self, conn: sa.Connection) -> None:
        """``synchronous_commit`` off for the rest of the transaction (``SET
        LOCAL``). A cleanup batch's commit then leaves its WAL to the WAL writer
        instead of flushing it itself: sampled under load (bench/cleanup.py),
        the writers' time went to WAL flushes, queued behind each batch's
        (``IO:WALSync``, ``LWLock:WALWrite``), never to a lock of the cleanup's.
        Safe for what it deletes: WAL is flushed in order, so a later commit
        that depends on a deletion (a claim of a purged key) flushes it first,
        and a crash can lose only deletions nothing depended on: rows still
        expired, deleted again by the next run."""
        conn.execute(_DEFER_FLUSH)

    def claim_batch(
        self, dialect: sa.Dialect, insert: str, read: str, *, bounded: bool, idle_bounded: bool
    ) -> list[str]:
        """The bounds, the insert, the app's ``lock_timeout`` put back, the read
        (:func:`batch_bounds`): the read comes last, so its row is what the
        batch returns; its own statement, it sees the row our insert made, or
        the one it yielded to."""
        before, after = batch_bounds(bounded, idle_bounded)
        return [*_present(before), insert, *_present(after), read]

    def batch_wait(self, wait: dt.timedelta) -> t.Any:
        return interval(wait)

    def set_wait(self, executor: Executor, wait: dt.timedelta) -> t.Any:
        return executor.execute(_SET_WAIT, {"v": interval(wait)}).scalar_one()

    def restore_wait(self, executor: Executor, previous: t.Any, *, failed: bool) -> None:
        if not failed:  # after a failure the transaction is over, and SET LOCAL with it
            executor.execute(_RESTORE_WAIT, {"v": previous})

    def bound_idle(self, executor: Executor, idle: dt.timedelta) -> None:
        executor.execute(SET_IDLE, {"idle": interval(idle)})

    def table_bytes(self, conn: sa.Connection, table: sa.Table) -> int | None:
        return t.cast("int | None", conn.execute(_TABLE_BYTES, {"t": table.name}).scalar_one())

    def transaction_id(self) -> t.Any:
        """``txid_current()``: 64 bits, epoch included, so ``txid_status`` can
        judge it however old."""
        return sa.func.txid_current()

    def commit_outcome(
        self, executor: sa.Engine | sa.Connection, transaction: int, wait: dt.timedelta
    ) -> bool | None:
        """Whether ``transaction`` committed: ``True`` or ``False``, or ``None``
        when that cannot be known within ``wait``.

        ``txid_status`` is PostgreSQL's answer to exactly this question (a
        connection lost during ``COMMIT``). A transaction still in progress
        after half of ``wait`` has a ``COMMIT`` that may yet arrive (held in a
        network buffer or a proxy) while its client has given up on it: its
        backend is terminated (allowed for the app's own role), so that it
        can never commit later, and the status read again.

        ``executor``: an engine (read on a connection of its own), or a
        connection in a transaction of the caller's, which is left usable
        (where a second connection may not be had: a pool of one).
        """
        if isinstance(executor, sa.Engine):
            with executor.connect() as conn:
                return _commit_outcome(conn, transaction, wait, own=True)
        return _commit_outcome(executor, transaction, wait, own=False)


def _commit_outcome(
    conn: sa.Connection, transaction: int, wait: dt.timedelta, *, own: bool
) -> bool | None:
    deadline = time.monotonic() + wait.total_seconds()
    status = _settle(conn, transaction, deadline - wait.total_seconds() / 2, own)
    if status == "in progress":
        end = {"xid": str(transaction % 2**32)}
        try:
            if own:
                conn.execute(_END_TRANSACTION, end)
                conn.commit()
            else:  # a savepoint: a refusal must not abort the caller's transaction
                with conn.begin_nested():
                    conn.execute(_FRESH_ACTIVITY)
                    conn.execute(_END_TRANSACTION, end)
        except sa_exc.DBAPIError:  # not allowed to: then it stays unknown
            if own:
                conn.rollback()
            return None
        status = _settle(conn, transaction, deadline, own)
    if status == "committed":
        return True
    if status == "aborted":
        return False
    return None  # too old to tell (NULL), or still in progress


def _settle(conn: sa.Connection, transaction: int, deadline: float, own: bool) -> str | None:
    """``txid_status`` of ``transaction``, polled until it is no longer in
    progress or ``deadline`` (a ``time.monotonic()``) passes. (It reads the
    commit log, not a snapshot: a transaction of the caller's sees it change.)"""
    pause = 0.01
    while True:
        status = conn.execute(_TRANSACTION_STATUS, {"xid": transaction}).scalar()
        if own:
            conn.rollback()
        if status != "in progress" or time.monotonic() >= deadline:
            return t.cast("str | None", status)
        time.sleep(pause)
        pause = min(pause * 2, 0.1)
