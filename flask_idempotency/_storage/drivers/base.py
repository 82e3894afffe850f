"""The interface of a driver fast path."""

from __future__ import annotations

import typing as t

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc


class FastPath:
    """A driver that takes SQL compiled once and sent as it is, and that can send
    the claim's statements as one batch: one round trip.

    Both psycopg drivers bind ``%(name)s`` parameters themselves and adapt every
    value the record holds (str, int, bool, bytes, aware datetimes), so
    SQLAlchemy's per-execution compilation and parameter processing, which
    cost more than the statement on a local database, are skipped.
    """

    #: SQLAlchemy's name of the driver (``dialect.driver``).
    name = ""

    def applies(self, connection: sa.Connection) -> bool:
        """Whether statements compiled once may be sent on ``connection``: not
        where SQLAlchemy rewrites them per connection (``schema_translate_map``)."""
        return not connection.get_execution_options().get("schema_translate_map")

    def prepares(self, dbapi_connection: t.Any) -> bool:
        """Whether the driver's connection prepares statements on the server by
        itself, under names a transaction pooler that does not track them
        would hand to another client."""
        return False

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        """Run ``statements`` in order, in the connection's transaction, in as
        few round trips as the connection allows (one, but on MariaDB without
        multi-statement strings); the first row of the last one that returns rows, as a dict
        (``None`` when it has none). A driver error is raised as SQLAlchemy raises it (a
        ``DBAPIError``), so callers and :mod:`..dberrors` see one kind of error
        on every path."""
        raise NotImplementedError

    def run(
        self, connection: sa.Connection, sql: str, params: dict[str, t.Any]
    ) -> tuple[list[t.Any], int]:
        """Run ``sql`` (compiled once, bound ``%(name)s``) on the driver's
        connection, in the connection's transaction: its rows and row count.
        Only where :func:`unobserved`: SQLAlchemy's execution context around a
        statement costs more than a local database takes to run it."""
        raw = begun(connection)
        try:
            cursor = raw.cursor()
            try:
                cursor.execute(sql, params)
                rows = cursor.fetchall() if cursor.description is not None else []
                count = int(cursor.rowcount)
            finally:
                cursor.close()
        except connection.dialect.loaded_dbapi.Error as exc:
            raise as_sqlalchemy_error(connection, [sql], params, exc) from exc
        return rows, count


def as_sqlalchemy_error(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any], exc: t.Any
) -> sa_exc.DBAPIError:
    """The driver's error as SQLAlchemy would raise it: a ``DBAPIError`` wrapping it,
    the connection invalidated when the driver says it is gone."""
    dialect = connection.dialect
    gone = dialect.is_disconnect(exc, connection.connection.driver_connection, None)
    if gone:
        connection.invalidate(exc)
    return t.cast(
        sa_exc.DBAPIError,
        sa_exc.DBAPIError.instance(
            ";\n".join(statements),
            params,
            exc,
            dialect.loaded_dbapi.Error,
            hide_parameters=connection.engine.hide_parameters,
            connection_invalidated=gone,
            dialect=dialect,
        ),
    )


# SQLAlchemy's events that see a statement run through a connection; a
# listener of any of them (but those of _QUIET) must see the record's too.
_STATEMENT_EVENTS = (
    "before_execute",
    "after_execute",
    "before_cursor_execute",
    "after_cursor_execute",
)
_QUIET: set[t.Callable[..., t.Any]] = set()


def quiet(listener: t.Callable[..., t.Any]) -> None:
    """Declare ``listener`` (registered with ``retval=True``, so SQLAlchemy
    keeps it as it is) one that need not see the record's statements: its
    presence does not turn the direct path off."""
    _QUIET.add(listener)


def unobserved(connection: sa.Connection) -> bool:
    """Whether nothing would miss a statement run on ``connection``'s driver
    connection, past SQLAlchemy's execution: no echo, no listener of its
    statement events (nor ``handle_error``) but those declared :func:`quiet`
    (an app's instrumentation or query log, the testing kit's trace, all see
    every statement wherever one listens)."""
    if getattr(connection, "_echo", True):
        return False
    dispatch = connection.dispatch
    for name in _STATEMENT_EVENTS:
        for listener in getattr(dispatch, name):
            if listener not in _QUIET:
                return False
    return not connection.dialect.dispatch.handle_error


def row_of(cursor: t.Any) -> dict[str, t.Any] | None:
    """The next row of a DB-API ``cursor`` by column name, or ``None``: the
    record's read as SQLAlchemy's ``row._mapping`` would give it."""
    row = cursor.fetchone()
    if row is None:
        return None
    return {column.name: value for column, value in zip(cursor.description, row, strict=True)}


def begun(connection: sa.Connection) -> t.Any:
    """``connection``'s driver connection, in the transaction SQLAlchemy began on
    it, as its own execution does first (autobegin): without it the connection's
    ``commit()`` would commit nothing, and its return to the pool would roll
    back what ran."""
    if not connection.in_transaction():
        connection.begin()
    return connection.connection.driver_connection
