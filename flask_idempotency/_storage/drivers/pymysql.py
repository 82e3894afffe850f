"""PyMySQL on MySQL and MariaDB: the claim in one round trip where the
connection takes multi-statement strings, else statement by statement.

A ``;``-joined string is one ``COM_QUERY``: the server runs its statements in
order and sends a result for each, which the cursor walks (``nextset``). It
needs the ``CLIENT.MULTI_STATEMENTS`` flag on the connection, which PyMySQL
leaves off unless the engine asks for it (``connect_args={"client_flag":
CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS}``: that ``client_flag`` replaces
SQLAlchemy's, whose ``FOUND_ROWS`` the extension needs, :func:`..sql.refuse_changed_rows`):
the extension does not own the engine, and the flag also lets SQL injected into
any of the app's statements run statements of its own, which is the app's choice
to make. Without it:

* on MariaDB the claim's statements are bounded each on its own
  (:meth:`.MySQL.claim_batch`, ``SET STATEMENT ... FOR``) and sent one by one:
  a new key's insert returns its row and ends the claim (one round trip), a
  taken key's is followed by the read (two), instead of three and four
  (bound, insert, read, bound put back);
* on MySQL no fast path: the statements go through SQLAlchemy as before.

Parameters are bound on the client (``%(name)s``), as SQLAlchemy's PyMySQL
dialect compiles them; PyMySQL quotes every value the record holds (str, int,
bool, bytes, datetimes: UTC, written without their zone, as SQLAlchemy does).
(mysqlclient, ``MySQLdb``, compiles to ``%s`` positional parameters: it keeps
SQLAlchemy's statement-by-statement path.)
"""

from __future__ import annotations

import contextlib
import typing as t

import sqlalchemy as sa

from ..dialects.mysql import RESTORE_WAIT_SQL
from .base import FastPath, as_sqlalchemy_error

#: PyMySQL's ``CLIENT.MULTI_STATEMENTS`` (``pymysql.constants.CLIENT``), not
#: imported: the driver is optional.
MULTI_STATEMENTS = 1 << 16


def multi_statements(dbapi_connection: t.Any) -> bool:
    """Whether the PyMySQL connection was opened with ``CLIENT.MULTI_STATEMENTS``."""
    return bool(getattr(dbapi_connection, "client_flag", 0) & MULTI_STATEMENTS)


class PyMySQL(FastPath):
    name = "pymysql"

    def applies(self, connection: sa.Connection) -> bool:
        """Where SQLAlchemy does not rewrite statements per connection, and the
        batch can do better than SQLAlchemy's path: a multi-statement
        connection, or MariaDB (whose statements each carry their own bound)."""
        if not super().applies(connection):
            return False
        if getattr(connection.dialect, "is_mariadb", False):
            return True
        return multi_statements(connection.connection.driver_connection)

    def send_batch(
        self, connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
    ) -> dict[str, t.Any] | None:
        raw = connection.connection.driver_connection
        assert raw is not None
        dbapi = connection.dialect.loaded_dbapi
        together = multi_statements(raw)
        # Not ``with raw.cursor()``: its close reads the batch's replies still
        # to come, which after an interruption would wait for them and may
        # raise a database error in place of the interruption.
        cursor = raw.cursor()
        try:
            found = _read_batch(cursor, statements, params, together=together)
        except dbapi.Error as exc:
            error = as_sqlalchemy_error(connection, statements, params, exc)
            if statements[-1] == RESTORE_WAIT_SQL and not error.connection_invalidated:
                # MySQL's bound is the session's until put back; the
                # failure stopped the batch before it did (a connection
                # that is gone is discarded with it).
                with contextlib.suppress(dbapi.Error):
                    cursor.execute(RESTORE_WAIT_SQL)
            raise error from exc
        except BaseException as exc:
            if not isinstance(exc, Exception):
                # KeyboardInterrupt, SystemExit (gunicorn's worker timeout),
                # GreenletExit: SQLAlchemy's own rule for them. PyMySQL closed
                # the socket if it was reading, and the batch's other replies
                # may be unread: the connection is discarded, so that the
                # session's rollback neither fails (hiding the interruption)
                # nor hands it back to the pool.
                connection.invalidate(exc)
            raise
        cursor.close()
        return found


def _read_batch(
    cursor: t.Any, statements: list[str], params: dict[str, t.Any], *, together: bool
) -> dict[str, t.Any] | None:
    """Send ``statements`` (as one string if ``together``, else one by one until
    the insert returns its row), reading each reply; the last row returned."""
    found: dict[str, t.Any] | None = None
    for sql in [";\n".join(statements)] if together else statements:
        cursor.execute(sql, params)
        while True:  # each statement's result, the last rows kept
            if cursor.description is not None:
                row = cursor.fetchone()
                names = [column[0] for column in cursor.description]
                found = None if row is None else dict(zip(names, row, strict=True))
            if not together or not cursor.nextset():
                break
        if not together and found is not None:
            # One by one is MariaDB's batch only (applies()): a row from its
            # insert (RETURNING) is the claim won, and nothing after it needs
            # to run (each bound is undone by the server).
            break
    return found
