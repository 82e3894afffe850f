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

    def conflict_tolerant_insert(
        self, table: sa.Table, values: dict[str, t.Any], key: list[str]
    ) -> t.Any | None:
        """An insert of ``values`` that inserts nothing when a row with the same
        ``key`` columns exists, or ``None`` where the engine has none (then the
        insert runs in a savepoint, and a unique violation means "exists")."""
        return None

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
