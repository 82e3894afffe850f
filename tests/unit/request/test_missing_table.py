"""A table of the extension's missing from the database (``create-tables`` or the
migrations never ran there) answers 503 ``server-misconfigured`` problem+json with
``Retry-After``, names the table and the command in one ERROR line per process and
table (not one per request), stores nothing, is counted ``misconfigured``, and
readiness says not ready; once the table exists, a retry with the same key runs. A table
of the app's missing stays the app's own error. On every engine, through real
requests on an empty database."""

from __future__ import annotations

import logging
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency.errors import PROBLEM_TYPE_BASE
from tests.support import testapp
from tests.support.flow import assert_problem, post
from tests.unit.telemetry import conftest as telemetry
from tests.unit.telemetry.conftest import Otel

otel = telemetry.otel  # the telemetry tests' fixture: the figures counted

CHARGE = {"amount": 500, "currency": "EUR"}
MISCONFIGURED = PROBLEM_TYPE_BASE + "server-misconfigured"


@pytest.fixture
def empty_app(fresh_database: str) -> t.Iterator[Flask]:
    """The test app on a database of its own holding only the app's ledger table."""
    app = testapp.create_app(fresh_database)
    with app.app_context():
        testapp.Ledger.__table__.create(testapp.db.engine)
    yield app
    with app.app_context():
        testapp.db.engine.dispose()


def _count(app: Flask, table: str) -> int:
    with app.app_context(), testapp.db.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one())


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "flask_idempotency" and r.levelno >= logging.ERROR
    ]


def test_a_missing_record_table_answers_503_problem_and_a_retry_runs_once_created(
    empty_app: Flask, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    client = empty_app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        answers = [post(client, "/charges", CHARGE, key=f"k{n}") for n in (1, 2, 3)]
    for answer in answers:
        problem = assert_problem(answer, 503)
        assert problem["type"] == MISCONFIGURED
        assert answer.headers["Retry-After"] == "30"
    assert _count(empty_app, "ledger") == 0
    (line,) = _errors(caplog)  # once per process and table, not once per request
    assert "idempotency_keys" in line
    assert "flask idempotency create-tables" in line
    assert otel.outcomes() == {("misconfigured", "/charges", "POST"): 3}
    with empty_app.app_context():
        ready, details = testapp.idem.readiness()
    assert (ready, details["database"]) == (False, "missing_table")

    done = empty_app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
    assert done.exit_code == 0, done.output
    assert post(client, "/charges", CHARGE, key="k1").status_code == 201
    assert post(client, "/charges", CHARGE, key="k1").headers["Idempotent-Replayed"] == "true"
    assert _count(empty_app, "ledger") == 1
    assert _count(empty_app, "idempotency_keys") == 1
    with empty_app.app_context():
        assert testapp.idem.readiness()[0] is True


def test_an_optimistic_route_without_its_record_table_keeps_nothing(
    empty_app: Flask, otel: Otel
) -> None:
    """The view runs first there; the record's write fails, and rolls its work back."""
    problem = assert_problem(post(empty_app.test_client(), "/optimistic", CHARGE, key="k1"), 503)
    assert problem["type"] == MISCONFIGURED
    assert _count(empty_app, "ledger") == 0
    assert otel.outcomes() == {("misconfigured", "/optimistic", "POST"): 1}


def test_a_missing_outbox_answers_503_problem_and_keeps_nothing(
    empty_app: Flask, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    @empty_app.post("/emits")
    @testapp.idem.idempotent()
    def emits() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("/emits")
        testapp.idem.emit("orders", {"n": 1})
        return {"ok": True}, 201

    with empty_app.app_context():
        for table in ("idempotency_keys", "idempotency_job_locks", "idempotency_inbox"):
            testapp.db.metadata.tables[table].create(testapp.db.engine)
    client = empty_app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        problem = assert_problem(post(client, "/emits", {}, key="k1"), 503)
    assert problem["type"] == MISCONFIGURED
    (line,) = _errors(caplog)
    assert "idempotency_outbox" in line
    assert (_count(empty_app, "ledger"), _count(empty_app, "idempotency_keys")) == (0, 0)
    assert otel.outcomes() == {("misconfigured", "/emits", "POST"): 1}


def test_a_missing_table_of_the_apps_stays_the_apps_error(
    empty_app: Flask, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    done = empty_app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
    assert done.exit_code == 0, done.output

    @empty_app.post("/reads-elsewhere")
    @testapp.idem.idempotent()
    def reads_elsewhere() -> dict[str, t.Any]:
        testapp.db.session.execute(sa.text("SELECT 1 FROM no_such_table_of_the_app"))
        return {}

    empty_app.config["PROPAGATE_EXCEPTIONS"] = False
    client = empty_app.test_client()
    answer = post(client, "/reads-elsewhere", {}, key="k1")
    assert answer.status_code == 500
    assert answer.mimetype != "application/problem+json"  # the app's error handling
    assert otel.outcomes() == {("failed", "/reads-elsewhere", "POST"): 1}
    assert _count(empty_app, "idempotency_keys") == 0  # released: a retry runs again


def test_a_missing_inbox_in_a_view_answers_503_problem_and_keeps_nothing(
    empty_app: Flask, otel: Otel, caplog: pytest.LogCaptureFixture
) -> None:
    """A view that marks an event processed (the inbox) in an ``@idempotent`` route,
    without the inbox table: 503 problem+json (was an HTML 500), nothing kept."""
    from flask_idempotency import inbox

    @empty_app.post("/hook")
    @testapp.idem.idempotent()
    def hook() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("/hook")
        inbox.mark_processed(testapp.db.session, "billing", "ev-1")
        return {"ok": True}, 201

    with empty_app.app_context():
        for table in ("idempotency_keys", "idempotency_job_locks", "idempotency_outbox"):
            testapp.db.metadata.tables[table].create(testapp.db.engine)
    client = empty_app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        answer = post(client, "/hook", {}, key="k1")
    problem = assert_problem(answer, 503)
    assert problem["type"] == MISCONFIGURED
    assert answer.headers["Retry-After"] == "30"
    assert "rolled back" in problem["detail"]
    (line,) = _errors(caplog)
    assert "idempotency_inbox" in line
    assert (_count(empty_app, "ledger"), _count(empty_app, "idempotency_keys")) == (0, 0)


def test_a_second_outage_of_a_table_logs_its_error_line_again(
    empty_app: Flask, caplog: pytest.LogCaptureFixture
) -> None:
    """The report is once per outage, not once per process: after a request that
    found the table back, a table dropped again is reported again."""
    client = empty_app.test_client()
    with caplog.at_level(logging.INFO, logger="flask_idempotency"):
        for n in (1, 2):
            assert_problem(post(client, "/charges", CHARGE, key=f"a{n}"), 503)
        assert len(_errors(caplog)) == 1
        done = empty_app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
        assert done.exit_code == 0, done.output
        assert post(client, "/charges", CHARGE, key="b1").status_code == 201
        assert _count(empty_app, "ledger") == 1
        with empty_app.app_context():
            testapp.db.metadata.tables["idempotency_keys"].drop(testapp.db.engine)
        caplog.clear()
        for n in (1, 2):
            assert_problem(post(client, "/charges", CHARGE, key=f"c{n}"), 503)
    (line,) = _errors(caplog)
    assert "idempotency_keys" in line
    assert _count(empty_app, "ledger") == 1


def test_readiness_fails_while_the_outbox_is_missing(empty_app: Flask) -> None:
    """``init_app`` puts the outbox on the metadata; without its table every
    request that emits answers 503, so the host is not ready."""
    with empty_app.app_context():
        for table in ("idempotency_keys", "idempotency_job_locks", "idempotency_inbox"):
            testapp.db.metadata.tables[table].create(testapp.db.engine)
        ready, details = testapp.idem.readiness()
    assert (ready, details["database"]) == (False, "missing_table")
    assert "idempotency_outbox" in details["reason"]
    with empty_app.app_context():
        testapp.db.metadata.tables["idempotency_outbox"].create(testapp.db.engine)
        assert testapp.idem.readiness()[0] is True
