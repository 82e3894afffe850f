"""What the store asks of a database engine: the interface each dialect module fills in.

:class:`Dialect` itself is the engine the extension knows nothing particular
about, served with what SQLAlchemy gives every engine: a claim inserted inside
a savepoint (a unique violation means "exists"), no bound of ours on lock
waits, ``CURRENT_TIMESTAMP`` for the clock. The modules beside this one
override what their engine does better or differently; the store above never
asks which engine it runs on.
"""

from __future__ import annotations

import datetime as dt
import math
import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session

from ..schema import as_utc

Executor = Session | sa.Connection


def millis(wait: dt.timedelta) -> int:
    """``wait`` in whole milliseconds, rounded up, at least 1 (0 means "no bound")."""
    return max(1, math.ceil(wait.total_seconds() * 1000))


class Verdict(t.NamedTuple):
    """What the readiness probe's write check found: ready when both are ``None``."""

    #: Why the database refuses writes (fixed words naming the setting).
    read_only: str | None = None
    #: What the app's role may not do that the claim needs (PostgreSQL).
    forbidden: str | None = None


READY = Verdict()


class Deleted(t.NamedTuple):
    """What one batch of :meth:`Dialect.delete_batch` deleted."""

    rows: int
    #: The largest value of the batch's ``last`` column among the rows it
    #: deleted (or, where the batch is read first, chose); ``None`` when none,
    #: when not asked, or where the engine cannot say.
    last: t.Any = None


def _listed(column: sa.ColumnElement[t.Any] | None) -> list[sa.ColumnElement[t.Any]]:
    return [] if column is None else [column]


def write_nothing(conn: sa.Connection, table: sa.Table) -> Verdict:
    """The server's own verdict on the claim's write: it refuses this write
    exactly as it would refuse the claim (so a user allowed to write on a
    read_only server passes); the refusal is raised, and the caller says why.

    "scope IS NULL" matches no row (the column is NOT NULL: MySQL plans an
    "Impossible WHERE", locking nothing), and names a key column, as
    sql_safe_updates wants (it refuses WHERE false). An UPDATE, not a DELETE:
    a claim needs INSERT and UPDATE, never DELETE (cleanup may run as another
    role), so an app user without DELETE stays ready."""
    conn.execute(sa.update(table).where(table.c.scope.is_(None)).values(status=table.c.status))
    return READY


class Dialect:
    """One database engine's way of doing what differs between engines.

    Instances are stateless and shared (one per dialect name, see
    :func:`~flask_idempotency._storage.dialects.dialect_for`).
    """

    #: SQLAlchemy's name of the dialect (``""``: an engine without a module here).
    name = ""
    #: Reads of a record lock it in share mode (``FOR SHARE``), so that a
    #: snapshot taken earlier in the transaction cannot hide a committed row.
    locking_reads = False
    #: A batch of rows to delete can be chosen ``FOR UPDATE SKIP LOCKED``.
    skip_locked = False
    #: ``DELETE ... WHERE (k) IN (SELECT ... LIMIT n)`` is accepted; elsewhere
    #: the batch is read first, then deleted by its keys.
    limit_in_subquery = False
    #: The server refuses (by dropping the connection) a statement larger than
    #: :meth:`statement_limit`, which the store checks before sending one.
    limits_statement_size = False
    #: A transaction can wake a listener at its commit (``NOTIFY``).
    notifies = False
    #: The isolation level a queue's take (choose a batch, lease it) runs
    #: under, where the default would lock more than the rows taken.
    take_isolation: str | None = None
    #: Whether the insert of :meth:`keeping_insert` tells whether it wrote the
    #: row by what it returns; where it does not, the caller reads the row back.
    keeping_insert_returns = True

    def conflict_tolerant_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str]
    ) -> t.Any | None:
        """An insert of ``values`` that inserts nothing when a row with the same
        ``key`` columns exists, or ``None`` where the engine has none (then the
        insert runs in a savepoint, and a unique violation means "exists")."""
        return None

    def keeping_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str], returned: t.Any
    ) -> t.Any:
        """An insert of ``values`` that leaves a row with the same ``key``
        columns as it is and otherwise fails as a plain insert would (a value
        too long, a NULL), returning ``returned`` of the row it wrote where
        :attr:`keeping_insert_returns`.

        Here: the :meth:`conflict_tolerant_insert` ``RETURNING returned``, or a
        plain insert (a duplicate raises) where the engine has none. (An engine
        without a module here is asked for the rows this plain insert returns.)
        """
        stmt = self.conflict_tolerant_insert(table, values, key)
        if stmt is None:
            return sa.insert(table).values(**values)
        return stmt.returning(returned)

    def read_latest(self, query: sa.Select[t.Any], *, read: bool = True) -> sa.Select[t.Any]:
        """``query`` made to see the latest committed rows, whatever snapshot the
        transaction took: a locking read (``read``: in share mode) where
        :attr:`locking_reads`, ``query`` itself elsewhere."""
        return query.with_for_update(read=read) if self.locking_reads else query

    def delete_batch(
        self,
        conn: sa.Connection,
        table: sa.Table,
        key: t.Sequence[sa.ColumnElement[t.Any]],
        batch: sa.Select[t.Any],
        *conditions: sa.ColumnElement[bool],
        last: sa.ColumnElement[t.Any] | None = None,
    ) -> Deleted:
        """Delete the rows ``batch`` chooses (a select of the ``key`` columns,
        ordered and limited) that still meet ``conditions``, in ``conn``'s
        transaction; the number deleted and, with ``last`` (the column
        ``batch`` is ordered by), its largest value among them.

        Where :attr:`skip_locked`, the batch is chosen ``FOR UPDATE SKIP
        LOCKED``: rows another deleter (or a writer) holds are skipped, so
        deleters never wait on each other. Where :attr:`limit_in_subquery`,
        one ``DELETE ... WHERE (key) IN (batch)``, ``RETURNING last`` where the
        engine returns rows from a ``DELETE`` (elsewhere ``last`` is not known:
        ``None``); elsewhere the batch, with ``last``, is read (and locked)
        first, then deleted by its keys (``last``: the largest read).
        """
        if self.skip_locked:
            batch = batch.with_for_update(skip_locked=True)
        pair = sa.tuple_(*key)
        if self.limit_in_subquery:
            stmt = sa.delete(table).where(pair.in_(batch), *conditions)
            if last is None or not self.returns_rows(conn.dialect, stmt):
                return Deleted(int(conn.execute(stmt).rowcount))
            values = conn.execute(stmt.returning(last)).scalars().all()
            return Deleted(len(values), max(values, default=None))
        rows = [tuple(row) for row in conn.execute(batch.add_columns(*_listed(last)))]
        if not rows:
            return Deleted(0)
        width = len(key)
        keys = [row[:width] for row in rows]
        largest = max((row[width] for row in rows), default=None) if last is not None else None
        deleted = conn.execute(sa.delete(table).where(pair.in_(keys), *conditions)).rowcount
        return Deleted(int(deleted), largest)

    def defer_flush(self, conn: sa.Connection) -> None:
        """Let this transaction's commit return before its log is on disk, where
        the engine allows it per transaction (PostgreSQL): for cleanup's
        batches, whose loss in a crash only leaves expired rows to delete again.
        Only in a transaction that is the cleanup's own (never in a caller's,
        whose other writes would lose their durability with it)."""

    def lock_writers(self, conn: sa.Connection, table: sa.Table, column: str) -> None:
        """Take the database's one write lock now, where the engine has one for
        all writers (SQLite), so that a second transaction doing the same waits
        here, before it reads anything (by a write of ``table``'s ``column`` to
        itself). Nothing elsewhere."""

    def erase_securely(self, conn: sa.Connection) -> t.Any:
        """Make the erasure's writes on ``conn`` overwrite the space they free,
        where the engine can (SQLite's ``secure_delete``); what
        :meth:`restore_erasing` puts back. Here nothing: a server keeps old row
        versions until it reclaims them itself (VACUUM, purge), as documented."""
        return None

    def restore_erasing(self, conn: sa.Connection, previous: t.Any) -> None:
        """Put back what :meth:`erase_securely` changed on ``conn`` (a pooled connection)."""

    def after_erasure(self, conn: sa.Connection) -> None:
        """After an erasure, drop the engine's own copies of the old rows where it
        can from an ordinary connection (SQLite: its write-ahead log). Nothing here."""

    def reclaim(self, conn: sa.Connection, tables: list[sa.Table]) -> None:
        """Rewrite ``tables`` so that no old row version stays in the database's
        files (``erase --vacuum``); ``conn`` is in autocommit. The engine's
        statement: SQLite ``VACUUM`` (the whole file), PostgreSQL ``VACUUM FULL``
        (an exclusive lock while it runs), MariaDB/MySQL ``OPTIMIZE TABLE``."""
        raise NotImplementedError(f"no vacuum offered for {conn.dialect.name}")

    def among(self, column: sa.ColumnElement[t.Any], name: str) -> sa.ColumnElement[bool]:
        """``column IN (ids)``, the ids a list given as the parameter ``name``
        when the statement runs: one bound parameter per id (PostgreSQL: one
        array, so that a batch of a thousand ids is one short statement whose
        text does not change with its size)."""
        return column.in_(sa.bindparam(name, expanding=True))

    def pending_order(self, table: sa.Table) -> list[sa.ColumnElement[t.Any]]:
        """The ORDER BY of the relay's take of pending outbox rows (both
        ``published_at`` and ``failed_at`` NULL): id order, which the pending
        index (``published_at, failed_at, id``) gives for the batch's rows alone
        on MariaDB/MySQL and SQLite when asked by id."""
        return [table.c.id]

    def skip_locked_take(self, query: sa.Select[t.Any]) -> sa.Select[t.Any]:
        """``query``, choosing a queue's batch that concurrent takers split
        between them: ``FOR UPDATE SKIP LOCKED`` (for an engine without a
        module here, as SQLAlchemy renders it)."""
        return query.with_for_update(skip_locked=True)

    def write_check(self, conn: sa.Connection, table: sa.Table, timeout: dt.timedelta) -> Verdict:
        """The readiness probe's check that the database would accept the
        claim's write on ``table``: a verdict, or the server's refusal itself
        raised where the check is a write. The first statement of ``conn``'s
        transaction, which the caller rolls back; ``timeout`` is how long the
        probe may take. Here no check: :data:`READY`."""
        return READY

    def can_listen(self, driver: str) -> bool:
        """Whether a connection through ``driver`` can ``LISTEN`` for what
        :attr:`notifies` sends, and be waited on."""
        return False

    def returns_rows(self, dialect: sa.Dialect, stmt: t.Any) -> bool:
        """Whether the engine returns rows (``RETURNING``) from this kind of
        statement: SQLAlchemy's flags for the connected server, read at each
        call (they depend on the server's version)."""
        if isinstance(stmt, sa.Insert):
            return bool(dialect.insert_returning)
        if isinstance(stmt, sa.Update):
            return bool(dialect.update_returning)
        if isinstance(stmt, sa.Delete):
            return bool(dialect.delete_returning)
        return False

    def now(self, conn: sa.Connection) -> dt.datetime:
        """The database server's clock, as an aware UTC datetime."""
        value = conn.execute(sa.select(sa.func.current_timestamp())).scalar_one()
        return t.cast(dt.datetime, as_utc(value))

    def record_locked(
        self, conn: sa.Connection, query: sa.Select[t.Any], params: dict[str, t.Any]
    ) -> bool | None:
        """Whether another transaction holds a lock on the row ``query`` reads,
        asked without waiting, on ``conn`` (its own transaction, ended after);
        ``None`` where the engine needs no such probe (PostgreSQL's error
        already says) or has none (SQLite: one lock for the whole database)."""
        return None

    def claim_batch(
        self, dialect: sa.Dialect, insert: str, read: str, *, bounded: bool, idle_bounded: bool
    ) -> list[str]:
        """The claim as a driver fast path sends it (:mod:`..drivers`): the
        ``insert`` and the ``read`` of the record (driver SQL, ``%(name)s``
        parameters), with the statements that bound the insert's wait
        (``%(wait)s``, :meth:`batch_wait`) and, where the engine has one, the
        transaction's idle time (``%(idle)s``). The record is the first row of
        the last statement that returns rows. Only engines with a fast path."""
        raise NotImplementedError(self.name)

    def batch_wait(self, wait: dt.timedelta) -> t.Any:
        """``wait`` as :meth:`claim_batch`'s ``%(wait)s``."""
        raise NotImplementedError(self.name)

    def set_wait(self, executor: Executor, wait: dt.timedelta) -> t.Any:
        """Bound how long the next statements wait on another transaction's locks;
        what :meth:`restore_wait` needs to put the connection's own bound back."""
        return None

    def restore_wait(self, executor: Executor, previous: t.Any, *, failed: bool) -> None:
        """Put back the bound :meth:`set_wait` replaced (``failed``: a statement
        in between failed, and the transaction may be over)."""

    def bound_idle(self, executor: Executor, idle: dt.timedelta) -> None:
        """Have the server end the rest of this transaction should it sit idle
        for ``idle`` (only where the server can: PostgreSQL)."""

    def open_transaction(self, connection: sa.Connection) -> None:
        """Make sure the database transaction SQLAlchemy began on ``connection`` is
        open on the server too, before the next statement (which may be a
        savepoint)."""

    def autocommits(self, connection: sa.Connection) -> bool:
        """Whether the driver's connection commits each statement on its own in a
        way SQLAlchemy's isolation level does not show."""
        return False

    def counts_changed_rows(self, connection: sa.Connection) -> bool:
        """Whether the driver's connection reports rows changed, not rows
        matched, for an ``UPDATE`` (a row count :func:`.sql.changed_one` reads
        where the engine has no ``RETURNING``)."""
        return False

    def statement_limit(self, executor: Executor) -> int | None:
        """The largest statement the server takes, in bytes (where
        :attr:`limits_statement_size`)."""
        return None

    def text_length(self, value: str) -> int:
        """The length the engine's ``substr`` counts in a scope or key column."""
        return len(value)

    def table_bytes(self, conn: sa.Connection, table: sa.Table) -> int | None:
        """The table's size on disk, indexes included, where the engine tells it."""
        return None

    def transaction_id(self) -> t.Any | None:
        """A select-list expression naming the current transaction, whose commit
        :meth:`commit_outcome` can judge later; ``None`` where the engine cannot."""
        return None

    def commit_outcome(
        self, executor: sa.Engine | sa.Connection, transaction: int, wait: dt.timedelta
    ) -> bool | None:
        """Whether ``transaction`` (named by :meth:`transaction_id`) committed."""
        raise NotImplementedError(f"{self.name or 'this engine'} cannot name a transaction")
