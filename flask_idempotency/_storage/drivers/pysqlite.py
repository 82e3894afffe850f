"""pysqlite (the standard library's ``sqlite3``): the record's statements
compiled once and run on the driver's connection, converted as SQLAlchemy
converts them.

On SQLite the statement itself takes microseconds; SQLAlchemy's execution
around it (cache key, execution context, result set-up) takes several times
more, and a request runs two or three of them. Here each statement is compiled
once per engine's dialect and parameter names; each execution binds the values
through the same type conversions SQLAlchemy would apply (so the rows written
and read are exactly SQLAlchemy's), on the same connection, in the same
transaction.

Only where nothing would miss those statements (:func:`.base.unobserved`),
without ``schema_translate_map``, and for a
statement whose every value is a parameter or a constant (no Python-side
default to compute per execution). Elsewhere the statement goes through
SQLAlchemy.
"""

from __future__ import annotations

import typing as t
import weakref

import sqlalchemy as sa

from .base import as_sqlalchemy_error, begun, unobserved

Processor = t.Callable[[t.Any], t.Any] | None


class Prepared(t.NamedTuple):
    """One statement, compiled for one dialect and set of parameter names."""

    #: The statement, held so that the id it is cached under is not reused.
    stmt: t.Any
    sql: str
    #: Per positional parameter: its name, the constant the statement binds
    #: (when the caller does not pass it), SQLAlchemy's conversion of its value.
    binds: tuple[tuple[str, t.Any, Processor], ...]
    #: The names of the columns the statement returns, and their conversions.
    columns: tuple[str, ...]
    results: tuple[Processor, ...]


# Prepared statements, per dialect (one per engine) and (statement, names);
# ``None``: the statement cannot be run here (a Python-side default).
_prepared: weakref.WeakKeyDictionary[sa.Dialect, dict[t.Any, Prepared | None]] = (
    weakref.WeakKeyDictionary()
)


def applies(connection: sa.Connection) -> bool:
    """Whether the record's statements may run on ``connection``'s driver
    directly (see the module's documentation)."""
    dialect = connection.dialect
    if dialect.name != "sqlite" or dialect.driver != "pysqlite" or dialect.paramstyle != "qmark":
        return False
    if connection.get_execution_options().get("schema_translate_map"):
        return False
    return unobserved(connection)


def prepare(dialect: sa.Dialect, stmt: t.Any, names: tuple[str, ...]) -> Prepared | None:
    """``stmt`` compiled for ``dialect`` with the parameters ``names`` (those
    named ``w_*`` are the WHERE clause, the others column values), once;
    ``None`` when it cannot run here."""
    cache = _prepared.get(dialect)
    if cache is None:
        cache = _prepared[dialect] = {}
    cache_key = (id(stmt), names)
    if cache_key in cache:
        found = cache[cache_key]
        if found is None or found.stmt is stmt:
            return found
    prepared = cache[cache_key] = _compile(dialect, stmt, names)
    return prepared


def _compile(dialect: sa.Dialect, stmt: t.Any, names: tuple[str, ...]) -> Prepared | None:
    columns = [name for name in names if not name.startswith("w_")]
    compiled: t.Any = stmt.compile(dialect=dialect, column_keys=columns)
    if (
        compiled.insert_prefetch
        or compiled.update_prefetch
        or compiled.positiontup is None
        or compiled.escaped_bind_names
    ):
        return None
    constants = compiled.params
    binds = []
    for name in compiled.positiontup:
        bind = compiled.binds[name]
        if bind.expanding or bind.callable is not None:
            return None
        processor = bind.type.dialect_impl(dialect).bind_processor(dialect)
        binds.append((name, constants.get(name), processor))
    if isinstance(stmt, sa.Select):
        returned = list(stmt.selected_columns)
    else:
        returned = list(stmt.exported_columns) if stmt._returning else []
    return Prepared(
        stmt,
        compiled.string,
        tuple(binds),
        tuple(column.name for column in returned),
        tuple(_result_processor(dialect, column) for column in returned),
    )


def _result_processor(dialect: sa.Dialect, column: t.Any) -> Processor:
    return t.cast(Processor, column.type.dialect_impl(dialect).result_processor(dialect, None))


def run(
    connection: sa.Connection, prepared: Prepared, params: t.Mapping[str, t.Any]
) -> tuple[list[dict[str, t.Any]], int]:
    """Run ``prepared`` with ``params`` on ``connection``'s driver connection,
    in its transaction: the rows it returns (as column values by name) and its
    row count. A driver error is raised as SQLAlchemy raises it."""
    values = []
    for name, constant, processor in prepared.binds:
        value = params.get(name, constant)
        values.append(value if processor is None else processor(value))
    raw = begun(connection)
    try:
        cursor = raw.cursor()
        try:
            cursor.execute(prepared.sql, values)
            rows = cursor.fetchall() if prepared.columns else []
            count = cursor.rowcount
        finally:
            cursor.close()
    except connection.dialect.loaded_dbapi.Error as exc:
        raise as_sqlalchemy_error(connection, [prepared.sql], dict(params), exc) from exc
    names, results = prepared.columns, prepared.results
    return [
        {
            name: value if result is None else result(value)
            for name, value, result in zip(names, row, results, strict=True)
        }
        for row in rows
    ], count
