"""The SQL behind the record: claim, load, take over, complete, release.

Every statement runs in the session (or connection) it is given, so the record
joins the app's transaction. Dialect differences live here and nowhere else:

* the claim is a conflict-tolerant insert: ``ON CONFLICT DO NOTHING`` on
  PostgreSQL and SQLite, ``INSERT IGNORE`` on MySQL/MariaDB (the values are
  ours and bounded, so IGNORE can only skip the duplicate); other engines insert
  inside a savepoint and treat a unique violation as "exists";
* a duplicate waits for the first request's transaction, bounded by
  ``IDEMPOTENCY_WAIT``: PostgreSQL's ``lock_timeout`` (transaction-local),
  MySQL's ``innodb_lock_wait_timeout`` (whole seconds), SQLite's busy timeout;
* on PostgreSQL, with ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``, the claim also sets
  ``idle_in_transaction_session_timeout`` for the rest of its transaction
  (``SET LOCAL``, never loosening a stricter one), in the same round trip: a
  claim whose app vanished mid-transaction (a host cut off, frozen or killed
  without a word) is ended by the server, not held until TCP gives up;
* on MySQL the record is read with a locking read, so that a REPEATABLE READ
  snapshot taken earlier in the transaction cannot hide the winner's row.

Nothing here checks and then inserts: the insert decides, and every later
change is a conditional ``UPDATE``/``DELETE`` on the fencing token that only one
contender can win. Fencing tokens are random 63-bit numbers drawn anew by every
claim and reclaim, so a token never repeats for a key, even after the record is
deleted (release, purge, recovery, the CLI) and the key claimed again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import secrets
import time
import typing as t

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, scoped_session

from ..errors import ClaimWaitExceeded, TooLargeToStore
from . import dberrors
from .schema import COMPLETED, IN_PROGRESS, MYSQL_DIALECTS, Record, as_utc

Executor = Session | sa.Connection

_MYSQL = MYSQL_DIALECTS
# Room for the rest of the INSERT besides the stored request body.
_STATEMENT_MARGIN = 64 * 1024

# PostgreSQL: set_config(..., true) is SET LOCAL: it ends with the transaction
# whatever happens, so a failed statement needs no restore.
_PG_SET_WAIT = sa.text(
    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', :v, true)"
)
_PG_RESTORE_WAIT = sa.text("SELECT set_config('lock_timeout', :v, true)")
# MySQL/MariaDB: the variable is per connection, not per transaction: it is
# restored even after a failure, or the pooled connection would keep our bound.
_MYSQL_SET_WAIT = sa.text(
    "SET @flask_idempotency_wait = @@SESSION.innodb_lock_wait_timeout, "
    "SESSION innodb_lock_wait_timeout = :v"
)
_MYSQL_RESTORE_WAIT = sa.text("SET SESSION innodb_lock_wait_timeout = @flask_idempotency_wait")


# Where a batched claim keeps the app's lock_timeout while ours applies.
_SAVED_WAIT = "flask_idempotency.saved_lock_timeout"


def idle_bound(param: str) -> str:
    """A select-list expression that sets ``idle_in_transaction_session_timeout``
    to ``param`` for the rest of the transaction (``SET LOCAL``), unless a
    stricter one is in force (the server's, the role's, the app's): it only
    tightens. ``CASE`` evaluates its branches lazily, so ``set_config`` runs
    only when it must; a setting of 0 (off) is not stricter."""
    current = "current_setting('idle_in_transaction_session_timeout')::interval"
    # Text in both places: a driver binding on the server (psycopg 3) sends one
    # parameter, whose type the server must deduce once.
    value = f"CAST({param} AS text)"
    return (
        f"CASE WHEN {current} BETWEEN interval '1 microsecond' AND CAST({value} AS interval) "
        f"THEN NULL ELSE set_config('idle_in_transaction_session_timeout', {value}, true) END"
    )


_PG_SET_IDLE = sa.text(f"SELECT {idle_bound(':idle')}")


# Whether a transaction committed (PostgreSQL 10+), and the end of one still open
# whose client gave up on it (backend_xid is the 32-bit xid of the 64-bit id).
_PG_TRANSACTION_STATUS = sa.text("SELECT txid_status(:xid)")
# pg_stat_activity is read once per transaction, then cached: cleared first where
# the caller's transaction may have read it already.
_PG_FRESH_ACTIVITY = sa.text("SELECT pg_stat_clear_snapshot()")
_PG_END_TRANSACTION = sa.text(
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE backend_xid::text = :xid"
)


def _millis(wait: dt.timedelta) -> str:
    return f"{max(1, math.ceil(wait.total_seconds() * 1000))}ms"


def _sqlite_connection(executor: Executor) -> t.Any:
    """The ``sqlite3.Connection`` under a session or connection, in its transaction."""
    connection = executor.connection() if isinstance(executor, Session) else executor
    return connection.connection.driver_connection


def stopped_waiting(exc: sa_exc.DBAPIError) -> bool:
    """The database gave up on the claim while it waited on another transaction:
    a lock timeout, a deadlock or serialization victim, or (PostgreSQL) a
    ``statement_timeout`` of the app's that ended the wait (SQLSTATE 57014; the
    claim's statements themselves are instant unless they wait)."""
    if dberrors.classify(exc) is dberrors.CONFLICT:
        return True
    return dberrors.sqlstate(exc) == "57014"


def lease_over(c: t.Any, now: t.Any) -> t.Any:
    """SQL: the record's lease has ended (or it has none); ``now`` a time or a bind."""
    return sa.or_(c.locked_until.is_(None), c.locked_until <= now)


def expired(c: t.Any, now: t.Any) -> tuple[t.Any, ...]:
    """SQL, as :meth:`Record.is_expired`: past its retention and not held under a live
    lease (a holder whose lease still runs keeps its record past the retention)."""
    return (c.expires_at <= now, sa.or_(c.status != IN_PROGRESS, lease_over(c, now)))


def text_param(name: str, value: t.Any = None) -> t.Any:
    """A bind parameter for a scope or key, bound as a string on every engine.

    MySQL's scope and key columns are VARBINARY, whose own type would insist on
    bytes; a string compared with (or stored in) them is taken byte for byte.
    """
    if value is None:
        return sa.bindparam(name, type_=sa.String())
    return sa.bindparam(name, value, type_=sa.String())


def conflict_tolerant_inserts(
    table: sa.Table, values: dict[str, t.Any], key: list[str]
) -> dict[str, t.Any]:
    """An insert of ``values`` per dialect that inserts nothing when a row with the
    same ``key`` columns exists: ``ON CONFLICT DO NOTHING`` on PostgreSQL and
    SQLite, ``INSERT IGNORE`` on MySQL/MariaDB (for values that are ours and
    bounded, so IGNORE can only skip the duplicate). Other engines have none."""
    inserts: dict[str, t.Any] = {
        "postgresql": postgresql.insert(table)
        .values(values)
        .on_conflict_do_nothing(index_elements=key),
        "sqlite": sqlite.insert(table).values(values).on_conflict_do_nothing(index_elements=key),
    }
    for name in _MYSQL:
        inserts[name] = sa.insert(table).values(values).prefix_with("IGNORE", dialect=name)
    return inserts


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


def dialect_name(executor: Executor) -> str:
    """The engine behind a session or a connection (``postgresql``, ``sqlite``...)."""
    if isinstance(executor, Session):
        return executor.get_bind().dialect.name
    return executor.dialect.name


def _returning(dialect: t.Any, stmt: t.Any) -> bool:
    """Whether the engine returns rows from this kind of statement (``RETURNING``)."""
    if isinstance(stmt, sa.Insert):
        return bool(dialect.insert_returning)
    if isinstance(stmt, sa.Update):
        return bool(dialect.update_returning)
    if isinstance(stmt, sa.Delete):
        return bool(dialect.delete_returning)
    return False


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


def returning(stmt: t.Any, dialect: t.Any, column: t.Any) -> t.Any:
    """``stmt ... RETURNING column`` where the engine returns rows from this kind
    of statement; ``stmt`` itself elsewhere."""
    return stmt.returning(column) if _returning(dialect, stmt) else stmt


def database_now(conn: sa.Connection) -> dt.datetime:
    """The database server's clock, as an aware UTC datetime (microseconds where
    the engine keeps them).

    For time that coordinates processes on several hosts (the job lock): every
    host reads the same clock, so a host whose own clock is off cannot make a
    job run twice as often, or start while another run still holds it.
    PostgreSQL's ``clock_timestamp()``, MySQL/MariaDB's ``UTC_TIMESTAMP(6)``;
    SQLite runs on the app's host, whose clock it reads.
    """
    name = conn.dialect.name
    if name == "postgresql":
        value = conn.execute(_PG_NOW).scalar_one()
    elif name in _MYSQL:
        value = conn.execute(_MYSQL_NOW).scalar_one()
    elif name == "sqlite":
        text = conn.execute(_SQLITE_NOW).scalar_one()
        value = dt.datetime.fromisoformat(text)
    else:
        value = conn.execute(sa.select(sa.func.current_timestamp())).scalar_one()
    return t.cast(dt.datetime, as_utc(value))


_PG_NOW = sa.text("SELECT clock_timestamp()")
_MYSQL_NOW = sa.text("SELECT UTC_TIMESTAMP(6)")
# SQLite's 'now' is UTC; %f gives milliseconds (the finest it keeps).
_SQLITE_NOW = sa.text("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')")


def refuse_autocommit(connection: sa.Connection) -> None:
    """Refuse a connection in autocommit mode (``isolation_level="AUTOCOMMIT"`` on
    the engine, the session's bind or its execution options; pysqlite's own
    autocommit): each statement
    would commit on its own, so the claim could not commit or roll back with
    the view's rows, and a failed view would leave them committed under a
    record in progress."""
    autocommits = getattr(connection, "_is_autocommit_isolation", None)
    if autocommits is not None:
        refused = bool(autocommits())
    else:  # an SQLAlchemy without the check: the levels set on the connection
        level = connection.get_execution_options().get("isolation_level") or getattr(
            connection.dialect, "_on_connect_isolation_level", None
        )
        refused = level == "AUTOCOMMIT"
    if not refused and connection.dialect.name == "sqlite":
        # pysqlite's own autocommit, which SQLAlchemy does not see:
        # ``connect_args={"isolation_level": None}`` (unless a "begin" listener
        # sends BEGIN itself, SQLAlchemy's recipe for SAVEPOINT: then a
        # transaction is open by now), or Python 3.12's ``autocommit=True``.
        raw: t.Any = connection.connection.driver_connection
        refused = getattr(raw, "autocommit", None) is True or (
            getattr(raw, "isolation_level", "") is None and not raw.in_transaction
        )
    if refused:
        raise RuntimeError(
            "Flask-Idempotency needs a transactional session: the session's connection "
            "is in AUTOCOMMIT mode (isolation_level='AUTOCOMMIT', or pysqlite's "
            "isolation_level=None without a BEGIN of SQLAlchemy's), where the claim and "
            "the view's rows cannot commit or roll back together. Use another "
            "isolation level for the app's session."
        )


def _fast_driver(connection: sa.Connection) -> str | None:
    """``"psycopg2"`` or ``"psycopg"`` where statements compiled once may be sent
    as they are (the claim's one-round-trip batch, precompiled statements);
    ``None`` elsewhere, and where SQLAlchemy rewrites statements per connection
    (``schema_translate_map``)."""
    dialect = connection.dialect
    if dialect.name != "postgresql" or dialect.driver not in ("psycopg2", "psycopg"):
        return None
    if connection.get_execution_options().get("schema_translate_map"):
        return None
    return str(dialect.driver)


def _client_batched(
    connection: sa.Connection, statements: list[str], params: dict[str, t.Any]
) -> dict[str, t.Any] | None:
    """Run ``statements`` on psycopg 3 as one batch, as psycopg2 does: parameters
    bound on the client (:class:`psycopg.ClientCursor`), every statement in one
    simple query, one round trip; the last one's first row as a dict (``None``
    when it has none).

    Not psycopg's pipeline mode, also one round trip: PostgreSQL arms
    ``idle_in_transaction_session_timeout`` when it sends ReadyForQuery, and a
    pipeline's Sync is followed by a Flush whose arrival disarms the timer until
    the next statement. A host cut off right after a pipelined claim sends no
    next statement, so its claim would be held, past the app's bound and the
    server's own setting, for as long as TCP keeps the session. A simple query
    ends with ReadyForQuery, and the timer runs.

    The statements go to the driver's connection, inside the transaction
    SQLAlchemy opened on it. A driver error is raised as SQLAlchemy would raise
    it (:func:`_as_sqlalchemy_error`), so callers and :mod:`.dberrors` see one
    kind of error on every path.
    """
    dialect = connection.dialect
    dbapi = dialect.loaded_dbapi
    raw = connection.connection.driver_connection
    assert raw is not None
    try:
        with dbapi.ClientCursor(raw) as cursor:
            cursor.execute(";\n".join(statements), params)
            while cursor.nextset():  # the read is the last statement
                pass
            row = cursor.fetchone()
            if row is None:
                return None
            return {
                column.name: value for column, value in zip(cursor.description, row, strict=True)
            }
    except dbapi.Error as exc:
        raise _as_sqlalchemy_error(connection, statements, params, exc) from exc


def _as_sqlalchemy_error(
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


#: The request as sent, kept for the recovery job only (``recover=True`` routes).
STORED_REQUEST = ("request_method", "request_path", "request_content_type", "request_body")


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
        **values,
    }


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


class Store:
    """Statements on one ``idempotency_keys`` table.

    The statements of the common path are built once: constructing SQLAlchemy
    statements per request costs more than the round trips on a local database.
    Parameters named ``w_*`` are the WHERE clause; the others are column values.
    """

    def __init__(self, table: sa.Table, *, claim_idle: dt.timedelta | None = None) -> None:
        self.table = table
        #: ``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``: on PostgreSQL, how long the server lets a
        #: transaction that holds a claim sit idle before it ends it.
        self.claim_idle = claim_idle
        # MySQL's max_allowed_packet, read once per engine.
        self._packet_limits: dict[t.Any, int] = {}
        c = table.c
        this_key = (c.scope == text_param("w_scope"), c.key == text_param("w_key"))
        still_held = (
            *this_key,
            c.fencing_token == sa.bindparam("w_token"),
            c.status == IN_PROGRESS,
        )
        this_record = {"scope": text_param("scope"), "key": text_param("key")}
        self._inserts = conflict_tolerant_inserts(table, this_record, ["scope", "key"])
        self._portable_insert = sa.insert(table).values(this_record)
        self._load = sa.select(table).where(*this_key)
        # What a request needs of an existing record: all but the stored request,
        # which only the recovery job reads (and which may be large).
        head = [col for col in table.c if col.name not in STORED_REQUEST]
        self._load_head = sa.select(*head).where(*this_key)
        # A locking read sees the latest committed row whatever the isolation level.
        self._load_locking = self._load.with_for_update(read=True)
        self._load_head_locking = self._load_head.with_for_update(read=True)
        self._claim_sql: dict[tuple[str, bool, bool, tuple[str, ...]], list[str]] = {}
        self._returning_cache: dict[int, tuple[t.Any, t.Any]] = {}
        self._sql_cache: dict[
            tuple[int, str, tuple[str, ...]], tuple[t.Any, str, dict[str, t.Any]]
        ] = {}
        self._complete = (
            sa.update(table).where(*still_held).values(status=COMPLETED, locked_until=None)
        )
        self._release = sa.delete(table).where(*still_held)
        # An UPDATE of a held record; the SET clause comes from the parameters.
        self._update_held = sa.update(table).where(*still_held)
        # PostgreSQL: the same, naming the transaction it runs in (txid_current():
        # 64 bits, epoch included, so txid_status can judge it however old).
        self._update_held_xid = self._update_held.returning(c.fencing_token, sa.func.txid_current())
        token_read = (*this_key, c.fencing_token == sa.bindparam("w_token"))
        self._replace_expired = sa.update(table).where(
            *token_read, *expired(c, sa.bindparam("w_now"))
        )
        self._reclaim = sa.update(table).where(
            *token_read,
            c.status == IN_PROGRESS,
            c.request_hash == sa.bindparam("w_request_hash"),
            lease_over(c, sa.bindparam("w_now")),
        )

    @contextlib.contextmanager
    def bounded_wait(self, executor: Executor, wait: dt.timedelta | None) -> t.Iterator[None]:
        """Bound how long the statements inside wait on another transaction's locks.

        Raises :class:`ClaimWaitExceeded` when the database gives up on the
        wait: the bound is hit, or this transaction is chosen as a deadlock or
        serialization victim. The engine's own setting is restored afterwards,
        so the view runs unaffected. ``wait=None`` sets no bound of ours (the
        connection's own settings apply).

        Every claim that is not one batch goes through here (the claim on other
        drivers, a take-over, a claim made again after the view rolled back),
        so on PostgreSQL it also bounds, with :attr:`claim_idle`, how long the
        rest of the transaction may sit idle (see :func:`idle_bound`); that
        bound stays until the transaction ends.
        """
        name = dialect_name(executor)
        previous: t.Any = None
        if name == "postgresql" and self.claim_idle is not None:
            executor.execute(_PG_SET_IDLE, {"idle": _millis(self.claim_idle)})
        if wait is not None:
            previous = self._set_wait(executor, name, wait)
        failed = False
        try:
            yield
        except sa_exc.DBAPIError as exc:
            failed = True
            if stopped_waiting(exc):
                raise ClaimWaitExceeded(str(exc.orig)) from exc
            raise
        finally:
            if wait is not None:
                try:
                    self._restore_wait(executor, name, previous, failed=failed)
                except sa_exc.DBAPIError:
                    if not failed:
                        raise
                    # The failure took the connection with it: the pool discards
                    # it, and the original error is the one to report.

    @staticmethod
    def _set_wait(executor: Executor, name: str, wait: dt.timedelta) -> t.Any:
        millis = max(1, math.ceil(wait.total_seconds() * 1000))
        if name == "postgresql":
            return executor.execute(_PG_SET_WAIT, {"v": f"{millis}ms"}).scalar_one()
        if name in _MYSQL:
            executor.execute(_MYSQL_SET_WAIT, {"v": max(1, math.ceil(millis / 1000))})
            return None
        if name == "sqlite":
            # Straight on the driver's connection: a PRAGMA there takes
            # microseconds, through SQLAlchemy's statement machinery ten times more.
            raw = _sqlite_connection(executor)
            previous = raw.execute("PRAGMA busy_timeout").fetchone()[0]
            raw.execute(f"PRAGMA busy_timeout = {int(millis)}")
            return previous
        return None

    @staticmethod
    def _restore_wait(executor: Executor, name: str, previous: t.Any, *, failed: bool) -> None:
        if name == "postgresql":
            if not failed:  # after a failure the transaction is over, and SET LOCAL with it
                executor.execute(_PG_RESTORE_WAIT, {"v": previous})
        elif name in _MYSQL:
            executor.execute(_MYSQL_RESTORE_WAIT)
        elif name == "sqlite":
            _sqlite_connection(executor).execute(f"PRAGMA busy_timeout = {int(previous)}")

    def _connection(self, executor: Executor) -> sa.Connection:
        """The connection under ``executor`` that holds the record's table, in the
        session's transaction. Core statements go to it directly: the ORM's
        execute path (bind lookup, ORM compile hooks) costs more than the statement."""
        if isinstance(executor, sa.Connection):
            return executor
        return executor.connection(bind_arguments={"clause": self.table})

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
        decided by reading the fencing token back (:meth:`_insert`).
        """
        executor = self._connection(executor)
        if _returning(executor.dialect, stmt):
            stmt = self._returning_form(stmt)
        compiled = self._precompiled(executor, stmt, params) if params else None
        if compiled is None:
            return changed_one(executor, stmt, params)
        sql, constants = compiled
        result = executor.exec_driver_sql(sql, {**constants, **params})
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

    def _precompiled(
        self, connection: sa.Connection, stmt: t.Any, params: dict[str, t.Any]
    ) -> tuple[str, dict[str, t.Any]] | None:
        """``stmt`` as psycopg SQL and the constants it binds, compiled once per
        statement and parameter names; ``None`` where it must be compiled per
        execution (other drivers, ``schema_translate_map``).

        psycopg2 and psycopg 3 adapt every value the record holds (str, int,
        bool, bytes, aware datetimes) themselves, so SQLAlchemy's per-execution
        parameter processing is skipped: for the statements of a request it
        costs more than the statement.
        """
        if _fast_driver(connection) is None:
            return None
        names = tuple(params)
        cache_key = (id(stmt), connection.dialect.driver, names)
        found = self._sql_cache.get(cache_key)
        # The entry holds the statement itself, so its id cannot be reused by another.
        if found is None or found[0] is not stmt:
            columns = [name for name in names if not name.startswith("w_")]
            compiled = stmt.compile(dialect=connection.dialect, column_keys=columns)
            constants = {k: v for k, v in compiled.params.items() if k not in names}
            found = self._sql_cache[cache_key] = (stmt, str(compiled), constants)
        return found[1], found[2]

    def try_insert(self, executor: Executor, values: dict[str, t.Any]) -> bool:
        """Insert a new record; ``False`` when one with the same scope and key exists.

        Raises :class:`TooLargeToStore` when a stored request would exceed what the
        engine takes in one statement (MySQL answers such a statement by dropping
        the connection).
        """
        self.check_size(executor, values)
        return self._insert(executor, values)[0]

    def _insert(self, executor: Executor, values: dict[str, t.Any]) -> tuple[bool, Record | None]:
        """Insert ``values`` unless (scope, key) exists: ``(won, record)``.

        Whether the insert won is what the statement returned (``RETURNING``
        where the engine has it with a conflict-tolerant insert) or, elsewhere,
        the fencing token read back: only the insert that wrote the row has its
        token. ``record`` is the record read back when the insert lost on an
        engine that needed the read (so the caller need not read it again);
        ``None`` otherwise.
        """
        conflict_tolerant = self._inserts.get(dialect_name(executor))
        if conflict_tolerant is None:
            try:
                with executor.begin_nested():
                    executor.execute(self._portable_insert, values)
            except sa_exc.IntegrityError:
                return False, None
            return True, None
        connection = self._connection(executor)
        if _returning(connection.dialect, conflict_tolerant):
            return self._changed_one(connection, conflict_tolerant, values), None
        connection.execute(conflict_tolerant, values)
        record = self.load(connection, values["scope"], values["key"], stored_request=False)
        if record is not None and record.fencing_token == values["fencing_token"]:
            return True, None
        return False, record

    def check_size(self, executor: Executor, values: dict[str, t.Any]) -> None:
        """Refuse a stored request larger than MySQL's ``max_allowed_packet``."""
        body = values.get("request_body")
        if not body or dialect_name(executor) not in _MYSQL:
            return
        engine = executor.get_bind().engine if isinstance(executor, Session) else executor.engine
        limit = self._packet_limits.get(engine)
        if limit is None:
            limit = int(executor.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one())
            self._packet_limits[engine] = limit
        if len(body) + _STATEMENT_MARGIN > limit:
            raise TooLargeToStore(f"{len(body)} bytes, max_allowed_packet is {limit}")

    def load(
        self, executor: Executor, scope: str, key: str, *, stored_request: bool = True
    ) -> Record | None:
        """The record for (scope, key), or ``None``: the latest committed version.

        ``stored_request=False`` leaves out the request kept for the recovery
        job (its fields read ``None``): what a request needs, at less cost.
        """
        mysql = dialect_name(executor) in _MYSQL
        if stored_request:
            stmt = self._load_locking if mysql else self._load
        else:
            stmt = self._load_head_locking if mysql else self._load_head
        row = executor.execute(stmt, {"w_scope": scope, "w_key": key}).first()
        return Record.from_row(row) if row is not None else None

    def claim(
        self, session: Session, values: dict[str, t.Any], wait: dt.timedelta | None
    ) -> tuple[bool, Record | None]:
        """Insert a new record unless one exists; ``(inserted, record)``.

        ``record`` is the one that holds (scope, key) after the insert, without
        its stored request, when it is not ours (``None``: it was deleted in
        between); after our insert it is ``None``. Waiting on another
        transaction is bounded by ``wait`` (:meth:`bounded_wait`). Whether the
        insert won is read from the fencing token of the row read back (or the
        row the insert returned), never from a row count.

        On psycopg2 and psycopg 3 this is one round trip: setting the bounds, the
        insert, restoring the wait's bound and reading the record travel as one
        batch of statements, parameters bound on the client (PostgreSQL runs
        them in order, in the transaction; :func:`_client_batched` says why not
        psycopg 3's pipeline mode). Elsewhere it is the same statements one by one.
        """
        self.check_size(session, values)
        connection = session.connection(bind_arguments={"clause": self.table})
        refuse_autocommit(connection)
        driver = _fast_driver(connection)
        if driver is None:
            with self.bounded_wait(session, wait):
                won, record = self._insert(session, values)
                if won:
                    return True, None
                if record is not None:
                    return False, record
                return False, self.load(
                    session, values["scope"], values["key"], stored_request=False
                )
        idle = self.claim_idle
        statements = self._claim_statements(
            connection.dialect, wait is not None, idle is not None, values
        )
        params = {**values, "w_scope": values["scope"], "w_key": values["key"]}
        if wait is not None:
            params["wait"] = _millis(wait)
        if idle is not None:
            params["idle"] = _millis(idle)
        try:
            if driver == "psycopg2":
                row = connection.exec_driver_sql(";\n".join(statements), params).first()
                found = dict(row._mapping) if row is not None else None
            else:
                found = _client_batched(connection, statements, params)
        except sa_exc.DBAPIError as exc:
            if stopped_waiting(exc):
                raise ClaimWaitExceeded(str(exc.orig)) from exc
            raise
        if found is None:
            return False, None  # deleted since it blocked our insert
        if found["fencing_token"] == values["fencing_token"]:
            return True, None  # ours
        return False, Record.from_mapping(found)

    def _claim_statements(
        self, dialect: t.Any, bounded: bool, idle_bounded: bool, values: dict[str, t.Any]
    ) -> list[str]:
        """The claim's statements for one round trip: the bounds (if any), the
        insert, the wait's bound restored, the read of the record; compiled once
        per shape (bounded or not, idle-bounded or not, the columns that have a
        value).

        Only used where SQLAlchemy does not rewrite statements per connection
        (:func:`_fast_driver` refuses ``schema_translate_map``).
        """
        # Columns left out of the INSERT are NULL: fewer parameters to send.
        columns = tuple(name for name, value in values.items() if value is not None)
        cache_key = (dialect.driver, bounded, idle_bounded, columns)
        statements = self._claim_sql.get(cache_key)
        if statements is not None:
            return statements
        c = self.table.c
        parts: list[str] = []
        bounds: list[str] = []
        if bounded:
            # Keep the app's lock_timeout in a custom setting of this
            # transaction, bound ours, and put the app's back after the insert:
            # SET LOCAL semantics (set_config(..., true)), so a failure ends both.
            bounds += [
                f"set_config('{_SAVED_WAIT}', current_setting('lock_timeout'), true)",
                "set_config('lock_timeout', %(wait)s, true)",
            ]
        if idle_bounded:
            # Kept to the transaction's end: the claim is held until then.
            bounds.append(idle_bound("%(idle)s"))
        if bounds:
            parts.append("SELECT " + ", ".join(bounds))
        insert = self._inserts["postgresql"]
        parts.append(self._compiled(insert, dialect, list(columns)))
        if bounded:
            parts.append(
                f"SELECT set_config('lock_timeout', current_setting('{_SAVED_WAIT}'), true)"
            )
        # The read comes last, so its row is what the batch returns: its own
        # statement, it sees the row our insert made, or the one it yielded to.
        # A plain primary-key lookup: PostgreSQL plans it in a fraction of the
        # time a join (or a CASE per column) takes, and planning is most of its cost.
        head = [col for col in c if col.name not in STORED_REQUEST]
        read = sa.select(*head).where(
            c.scope == text_param("w_scope"), c.key == text_param("w_key")
        )
        parts.append(self._compiled(read, dialect, None))
        self._claim_sql[cache_key] = parts
        return parts

    def _compiled(self, stmt: t.Any, dialect: t.Any, column_keys: list[str] | None) -> str:
        compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
        # Every parameter must be one the caller passes: a constant the compiler
        # bound on its own would be missing from the batch's parameters.
        named = {"w_scope", "w_key", *(col.name for col in self.table.c)}
        unexpected = set(compiled.params) - named
        assert not unexpected, unexpected
        return str(compiled)

    def load_committed(
        self, executor: sa.Engine | sa.Connection, scope: str, key: str
    ) -> Record | None:
        """The committed record for (scope, key): read on a connection of its own
        (an engine), or in the caller's transaction on ``executor`` (a
        connection: the latest committed row on every engine, the read on MySQL
        locking)."""
        if isinstance(executor, sa.Connection):
            return self.load(executor, scope, key)
        with executor.connect() as conn:
            return self.load(conn, scope, key)

    def take_over(
        self,
        executor: Executor,
        record: Record,
        values: dict[str, t.Any],
        now: dt.datetime,
        *,
        expired: bool,
        token: int,
    ) -> bool:
        """Claim an existing record with the fresh fencing ``token``.

        An expired record is replaced: ``values`` must set every column of an
        operation, so nothing of the old operation (recovery points, stored
        request, response) survives into the new one. A record whose lease ended
        is reclaimed: the same operation goes on, keeping its recovery points,
        stored request, creation and retention times. One conditional ``UPDATE``
        on the fencing token read: exactly one contender can win.
        """
        self.check_size(executor, values)
        params = {
            **values,
            "fencing_token": token,
            "w_scope": record.scope,
            "w_key": record.key,
            "w_token": record.fencing_token,
            "w_now": now,
        }
        if expired:
            return self._changed_one(executor, self._replace_expired, params)
        for kept in RECLAIM_KEEPS:
            params.pop(kept, None)
        params["w_request_hash"] = values["request_hash"]
        return self._changed_one(executor, self._reclaim, params)

    def complete(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        response_code: int,
        response_headers: list[tuple[str, str]],
        response_body: bytes | None,
        body_omitted: bool,
        now: dt.datetime,
    ) -> bool:
        """Mark the record completed with its response, fenced by ``token``.

        ``False`` means another request took the record over: the caller must
        roll back.
        """
        params = {
            "w_scope": scope,
            "w_key": key,
            "w_token": token,
            "response_code": response_code,
            "response_headers": json.dumps(response_headers),
            "response_body": response_body,
            "body_omitted": body_omitted,
            "completed_at": now,
        }
        return self._changed_one(executor, self._complete, params)

    def release(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        keep_recovery_points: bool = False,
    ) -> bool:
        """Free a record this holder (``token``) still owns, so a retry runs at once.

        The record is deleted, unless it has recovery points to keep: then its
        lease is ended instead, and the retry reclaims it and resumes.
        """
        if keep_recovery_points:
            return self._set_held(executor, scope, key, token, {"locked_until": None})
        params = {"w_scope": scope, "w_key": key, "w_token": token}
        return self._changed_one(executor, self._release, params)

    def keep_for_retry(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        recovery_points: t.Mapping[str, t.Any],
    ) -> bool:
        """End the lease of a record this holder (``token``) still owns, and keep
        it for the client's retry.

        Its recovery points are written (an empty set included) and its stored
        request dropped, so neither a release nor the recovery job (which
        re-runs stored requests and deletes records without points) takes it:
        the client's retry reclaims the same operation.
        """
        values: dict[str, t.Any] = {
            "locked_until": None,
            "recovery_points": json.dumps(
                dict(recovery_points), sort_keys=True, separators=(",", ":")
            ),
            "request_method": None,
            "request_path": None,
            "request_content_type": None,
            "request_body": None,
        }
        return self._set_held(executor, scope, key, token, values)

    def renew_lease(
        self, executor: Executor, scope: str, key: str, token: int, locked_until: dt.datetime
    ) -> bool:
        """Extend the lease of a record this holder (``token``) still owns.

        Run inside a transaction that commits business rows, it also locks the
        record until that commit, so nobody can take the key over in between.
        ``False``: the record was taken over or deleted.
        """
        return self._set_held(executor, scope, key, token, {"locked_until": locked_until})

    def renew_lease_before_commit(
        self, executor: Executor, scope: str, key: str, token: int, locked_until: dt.datetime
    ) -> tuple[bool, int | None]:
        """:meth:`renew_lease` in a transaction about to commit, and, on
        PostgreSQL, that transaction's id: should the ``COMMIT`` be interrupted
        with no answer, :meth:`commit_outcome` tells from the id whether it
        landed (``None`` elsewhere)."""
        connection = self._connection(executor)
        if connection.dialect.name != "postgresql":
            return self.renew_lease(connection, scope, key, token, locked_until), None
        params = {"w_scope": scope, "w_key": key, "w_token": token, "locked_until": locked_until}
        stmt = self._update_held_xid
        compiled = self._precompiled(connection, stmt, params)
        if compiled is None:
            row = connection.execute(stmt, params).first()
        else:
            sql, constants = compiled
            row = connection.exec_driver_sql(sql, {**constants, **params}).first()
        if row is None:
            return False, None
        return True, int(row[1])

    def commit_outcome(
        self, executor: sa.Engine | sa.Connection, transaction: int, wait: dt.timedelta
    ) -> bool | None:
        """Whether PostgreSQL transaction ``transaction`` (from
        :meth:`renew_lease_before_commit`) committed: ``True`` or ``False``,
        or ``None`` when that cannot be known within ``wait``.

        ``txid_status`` is PostgreSQL's answer to exactly this question (a
        connection lost during ``COMMIT``). A transaction still in progress
        after half of ``wait`` has a ``COMMIT`` that may yet arrive (held in a
        network buffer or a proxy) while its client has given up on it: its
        backend is terminated (allowed for the app's own role), so that it
        can never commit later, and the status read again.

        ``executor``: an engine (read on a connection of its own), or a
        connection in a transaction of the caller's, which is left usable
        (where a second connection may not be had: a pool of one).
        """
        if isinstance(executor, sa.Engine):
            with executor.connect() as conn:
                return self._commit_outcome(conn, transaction, wait, own=True)
        return self._commit_outcome(executor, transaction, wait, own=False)

    def _commit_outcome(
        self, conn: sa.Connection, transaction: int, wait: dt.timedelta, *, own: bool
    ) -> bool | None:
        deadline = time.monotonic() + wait.total_seconds()
        status = self._settle(conn, transaction, deadline - wait.total_seconds() / 2, own)
        if status == "in progress":
            end = {"xid": str(transaction % 2**32)}
            try:
                if own:
                    conn.execute(_PG_END_TRANSACTION, end)
                    conn.commit()
                else:  # a savepoint: a refusal must not abort the caller's transaction
                    with conn.begin_nested():
                        conn.execute(_PG_FRESH_ACTIVITY)
                        conn.execute(_PG_END_TRANSACTION, end)
            except sa_exc.DBAPIError:  # not allowed to: then it stays unknown
                if own:
                    conn.rollback()
                return None
            status = self._settle(conn, transaction, deadline, own)
        if status == "committed":
            return True
        if status == "aborted":
            return False
        return None  # too old to tell (NULL), or still in progress

    @staticmethod
    def _settle(conn: sa.Connection, transaction: int, deadline: float, own: bool) -> str | None:
        """``txid_status`` of ``transaction``, polled until it is no longer in
        progress or ``deadline`` (a ``time.monotonic()``) passes. (It reads the
        commit log, not a snapshot: a transaction of the caller's sees it change.)"""
        pause = 0.01
        while True:
            status = conn.execute(_PG_TRANSACTION_STATUS, {"xid": transaction}).scalar()
            if own:
                conn.rollback()
            if status != "in progress" or time.monotonic() >= deadline:
                return t.cast("str | None", status)
            time.sleep(pause)
            pause = min(pause * 2, 0.1)

    def restamp(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        *,
        locked_until: dt.datetime,
        created_at: dt.datetime | None = None,
        expires_at: dt.datetime | None = None,
    ) -> bool:
        """Set a held record's lease end (and creation and expiry, for a new
        operation), fenced by ``token``."""
        values: dict[str, t.Any] = {"locked_until": locked_until}
        if created_at is not None:
            values["created_at"] = created_at
        if expires_at is not None:
            values["expires_at"] = expires_at
        return self._set_held(executor, scope, key, token, values)

    def save_recovery_points(
        self,
        executor: Executor,
        scope: str,
        key: str,
        token: int,
        points: dict[str, t.Any],
        locked_until: dt.datetime,
    ) -> bool:
        """Store the recovery points and renew the lease, fenced by ``token``;
        ``False``: the lease was lost."""
        values = {
            "locked_until": locked_until,
            "recovery_points": json.dumps(points, sort_keys=True, separators=(",", ":")),
        }
        return self._set_held(executor, scope, key, token, values)

    def _set_held(
        self, executor: Executor, scope: str, key: str, token: int, values: dict[str, t.Any]
    ) -> bool:
        """Set ``values`` on a record this holder (``token``) still has in progress."""
        params = {"w_scope": scope, "w_key": key, "w_token": token, **values}
        return self._changed_one(executor, self._update_held, params)

    def find_abandoned(self, conn: sa.Connection, now: dt.datetime, limit: int) -> list[Record]:
        """In-progress, unexpired records whose lease has ended, oldest lease first,
        that the recovery job can act on: those it can re-run (a stored request),
        and those with no recovery points (released). A record that keeps
        finished steps for the client's retry to resume from is left alone."""
        c = self.table.c
        stmt = (
            sa.select(self.table)
            .where(
                c.status == IN_PROGRESS,
                lease_over(c, now),
                c.expires_at > now,
                sa.or_(c.recovery_points.is_(None), c.request_method.is_not(None)),
            )
            .order_by(c.locked_until)
            .limit(limit)
        )
        return [Record.from_row(row) for row in conn.execute(stmt)]

    def release_abandoned(self, conn: sa.Connection, record: Record, now: dt.datetime) -> bool:
        """Delete an abandoned record, unless someone reclaimed it since it was read
        or it holds recovery points (a retry resumes after its finished steps)."""
        c = self.table.c
        stmt = sa.delete(self.table).where(
            c.scope == text_param("w_scope", record.scope),
            c.key == text_param("w_key", record.key),
            c.fencing_token == record.fencing_token,
            c.status == IN_PROGRESS,
            lease_over(c, now),
            c.recovery_points.is_(None),
        )
        return self._changed_one(conn, stmt, {})

    def purge_batch(self, conn: sa.Connection, now: dt.datetime, limit: int) -> int:
        """Delete up to ``limit`` expired records in one statement; the number deleted.

        On PostgreSQL the batch is chosen ``FOR UPDATE SKIP LOCKED``: rows another
        cleaner (or a request replacing an expired record) holds are skipped, so
        cleaners never wait on each other and cannot deadlock. Elsewhere the
        delete re-checks ``expires_at``, so a record replaced meanwhile stays.
        """
        c = self.table.c
        dialect = conn.dialect.name
        # A record past its retention whose holder's lease still runs is not
        # expired yet: cleanup waits for the lease to end.
        gone = expired(c, now)
        batch = sa.select(c.scope, c.key).where(*gone).order_by(c.expires_at).limit(limit)
        if dialect == "postgresql" or dialect in _MYSQL:
            # MySQL 8 and MariaDB 10.6 know SKIP LOCKED too.
            batch = batch.with_for_update(skip_locked=True)
        if dialect in ("postgresql", "sqlite"):
            stmt = sa.delete(self.table).where(sa.tuple_(c.scope, c.key).in_(batch), *gone)
            return int(conn.execute(stmt).rowcount)
        # Engines that refuse LIMIT in an IN subquery (MySQL): read (and lock),
        # then delete, in the caller's transaction.
        keys = [tuple(row) for row in conn.execute(batch)]
        if not keys:
            return 0
        stmt = sa.delete(self.table).where(sa.tuple_(c.scope, c.key).in_(keys), *gone)
        return int(conn.execute(stmt).rowcount)

    def count_expired(self, conn: sa.Connection, now: dt.datetime) -> int:
        """How many records are past their retention and await cleanup."""
        c = self.table.c
        stmt = sa.select(sa.func.count()).select_from(self.table).where(*expired(c, now))
        return int(conn.execute(stmt).scalar_one())

    def stats(self, conn: sa.Connection, now: dt.datetime) -> dict[str, t.Any]:
        """Counts by status (unexpired), expired awaiting cleanup, oldest in progress,
        and the table's size in bytes where the database tells it."""
        c = self.table.c
        live = c.expires_at > now
        by_status = {
            status: int(n)
            for status, n in conn.execute(
                sa.select(c.status, sa.func.count()).where(live).group_by(c.status)
            )
        }
        oldest = conn.execute(
            sa.select(sa.func.min(c.created_at)).where(live, c.status == IN_PROGRESS)
        ).scalar_one()
        size = None
        if conn.dialect.name == "postgresql":
            size = conn.execute(
                sa.text("SELECT pg_total_relation_size(CAST(:t AS regclass))"),
                {"t": self.table.name},
            ).scalar_one()
        return {
            "by_status": by_status,
            "expired_awaiting_cleanup": self.count_expired(conn, now),
            "oldest_in_progress": as_utc(oldest),
            "table_bytes": size,
        }

    def find(
        self,
        conn: sa.Connection,
        *,
        key: str | None = None,
        scope_prefix: str | None = None,
        status: str | None = None,
        limit: int = 20,
    ) -> list[Record]:
        """Records matching all the given filters, newest first (an operator query)."""
        c = self.table.c
        stmt = sa.select(self.table)
        if key is not None:
            stmt = stmt.where(c.key == text_param("w_key", key))
        if scope_prefix:
            # substr/= rather than LIKE, which folds case on SQLite; MySQL's
            # binary column counts bytes.
            length = (
                len(scope_prefix.encode()) if conn.dialect.name in _MYSQL else len(scope_prefix)
            )
            prefix = text_param("w_prefix", scope_prefix)
            stmt = stmt.where(sa.func.substr(c.scope, 1, length) == prefix)
        if status is not None:
            stmt = stmt.where(c.status == status)
        stmt = stmt.order_by(c.created_at.desc(), c.scope, c.key).limit(limit)
        return [Record.from_row(row) for row in conn.execute(stmt)]

    def delete_record(
        self,
        conn: sa.Connection,
        scope: str,
        key: str,
        *,
        token: int | None = None,
        status: str | None = None,
    ) -> bool:
        """Delete one record (the operator's ``release``): only while it still has
        the fencing ``token`` and ``status`` the operator was shown, when given, so
        that a record that completed, or was replaced by a new operation, in the
        meantime is left alone."""
        c = self.table.c
        stmt = sa.delete(self.table).where(
            c.scope == text_param("w_scope", scope), c.key == text_param("w_key", key)
        )
        if token is not None:
            stmt = stmt.where(c.fencing_token == token)
        if status is not None:
            stmt = stmt.where(c.status == status)
        return self._changed_one(conn, stmt, {})
