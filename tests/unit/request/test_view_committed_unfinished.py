"""A view that committed its work itself, whose request then never finished.

The view's own commit makes the charge durable; the extension then stores the
answer with a commit of its own (the completion). When that completion is lost
(the database gone, the connection cut) and so is the recording of the failure
that follows, or the worker dies between the two, the record stays in progress
under its lease. The operation has happened, so after the lease a retry (or the
recovery job) must not run the view again: the record is completed with the
500 ``failed-after-commit`` answer the view's commit stored, and that answer is
replayed to every retry. Counted in ledger rows.

On PostgreSQL (psycopg2 and psycopg 3) the completion is cut on the wire, by the
fault suite's proxy (:mod:`reliability.pgproxy`); on every engine the database
refuses the completion and the failure's recording at the statement.
"""

from __future__ import annotations

import typing as t
import uuid

import pytest
from flask import Flask
from sqlalchemy import event

from flask_idempotency._maintenance.jobs import recover_abandoned
from reliability.pgproxy import CommitCutter
from tests.conftest import Clock, ledger_count, postgres_url, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem, post

ROUTE = "/commits-itself"
LEASE = 2  # seconds: the clock is moved past it, nobody waits


def _assert_failed_after_commit(answer: t.Any) -> None:
    assert answer.headers.get("Idempotent-Replayed") == "true"
    assert assert_problem(answer, 500)["type"].endswith("failed-after-commit")


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize(
    ("mode", "cuts"),
    [("answered", 1), ("withheld", 1), ("withheld", 2)],
    ids=["completion-landed", "completion-lost", "completion-and-failure-lost"],
)
def test_a_completion_cut_after_the_view_committed_never_runs_the_view_again(
    driver: str, mode: str, cuts: int
) -> None:
    url = postgres_url(driver)
    reset_tables(url)
    clock = Clock()
    # Only transactions without a ledger row: the completion, then the
    # recording of the failure (the view's own commit carries the row).
    cutter = CommitCutter(
        url, rate=1.0, seed=0, modes=(mode,), limit=cuts, table="ledger", record_only=True
    )
    with cutter as proxy:
        app = testapp.create_app(proxy.url(), clock=clock, IDEMPOTENCY_LEASE=LEASE)
        client = app.test_client()
        key = str(uuid.uuid4())
        first = post(client, ROUTE, {"delay": 0}, key=key)
        assert_problem(first, 503)  # the database lost mid-request
        assert ledger_count(app) == 1
        [record] = record_rows(app)
        if mode == "answered":  # the completion landed: its answer is replayed
            assert record["status"] == "completed"
            retry = post(client, ROUTE, {"delay": 0}, key=key)
            assert retry.status_code == 201
            assert retry.headers.get("Idempotent-Replayed") == "true"
        elif cuts == 1:  # the failure was recorded at once, on a new connection
            assert (record["status"], record["response_code"]) == ("completed", 500)
            _assert_failed_after_commit(post(client, ROUTE, {"delay": 0}, key=key))
        else:  # both lost: in progress, holding the failure its view's commit stored
            assert (record["status"], record["response_code"]) == ("in_progress", 500)
            during = post(client, ROUTE, {"delay": 0}, key=key)
            assert_problem(during, 409)
            clock.advance(seconds=LEASE + 1)
            _assert_failed_after_commit(post(client, ROUTE, {"delay": 0}, key=key))
            [record] = record_rows(app)
            assert (record["status"], record["response_code"]) == ("completed", 500)
        clock.advance(seconds=LEASE + 1)
        for _ in range(2):
            again = post(client, ROUTE, {"delay": 0}, key=key)
            assert again.headers.get("Idempotent-Replayed") == "true"
        assert ledger_count(app) == 1, again.get_data()
        # Read last: the proxy notes a cut just after dropping the connection.
        assert [(c.mode, c.keys, c.work) for c in proxy.cuts] == [(mode, {key}, False)] * cuts
        with app.app_context():
            testapp.db.engine.dispose()


class Refused(Exception):
    """The database "gone" for the completion and the failure's recording."""


def _refuse_completions(app: Flask) -> t.Callable[[], None]:
    """Make every completion of a record (``UPDATE ... status``) fail at the
    statement, as a database gone after the view's commit would; returns the
    undo."""
    with app.app_context():
        engine = testapp.db.engine

    def refuse(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        head = " ".join(statement.split()).lower()
        if head.startswith("update idempotency_keys set status"):
            raise Refused("the database went away")

    event.listen(engine, "before_cursor_execute", refuse)
    return lambda: event.remove(engine, "before_cursor_execute", refuse)


@pytest.mark.parametrize("settle", ["retry", "recovery-job"])
def test_a_lost_completion_and_failure_leave_a_record_settled_after_its_lease(
    database_url: str, clock: Clock, settle: str
) -> None:
    app = testapp.create_app(database_url, clock=clock, IDEMPOTENCY_LEASE=LEASE)
    reset_tables(database_url)
    client = app.test_client()
    undo = _refuse_completions(app)
    try:
        first = post(client, ROUTE, {"delay": 0}, key="k1")
    finally:
        undo()
    assert first.status_code == 500
    assert ledger_count(app) == 1
    [record] = record_rows(app)
    assert (record["status"], record["response_code"]) == ("in_progress", 500)
    assert_problem(post(client, ROUTE, {"delay": 0}, key="k1"), 409)  # under its lease
    clock.advance(seconds=LEASE + 1)
    if settle == "recovery-job":
        report = recover_abandoned(app)
        assert (report.completed, report.released) == (1, 0)
        [record] = record_rows(app)
        assert (record["status"], record["response_code"]) == ("completed", 500)
    for _ in range(2):
        _assert_failed_after_commit(post(client, ROUTE, {"delay": 0}, key="k1"))
    assert ledger_count(app) == 1
    [record] = record_rows(app)
    assert (record["status"], record["response_code"]) == ("completed", 500)
    with app.app_context():
        testapp.db.engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_withheld_view_commit_then_a_landed_completion_replays_the_second_attempt(
    driver: str,
) -> None:
    """The first attempt's view COMMIT never reaches the server (nothing
    happened); the second attempt runs the work, and its completion lands but
    its answer is cut: the third attempt replays the second's answer. A replay
    after a withheld commit, with the work run exactly once."""
    url = postgres_url(driver)
    reset_tables(url)
    # Keyed COMMITs in order: attempt 1's view commit; attempt 2's view commit
    # and its completion.
    plan = ["withheld", None, "answered"]
    with CommitCutter(url, rate=1.0, seed=0, table="ledger", plan=plan) as proxy:
        app = testapp.create_app(proxy.url(), IDEMPOTENCY_LEASE=LEASE)
        client = app.test_client()
        key = str(uuid.uuid4())
        first = post(client, ROUTE, {"delay": 0}, key=key)
        assert_problem(first, 503)
        assert ledger_count(app) == 0  # withheld: nothing happened
        second = post(client, ROUTE, {"delay": 0}, key=key)
        assert_problem(second, 503)  # the work committed; its answer was lost
        assert ledger_count(app) == 1
        third = post(client, ROUTE, {"delay": 0}, key=key)
        assert third.status_code == 201
        assert third.headers.get("Idempotent-Replayed") == "true"
        assert ledger_count(app) == 1
        [record] = record_rows(app)
        assert (record["status"], record["response_code"]) == ("completed", 201)
        assert [(c.mode, c.work, c.server_said) for c in proxy.cuts] == [
            ("withheld", True, "not sent"),
            ("answered", False, "COMMIT"),
        ]
        with app.app_context():
            testapp.db.engine.dispose()
