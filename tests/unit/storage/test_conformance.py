"""Every dialect and driver implementation of the storage layer keeps one contract.

The same tests run on each implementation, against the real database: what
each primitive answers, and what it leaves in the table (read back on a
connection of its own), never a mock.

* ``psycopg2``, ``psycopg``: PostgreSQL with each driver's fast path (the claim
  as one batch, statements compiled once);
* ``postgresql-one-by-one``: PostgreSQL with no fast path registered, each
  statement through SQLAlchemy (the path of every other PostgreSQL driver);
* ``sqlite``, ``mysql`` (MariaDB or MySQL, where one answers);
* ``generic``: SQLite served as an engine without a module of its own
  (:class:`~flask_idempotency._storage.dialects.Dialect` itself: the claim
  inserted in a savepoint), with SQLAlchemy's recipe that makes pysqlite's
  savepoints transactional.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from flask_idempotency._storage import (
    COMPLETED,
    IN_PROGRESS,
    Store,
    as_utc,
    database_now,
    dialects,
    drivers,
    new_fencing_token,
    open_transaction,
    operation_values,
)
from flask_idempotency._storage.dialects import Dialect, MySQL, PostgreSQL, SQLite, dialect_of
from flask_idempotency._storage.drivers.psycopg import Psycopg
from flask_idempotency._storage.drivers.psycopg2 import Psycopg2
from flask_idempotency.errors import ClaimWaitExceeded
from tests.conftest import mysql_url, postgres_url, reset_tables
from tests.support import testapp

HOUR = dt.timedelta(hours=1)
SCOPE = "conformance"

#: Implementation: (database, its dialect object's class, its fast path's class).
IMPLEMENTATIONS: dict[str, tuple[str, type[Dialect], type[drivers.FastPath] | None]] = {
    "psycopg2": ("psycopg2", PostgreSQL, Psycopg2),
    "psycopg": ("psycopg", PostgreSQL, Psycopg),
    "postgresql-one-by-one": ("psycopg2", PostgreSQL, None),
    "sqlite": ("sqlite", SQLite, None),
    "mysql": ("mysql", MySQL, None),
    "generic": ("sqlite", Dialect, None),
}


@dataclasses.dataclass
class Impl:
    name: str
    url: str
    engine: sa.Engine
    store: Store
    dialect: type[Dialect]
    fast_path: type[drivers.FastPath] | None

    def engine_like(self, **kwargs: t.Any) -> sa.Engine:
        """Another engine on the same database, set up as :attr:`engine` is."""
        return _engine(self.name, self.url, **kwargs)

    def rows(self) -> dict[str, dict[str, t.Any]]:
        """The table's rows by key, read on a connection of their own, as
        PostgreSQL returns them (aware UTC times, ``str`` scope and key)."""
        found = {}
        with self.engine.connect() as conn:
            for row in conn.execute(sa.select(self.store.table)):
                values = {k: _portable(v) for k, v in row._mapping.items()}
                for name in ("scope", "key"):  # VARBINARY on MySQL
                    if isinstance(values[name], bytes):
                        values[name] = values[name].decode()
                found[values["key"]] = values
        return found


def _portable(value: t.Any) -> t.Any:
    if isinstance(value, dt.datetime):
        return as_utc(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return value


def _engine(name: str, url: str, **kwargs: t.Any) -> sa.Engine:
    if name != "generic":
        return sa.create_engine(url, **kwargs)
    # SQLAlchemy's recipe for pysqlite savepoints: the driver's own transaction
    # handling off, BEGIN sent when SQLAlchemy begins.
    engine = sa.create_engine(url, connect_args={"isolation_level": None}, **kwargs)
    event.listen(engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN"))
    return engine


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> t.Iterator[Impl]:
    database, dialect, fast_path = IMPLEMENTATIONS[request.param]
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'conformance.sqlite3'}"
    elif database == "mysql":
        found = mysql_url()
        if found is None:
            pytest.skip("no MariaDB/MySQL reachable (see the report header)")
        url = found
    else:
        url = postgres_url(database)
    if request.param == "postgresql-one-by-one":
        monkeypatch.setattr(drivers, "_PATHS", {})
    if request.param == "generic":
        monkeypatch.delitem(dialects.DIALECTS, "sqlite")
    reset_tables(url)
    engine = _engine(request.param, url)
    store = Store(testapp.db.metadata.tables["idempotency_keys"])
    try:
        yield Impl(request.param, url, engine, store, dialect, fast_path)
    finally:
        engine.dispose()


def _now() -> dt.datetime:
    # Milliseconds: the finest time SQLite's own clock gives.
    now = dt.datetime.now(dt.UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _values(
    key: str, now: dt.datetime, *, lease: dt.timedelta = HOUR, **columns: t.Any
) -> dict[str, t.Any]:
    return {
        "scope": SCOPE,
        "key": key,
        "fencing_token": new_fencing_token(),
        **operation_values(
            request_hash="h",
            status=IN_PROGRESS,
            locked_until=now + lease,
            created_at=now,
            expires_at=now + 24 * HOUR,
            **columns,
        ),
    }


def _claimed(impl: Impl, values: dict[str, t.Any]) -> None:
    """Claim ``values`` and commit."""
    with Session(impl.engine) as session:
        assert impl.store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        session.commit()


def _key() -> str:
    return f"k-{uuid.uuid4()}"


def test_the_registries_pick_the_engines_implementation(impl: Impl) -> None:
    with impl.engine.connect() as conn:
        assert type(dialect_of(conn)) is impl.dialect
        path = drivers.fast_path(conn)
        assert (type(path) if path is not None else None) is impl.fast_path
        # SQLAlchemy rewrites statements per connection there: nothing compiled once.
        mapped = conn.execution_options(schema_translate_map={"elsewhere": None})
        assert drivers.fast_path(mapped) is None


def test_a_new_key_is_claimed_in_the_callers_transaction(impl: Impl) -> None:
    now, key = _now(), _key()
    values = _values(key, now, request_method="POST", request_body=b"{}")
    with Session(impl.engine) as session:
        assert impl.store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        assert key not in impl.rows()  # not committed yet
        session.rollback()
    assert key not in impl.rows()  # rolled back with the caller's transaction
    _claimed(impl, values)
    row = impl.rows()[key]
    assert (row["scope"], row["status"], row["fencing_token"]) == (
        SCOPE,
        IN_PROGRESS,
        values["fencing_token"],
    )
    assert (row["locked_until"], row["request_body"]) == (now + HOUR, b"{}")
    with impl.engine.connect() as conn:
        whole = impl.store.load(conn, SCOPE, key)
        head = impl.store.load(conn, SCOPE, key, stored_request=False)
    assert whole is not None
    assert head is not None
    assert (whole.request_body, head.request_body) == (b"{}", None)
    assert head.fencing_token == values["fencing_token"]


def test_a_held_key_is_not_claimed_again_and_its_holder_is_told(impl: Impl) -> None:
    now, key = _now(), _key()
    first = _values(key, now)
    _claimed(impl, first)
    with Session(impl.engine) as session:
        won, held = impl.store.claim(session, _values(key, now), None)
        assert (won, held is not None) == (False, True)
        assert held is not None
        assert held.fencing_token == first["fencing_token"]
        assert held.request_body is None  # a request needs no stored request
        assert impl.store.try_insert(session, _values(key, now)) is False
        session.commit()
    assert [row["fencing_token"] for row in impl.rows().values()] == [first["fencing_token"]]


def test_an_expired_record_is_replaced_by_a_new_operation(impl: Impl) -> None:
    now, key = _now(), _key()
    old = _values(key, now - 48 * HOUR, lease=-HOUR, recovery_points='{"a":1}')
    _claimed(impl, old)
    with Session(impl.engine) as session:
        won, record = impl.store.claim(session, _values(key, now), None)
        assert not won
        assert record is not None
        assert record.is_expired(now)
        token = new_fencing_token(record.fencing_token)
        columns = {k: v for k, v in _values(key, now).items() if k not in ("scope", "key")}
        columns["request_hash"] = "h2"
        assert impl.store.take_over(session, record, columns, now, expired=True, token=token)
        session.commit()
    row = impl.rows()[key]
    assert (row["fencing_token"], row["request_hash"], row["created_at"]) == (token, "h2", now)
    assert (row["recovery_points"], row["status"], row["response_code"]) == (
        None,
        IN_PROGRESS,
        None,
    )


def test_a_reclaim_continues_the_operation_and_one_contender_wins(impl: Impl) -> None:
    now, key = _now(), _key()
    first = _values(key, now - HOUR, lease=dt.timedelta(minutes=-1), recovery_points='{"a":1}')
    _claimed(impl, first)
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    tokens = [new_fencing_token(record.fencing_token) for _ in range(2)]
    outcomes = []
    for token in tokens:
        with Session(impl.engine) as session:
            columns = {k: v for k, v in _values(key, now).items() if k not in ("scope", "key")}
            outcomes.append(
                impl.store.take_over(session, record, columns, now, expired=False, token=token)
            )
            session.commit()
    assert outcomes == [True, False]
    row = impl.rows()[key]
    assert (row["fencing_token"], row["locked_until"]) == (tokens[0], now + HOUR)
    # The operation goes on: its creation and its recovery points are kept.
    assert (row["created_at"], row["recovery_points"]) == (now - HOUR, '{"a":1}')


def test_completion_is_fenced_by_the_token(impl: Impl) -> None:
    now, key = _now(), _key()
    values = _values(key, now)
    _claimed(impl, values)
    completion: dict[str, t.Any] = {
        "response_code": 201,
        "response_headers": [("Content-Type", "application/json")],
        "response_body": b'{"id":1}',
        "body_omitted": False,
        "now": now,
    }
    token = values["fencing_token"]
    with impl.engine.begin() as conn:
        assert not impl.store.complete(conn, SCOPE, key, new_fencing_token(token), **completion)
        assert impl.rows()[key]["status"] == IN_PROGRESS
        assert impl.store.complete(conn, SCOPE, key, token, **completion)
    row = impl.rows()[key]
    assert (row["status"], row["response_code"], row["response_body"]) == (
        COMPLETED,
        201,
        b'{"id":1}',
    )
    assert (row["locked_until"], row["completed_at"]) == (None, now)
    with impl.engine.begin() as conn:  # completed: no holder's statement applies any more
        assert not impl.store.complete(conn, SCOPE, key, token, **completion)
        assert not impl.store.renew_lease(conn, SCOPE, key, token, now + HOUR)
        assert not impl.store.release(conn, SCOPE, key, token)
    assert impl.rows()[key]["status"] == COMPLETED


def test_release_deletes_the_record_or_keeps_its_recovery_points(impl: Impl) -> None:
    now, gone, kept = _now(), _key(), _key()
    values = {key: _values(key, now) for key in (gone, kept)}
    for one in values.values():
        _claimed(impl, one)
    with impl.engine.begin() as conn:
        tokens = {key: one["fencing_token"] for key, one in values.items()}
        assert not impl.store.release(conn, SCOPE, gone, new_fencing_token(tokens[gone]))
        assert impl.store.release(conn, SCOPE, gone, tokens[gone])
        assert impl.store.save_recovery_points(
            conn, SCOPE, kept, tokens[kept], {"charge": 1}, now + HOUR
        )
        assert impl.store.release(conn, SCOPE, kept, tokens[kept], keep_recovery_points=True)
    rows = impl.rows()
    assert gone not in rows
    assert (rows[kept]["locked_until"], rows[kept]["recovery_points"]) == (None, '{"charge":1}')


def test_a_lease_is_renewed_and_kept_for_retry_only_by_its_holder(impl: Impl) -> None:
    now, key = _now(), _key()
    values = _values(key, now, request_method="POST", request_body=b"{}")
    _claimed(impl, values)
    token = values["fencing_token"]
    with impl.engine.begin() as conn:
        assert not impl.store.renew_lease(conn, SCOPE, key, new_fencing_token(token), now)
        assert impl.store.renew_lease(conn, SCOPE, key, token, now + 2 * HOUR)
        assert impl.store.restamp(
            conn, SCOPE, key, token, locked_until=now + 3 * HOUR, expires_at=now + 48 * HOUR
        )
    row = impl.rows()[key]
    assert (row["locked_until"], row["expires_at"]) == (now + 3 * HOUR, now + 48 * HOUR)
    with Session(impl.engine) as session:
        renewed, transaction = impl.store.renew_lease_before_commit(
            session, SCOPE, key, token, now + 4 * HOUR
        )
        assert renewed
        session.commit()
    if impl.dialect is PostgreSQL:
        assert isinstance(transaction, int)
        assert impl.store.commit_outcome(impl.engine, transaction, dt.timedelta(seconds=2))
    else:
        assert transaction is None
    with impl.engine.begin() as conn:
        assert impl.store.keep_for_retry(conn, SCOPE, key, token, recovery_points={})
    row = impl.rows()[key]
    assert (row["locked_until"], row["recovery_points"], row["request_body"]) == (None, "{}", None)


def test_purge_deletes_expired_records_and_nothing_else(impl: Impl) -> None:
    now = _now()
    past = now - 48 * HOUR
    expired = [_values(_key(), past, lease=-HOUR) for _ in range(3)]
    still_leased = _values(_key(), past, lease=49 * HOUR)  # past retention, lease live
    live = _values(_key(), now)
    for values in (*expired, still_leased, live):
        _claimed(impl, values)
    with impl.engine.begin() as conn:
        assert impl.store.count_expired(conn, now) == 3
        assert impl.store.purge_batch(conn, now, limit=2) == 2
        assert impl.store.purge_batch(conn, now, limit=2) == 1
        assert impl.store.purge_batch(conn, now, limit=2) == 0
    assert set(impl.rows()) == {still_leased["key"], live["key"]}


def test_abandoned_records_are_found_and_released(impl: Impl) -> None:
    now = _now()
    abandoned = _values(_key(), now - HOUR, lease=dt.timedelta(minutes=-1))
    resumable = _values(
        _key(), now - HOUR, lease=dt.timedelta(minutes=-2), recovery_points='{"a":1}'
    )
    held = _values(_key(), now)
    for values in (abandoned, resumable, held):
        _claimed(impl, values)
    with impl.engine.begin() as conn:
        found = impl.store.find_abandoned(conn, now, limit=10)
        assert [record.key for record in found] == [abandoned["key"]]
        assert impl.store.release_abandoned(conn, found[0], now)
        assert not impl.store.release_abandoned(conn, found[0], now)  # already gone
    assert set(impl.rows()) == {resumable["key"], held["key"]}


def test_the_operators_queries_compare_scope_and_key_exactly(impl: Impl) -> None:
    now = _now()
    ours = _values("Kéy", now)
    ours["scope"] = "tenant-é:1"
    other = _values("kéy", now)
    other["scope"] = "tenant-E:1"
    for values in (ours, other):
        _claimed(impl, values)
    with impl.engine.begin() as conn:
        found = impl.store.find(conn, scope_prefix="tenant-é")
        assert [(r.scope, r.key) for r in found] == [("tenant-é:1", "Kéy")]
        assert [r.scope for r in impl.store.find(conn, key="kéy")] == ["tenant-E:1"]
        stats = impl.store.stats(conn, now)
        assert stats["by_status"] == {IN_PROGRESS: 2}
        assert stats["table_bytes"] is None or stats["table_bytes"] > 0
        token = ours["fencing_token"]
        assert not impl.store.delete_record(
            conn, "tenant-é:1", "Kéy", token=new_fencing_token(token)
        )
        assert not impl.store.delete_record(conn, "tenant-é:1", "Kéy", status=COMPLETED)
        assert impl.store.delete_record(conn, "tenant-é:1", "Kéy", token=token)
    assert set(impl.rows()) == {"kéy"}


def test_database_now_is_the_servers_clock_in_utc(impl: Impl) -> None:
    with impl.engine.connect() as conn:
        now = database_now(conn)
    assert now.utcoffset() == dt.timedelta(0)
    assert abs(now - dt.datetime.now(dt.UTC)) < dt.timedelta(seconds=5)


def _wait_setting(impl: Impl, conn: sa.Connection) -> t.Any:
    if impl.dialect is PostgreSQL:
        return conn.execute(sa.text("SHOW lock_timeout")).scalar_one()
    if impl.dialect is MySQL:
        return conn.execute(sa.text("SELECT @@SESSION.innodb_lock_wait_timeout")).scalar_one()
    return conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one()


def test_a_duplicate_waits_no_longer_than_the_bound_which_is_then_put_back(impl: Impl) -> None:
    if impl.dialect is Dialect:
        pytest.skip("an engine without a module has no bound of ours")
    now, key = _now(), _key()
    other = impl.engine_like(pool_size=1, max_overflow=0)  # one connection: its settings
    try:
        with Session(impl.engine) as first, Session(other) as second:
            assert impl.store.claim(first, _values(key, now), None) == (True, None)
            before = _wait_setting(impl, second.connection())
            with pytest.raises(ClaimWaitExceeded):
                impl.store.claim(second, _values(key, now), dt.timedelta(milliseconds=200))
            second.rollback()
            assert _wait_setting(impl, second.connection()) == before
            first.commit()
            won, held = impl.store.claim(second, _values(key, now), dt.timedelta(seconds=5))
            assert (won, held is not None) == (False, True)
            assert _wait_setting(impl, second.connection()) == before
            second.rollback()
    finally:
        other.dispose()


def test_a_claim_bounds_how_long_its_transaction_may_sit_idle(impl: Impl) -> None:
    """On PostgreSQL, for the rest of the claim's transaction only; elsewhere the
    setting does nothing, and the claim works the same."""
    store = Store(impl.store.table, claim_idle=dt.timedelta(seconds=30))
    show = sa.text("SHOW idle_in_transaction_session_timeout")
    with Session(impl.engine) as session:
        if impl.dialect is PostgreSQL:
            server_setting = session.execute(show).scalar_one()
            assert server_setting == "0"  # the suite's servers: off
            session.rollback()
        values = _values(_key(), _now())
        assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
        if impl.dialect is PostgreSQL:
            assert session.execute(show).scalar_one() == "30s"
        session.commit()
        if impl.dialect is PostgreSQL:
            assert session.execute(show).scalar_one() == server_setting
    assert impl.rows()[values["key"]]["fencing_token"] == values["fencing_token"]


def test_an_autocommit_connection_is_refused_before_anything_is_written(impl: Impl) -> None:
    engine = impl.engine_like(isolation_level="AUTOCOMMIT")
    try:
        with Session(engine) as session, pytest.raises(RuntimeError, match="AUTOCOMMIT"):
            impl.store.claim(session, _values(_key(), _now()), None)
    finally:
        engine.dispose()
    assert impl.rows() == {}


def test_a_savepoint_first_in_the_transaction_rolls_back_with_it(impl: Impl) -> None:
    """Once the transaction is opened on the server (pysqlite's own waits for a
    write), a savepoint made first belongs to it: released, then rolled back
    with it, it leaves nothing."""
    with impl.engine.connect() as conn:
        conn.begin()
        open_transaction(conn)
        with conn.begin_nested():
            assert impl.store.try_insert(conn, _values(_key(), _now()))
        conn.rollback()
    assert impl.rows() == {}
