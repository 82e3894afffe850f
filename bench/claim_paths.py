"""Other ways to send the claim on psycopg 3, for the benchmark only.

The extension claims in one round trip on psycopg 3: its four statements (the
``lock_timeout`` bound, the insert, the bound restored, the read of the record)
go in pipeline mode (``flask_idempotency.store._pipelined``). To show what that
buys, the benchmark app on psycopg 3 has routes that claim another way, chosen
per request by the route:

* ``serial``: the same four statements, on the same kind of cursor, sent one at a
  time, each waiting for its answer: the pipeline taken away, nothing else;
* ``client-batch``: the four statements as one string through
  :class:`psycopg.ClientCursor`: psycopg quotes the values into the text and
  sends it as one simple query, one round trip (what psycopg2 does);
* ``generic``: ``store._pipeline_supported`` answers ``False``, so the extension
  takes its path for drivers it has no batch for: each statement executed by
  SQLAlchemy, compiled per execution, the request's other statements too.

:func:`install` puts dispatchers in place of ``store._pipelined`` and
``store._pipeline_supported``: they run the route's way, and the extension's own
function for every other request, so ``/ext`` on the same app claims as the
extension does (through one more function call). Nothing here changes the
package: its module attributes are replaced in the benchmark's processes only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import typing as t

import psycopg
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from flask_idempotency import store

PIPELINE, SERIAL, CLIENT_BATCH, GENERIC = "pipeline", "serial", "client-batch", "generic"

#: The current request's way to claim; the extension's pipeline unless a route says.
_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("bench_claim_path", default=PIPELINE)

Runner = t.Callable[[sa.Connection, list[str], dict[str, t.Any]], "dict[str, t.Any] | None"]
View = t.Callable[..., t.Any]


def claiming(path: str, view: View) -> View:
    """``view`` with its claims made the ``path`` way (one of the names above)."""

    @functools.wraps(view)
    def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
        token = _PATH.set(path)
        try:
            return view(*args, **kwargs)
        finally:
            _PATH.reset(token)

    return wrapper


@contextlib.contextmanager
def _as_sqlalchemy_error(
    connection: sa.Connection, sql: str, params: dict[str, t.Any]
) -> t.Iterator[None]:
    """A driver error raised as SQLAlchemy raises it, as the extension's own path does,
    so the flow above sees the same kind of error on every path."""
    dialect = connection.dialect
    try:
        yield
    except psycopg.Error as exc:
        raw = connection.connection.driver_connection
        gone = dialect.is_disconnect(t.cast(t.Any, exc), raw, None)
        if gone:
            connection.invalidate(exc)
        raise sa_exc.DBAPIError.instance(
            sql, params, exc, psycopg.Error, connection_invalidated=gone, dialect=dialect
        ) from exc


def _first_row(cursor: psycopg.Cursor[t.Any]) -> dict[str, t.Any] | None:
    row = cursor.fetchone()
    if row is None or cursor.description is None:
        return None
    return {column.name: value for column, value in zip(cursor.description, row, strict=True)}


def _driver_connection(connection: sa.Connection) -> psycopg.Connection[t.Any]:
    raw = connection.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def serial(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> dict[str, t.Any] | None:
    """The claim's statements one by one, each its own round trip; the last one's
    first row, as the pipeline gives it."""
    raw = _driver_connection(connection)
    last = len(statements) - 1
    found = None
    with _as_sqlalchemy_error(connection, ";\n".join(statements), params):
        for i, sql in enumerate(statements):
            with raw.cursor() as cursor:
                cursor.execute(sql, params)
                if i == last:
                    found = _first_row(cursor)
    return found


def client_batch(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> dict[str, t.Any] | None:
    """The claim's statements as one multi-statement string, the values bound by
    psycopg on the client, sent as one simple query; the last one's first row."""
    raw = _driver_connection(connection)
    sql = ";\n".join(statements)
    with _as_sqlalchemy_error(connection, sql, params), psycopg.ClientCursor(raw) as cursor:
        cursor.execute(sql, params)
        while cursor.nextset():  # one result per statement: the read's is the last
            pass
        return _first_row(cursor)


_RUNNERS: dict[str, Runner] = {SERIAL: serial, CLIENT_BATCH: client_batch}
_INSTALLED: dict[str, t.Any] = {}


def install() -> None:
    """Route the claim through :data:`_PATH` (once per process)."""
    if _INSTALLED:
        return
    pipelined = _INSTALLED["pipelined"] = store._pipelined
    supported = _INSTALLED["supported"] = store._pipeline_supported

    def pipelined_or_other(
        connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        return _RUNNERS.get(_PATH.get(), pipelined)(connection, statements, params)

    def supported_unless_generic(*args: t.Any) -> bool:
        # Whatever the extension passes (the driver's module): only forwarded.
        return _PATH.get() != GENERIC and bool(supported(*args))

    store._pipelined = pipelined_or_other
    store._pipeline_supported = supported_unless_generic
