"""pysqlite's direct path (:mod:`flask_idempotency._storage.drivers.pysqlite`):
the record's statements run on the driver's connection write and read exactly
what SQLAlchemy's execution writes and reads, and the path steps aside wherever
something would miss its statements (echo, a statement listener)."""

from __future__ import annotations

import datetime as dt
import sqlite3
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from flask_idempotency._storage import Store, drivers
from flask_idempotency.errors import ClaimWaitExceeded
from tests.conftest import reset_tables
from tests.support import testapp
from tests.support.claims import HOUR, claim_values


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'direct.sqlite3'}"
    reset_tables(url)
    return url


def _store() -> Store:
    return Store(testapp.db.metadata.tables["idempotency_keys"])


def _lifecycle(engine: sa.Engine, store: Store, key: str, now: dt.datetime) -> t.Any:
    """Claim, lose a second claim, complete: the record as read at each step."""
    values = claim_values(key, now)
    with Session(engine) as session:
        assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        session.commit()
    with Session(engine) as session:
        won, held = store.claim(session, claim_values(key, now), dt.timedelta(seconds=5))
        assert won is False
        assert held is not None
        session.rollback()
    with Session(engine) as session:
        assert store.complete(
            session,
            "outcomes",
            key,
            values["fencing_token"],
            response_code=201,
            response_headers=[("Content-Type", "application/json")],
            response_body=b'{"id": 1}',
            body_omitted=False,
            now=now + dt.timedelta(seconds=1),
            expires_at=now + 48 * HOUR,
        )
        assert not store.complete(
            session,
            "outcomes",
            key,
            values["fencing_token"],
            response_code=500,
            response_headers=[],
            response_body=None,
            body_omitted=False,
            now=now,
        )
        session.commit()
    done = store.load_committed(engine, "outcomes", key)
    return held, done, values["fencing_token"]


def _stored_row(path: str, key: str) -> tuple[t.Any, ...]:
    with sqlite3.connect(path) as raw:
        row = raw.execute("SELECT * FROM idempotency_keys WHERE key = ?", (key,)).fetchone()
    assert row is not None
    return tuple(row)


def test_direct_path_writes_and_reads_what_sqlalchemy_does(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    store = _store()
    now = dt.datetime.now(dt.timezone.utc).replace(microsecond=123456)
    runs: list[str] = []
    real_run = drivers.pysqlite.run

    def counted(connection: sa.Connection, prepared: t.Any, params: t.Any) -> t.Any:
        runs.append(prepared.sql)
        return real_run(connection, prepared, params)

    direct_key, through_key = str(uuid.uuid4()), str(uuid.uuid4())
    # Direct exactly where nothing observes the engine: a listener another test
    # left on every Engine in this process turns it off, as it must.
    with engine.connect() as probe:
        observed = not drivers.unobserved(probe)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(drivers.pysqlite, "run", counted)
        direct = _lifecycle(engine, store, direct_key, now)
        # both claims' inserts and reads, the completions
        assert runs == [] if observed else len(runs) >= 4
        runs.clear()
        # Any statement listener turns the path off: it must see every statement.
        seen: list[str] = []

        def listener(*args: t.Any) -> None:
            seen.append(args[2])

        event.listen(engine, "before_cursor_execute", listener)
        try:
            through = _lifecycle(engine, store, through_key, now)
        finally:
            event.remove(engine, "before_cursor_execute", listener)
        assert runs == []
        assert any("idempotency_keys" in sql for sql in seen)
    engine.dispose()
    held_direct, done_direct, token_direct = direct
    held_through, done_through, token_through = through
    assert held_direct.fencing_token == token_direct
    assert held_through.fencing_token == token_through
    assert done_direct.status == done_through.status == "completed"
    assert done_direct.completed_at == now + dt.timedelta(seconds=1)
    assert done_direct.expires_at == now + 48 * HOUR
    assert done_direct.response_body == b'{"id": 1}'
    assert done_direct.response_headers == [("Content-Type", "application/json")]
    # The columns as stored, byte for byte, but for the key and its token.
    path = sa.make_url(sqlite_url).database
    assert path is not None
    columns = list(testapp.db.metadata.tables["idempotency_keys"].c.keys())
    mine = dict(zip(columns, _stored_row(path, direct_key), strict=True))
    theirs = dict(zip(columns, _stored_row(path, through_key), strict=True))
    for name in ("key", "fencing_token"):
        mine.pop(name), theirs.pop(name)
    assert mine == theirs


def test_a_connection_of_its_own_commits_what_ran_directly(sqlite_url: str) -> None:
    """A statement run first on a connection outside a session (a step's lease
    renewal) begins the connection's transaction as SQLAlchemy's execution
    would: its ``commit()`` commits it."""
    engine = sa.create_engine(sqlite_url)
    store = _store()
    now = dt.datetime.now(dt.timezone.utc)
    values = claim_values("own", now)
    with Session(engine) as session:
        assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        session.commit()
    token = values["fencing_token"]
    with engine.connect() as conn:
        assert store.save_recovery_points(conn, "outcomes", "own", token, {"a": 1}, now + HOUR)
        conn.commit()
    with engine.connect() as conn:
        assert store.renew_lease(conn, "outcomes", "own", token, now + 2 * HOUR)
        # Not committed: returned to the pool, rolled back.
    record = store.load_committed(engine, "outcomes", "own")
    assert record is not None
    assert record.recovery_points == {"a": 1}
    assert record.locked_until == now + HOUR
    engine.dispose()


def test_direct_path_steps_aside_for_echo_and_listeners(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url)
    with engine.connect() as conn:
        # Off only where a listener left on every Engine in this process observes it.
        direct = drivers.unobserved(conn)
        assert drivers.pysqlite.applies(conn) is direct
    echoing = sa.create_engine(sqlite_url, echo=True)
    with echoing.connect() as conn:
        assert not drivers.pysqlite.applies(conn)
    echoing.dispose()

    def after(*args: t.Any) -> None:
        pass

    event.listen(engine, "after_execute", after)
    with engine.connect() as conn:
        assert not drivers.pysqlite.applies(conn)
    event.remove(engine, "after_execute", after)
    with engine.connect() as conn:
        assert drivers.pysqlite.applies(conn) is direct
    engine.dispose()


def test_a_driver_error_is_raised_as_sqlalchemy_raises_it(sqlite_url: str) -> None:
    engine = sa.create_engine(sqlite_url, connect_args={"timeout": 0})
    store = _store()
    now = dt.datetime.now(dt.timezone.utc)
    with engine.connect() as blocker:
        blocker.exec_driver_sql("BEGIN IMMEDIATE")  # SQLite's one write lock
        with Session(engine) as session:
            # SQLAlchemy's error, so the store reads it as a wait the database gave up.
            with pytest.raises(ClaimWaitExceeded, match="locked") as raised:
                store.claim(session, claim_values(str(uuid.uuid4()), now), None)
            assert isinstance(raised.value.__cause__, sa.exc.OperationalError)
            assert isinstance(raised.value.__cause__.orig, sqlite3.OperationalError)
            session.rollback()
        blocker.rollback()
    engine.dispose()
