"""How the store sends a statement on one table, and reads whether it changed its row."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session

from .._failures import SealBroken
from ..errors import TooLargeToStore
from . import added, drivers, seal
from .dialects import Executor, dialect_for, dialect_of
from .schema import Record, identity
from .sql import changed_one

# Room for the rest of a statement besides its one large value.
_STATEMENT_MARGIN = 64 * 1024


class Statements:
    """The base of the statements on one table: the connection they run on, the
    fast path where the driver has one (:mod:`.drivers`), the outcome of a
    conditional change.

    Parameters named ``w_*`` are the WHERE clause; the others are column values.
    """

    #: The keys that seal a record's sealed columns (encryption at rest,
    #: :mod:`.seal`); ``None``: stored in clear.
    keyring: seal.Keyring | None = None

    def _sealed(self, scope: str, key: str, values: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
        """``values`` (column values, in clear) with the record's sealed columns
        sealed for (scope, key): every write of those columns goes through here."""
        if self.keyring is None:
            return dict(values)
        return seal.seal_record(self.keyring, self.table.name, scope, key, values)

    def _absent(self, executor: Executor) -> frozenset[str]:
        """The columns a release added that this table lacks on ``executor``'s
        engine (a table from an earlier release, :mod:`.added`); read once per
        engine."""
        return added.absent_columns(self._connection(executor), self.table)

    def _present(self, executor: Executor, values: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
        """``values`` without the columns the table lacks: every write of a
        record's operation values goes through here (and :meth:`_sealed`)."""
        return added.without(values, self._absent(executor))

    def _read_columns(self, executor: Executor, leave_out: t.Collection[str] = ()) -> list[t.Any]:
        """The columns a read of whole records selects: all the table has on
        ``executor``'s engine, but ``leave_out``."""
        skip = {*leave_out, *self._absent(executor)}
        return [column for column in self.table.c if column.name not in skip]

    def _record(self, m: t.Mapping[t.Any, t.Any]) -> Record:
        """The record of a row as read, its sealed columns opened; raises
        :class:`SealBroken` when one does not open for this row."""
        scope, key = identity(m)
        opened = seal.open_record(self.keyring, self.table.name, scope, key, m)
        return Record.from_mapping(opened)

    def _record_or_unreadable(self, m: t.Mapping[t.Any, t.Any]) -> Record:
        """As :meth:`_record`; a row whose sealed columns do not open is the
        record of what is in clear, with :attr:`.Record.unreadable` saying why
        (the operator's reads: one such row never stops a list or a job)."""
        try:
            return self._record(m)
        except SealBroken as exc:
            return Record.unreadable_from(m, (*seal.RECORD_TEXT, *seal.RECORD_BINARY), str(exc))

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._compiled = drivers.Compiled(table)
        self._returning_cache: dict[int, tuple[t.Any, t.Any]] = {}
        # The largest statement, where the engine limits it: read once per engine.
        self._statement_limits: dict[t.Any, int | None] = {}

    def refuse_oversized(self, executor: Executor, size: int) -> None:
        """Raise :class:`TooLargeToStore` when a statement that carries a value
        of ``size`` bytes would exceed what the engine takes in one statement
        (MySQL's ``max_allowed_packet``, which it answers by dropping the
        connection: the refusal must come before the statement is sent)."""
        dialect = dialect_of(executor)
        if not dialect.limits_statement_size:
            return
        engine = executor.get_bind().engine if isinstance(executor, Session) else executor.engine
        if engine not in self._statement_limits:
            self._statement_limits[engine] = dialect.statement_limit(executor)
        limit = self._statement_limits[engine]
        if limit is not None and size + _STATEMENT_MARGIN > limit:
            raise TooLargeToStore(f"{size} bytes, max_allowed_packet is {limit}")

    def _connection(self, executor: Executor) -> sa.Connection:
        """The connection under ``executor`` that holds the table, in the
        session's transaction. Core statements go to it directly: the ORM's
        execute path (bind lookup, ORM compile hooks) costs more than the statement."""
        if isinstance(executor, sa.Connection):
            return executor
        return executor.connection(bind_arguments={"clause": self.table})

    def _execute(
        self, connection: sa.Connection, stmt: t.Any, params: dict[str, t.Any]
    ) -> sa.CursorResult[t.Any]:
        """Run ``stmt``: compiled once where the driver has a fast path, through
        SQLAlchemy elsewhere."""
        path = drivers.fast_path(connection) if params else None
        if path is None:
            return connection.execute(stmt, params)
        sql, constants = self._compiled.statement(connection, stmt, params)
        return connection.exec_driver_sql(sql, {**constants, **params})

    def _changed_one(self, executor: Executor, stmt: t.Any, params: dict[str, t.Any]) -> bool:
        """Run a conditional ``UPDATE``/``DELETE`` (or a conflict-tolerant
        ``INSERT``) of one record; whether it changed the row.

        The answer is the row the statement returns (``RETURNING``) wherever the
        engine has it for that kind of statement (PostgreSQL on every driver,
        SQLite 3.35+, MariaDB for ``DELETE`` and ``INSERT``), never a driver's
        row count: psycopg 3 under SQLAlchemy 2.1 reports -1 for an ``INSERT``.
        Only where there is no ``RETURNING`` (MySQL, MariaDB's ``UPDATE``) is it
        the matched-row count the server sends with the statement's result
        (SQLAlchemy's MySQL drivers all ask for matched, not changed, rows),
        kept with ``preserve_rowcount``. Inserts without ``RETURNING`` are
        decided by reading the fencing token back (``Store._insert``).
        """
        connection = self._connection(executor)
        if dialect_for(connection.dialect.name).returns_rows(connection.dialect, stmt):
            stmt = self._returning_form(stmt)
        path = drivers.fast_path(connection) if params else None
        if path is None:
            ran = drivers.direct(connection, stmt, params)
            if ran is None:
                return changed_one(connection, stmt, params)
            rows, count = ran
            return bool(rows) if stmt._returning else count == 1
        sql, constants = self._compiled.statement(connection, stmt, params)
        if drivers.unobserved(connection):
            rows, count = path.run(connection, sql, {**constants, **params})
            return bool(rows) if stmt._returning else count == 1
        result = connection.exec_driver_sql(sql, {**constants, **params})
        if stmt._returning:
            return result.first() is not None
        return bool(result.rowcount == 1)  # an UPDATE or DELETE: the server's count

    def _returning_form(self, stmt: t.Any) -> t.Any:
        """``stmt ... RETURNING fencing_token``, built once per statement."""
        found = self._returning_cache.get(id(stmt))
        # The entry holds the statement itself, so its id cannot be reused by another.
        if found is None or found[0] is not stmt:
            found = self._returning_cache[id(stmt)] = (
                stmt,
                stmt.returning(self.table.c.fencing_token),
            )
        return found[1]
