"""What a database error means for the client, on every engine the record supports.

Two kinds of failure are not the request's fault and must reach the client as a
clear, retryable answer instead of an HTML 500:

* ``CONFLICT``: the database refused to wait any longer for another transaction
  on the same rows, or chose this transaction as the victim: a lock timeout, a
  deadlock, a serialization failure. The request did nothing; a retry after the
  other transaction ends gets the right answer (409 with ``Retry-After``).
* ``UNAVAILABLE``: the database could not be reached or dropped the connection
  (restart, failover, network partition, too many connections, pool exhausted),
  or it does not accept writes (:func:`read_only`: a standby or replica after a
  failover, a read-only transaction default, a server or file set read-only).
  Nothing was committed by this request's failed transaction (503 with
  ``Retry-After``).

Everything else (constraint violations, bad SQL) is a bug or a business error
and is left alone. Engine codes are listed here and nowhere else.
"""

from __future__ import annotations

import datetime as dt
import enum
import re
import typing as t

from sqlalchemy import exc as sa_exc

from ..errors import DatabaseUnavailableError, ProblemError, TransactionConflictError


class Failure(enum.Enum):
    """The kinds of database failure a client gets a retryable answer for."""

    CONFLICT = "conflict"
    UNAVAILABLE = "unavailable"


CONFLICT = Failure.CONFLICT
UNAVAILABLE = Failure.UNAVAILABLE

#: What the client is told to wait before its retry, for either kind.
RETRY_AFTER = dt.timedelta(seconds=1)


def problem_for(failure: Failure, exc: BaseException | None = None) -> ProblemError:
    """The problem+json answer for a failure: 409 ``transaction-conflict`` or 503
    ``database-unavailable``, both with ``Retry-After``. With ``exc``, a
    read-only database's 503 says so in its ``detail``."""
    if failure is CONFLICT:
        return TransactionConflictError(
            "The database aborted this request's transaction because of a concurrent "
            "one (lock timeout, deadlock or serialization failure); its writes were "
            "rolled back. Retry after Retry-After, with the same Idempotency-Key.",
            retry_after=RETRY_AFTER,
        )
    if exc is not None and read_only(exc):
        return DatabaseUnavailableError(
            "The database does not accept writes right now (it is read-only: a "
            "standby or replica, a failover in progress, or maintenance); nothing "
            "was stored. Retry after Retry-After with the same Idempotency-Key.",
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
    "57P04",  # database_dropped
    "57014",  # query_canceled (statement_timeout: the database did not answer in time)
    # The server ended an idle session: idle_in_transaction_session_timeout (as
    # IDEMPOTENCY_CLAIM_IDLE_TIMEOUT sets it), idle_session_timeout (PostgreSQL 14+).
    "25P03",
    "57P05",
}
_PG_UNAVAILABLE_CLASSES = (
    "08",  # connection_exception and its subclasses
    # insufficient_resources: disk_full (53100), out_of_memory (53200),
    # too_many_connections (53300), configuration_limit_exceeded (53400)
    "53",
    "58",  # system_error, io_error (58030): the server's disk or OS failed it
)
# read_only_sql_transaction: a hot standby ("cannot execute INSERT in a read-only
# transaction", "cannot execute LISTEN during recovery"),
# default_transaction_read_only, SET TRANSACTION READ ONLY.
_PG_READ_ONLY = {
    "25006": "transactions are read-only (a standby, or default_transaction_read_only)"
}

# MySQL / MariaDB error numbers.
_MYSQL_CONFLICT = {
    1205,  # ER_LOCK_WAIT_TIMEOUT
    1213,  # ER_LOCK_DEADLOCK
    3572,  # ER_LOCK_NOWAIT (MySQL 8)
}
_MYSQL_UNAVAILABLE = {
    1040,  # ER_CON_COUNT_ERROR: too many connections
    1053,  # ER_SERVER_SHUTDOWN
    1317,  # ER_QUERY_INTERRUPTED: KILL QUERY (an operator, pt-kill) ended the statement
    1021,  # ER_DISK_FULL
    1114,  # ER_RECORD_FILE_FULL: "The table is full" (disk, or innodb_data_file_path)
    1041,  # ER_OUT_OF_RESOURCES
    1037,  # ER_OUTOFMEMORY
    1038,  # ER_OUT_OF_SORTMEMORY
    4031,  # ER_CLIENT_INTERACTION_TIMEOUT (MySQL 8: the server closed an idle session)
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
_MYSQL_READ_ONLY = {
    # ER_OPTION_PREVENTS_STATEMENT: "running with the --read-only option" (read_only,
    # super_read_only; a user with READ_ONLY ADMIN or SUPER writes anyway). Only
    # when its text names a read-only option: others (--secure-file-priv) are not.
    1290: "the server is read-only (read_only)",
    # ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION: tx_read_only / transaction_read_only,
    # START TRANSACTION READ ONLY.
    1792: "transactions are read-only (transaction_read_only)",
    # ER_OPEN_AS_READONLY, "Table 't' is read only": what MariaDB 10.11 raises
    # under innodb_read_only.
    1036: "the storage engine is read-only (innodb_read_only)",
    1836: "the storage engine is read-only (innodb_read_only)",  # ER_READ_ONLY_MODE (MySQL)
    3989: "the schema is read-only",  # ER_SCHEMA_READ_ONLY (MySQL 8.0.22+)
}
_MYSQL_OPTION_PREVENTS = 1290
_MYSQL_READ_ONLY_OPTIONS = ("read-only", "read_only")

# SQLite has no codes in its Python exceptions' text that outlive versions; the
# messages are stable.
_SQLITE_CONFLICT = ("database is locked", "database table is locked")
_SQLITE_UNAVAILABLE = (
    "unable to open database file",
    "disk i/o error",
    "database or disk is full",
)
# SQLITE_READONLY and its extended codes (a file opened mode=ro or not writable,
# PRAGMA query_only, a moved or recovering database): "attempt to write a
# readonly database". Python 3.11+ gives the code too (sqlite_errorcode).
_SQLITE_READONLY = 8
_SQLITE_READ_ONLY_TEXT = "readonly database"
_SQLITE_READ_ONLY_REASON = "the database is read-only (a file opened read-only, or query_only)"

_PG_MODULES = ("psycopg2", "psycopg", "asyncpg", "pg8000")
_MYSQL_MODULES = ("pymysql", "MySQLdb", "mysql", "mariadb")
_SQLITE_MODULES = ("sqlite3", "pysqlite2", "aiosqlite")


def _mysql_errno(orig: BaseException) -> int | None:
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0]
    return None


def _driver_error(exc: BaseException) -> BaseException:
    """The driver's exception inside SQLAlchemy's wrapper, or ``exc`` itself."""
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, BaseException) else exc


def _module(orig: BaseException) -> str:
    return type(orig).__module__.split(".")[0]


def read_only_reason(exc: BaseException) -> str | None:
    """Why the database refused a write because it is read-only, in fixed words
    (never the driver's text), or ``None`` when ``exc`` is anything else.

    PostgreSQL: SQLSTATE 25006 (a hot standby, ``default_transaction_read_only``,
    a read-only transaction). MySQL/MariaDB: ``read_only``/``super_read_only``
    (1290), a read-only transaction (1792), ``innodb_read_only`` (1036 on
    MariaDB, 1836 on MySQL), a read-only schema (3989). SQLite: "attempt to
    write a readonly database" (a file opened ``mode=ro`` or not writable,
    ``PRAGMA query_only``).
    """
    orig = _driver_error(exc)
    module = _module(orig)
    if module in _PG_MODULES:
        pgcode = sqlstate(orig)
        return _PG_READ_ONLY.get(pgcode) if isinstance(pgcode, str) else None
    if module in _MYSQL_MODULES:
        errno = _mysql_errno(orig)
        if errno == _MYSQL_OPTION_PREVENTS:
            text = str(orig).lower()
            if not any(option in text for option in _MYSQL_READ_ONLY_OPTIONS):
                return None
        return _MYSQL_READ_ONLY.get(errno) if errno is not None else None
    if module in _SQLITE_MODULES:
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            readonly = code & 0xFF == _SQLITE_READONLY  # the primary code of an extended one
        else:
            readonly = _SQLITE_READ_ONLY_TEXT in str(orig).lower()
        return _SQLITE_READ_ONLY_REASON if readonly else None
    return None


# A GRANT missing: PostgreSQL insufficient_privilege (also a row-level security
# refusal), MySQL ER_TABLEACCESS_DENIED_ERROR / ER_COLUMNACCESS_DENIED_ERROR.
_PG_PRIVILEGE = "42501"
_MYSQL_PRIVILEGE = {1142, 1143}


def privilege_refused(exc: BaseException) -> bool:
    """Whether the database refused a statement for want of a privilege.

    Not a :func:`classify` failure: only the extension's own statements on the
    record's table make it an outage of this host (the claim answers 503 and
    readiness fails); the same refusal of a view's own statement (a GRANT or a
    row-level security policy of the app's) is the app's error, permanent, and
    retrying it would change nothing."""
    orig = _driver_error(exc)
    module = _module(orig)
    if module in _PG_MODULES:
        return sqlstate(orig) == _PG_PRIVILEGE
    if module in _MYSQL_MODULES:
        return _mysql_errno(orig) in _MYSQL_PRIVILEGE
    return False


# A table missing (PostgreSQL undefined_table, MySQL ER_NO_SUCH_TABLE, SQLite): named in the text.
_PG_UNDEFINED_TABLE, _MYSQL_NO_SUCH_TABLE = "42P01", 1146
_MISSING_TABLE_NAME = re.compile(r"""relation "([^"]+)"|Table '([^']+)'|no such table: (\S+)""")


def missing_table(exc: BaseException, tables: t.Collection[str]) -> str | None:
    """Which of ``tables`` (``schema.table`` matching ``table``) the database says is missing,
    or ``None``. Not a :func:`classify` failure: no retry helps until someone creates it."""
    orig = _driver_error(exc)
    module, text = _module(orig), str(orig)
    if not (
        (module in _PG_MODULES and sqlstate(orig) == _PG_UNDEFINED_TABLE)
        or (module in _MYSQL_MODULES and _mysql_errno(orig) == _MYSQL_NO_SUCH_TABLE)
        or (module in _SQLITE_MODULES and "no such table" in text)
    ):
        return None
    found = _MISSING_TABLE_NAME.search(text)
    if found is None:  # a message in another language (lc_messages): the statement tells
        named = [table for table in tables if names_table(exc, table)]
        return named[0] if len(named) == 1 else None
    name = next(group for group in found.groups() if group).rsplit(".", 1)[-1]
    return name if name in tables else None


# A value or statement larger than the database takes: PostgreSQL
# program_limit_exceeded (a field over 1 GB), MySQL/MariaDB
# ER_NET_PACKET_TOO_LARGE (a statement over max_allowed_packet, when the server
# answers before it drops the connection), ER_WARN_ALLOWED_PACKET_OVERFLOWED,
# ER_DATA_TOO_LONG (strict mode), SQLite SQLITE_TOOBIG ("string or blob too
# big", over SQLITE_LIMIT_LENGTH).
_PG_TOO_LARGE = "54000"
_MYSQL_TOO_LARGE = {1153, 1301, 1406}
_SQLITE_TOOBIG = 18
_SQLITE_TOOBIG_TEXT = "string or blob too big"


def too_large(exc: BaseException) -> bool:
    """Whether the database refused a statement for the size of a value in it.

    Not a :func:`classify` failure: the same value is refused again on every
    retry. (MySQL/MariaDB mostly answer a statement over ``max_allowed_packet``
    by dropping the connection, which reads as unavailable: the store checks
    that size before it sends one.)"""
    orig = _driver_error(exc)
    module = _module(orig)
    if module in _PG_MODULES:
        return sqlstate(orig) == _PG_TOO_LARGE
    if module in _MYSQL_MODULES:
        return _mysql_errno(orig) in _MYSQL_TOO_LARGE
    if module in _SQLITE_MODULES:
        code = getattr(orig, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF == _SQLITE_TOOBIG
        return _SQLITE_TOOBIG_TEXT in str(orig).lower()
    return False


def read_only(exc: BaseException) -> bool:
    """Whether ``exc`` is the database refusing a write because it is read-only
    (see :func:`read_only_reason`). :func:`classify` counts it as ``UNAVAILABLE``:
    the request did nothing, and its retry succeeds once writes are accepted
    again (here after the failover completes, or on another host)."""
    return read_only_reason(exc) is not None


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
    orig = _driver_error(exc)
    return getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)


def waited_on_row(exc: BaseException, table: str) -> bool | None:
    """Whether the wait the database gave up on was on a row of ``table`` (the
    key's own record: a duplicate's uncommitted claim, or a lock on that row),
    as the error says: ``True``/``False`` on PostgreSQL, whose error context
    names the tuple it waited for ("while inserting index tuple (0,1) in
    relation ..."), or nothing for a lock on the table; ``None`` where the
    error does not tell (MySQL/MariaDB's lock wait timeout names nothing;
    SQLite's "database is locked" is the whole database's write lock)."""
    orig = _driver_error(exc)
    if _module(orig) not in _PG_MODULES:
        return None
    context = getattr(getattr(orig, "diag", None), "context", None) or ""
    return "tuple (" in context and f'in relation "{table}"' in context


# query_canceled: what a statement_timeout raises.
_PG_QUERY_CANCELED = "57014"


def stopped_waiting(exc: BaseException) -> bool:
    """The database gave up on a claim while it waited on another transaction:
    a lock timeout, a deadlock or serialization victim (:data:`CONFLICT`), or
    (PostgreSQL) a ``statement_timeout`` of the app's that ended the wait
    (SQLSTATE 57014; the claim's statements themselves are instant unless
    they wait)."""
    if classify(exc) is CONFLICT:
        return True
    return sqlstate(exc) == _PG_QUERY_CANCELED


def _classify_driver_error(orig: BaseException) -> Failure | None:
    if read_only(orig):
        return UNAVAILABLE
    module = _module(orig)
    if module in _PG_MODULES:
        pgcode = sqlstate(orig)
        if pgcode is None:
            # The drivers raise OperationalError (or a subclass: psycopg 3's
            # ConnectionTimeout) without a SQLSTATE for failures of the connection
            # itself: refused, reset, timed out, closed.
            names = {cls.__name__ for cls in type(orig).__mro__}
            return UNAVAILABLE if names & {"OperationalError", "InterfaceError"} else None
        if pgcode in _PG_CONFLICT:
            return CONFLICT
        if pgcode in _PG_UNAVAILABLE_EXACT or pgcode.startswith(_PG_UNAVAILABLE_CLASSES):
            return UNAVAILABLE
        return None
    if module in _MYSQL_MODULES:
        errno = _mysql_errno(orig)
        if errno in _MYSQL_CONFLICT:
            return CONFLICT
        if errno in _MYSQL_UNAVAILABLE:
            return UNAVAILABLE
        if errno == 0 and type(orig).__name__ == "InterfaceError":
            return UNAVAILABLE  # pymysql: the connection is already closed
        return None
    if module in _SQLITE_MODULES:
        text = str(orig).lower()
        if any(m in text for m in _SQLITE_CONFLICT):
            return CONFLICT
        if any(m in text for m in _SQLITE_UNAVAILABLE):
            return UNAVAILABLE
        return None
    return None


def describe(exc: BaseException) -> str | None:
    """One log line's worth for a database failure a retry can outlive: ``"database
    read-only (why): <summary>"``, ``"database unavailable: <summary>"`` or
    ``"database conflict: <summary>"``; ``None`` for any other error (a bug,
    whose traceback matters)."""
    failure = classify(exc)
    if failure is None:
        return None
    reason = read_only_reason(exc)
    kind = f"read-only ({reason})" if reason is not None else failure.value
    return f"database {kind}: {summary(exc)}"


def summary(exc: BaseException) -> str:
    """``DriverClass [code]: first line of the driver's message``, for one log line.

    SQLAlchemy's own text of a ``DBAPIError`` carries the statement and its
    parameters, which can hold customer data; the driver's first line does not.
    """
    orig = _driver_error(exc)
    if _module(orig) in _MYSQL_MODULES:
        code = _mysql_errno(orig)  # PyMySQL 1.2 has a sqlstate too; the number says more
    else:
        code = getattr(orig, "pgcode", None) or getattr(orig, "sqlstate", None)
    name = type(orig).__name__ + (f" [{code}]" if code else "")
    text = str(orig).strip()
    return f"{name}: {text.splitlines()[0]}" if text else name


# The database ended the transaction to break a deadlock or a serialization
# conflict: PostgreSQL deadlock_detected and serialization_failure, MySQL
# ER_LOCK_DEADLOCK and MariaDB's ER_CHECKREAD ("record has changed").
_PG_VICTIM = ("40P01", "40001")
_MYSQL_VICTIM = (1213, 1020)


def deadlock_victim(exc: sa_exc.DBAPIError) -> bool:
    """Whether the database rolled this transaction back to break a deadlock or a
    serialization conflict: running it again may succeed."""
    orig = exc.orig
    if orig is None:
        return False
    if sqlstate(orig) in _PG_VICTIM:
        return True
    return _mysql_errno(orig) in _MYSQL_VICTIM


def names_table(exc: BaseException, table: str) -> bool:
    """Whether the statement that failed (SQLAlchemy keeps it on its errors)
    names ``table``: a refusal of one of the extension's own statements on the
    record's table, not of one of the app's."""
    statement = getattr(exc, "statement", None) or ""
    return isinstance(statement, str) and table in statement
