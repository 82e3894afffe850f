"""The jobs and the operator's commands judge leases and retention by the
database's clock, not by the clock of the host they run on (DESIGN: "Time that
coordinates processes comes from the database").

An ops host whose clock runs 3 minutes ahead (NTP drift, a VM restored from a
snapshot) sees a live 2-minute lease as over and a record with 2 minutes of
retention left as expired. Judged by its own clock, ``release`` deleted the
running operation's record without ``--override``, ``recover`` released it,
and ``purge`` deleted a completed record inside its window: each time the
client's retry ran the operation a second time. On every engine, with the
records' times set in the database's frame, as hosts with the right clock wrote
them; a host behind the database, likewise, does not keep an ended lease or an
expired record.
"""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import pytest
from flask import Flask

import flask_idempotency.extension as extension
from flask_idempotency._storage import (
    COMPLETED,
    IN_PROGRESS,
    database_now,
    new_fencing_token,
    operation_values,
)
from flask_idempotency.jobs import purge_expired, recover_abandoned
from tests.conftest import insert_records, record_rows, reset_tables
from tests.support import testapp

SCOPE = "tenant:1"
SKEW = dt.timedelta(minutes=3)


def host_app(database_url: str, monkeypatch: pytest.MonkeyPatch, skew: dt.timedelta) -> Flask:
    """The test app on a host whose system clock is ``skew`` off the real time
    (no clock of its own given: the host's, as in production)."""
    with monkeypatch.context() as patched:
        patched.setattr(extension, "utc_now", lambda: dt.datetime.now(dt.timezone.utc) + skew)
        app = testapp.create_app(database_url)
    reset_tables(database_url)
    return app


def db_now(app: Flask) -> dt.datetime:
    with app.app_context(), testapp.db.engine.connect() as conn:
        return database_now(conn)


def put(app: Flask, key: str, **columns: t.Any) -> None:
    now = db_now(app)
    values = {
        "scope": SCOPE,
        "key": key,
        "fencing_token": new_fencing_token(),
        **operation_values(
            **{
                "request_hash": "h",
                "status": IN_PROGRESS,
                "created_at": now - dt.timedelta(minutes=1),
                "expires_at": now + dt.timedelta(hours=24),
                **columns,
            }
        ),
    }
    with app.app_context(), testapp.db.engine.begin() as conn:
        insert_records(conn, [values])


def keys(app: Flask) -> set[str]:
    return {row["key"] for row in record_rows(app)}


def cli(app: Flask, *args: str) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args])


@pytest.fixture
def ahead(database_url: str, monkeypatch: pytest.MonkeyPatch) -> t.Iterator[Flask]:
    app = host_app(database_url, monkeypatch, SKEW)
    yield app
    with app.app_context():
        testapp.db.engine.dispose()


def test_release_from_a_host_ahead_refuses_a_live_lease(ahead: Flask) -> None:
    put(ahead, "running", locked_until=db_now(ahead) + dt.timedelta(minutes=2))
    put(ahead, "abandoned", locked_until=db_now(ahead) - dt.timedelta(seconds=5))

    refused = cli(ahead, "release", SCOPE, "running", "--yes")
    assert refused.exit_code == 1, refused.output
    assert "its lease is live until" in refused.output
    released = cli(ahead, "release", SCOPE, "abandoned", "--yes")
    assert released.exit_code == 0, released.output
    assert keys(ahead) == {"running"}


def test_recovery_on_a_host_ahead_leaves_a_live_lease(ahead: Flask) -> None:
    put(ahead, "running", locked_until=db_now(ahead) + dt.timedelta(minutes=2))
    put(ahead, "abandoned", locked_until=db_now(ahead) - dt.timedelta(seconds=5))

    report = recover_abandoned(ahead)
    assert (report.released, report.kept, report.completed) == (1, 0, 0)
    assert keys(ahead) == {"running"}
    result = cli(ahead, "recover")
    assert result.exit_code == 0, result.output
    assert keys(ahead) == {"running"}


def test_purge_on_a_host_ahead_keeps_a_record_in_its_window(ahead: Flask) -> None:
    done = {"status": COMPLETED, "response_code": 201, "response_body": b"{}"}
    put(ahead, "in-window", expires_at=db_now(ahead) + dt.timedelta(minutes=2), **done)
    put(ahead, "expired", expires_at=db_now(ahead) - dt.timedelta(seconds=5), **done)

    assert purge_expired(ahead, dry_run=True).deleted == 1
    listed = cli(ahead, "list")
    assert {row["key"]: row["expired"] for row in json.loads(listed.output)} == {
        "in-window": False,
        "expired": True,
    }
    result = cli(ahead, "purge")
    assert result.exit_code == 0, result.output
    assert "deleted 1 expired record(s)" in result.output
    assert keys(ahead) == {"in-window"}


def test_jobs_on_a_host_behind_do_not_keep_what_has_ended(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    behind = host_app(database_url, monkeypatch, -SKEW)
    try:
        done = {"status": COMPLETED, "response_code": 201, "response_body": b"{}"}
        put(behind, "expired", expires_at=db_now(behind) - dt.timedelta(seconds=5), **done)
        put(behind, "abandoned", locked_until=db_now(behind) - dt.timedelta(seconds=5))
        assert recover_abandoned(behind).released == 1
        assert purge_expired(behind).deleted == 1
        assert keys(behind) == set()
    finally:
        with behind.app_context():
            testapp.db.engine.dispose()


def test_an_app_given_its_own_clock_keeps_driving_the_jobs_with_it(database_url: str) -> None:
    """Tests move time with ``Idempotency(clock=...)``: the jobs and commands
    follow that clock, not the database's."""
    late = dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)
    app = testapp.create_app(database_url, clock=lambda: late)
    reset_tables(database_url)
    try:
        put(app, "running", locked_until=db_now(app) + dt.timedelta(minutes=2))
        released = cli(app, "release", SCOPE, "running", "--yes")
        assert released.exit_code == 0, released.output
        assert keys(app) == set()
    finally:
        with app.app_context():
            testapp.db.engine.dispose()
