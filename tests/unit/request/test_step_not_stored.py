"""A step whose result cannot be saved (not JSON, or larger than the database
takes) answers 500 problem+json ``step-not-stored``, never an HTML 500 or a
503 whose retry runs the step again; its function ran once and never runs
again for the key; the developer gets an ERROR line with the cause. The answer
says how long (until an operator releases the record, or it expires: when),
and the operator's override says that the retry runs the step again.
"""

from __future__ import annotations

import datetime as dt
import logging
import sqlite3
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._storage import dberrors
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem

CALLS: list[str] = []


def step_app(database_url: str, clock: Clock) -> Flask:
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/charge-object")
    @testapp.idem.idempotent(lease=30, scope=lambda: "tenant:1")
    def charge_object() -> tuple[dict[str, t.Any], int]:
        def charge() -> t.Any:
            CALLS.append(testapp.idem.derived_key("charge"))
            if app.config.get("FIXED"):
                return {"id": "ch_1"}
            if app.config.get("RESULT_BYTES"):  # a document, an upstream's whole answer
                return {"receipt": "x" * app.config["RESULT_BYTES"]}
            return dt.datetime.now(dt.timezone.utc)  # an SDK object, not JSON

        result = testapp.idem.step("charge", charge)
        testapp.write_ledger("charge-object")
        return {"charge": str(result)}, 201

    reset_tables(database_url)
    return app


def test_an_unstorable_step_result_is_a_problem_and_never_runs_again(
    database_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    CALLS.clear()
    app = step_app(database_url, clock)
    client = app.test_client()

    with caplog.at_level(logging.ERROR, logger="flask_idempotency"):
        first = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})

    doc = assert_problem(first, 500)
    assert doc["type"].endswith("step-not-stored")
    assert "'charge'" in doc["detail"]
    # How long: until an operator releases the record, or it expires (when).
    assert "until the server is fixed" not in doc["detail"]
    assert "until an operator releases the operation's record or it expires at " in doc["detail"]
    [logged] = [r for r in caplog.records if "not JSON-serializable" in r.getMessage()]
    assert logged.exc_info is not None
    assert isinstance(logged.exc_info[1], TypeError)
    assert len(CALLS) == 1
    [record] = record_rows(app)
    assert record["status"] == "in_progress"
    assert record["recovery_points"] is not None
    assert record["expires_at"].isoformat() in doc["detail"]
    assert ledger_count(app, "charge-object") == 0

    # The retry, at once and after the lease: the same answer, the step not run again.
    again = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert assert_problem(again, 500)["type"].endswith("step-not-stored")
    clock.advance(seconds=31)
    later = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert assert_problem(later, 500)["type"].endswith("step-not-stored")
    assert len(CALLS) == 1

    # Fixed, and released by the operator naming what it gives up: the retry runs.
    app.config["FIXED"] = True
    refused = app.test_cli_runner().invoke(
        args=["idempotency", "release", "tenant:1", "k", "--yes"]
    )
    assert refused.exit_code == 1
    assert "recovery points" in refused.output
    released = app.test_cli_runner().invoke(
        args=["idempotency", "release", "tenant:1", "k", "--yes", "--override", "recovery-points"]
    )
    assert released.exit_code == 0, released.output
    # The operator is told, naming the step, that the retry runs it again.
    assert "step 'charge' ran but its result was not stored" in released.output
    assert "runs it again" in released.output
    done = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert done.status_code == 201
    assert ledger_count(app, "charge-object") == 1
    # It did: a second call, under a new derived key (a new operation).
    assert len(CALLS) == 2
    assert CALLS[0] != CALLS[1]


def test_the_release_prompt_names_the_unstored_step(database_url: str, clock: Clock) -> None:
    CALLS.clear()
    app = step_app(database_url, clock)
    first = app.test_client().post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert assert_problem(first, 500)["type"].endswith("step-not-stored")
    declined = app.test_cli_runner().invoke(
        args=["idempotency", "release", "tenant:1", "k", "--override", "recovery-points"],
        input="n\n",
    )
    assert declined.exit_code == 1
    assert "step 'charge' ran but its result was not stored" in declined.output
    assert len(record_rows(app)) == 1


def _limit_sqlite_length(dbapi_connection: t.Any, record: t.Any) -> None:
    dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _SQLITE_LENGTH)


#: SQLite's longest string or blob, as the SQLite test's connections set it.
_SQLITE_LENGTH = 1_000_000


def test_a_step_result_larger_than_the_database_takes_is_not_stored(
    database_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """MariaDB: a result over ``max_allowed_packet`` (read from the server; a
    statement over it is answered by dropping the connection, which read as
    503 database-unavailable, and the retry charged again). SQLite: over the
    connection's ``SQLITE_LIMIT_LENGTH`` (set lower here; the server's own
    error, "string or blob too big"). PostgreSQL's limit is 1 GB a field:
    its refusal is classified below, with a real error, instead."""
    CALLS.clear()
    app = step_app(database_url, clock)
    with app.app_context():
        engine = testapp.db.engine
        if database_url.startswith("sqlite"):
            sa.event.listen(engine, "connect", _limit_sqlite_length)
            engine.dispose()
            app.config["RESULT_BYTES"] = 2 * _SQLITE_LENGTH
        elif database_url.startswith("mysql"):
            with engine.connect() as conn:
                limit = conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one()
            if limit > 64 * 1024 * 1024:
                pytest.skip(f"max_allowed_packet is {limit} bytes: too large a result to test")
            app.config["RESULT_BYTES"] = limit + 1024 * 1024
        else:
            pytest.skip("PostgreSQL takes 1 GB in a field: see the classification test")
    client = app.test_client()
    with caplog.at_level(logging.ERROR, logger="flask_idempotency"):
        first = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    doc = assert_problem(first, 500)
    assert doc["type"].endswith("step-not-stored")
    assert [r for r in caplog.records if "larger than the database takes" in r.getMessage()]
    # The error line names the step, never its result (the statement's
    # parameters, in the text of SQLAlchemy's error that caused the refusal).
    assert "receipt" not in caplog.text
    assert "x" * 50 not in caplog.text
    clock.advance(seconds=31)  # past the lease: the retry resumes the record
    again = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert assert_problem(again, 500)["type"].endswith("step-not-stored")
    assert len(CALLS) == 1
    [record] = record_rows(app)
    assert record["status"] == "in_progress"
    assert "result-not-stored" in record["recovery_points"]
    assert ledger_count(app, "charge-object") == 0
    if database_url.startswith("sqlite"):
        with app.app_context():
            sa.event.remove(testapp.db.engine, "connect", _limit_sqlite_length)


def test_a_refusal_for_size_is_told_apart_from_an_outage(database_url: str) -> None:
    """The database's own errors, produced for real: PostgreSQL's
    program_limit_exceeded (a string over 1 GB asked for, refused before it
    is made), MariaDB's ER_DATA_TOO_LONG (strict mode), SQLite's SQLITE_TOOBIG
    (a connection's length limit set low). Each is ``too_large`` and no
    retryable failure: the same value is refused on every retry."""
    engine = sa.create_engine(database_url)
    params: dict[str, t.Any] = {}
    if database_url.startswith("postgresql"):
        refused = "SELECT repeat('x', 1073741824)"
    elif database_url.startswith("mysql"):
        refused = "INSERT INTO too_long VALUES ('xy')"
    else:
        sa.event.listen(engine, "connect", _limit_sqlite_length)
        refused, params = "SELECT :v", {"v": "x" * (2 * _SQLITE_LENGTH)}
    try:
        with engine.connect() as conn:
            if database_url.startswith("mysql"):
                conn.execute(sa.text("SET SESSION sql_mode = 'STRICT_ALL_TABLES'"))
                conn.execute(sa.text("CREATE TEMPORARY TABLE too_long (x VARCHAR(1))"))
            with pytest.raises(sa.exc.DBAPIError) as caught:
                conn.execute(sa.text(refused), params)
    finally:
        engine.dispose()
    assert dberrors.too_large(caught.value)
    assert dberrors.classify(caught.value) is None
