"""The claim's round trips on MariaDB/MySQL through PyMySQL (drivers/pymysql.py),
counted at the client: every command PyMySQL sends waits for its reply, so
each is one round trip. Before the batch: four (the wait's bound, the insert,
the read, the bound put back), three on MariaDB for a new key (``RETURNING``)."""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from flask_idempotency._storage import Store, added, drivers
from flask_idempotency.errors import ClaimWaitExceeded
from tests.conftest import mysql_url, reset_tables
from tests.support import testapp
from tests.support.storage import (
    MULTI_STATEMENTS,
    MULTI_STATEMENTS_ONLY,
    new_key,
    now_ms,
    record_values,
)

BOUNDS = "SELECT @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout"
# The session's own bounds, which the claim must leave as it found them.
OWN_BOUNDS = (37, 41)


class Counted:
    """An engine on the suite's MariaDB/MySQL whose connections count the
    commands they send (round trips); ``multi``: they take ``;``-joined strings."""

    def __init__(self, url: str, *, multi: bool) -> None:
        args = {"client_flag": MULTI_STATEMENTS} if multi else {}
        self.engine = sa.create_engine(url, connect_args=args, pool_size=1, max_overflow=0)
        self.sent: list[t.Any] = []
        event.listen(self.engine, "connect", self._wrap)

    def _wrap(self, dbapi_connection: t.Any, record: t.Any) -> None:
        send = dbapi_connection._execute_command

        def counted(command: int, sql: t.Any) -> t.Any:
            self.sent.append(sql)
            return send(command, sql)

        dbapi_connection._execute_command = counted
        cursor = dbapi_connection.cursor()
        cursor.execute(
            f"SET SESSION innodb_lock_wait_timeout = {OWN_BOUNDS[0]}, "
            f"SESSION lock_wait_timeout = {OWN_BOUNDS[1]}"
        )
        cursor.close()

    def claim(
        self, session: Session, store: Store, values: dict[str, t.Any], wait: dt.timedelta | None
    ) -> tuple[tuple[bool, bool], int]:
        """(won, held a record) and the round trips the claim took."""
        session.connection().exec_driver_sql("SELECT 1")  # the connection's set-up
        # Which added columns the table lacks is read once per engine, at its
        # first claim (a table from an earlier release): not per claim.
        added.absent_columns(session.connection(), store.table)
        self.sent.clear()
        won, held = store.claim(session, values, wait)
        return (won, held is not None), len(self.sent)


@pytest.fixture
def url() -> str:
    found = mysql_url()
    if found is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    reset_tables(found)
    return found


@pytest.fixture
def store(url: str) -> Store:
    return Store(testapp.db.metadata.tables["idempotency_keys"])


def _is_mariadb(url: str) -> bool:
    engine = sa.create_engine(url)
    try:
        with engine.connect():
            return bool(getattr(engine.dialect, "is_mariadb", False))
    finally:
        engine.dispose()


@pytest.mark.parametrize("wait", [dt.timedelta(seconds=3), None], ids=["bounded", "unbounded"])
def test_with_multi_statement_strings_the_claim_is_one_round_trip(
    url: str, store: Store, wait: dt.timedelta | None
) -> None:
    counted = Counted(url, multi=True)
    try:
        values = record_values(new_key(), now_ms())
        with Session(counted.engine) as session:
            assert counted.claim(session, store, values, wait) == ((True, False), 1)
            again = record_values(values["key"], now_ms())
            assert counted.claim(session, store, again, wait) == ((False, True), 1)
            assert tuple(session.execute(sa.text(BOUNDS)).one()) == OWN_BOUNDS
            session.commit()
    finally:
        counted.engine.dispose()


def test_on_mariadb_without_them_it_is_two_each_bounded_on_its_own(url: str, store: Store) -> None:
    if not _is_mariadb(url):
        pytest.skip("MySQL has no SET STATEMENT: its claim without the flag is unchanged")
    counted = Counted(url, multi=False)
    try:
        values = record_values(new_key(), now_ms())
        wait = dt.timedelta(seconds=3)
        with Session(counted.engine) as session:
            assert counted.claim(session, store, values, wait) == ((True, False), 1)
            again = record_values(values["key"], now_ms())
            assert counted.claim(session, store, again, wait) == ((False, True), 2)
            assert all(b"SET STATEMENT innodb_lock_wait_timeout = 3" in sql for sql in counted.sent)
            assert tuple(session.execute(sa.text(BOUNDS)).one()) == OWN_BOUNDS
            session.commit()
    finally:
        counted.engine.dispose()


@pytest.mark.parametrize("shape", ["mariadb", "mysql"])
def test_a_batch_that_hit_its_bound_leaves_the_sessions_bounds_as_they_were(
    url: str, store: Store, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bound applies (the duplicate gives up instead of waiting for the
    first claim's transaction), and what it replaced is back afterwards: put
    back by MariaDB itself (``SET STATEMENT``), or by the fast path after a
    failed MySQL-shaped batch (``SET``, then the statement that restores)."""
    if not _is_mariadb(url) and shape == "mariadb":
        pytest.skip("SET STATEMENT is MariaDB's")
    holder = sa.create_engine(url)
    counted = Counted(url, multi=True)
    try:
        with counted.engine.connect():  # SQLAlchemy reads the server's version first
            pass
        # The MySQL shape on a MariaDB server, which takes MySQL's statements too.
        monkeypatch.setattr(counted.engine.dialect, "is_mariadb", shape == "mariadb")
        key, now = new_key(), now_ms()
        with Session(holder) as first, Session(counted.engine) as second:
            assert store.claim(first, record_values(key, now), None) == (True, None)
            with pytest.raises(ClaimWaitExceeded):
                counted.claim(second, store, record_values(key, now), dt.timedelta(seconds=1))
            sent = b" ".join(counted.sent)
            assert (b"SET STATEMENT" in sent) is (shape == "mariadb")
            second.rollback()
            assert tuple(second.execute(sa.text(BOUNDS)).one()) == OWN_BOUNDS
            first.rollback()
    finally:
        holder.dispose()
        counted.engine.dispose()


def test_only_the_claim_takes_the_pymysql_path(url: str) -> None:
    """The engine's other statements keep SQLAlchemy's path (its processing of
    binds and results); a rewritten statement (``schema_translate_map``) none."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            assert drivers.fast_path(conn) is None
            path = drivers.fast_path(conn, claim=True)
            mariadb = getattr(engine.dialect, "is_mariadb", False)
            assert (path is not None) is bool(mariadb)
            mapped = conn.execution_options(schema_translate_map={"elsewhere": None})
            assert drivers.fast_path(mapped, claim=True) is None
    finally:
        engine.dispose()


def test_a_claim_on_connections_that_count_changed_rows_is_refused(url: str, store: Store) -> None:
    """``connect_args={"client_flag": CLIENT.MULTI_STATEMENTS}`` replaces the
    flags SQLAlchemy builds, ``FOUND_ROWS`` among them: every fenced update
    that writes the values already there (a lease renewed to the same end)
    would then read as lost, after the view's work committed. Refused before
    anything is written, saying which flag to add."""
    engine = sa.create_engine(url, connect_args={"client_flag": MULTI_STATEMENTS_ONLY})
    try:
        values = record_values(new_key(), now_ms())
        with Session(engine) as session, pytest.raises(RuntimeError, match="FOUND_ROWS"):
            store.claim(session, values, None)
        with engine.connect() as conn:
            assert conn.execute(sa.select(store.table)).first() is None
    finally:
        engine.dispose()


class Interrupting:
    """A PyMySQL connection's socket reader that raises KeyboardInterrupt (as
    Ctrl-C, or gunicorn's SystemExit, does) in the read of the first reply to a
    statement that inserts, once armed: mid-claim, in the driver."""

    def __init__(self, engine: sa.Engine) -> None:
        self.armed = False
        event.listen(engine, "connect", self._wrap)

    def _wrap(self, dbapi_connection: t.Any, record: t.Any) -> None:
        outer, send, rfile = self, dbapi_connection._execute_command, dbapi_connection._rfile

        class Reader:
            def read(self, size: int) -> bytes:
                if outer.armed == "fire":
                    outer.armed = False
                    raise KeyboardInterrupt
                return t.cast(bytes, rfile.read(size))

            def close(self) -> None:
                rfile.close()

        def sent(command: int, sql: t.Any) -> t.Any:
            if outer.armed is True and b"INSERT" in (sql if isinstance(sql, bytes) else b""):
                outer.armed = "fire"  # type: ignore[assignment]
            return send(command, sql)

        dbapi_connection._rfile = Reader()
        dbapi_connection._execute_command = sent


@pytest.mark.parametrize("shape", ["multi", "one-by-one", "sqlalchemy"])
def test_an_interruption_mid_claim_comes_out_and_the_connection_is_discarded(
    url: str, store: Store, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PyMySQL closes its socket when interrupted in a read; the batch's other
    replies may be unread. As SQLAlchemy's own path does (its invalidation on
    an exit exception), the claim's connection is discarded: the interruption
    comes out as itself, the session closes without an error that would hide
    it, and the pool's next connection reads its own replies."""
    counted = Counted(url, multi=shape == "multi")
    interrupting = Interrupting(counted.engine)
    try:
        with counted.engine.connect():  # SQLAlchemy reads the server's version first
            pass
        if shape == "sqlalchemy":  # MySQL without the flag (or mysqlclient): no fast path
            monkeypatch.setattr(counted.engine.dialect, "is_mariadb", False)
        elif not _is_mariadb(url) and shape == "one-by-one":
            pytest.skip("MariaDB's batch")
        session = Session(counted.engine)
        session.connection().exec_driver_sql("SELECT 1")
        interrupting.armed = True
        with pytest.raises(KeyboardInterrupt):
            store.claim(session, record_values(new_key(), now_ms()), dt.timedelta(seconds=3))
        assert interrupting.armed is False  # it fired in the claim's driver read
        session.close()
        with counted.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT 'mine'").scalar_one() == "mine"
            assert tuple(conn.execute(sa.text(BOUNDS)).one()) == OWN_BOUNDS
    finally:
        counted.engine.dispose()
