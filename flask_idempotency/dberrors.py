"""What a database error means for the client, on every engine the record supports.

Two kinds of failure are not the request's fault and must reach the client as a
clear, retryable answer instead of an HTML 500:

* ``CONFLICT``: the database refused to wait any longer for another transaction
  on the same rows, or chose this transaction as the victim: a lock timeout, a
  deadlock, a serialization failure. The request did nothing; a retry after the
  other transaction ends gets the right answer (409 with ``Retry-After``).
* ``UNAVAILABLE``: the database could not be reached or dropped the connection
  (restart, failover, network partition, too many connections, pool exhausted).
  Nothing was committed by this request's failed transaction (503 with
  ``Retry-After``).

Everything else (constraint violations, bad SQL) is a bug or a business error
and is left alone. Engine codes are listed here and nowhere else.
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import exc as sa_exc

from .errors import DatabaseUnavailableError, ProblemError, TransactionConflictError


class Failure(enum.Enum):
    """The kinds of database failure a client gets a retryable answer for."""

    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"


CONFLICT = Failure.CONFLICT
UNAVAILABLE = Failure.UNAVAILABLE

#: What the client is told to wait before its retry, for either kind.
RETRY_AFTER = dt.timedelta(seconds=1)


def problem_for(failure: Failure) -> ProblemError:
    """The problem+json answer for a failure: 409 ``transaction-conflict`` or 503
    ``database-unavailable``, both with ``Retry-After``."""
    if failure is CONFLICT:
        return TransactionConflictError(
            "The database aborted this request's transaction because of a concurrent "
            "one (lock timeout, deadlock or serialization failure); its writes were "
            "rolled back. Retry after Retry-After, with the same Idempotency-Key.",
            retry_after=RETRY_AFTER,
        )
    return DatabaseUnavailableError(
        "The database is unavailable. Retry after Retry-After with the same "
        "Idempotency-Key: the retry either runs the request or replays its "
        "stored response.",
        retry_after=RETRY_AFTER,
    )


# PostgreSQL SQLSTATEs.
_PG_CONFLICT = {
    "55P03",  # lock_not_available (lock_timeout, NOWAIT)
    "40001",  # serialization_failure (REPEATABLE READ, SERIALIZABLE)
    "40P01",  # deadlock_detected
}
_PG_UNAVAILABLE_EXACT = {
    "57P01",  # admin_shutdown
    "57P02",  # crash_shutdown
    "57P03",  # cannot_connect_now (starting up, recovery)
    "53300",  # too_many_connections
    "57014",  # query_canceled (statement_timeout: the database did not answer in time)
}
_PG_UNAVAILABLE_CLASSES = ("08",)  # connection_exception and its subclasses

# MySQL / MariaDB error numbers.
_MYSQL_CONFLICT = {
    1205,  # ER_LOCK_WAIT_TIMEOUT
    1213,  # ER_LOCK_DEADLOCK
    3572,  # ER_LOCK_NOWAIT (MySQL 8)
}
_MYSQL_UNAVAILABLE = {
    1040,  # ER_CON_COUNT_ERROR: too many connections
    1053,  # ER_SERVER_SHUTDOWN
    1927,  # ER_CONNECTION_KILLED (MariaDB)
    1969,  # ER_STATEMENT_TIMEOUT (MariaDB max_statement_time)
    3024,  # ER_QUERY_TIMEOUT (MySQL max_execution_time)
    2002,  # CR_CONNECTION_ERROR
    2003,  # CR_CONN_HOST_ERROR
    2005,  # CR_UNKNOWN_HOST
    2006,  # CR_SERVER_GONE_ERROR
    2013,  # CR_SERVER_LOST
    2055,  # CR_SERVER_LOST_EXTENDED
}

# SQLite has no codes in its Python exceptions' text that outlive versions; the
# messages are stable.
_SQLITE_CONFLICT = ("database is locked", "database table is locked")
_SQLITE_UNAVAILABLE = ("unable to open database file", "disk i/o error")


def _mysql_errno(orig: BaseException) -> int | None:
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


def classify(exc: BaseException) -> Failure | None:
    """``CONFLICT``, ``UNAVAILABLE``, or ``None`` for any other error.

    Accepts SQLAlchemy's wrapped errors (``DBAPIError`` and its subclasses,
    ``TimeoutError`` of the connection pool, ``DisconnectionError``) and the
    driver exception inside them.
    """
    if isinstance(exc, sa_exc.TimeoutError | sa_exc.DisconnectionError):
        return UNAVAILABLE  # the pool is exhausted, or a connection was found dead
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return UNAVAILABLE
        orig: BaseException = exc.orig if exc.orig is not None else exc
        found = _classify_driver_error(orig)
        if found is None and isinstance(exc, sa_exc.InterfaceError):
            return UNAVAILABLE  # the driver's connection object is closed or broken
        return found
    return _classify_driver_error(exc)


def sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of an error (SQLAlchemy's wrapper or the driver's
    own), or ``None``: psycopg2 names it ``pgcode``, psycopg 3 ``sqlstate``."""
    orig = getattr(exc, "orig", None)
    if not isinstance(orig, BaseException):
        orig = exc
    return getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)


def _classify_driver_error(orig: BaseException) -> Failure | None:
    pgcode = sqlstate(orig)
    module = type(orig).__module__.split(".")[0]
    if module in ("psycopg2", "psycopg", "asyncpg", "pg8000"):
        if pgcode is None:
            # The drivers raise OperationalError (or a subclass: psycopg 3's
            # ConnectionTimeout) without a SQLSTATE for failures of the
            # connection itself: refused, reset, timed out, closed.
            names = {cls.__name__ for cls in type(orig).__mro__}
            return UNAVAILABLE if names & {"OperationalError", "InterfaceError"} else None
        if pgcode in _PG_CONFLICT:
            return CONFLICT
        if pgcode in _PG_UNAVAILABLE_EXACT or pgcode.startswith(_PG_UNAVAILABLE_CLASSES):
            return UNAVAILABLE
        return None
    if module in ("pymysql", "MySQLdb", "mysql", "mariadb"):
        errno = _mysql_errno(orig)
        if errno in _MYSQL_CONFLICT:
            return CONFLICT
        if errno in _MYSQL_UNAVAILABLE:
            return UNAVAILABLE
        if errno == 0 and type(orig).__name__ == "InterfaceError":
            return UNAVAILABLE  # pymysql: the connection is already closed
        return None
    if module in ("sqlite3", "pysqlite2", "aiosqlite"):
        text = str(orig).lower()
        if any(m in text for m in _SQLITE_CONFLICT):
            return CONFLICT
        if any(m in text for m in _SQLITE_UNAVAILABLE):
            return UNAVAILABLE
        return None
    return None


def summary(exc: BaseException) -> str:
    """``DriverClass [code]: first line of the driver's message``, for one log line.

    SQLAlchemy's own text of a ``DBAPIError`` carries the statement and its
    parameters, which can hold customer data; the driver's first line does not.
    """
    orig = getattr(exc, "orig", None)
    if not isinstance(orig, BaseException):
        orig = exc
    code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    if code is None and type(orig).__module__.split(".")[0] in ("pymysql", "MySQLdb", "mysql"):
        code = _mysql_errno(orig)
    name = type(orig).__name__ + (f" [{code}]" if code else "")
    text = str(orig).strip()
    return f"{name}: {text.splitlines()[0]}" if text else name
