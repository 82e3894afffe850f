"""The building blocks the storage layer's statements share, on every engine.

Conditions on a record (:func:`lease_over`, :func:`expired`), a scope or key
bound byte for byte (:func:`text_param`), fencing tokens, the columns of a new
operation, and the two rules every change of a row follows: an insert never
checks first (each engine's :meth:`~.dialects.Dialect.conflict_tolerant_insert`),
and whether a statement changed its row is read from what it returned
(:func:`changed_one`).
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
import threading
import typing as t
import weakref

import sqlalchemy as sa
from sqlalchemy.orm import scoped_session

from .dialects import Executor, dialect_for
from .schema import IN_PROGRESS

#: The request as sent, kept for the recovery job only (``recover=True`` routes).
STORED_REQUEST = ("request_method", "request_path", "request_content_type", "request_body")

#: Columns a reclaim leaves alone: they belong to the operation it continues.
RECLAIM_KEEPS = (
    "created_at",
    "expires_at",
    "recovery_points",
    "request_method",
    "request_path",
    "request_content_type",
    "request_body",
)


def lease_over(c: t.Any, now: t.Any) -> t.Any:
    """SQL: the record's lease has ended (or it has none); ``now`` a time or a bind."""
    return sa.or_(c.locked_until.is_(None), c.locked_until <= now)


def expired(c: t.Any, now: t.Any) -> tuple[t.Any, ...]:
    """SQL, as :meth:`Record.is_expired`: past its retention, and neither in
    progress under a live lease nor a view that committed (an operation that
    may have happened keeps its record past the retention)."""
    held = sa.and_(lease_over(c, now), c.response_code.is_(None))
    return (c.expires_at <= now, sa.or_(c.status != IN_PROGRESS, held))


def unexpired(c: t.Any, now: t.Any) -> t.Any:
    """SQL: not :func:`expired` (what a request still finds)."""
    return sa.not_(sa.and_(*expired(c, now)))


def text_param(name: str, value: t.Any = None) -> t.Any:
    """A bind parameter for a scope or key, bound as a string on every engine.

    MySQL's scope and key columns are VARBINARY, whose own type would insist on
    bytes; a string compared with (or stored in) them is taken byte for byte.
    """
    if value is None:
        return sa.bindparam(name, type_=sa.String())
    return sa.bindparam(name, value, type_=sa.String())


def new_fencing_token(previous: int | None = None) -> int:
    """A fresh fencing token: random, 63 bits, positive, never ``previous``.

    Random rather than counted, because a counter kept on the row restarts
    whenever the row is deleted; two draws for one key collide with odds of
    about one in 2**62.
    """
    while True:
        token = secrets.randbits(63)
        if token and token != previous:
            return token


def operation_values(**values: t.Any) -> dict[str, t.Any]:
    """Every column of an operation, those not in ``values`` as a new one starts
    (no response, no recovery points, no stored request): so that a record that
    replaces an expired one keeps nothing of the operation before it."""
    return {
        "response_code": None,
        "response_headers": None,
        "response_body": None,
        "body_omitted": False,
        "locked_until": None,
        "completed_at": None,
        "recovery_points": None,
        "request_method": None,
        "request_path": None,
        "request_content_type": None,
        "request_body": None,
        # A record made outside a route's rules is judged by its fingerprint.
        "rules_version": None,
        "request_digest": None,
        **values,
    }


def returning(stmt: t.Any, dialect: sa.Dialect, column: t.Any) -> t.Any:
    """``stmt ... RETURNING column`` where the engine returns rows from this kind
    of statement; ``stmt`` itself elsewhere."""
    if dialect_for(dialect.name).returns_rows(dialect, stmt):
        return stmt.returning(column)
    return stmt


def changed_one(
    executor: Executor | scoped_session[t.Any], stmt: t.Any, params: dict[str, t.Any]
) -> bool:
    """Run a conditional ``UPDATE``/``DELETE`` of one row, or a conflict-tolerant
    ``INSERT`` of one, with ``RETURNING`` already added where the engine has it
    (:func:`returning`); whether the row was changed.

    The answer is whether the statement returned a row, where it returns rows;
    elsewhere (MySQL; MariaDB's ``UPDATE``) the matched-row count the server
    sends with the statement's result (SQLAlchemy's MySQL drivers all ask for
    matched, not changed, rows), kept with ``preserve_rowcount``. Never a row
    count where the engine could return rows: psycopg 3 under SQLAlchemy 2.1
    reports -1 for an ``INSERT``.
    """
    if stmt._returning:
        return executor.execute(stmt, params).first() is not None
    if isinstance(stmt, sa.Insert):
        raise ValueError("an INSERT's outcome needs RETURNING (or a token read back)")
    result = executor.execute(stmt, params, execution_options={"preserve_rowcount": True})
    return bool(t.cast("sa.CursorResult[t.Any]", result).rowcount == 1)


def database_now(conn: sa.Connection) -> dt.datetime:
    """The database server's clock, as an aware UTC datetime (microseconds where
    the engine keeps them).

    For time that coordinates processes on several hosts (the job lock): every
    host reads the same clock, so a host whose own clock is off cannot make a
    job run twice as often, or start while another run still holds it.
    PostgreSQL's ``clock_timestamp()``, MySQL/MariaDB's ``UTC_TIMESTAMP(6)``;
    SQLite runs on the app's host, whose clock it reads.
    """
    return dialect_for(conn.dialect.name).now(conn)


def open_transaction(connection: sa.Connection) -> None:
    """Open the database transaction of ``connection`` on the server now, where the
    driver would wait for the first write (pysqlite): so that a savepoint the
    view makes first is part of it (see :meth:`.dialects.Dialect.open_transaction`)."""
    dialect_for(connection.dialect.name).open_transaction(connection)


def refuse_autocommit(connection: sa.Connection) -> None:
    """Refuse a connection in autocommit mode (``isolation_level="AUTOCOMMIT"`` on
    the engine, the session's bind or its execution options; pysqlite's own
    autocommit): each statement would commit on its own, so the claim could
    not commit or roll back with the view's rows, and a failed view would
    leave them committed under a record in progress."""
    autocommits = getattr(connection, "_is_autocommit_isolation", None)
    if autocommits is not None:
        refused = bool(autocommits())
    else:  # an SQLAlchemy without the check: the levels set on the connection
        level = connection.get_execution_options().get("isolation_level") or getattr(
            connection.dialect, "_on_connect_isolation_level", None
        )
        refused = level == "AUTOCOMMIT"
    if not refused:
        refused = dialect_for(connection.dialect.name).autocommits(connection)
    if refused:
        raise RuntimeError(
            "Flask-Idempotency needs a transactional session: the session's connection "
            "is in AUTOCOMMIT mode (isolation_level='AUTOCOMMIT', or pysqlite's "
            "isolation_level=None without a BEGIN of SQLAlchemy's), where the claim and "
            "the view's rows cannot commit or roll back together. Use another "
            "isolation level for the app's session."
        )


def refuse_changed_rows(connection: sa.Connection) -> None:
    """Refuse a connection whose ``UPDATE`` row counts are the rows changed,
    not matched (:meth:`.Dialect.counts_changed_rows`): a fenced update that
    writes the values already there (a lease renewed to the same end) would
    read as lost, and the request answer 409 with its work committed."""
    if dialect_for(connection.dialect.name).counts_changed_rows(connection):
        raise RuntimeError(
            "Flask-Idempotency needs UPDATE row counts of matched rows: the engine's "
            "PyMySQL connections were opened without CLIENT.FOUND_ROWS (a client_flag "
            "in connect_args replaces the one SQLAlchemy builds, which has it). Pass "
            "connect_args={'client_flag': CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS} "
            "(pymysql.constants.CLIENT), or the flags you need | CLIENT.FOUND_ROWS."
        )


def add_column_sql(dialect: sa.Dialect, table: sa.Table, name: str) -> str:
    """The statement that adds the column ``name`` to ``table`` on ``dialect``,
    as the table declares it (nullable): a table from an earlier release."""
    column = table.c[name]
    quote = dialect.identifier_preparer
    kind = column.type.compile(dialect=dialect)
    return f"ALTER TABLE {quote.format_table(table)} ADD COLUMN {quote.quote(column.name)} {kind}"


class AddedColumns:
    """Columns a release added to an existing table, which a table created by an
    earlier release lacks: it works without them until they are added.

    Which are absent is read once per engine (a column added later is used by
    processes started after), with one WARNING per engine and column saying
    what its absence costs (``costs``) and the statement that adds it."""

    def __init__(
        self, names: tuple[str, ...], costs: t.Callable[[str], str], prefix: str = ""
    ) -> None:
        #: The added columns, in the order they came.
        self.names = names
        self._costs = costs
        self._prefix = prefix
        self._absent: weakref.WeakKeyDictionary[sa.Engine, frozenset[str]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def lacking(self, conn: sa.Connection, table: sa.Table) -> tuple[str, ...]:
        """Of :attr:`names`, those ``table`` lacks on ``conn``, read now; none
        without the table (it is created whole)."""
        try:
            columns = sa.inspect(conn).get_columns(table.name, schema=table.schema)
        except sa.exc.NoSuchTableError:
            return ()
        present = {c["name"].lower() for c in columns}
        return tuple(name for name in self.names if name not in present)

    def absent(self, conn: sa.Connection, table: sa.Table) -> frozenset[str]:
        """The added columns ``table`` lacks behind ``conn``, read once per engine."""
        engine = conn.engine
        known = self._absent.get(engine)
        if known is not None:
            return known
        missing = self.lacking(conn, table)
        with self._lock:
            if engine in self._absent:
                return self._absent[engine]
            self._absent[engine] = frozenset(missing)
        for name in missing:
            _logger.warning(
                "%s%s has no column %s (a table from an earlier release): %s until you "
                "run: %s (or your migrations), then restart",
                self._prefix,
                table.name,
                name,
                self._costs(name),
                add_column_sql(engine.dialect, table, name),
            )
        return frozenset(missing)

    def forget(self, engine: sa.Engine) -> None:
        """Read the table's columns again at the next use on ``engine`` (tests)."""
        with self._lock:
            self._absent.pop(engine, None)


_logger = logging.getLogger("flask_idempotency")
