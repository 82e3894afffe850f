"""Other ways to send the claim on psycopg 3, for the benchmark only.

The extension claims in one round trip on psycopg 3: its four statements (the
``lock_timeout`` bound, the insert, the bound restored, the read of the record)
go as one ``;``-joined string through :class:`psycopg.ClientCursor`
(``flask_idempotency._storage.drivers.psycopg``): psycopg quotes the values into
the text and sends it as one simple query, as psycopg2 does. To show what that costs
and buys, the benchmark app on psycopg 3 has routes that claim another way,
chosen per request by the route:

* ``pipeline``: the same four statements in psycopg's pipeline mode, each on a
  regular cursor (bound on the server, prepared by psycopg after five
  executions), all sent before one ``Sync``: one round trip too. The extension
  used it before; it no longer does because the pipeline's closing ``Flush``
  disarms PostgreSQL's ``idle_in_transaction_session_timeout`` until the next
  statement, so a claim whose host went quiet right after it would be held past
  the server's own setting. It needs libpq 14 or newer (the binary wheels ship
  one); without it the route fails;
* ``serial``: the same four statements, on a regular cursor, sent one at a time,
  each waiting for its answer: four round trips;
* ``generic``: the psycopg 3 fast path does not apply, so the extension takes
  its path for drivers it has no batch for: each statement executed by
  SQLAlchemy, compiled per execution, the request's other statements too.

:func:`install` registers a dispatcher as the fast path of psycopg 3
(``drivers.register``): it runs the route's way, and the extension's own for
every other request, so ``/ext`` on the same app claims as the extension does
(through one more method call). Nothing here changes the package: the
registry's entry is replaced in the benchmark's processes only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import typing as t

import psycopg
import sqlalchemy as sa

from flask_idempotency._storage import drivers
from flask_idempotency._storage.drivers.psycopg import Psycopg, as_sqlalchemy_error

EXT, PIPELINE, SERIAL, GENERIC = "ext", "pipeline", "serial", "generic"

#: The current request's way to claim; the extension's own unless a route says.
_PATH: contextvars.ContextVar[str] = contextvars.ContextVar("bench_claim_path", default=EXT)

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
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> t.Iterator[None]:
    """A driver error raised as the extension's own path raises it
    (``drivers.psycopg.as_sqlalchemy_error``), so the flow above sees the same
    kind of error on every path."""
    try:
        yield
    except psycopg.Error as exc:
        raise as_sqlalchemy_error(connection, statements, params, exc) from exc


def _first_row(cursor: psycopg.Cursor[t.Any]) -> dict[str, t.Any] | None:
    row = cursor.fetchone()
    if row is None or cursor.description is None:
        return None
    return {column.name: value for column, value in zip(cursor.description, row, strict=True)}


def _driver_connection(connection: sa.Connection) -> psycopg.Connection[t.Any]:
    raw = connection.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    return raw


def pipeline(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> dict[str, t.Any] | None:
    """The claim's statements in psycopg's pipeline mode, each on a cursor of its
    own, sent together and answered together (one round trip); the last one's
    first row, as the extension's batch gives it."""
    raw = _driver_connection(connection)
    cursors: list[psycopg.Cursor[t.Any]] = []
    with _as_sqlalchemy_error(connection, statements, params):
        try:
            with raw.pipeline():
                for sql in statements:
                    cursor = raw.cursor()
                    cursors.append(cursor)
                    cursor.execute(sql, params)
            return _first_row(cursors[-1])
        finally:
            for cursor in cursors:
                cursor.close()


def serial(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> dict[str, t.Any] | None:
    """The claim's statements one by one, each its own round trip; the last one's
    first row, as the extension's batch gives it."""
    raw = _driver_connection(connection)
    last = len(statements) - 1
    found = None
    with _as_sqlalchemy_error(connection, statements, params):
        for i, sql in enumerate(statements):
            with raw.cursor() as cursor:
                cursor.execute(sql, params)
                if i == last:
                    found = _first_row(cursor)
    return found


_RUNNERS: dict[str, Runner] = {PIPELINE: pipeline, SERIAL: serial}
_INSTALLED: dict[str, t.Any] = {}


class _Dispatching(Psycopg):
    """psycopg 3's fast path, unless the route claims another way."""

    def applies(self, connection: sa.Connection) -> bool:
        # The generic path, for psycopg 3 on a generic route only.
        return _PATH.get() != GENERIC and super().applies(connection)

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        runner = _RUNNERS.get(_PATH.get())
        if runner is None:
            return super().send_batch(connection, statements, params)
        return runner(connection, statements, params)


def install() -> None:
    """Route the claim through :data:`_PATH` (once per process)."""
    if _INSTALLED:
        return
    _INSTALLED["psycopg"] = drivers.register("postgresql", "psycopg", _Dispatching())
