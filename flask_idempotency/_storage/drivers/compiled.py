"""Statements of one table compiled once, for the drivers of a fast path."""

from __future__ import annotations

import datetime as dt
import typing as t

import sqlalchemy as sa

from ..dialects import dialect_for
from ..dialects.postgresql import interval


class Compiled:
    """The SQL a fast path sends, compiled once per statement and parameter names
    (constructing and compiling SQLAlchemy statements per request costs more
    than the round trips on a local database). Only used where the driver's
    :meth:`~.base.FastPath.applies` allows."""

    def __init__(self, table: sa.Table) -> None:
        self.table = table
        self._sql: dict[tuple[int, str, tuple[str, ...]], tuple[t.Any, str, dict[str, t.Any]]] = {}
        self._claims: dict[tuple[str, str, bool, bool, bool, tuple[str, ...]], list[str]] = {}

    def statement(
        self, connection: sa.Connection, stmt: t.Any, params: dict[str, t.Any]
    ) -> tuple[str, dict[str, t.Any]]:
        """``stmt`` as the driver's SQL and the constants it binds, for the names
        in ``params`` (those named ``w_*`` are the WHERE clause, the others are
        column values)."""
        names = tuple(params)
        cache_key = (id(stmt), connection.dialect.driver, names)
        found = self._sql.get(cache_key)
        # The entry holds the statement itself, so its id cannot be reused by another.
        if found is None or found[0] is not stmt:
            columns = [name for name in names if not name.startswith("w_")]
            compiled = stmt.compile(dialect=connection.dialect, column_keys=columns)
            constants = {k: v for k, v in compiled.params.items() if k not in names}
            found = self._sql[cache_key] = (stmt, str(compiled), constants)
        return found[1], found[2]

    def claim(
        self,
        dialect: sa.Dialect,
        insert: t.Any,
        read: t.Any,
        *,
        bounded: bool,
        idle_bounded: bool,
        values: dict[str, t.Any],
    ) -> list[str]:
        """The claim's statements for one batch, as the engine's dialect puts
        them together (:meth:`.Dialect.claim_batch`): the ``insert`` of
        ``values``, the ``read`` of the record, the bounds; compiled once per
        shape (engine, bounded or not, idle-bounded or not, the columns that
        have a value)."""
        # Columns left out of the INSERT are NULL: fewer parameters to send.
        columns = tuple(name for name, value in values.items() if value is not None)
        mariadb = bool(getattr(dialect, "is_mariadb", False))
        cache_key = (dialect.name, dialect.driver, mariadb, bounded, idle_bounded, columns)
        statements = self._claims.get(cache_key)
        if statements is not None:
            return statements
        parts = dialect_for(dialect.name).claim_batch(
            dialect,
            self._checked(insert, dialect, list(columns)),
            self._checked(read, dialect, None),
            bounded=bounded,
            idle_bounded=idle_bounded,
        )
        self._claims[cache_key] = parts
        return parts

    def _checked(self, stmt: t.Any, dialect: sa.Dialect, column_keys: list[str] | None) -> str:
        compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
        # Every parameter must be one the caller passes: a constant the compiler
        # bound on its own would be missing from the batch's parameters.
        named = {"w_scope", "w_key", *(col.name for col in self.table.c)}
        unexpected = set(compiled.params) - named
        assert not unexpected, unexpected
        return str(compiled)


def claim_params(
    values: dict[str, t.Any],
    *,
    wait: dt.timedelta | None,
    idle: dt.timedelta | None,
    dialect: str = "postgresql",
) -> dict[str, t.Any]:
    """The parameters of :meth:`Compiled.claim`'s batch: the record's ``values``,
    the key it reads back, the bounds (as ``dialect``'s batch takes the wait's:
    ``"1500ms"`` on PostgreSQL; the idle bound's, PostgreSQL's only, ``"500ms"``)."""
    params = {**values, "w_scope": values["scope"], "w_key": values["key"]}
    if wait is not None:
        params["wait"] = dialect_for(dialect).batch_wait(wait)
    if idle is not None:
        params["idle"] = interval(idle)
    return params
