"""Every statement's outcome is read from what it returned or wrote, on every driver.

Whether a claim won, a reclaim took the record over, a completion, renewal or
release applied, an inbox id was new, a job lock was taken: each is decided by
the row the statement returns (``RETURNING``) or, where the engine has none,
by the fencing token read back (inserts) or the matched-row count the server
sends (MySQL's ``UPDATE``). Never by a driver's ``rowcount`` where the engine
could return rows: psycopg 3 under SQLAlchemy 2.1 reports -1 for an
``INSERT``, and every fresh key answered 409.

The same primitives run on every engine and driver (psycopg2, psycopg 3,
SQLite, MariaDB), once as the engine is and once with ``RETURNING`` switched
off on the engine's dialect, the path MySQL takes; and once more with every
``rowcount`` reading -1, which must change nothing where ``RETURNING`` is used.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy.orm import Session

from flask_idempotency._maintenance.scheduler import JobScheduler
from flask_idempotency._messaging import inbox
from flask_idempotency._storage import (
    COMPLETED,
    IN_PROGRESS,
    OVERRIDABLE,
    Record,
    Store,
    new_fencing_token,
)
from tests.conftest import reset_tables
from tests.support import pgbouncer, testapp
from tests.support.claims import HOUR, claim_values, claimed_in_one_round_trip_each


@pytest.fixture(params=["as-is", "no-returning", "rowcount-lies"])
def outcome_app(
    request: pytest.FixtureRequest, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> Flask:
    """The test app, its engine as it is, without ``RETURNING`` (MySQL's path),
    or with every row count reading -1 (where ``RETURNING`` decides)."""
    app = testapp.create_app(database_url)
    reset_tables(database_url)
    with app.app_context():
        engine = testapp.db.engine
        with engine.connect():
            pass  # the dialect learns the server's version (and its RETURNING) here
        dialect = engine.dialect
        if request.param == "no-returning":
            for flag in ("insert_returning", "update_returning", "delete_returning"):
                monkeypatch.setattr(dialect, flag, False)
        elif request.param == "rowcount-lies":
            if not (dialect.insert_returning and dialect.update_returning):
                pytest.skip(f"{dialect.name} has no UPDATE ... RETURNING: its row count decides")
            monkeypatch.setattr(
                type(dialect).execution_ctx_cls, "rowcount", property(lambda self: -1)
            )
    return app


def _store(app: Flask) -> Store:
    return t.cast(Store, app.extensions["idempotency"].store)


def test_claim_takeover_completion_and_release_outcomes(outcome_app: Flask) -> None:
    app, store = outcome_app, _store(outcome_app)
    now = dt.datetime.now(dt.timezone.utc)
    key = str(uuid.uuid4())
    first = claim_values(key, now, lease=dt.timedelta(seconds=-1))  # its lease already over
    with app.app_context():
        engine = testapp.db.engine
        with Session(engine) as session:
            assert store.claim(session, first, dt.timedelta(seconds=5)) == (True, None)
            session.commit()
        # A second claim of the key loses, and is told whose record holds it.
        with Session(engine) as session:
            won, held = store.claim(session, claim_values(key, now), dt.timedelta(seconds=5))
            assert won is False
            assert held is not None
            assert held.fencing_token == first["fencing_token"]
            assert store.try_insert(session, claim_values(key, now)) is False
            session.rollback()
        record = store.load_committed(engine, "outcomes", key)
        assert isinstance(record, Record)
        # Two contenders reclaim the record they both read: exactly one wins.
        tokens = [new_fencing_token(record.fencing_token) for _ in range(2)]
        outcomes = []
        for token in tokens:
            with Session(engine) as session:
                columns = {
                    k: v
                    for k, v in claim_values(key, now).items()
                    if k not in ("scope", "key", "fencing_token")
                }
                taken = store.take_over(session, record, columns, now, expired=False, token=token)
                outcomes.append(taken)
                session.commit()
        assert outcomes == [True, False]
        holder = tokens[0]
        # Fenced updates: the old token changes nothing, the holder's does.
        with Session(engine) as session:
            old = first["fencing_token"]
            assert not store.renew_lease(session, "outcomes", key, old, now + HOUR)
            assert not store.release(session, "outcomes", key, old)
            assert store.renew_lease(session, "outcomes", key, holder, now + HOUR)
            assert store.save_recovery_points(
                session, "outcomes", key, holder, {"a": 1}, now + HOUR
            )
            completion = {
                "response_code": 201,
                "response_headers": [],
                "response_body": b"{}",
                "body_omitted": False,
                "now": now,
            }
            assert not store.complete(session, "outcomes", key, old, **completion)
            assert store.complete(session, "outcomes", key, holder, **completion)
            # Completed: no longer held, so nothing fenced applies any more.
            assert not store.renew_lease(session, "outcomes", key, holder, now + HOUR)
            assert not store.release(session, "outcomes", key, holder)
            session.commit()
        done = store.load_committed(engine, "outcomes", key)
        assert done is not None
        assert (done.status, done.fencing_token, done.response_code) == (COMPLETED, holder, 201)
        # An operator's delete on a token it was not shown changes nothing, and a
        # completed record (a committed outcome) is never released.
        with engine.begin() as conn:
            stale = dataclasses.replace(done, fencing_token=old, status=IN_PROGRESS)
            assert not store.delete_releasable(conn, stale, now, OVERRIDABLE)
            assert not store.delete_releasable(conn, done, now, OVERRIDABLE)
        assert store.load_committed(engine, "outcomes", key) == done


def test_release_of_a_held_record_frees_it(outcome_app: Flask) -> None:
    app, store = outcome_app, _store(outcome_app)
    now = dt.datetime.now(dt.timezone.utc)
    values = claim_values(str(uuid.uuid4()), now)
    with app.app_context(), Session(testapp.db.engine) as session:
        assert store.claim(session, values, None) == (True, None)
        token = values["fencing_token"]
        assert store.release(session, "outcomes", values["key"], token)
        assert store.claim(session, claim_values(values["key"], now), None)[0] is True
        session.rollback()


def test_inbox_and_job_lock_outcomes(outcome_app: Flask) -> None:
    app = outcome_app
    now = dt.datetime.now(dt.timezone.utc)
    with app.app_context():
        with Session(testapp.db.engine) as session:
            assert inbox.mark_processed(session, "billing", "evt-1", now=now) is True
            session.commit()
        with Session(testapp.db.engine) as session:
            assert inbox.mark_processed(session, "billing", "evt-1", now=now) is False
            # Kept past its window, the id is new again, for one delivery.
            later = now + 30 * 24 * HOUR
            assert inbox.mark_processed(session, "billing", "evt-1", now=later) is True
            session.commit()
        locks = JobScheduler(app).locks
        engine, ttl = testapp.db.engine, dt.timedelta(minutes=2)
        assert locks.acquire(engine, "demo", "a", ttl) is True
        assert locks.acquire(engine, "demo", "b", ttl) is False
        assert locks.renew(engine, "demo", "a", ttl) is True
        assert locks.renew(engine, "demo", "b", ttl) is False


def test_a_fresh_key_runs_once_through_the_app(outcome_app: Flask) -> None:
    """The whole request path, on each driver and path: a new key runs the view
    and commits (the psycopg 3 defect answered 409 to every fresh key)."""
    client = outcome_app.test_client()
    for n in range(3):
        key = f"fresh-{n}"
        for _ in range(2):
            response = client.post(
                "/charges", json={"amount": 5, "currency": "EUR"}, headers={"Idempotency-Key": key}
            )
            assert response.status_code == 201, response.get_data(as_text=True)
    with outcome_app.app_context(), testapp.db.engine.connect() as conn:
        count = conn.execute(sa.select(sa.func.count()).select_from(testapp.Ledger)).scalar_one()
    assert count == 3


@pytest.mark.parametrize("wait", [dt.timedelta(seconds=10), None], ids=["bounded", "unbounded"])
def test_the_claim_is_one_round_trip_on_psycopg2_and_psycopg_3(
    pg_url: str, wait: dt.timedelta | None
) -> None:
    """Setting the wait's bound, the insert, restoring the bound and reading the
    record travel together: one batch, parameters bound on the client, on each
    driver. Counted on the wire (exchanges: the client sends after a reply), for
    a key that is new and for one that is taken."""
    table = testapp.db.metadata.tables.get("idempotency_keys")
    if table is None:
        reset_tables(pg_url)
        table = testapp.db.metadata.tables["idempotency_keys"]
    reset_tables(pg_url)
    store = Store(table)
    with claimed_in_one_round_trip_each(pg_url, store, wait):
        pass  # the claims and their exchanges are checked as they run


def test_the_servers_own_idle_timeout_still_ends_a_claim_left_idle(
    pg_url: str, pooled_role: t.Callable[..., str]
) -> None:
    """A claim whose host goes quiet right after it (a partition, a frozen
    process) is ended by the server's ``idle_in_transaction_session_timeout``,
    whatever the driver: psycopg 3's pipeline mode, once used for the claim,
    ends with a Flush that disarms the server's idle timer until the next
    statement, which such a host never sends; its claim stayed held."""
    reset_tables(pg_url)
    store = Store(testapp.db.metadata.tables["idempotency_keys"])
    url = sa.make_url(pg_url)
    if pgbouncer.is_pooled(pg_url):  # behind the pooler: the role's setting
        role = pooled_role(pg_url, idle_in_transaction_session_timeout="500")
        engine = sa.create_engine(role, poolclass=sa.NullPool)
    else:
        options = f"{url.query.get('options', '')} -c idle_in_transaction_session_timeout=500"
        engine = sa.create_engine(
            url.update_query_dict({"options": options.strip()}), poolclass=sa.NullPool
        )
    try:
        now = dt.datetime.now(dt.timezone.utc)
        values = claim_values(str(uuid.uuid4()), now)
        with Session(engine) as session:
            assert store.claim(session, values, dt.timedelta(seconds=5)) == (True, None)
            time.sleep(2)  # quiet: the server's timer must end the transaction
            with pytest.raises(sa.exc.DBAPIError):
                session.execute(sa.text("SELECT 1"))
            session.rollback()
        # The claim went with it: the key is free for the retry elsewhere.
        with Session(engine) as session:
            assert store.claim(session, claim_values(values["key"], now), None) == (True, None)
            session.rollback()
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_the_outcome_of_a_commit_whose_answer_was_lost(driver: str) -> None:
    """PostgreSQL says whether the transaction that renewed the lease before a
    commit committed (``txid_status``). One still open (its ``COMMIT`` still on
    the way) is ended, so that it can no longer land after the answer "not
    committed" was given: a request judging its own interrupted commit never
    frees a key whose work then commits."""
    from tests.conftest import postgres_url

    url = postgres_url(driver)
    app = testapp.create_app(url)
    reset_tables(url)
    with app.app_context():
        engine = testapp.db.engine
        table = testapp.db.metadata.tables["idempotency_keys"]
    store = Store(table)
    now = dt.datetime.now(dt.UTC)
    wait = dt.timedelta(seconds=2)
    outcomes = {}
    for ending in ("commit", "rollback", "left-open"):
        key = f"in-doubt-{ending}"
        values = claim_values(key, now)
        with Session(engine) as session:
            assert store.claim(session, values, None)[0]
            session.commit()
        session = Session(engine)
        renewed, xid = store.renew_lease_before_commit(
            session, "outcomes", key, values["fencing_token"], now + HOUR
        )
        assert renewed
        assert isinstance(xid, int)
        if ending == "commit":
            session.commit()
        elif ending == "rollback":
            session.rollback()
        outcomes[ending] = store.commit_outcome(engine, xid, wait)
        if ending == "left-open":
            # The late COMMIT finds its session ended by the server.
            with pytest.raises(sa.exc.DBAPIError):
                session.commit()
        session.close()
    assert outcomes == {"commit": True, "rollback": False, "left-open": False}
    engine.dispose()
