"""Recovery points, derived keys and the lease recovery job, in-process on both databases."""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request

from flask_idempotency import IN_PROGRESS
from flask_idempotency._maintenance.jobs import recover_abandoned
from flask_idempotency.keys import derive_scoped_key as derive_key
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import abandon, assert_problem, post


def test_derived_keys_are_stable_and_distinct_per_step_and_scope() -> None:
    assert derive_key("t:a", "k", "charge") == derive_key("t:a", "k", "charge")
    assert derive_key("t:a", "k", "charge") != derive_key("t:a", "k", "email")
    assert derive_key("t:a", "k", "charge") != derive_key("t:b", "k", "charge")
    # NUL is the separator, so it may not appear where it could shift parts.
    with pytest.raises(ValueError, match="NUL"):
        derive_key("a\x00b", "c", "s")
    with pytest.raises(ValueError, match="NUL"):
        derive_key("a", "b", "s\x00t")
    assert len(derive_key("t", "k", "s")) == 64
    with pytest.raises(ValueError, match="step"):
        derive_key("t", "k", "")


def test_step_outside_a_leased_route_is_a_clear_error(app: Flask, client: t.Any) -> None:
    app.config["PROPAGATE_EXCEPTIONS"] = True
    with pytest.raises(RuntimeError, match="leased route"):
        post(client, "/step-without-lease", {})
    assert record_rows(app) == []


def test_step_refused_after_a_takeover_rolls_back(database_url: str, clock: Clock) -> None:
    """Another request takes the record over while a step runs: the step's
    result is not saved, and the request ends with lease-lost, its writes undone."""
    app = testapp.create_app(database_url, clock=clock)
    taken_over_by = 424242

    @app.post("/taken-over")
    @testapp.idem.idempotent(lease=30)
    def taken_over() -> tuple[dict[str, t.Any], int]:
        # On SQLite (one writer) a write before a step would block the step's
        # own transaction; the README says so. PostgreSQL shows the rollback.
        if database_url.startswith("postgresql"):
            testapp.write_ledger("taken-over")

        def charge() -> str:
            # What a reclaim by another worker does to the row: a new token.
            table = testapp.db.metadata.tables["idempotency_keys"]
            with testapp.db.engine.begin() as conn:
                conn.execute(sa.update(table).values(fencing_token=taken_over_by))
            return "ch_1"

        testapp.idem.step("charge", charge)
        return {"charged": True}, 201

    reset_tables(database_url)
    response = post(app.test_client(), "/taken-over", {})
    assert_problem(response, 409)
    assert response.get_json()["type"].endswith("lease-lost")
    [record] = record_rows(app)
    assert record["status"] == IN_PROGRESS
    assert record["fencing_token"] == taken_over_by
    assert record["recovery_points"] is None  # the step was not saved
    assert ledger_count(app) == 0


def test_step_results_round_trip_and_must_be_json(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock)
    calls: list[str] = []

    @app.post("/steps")
    @testapp.idem.idempotent(lease=30)
    def steps() -> tuple[dict[str, t.Any], int]:
        first = testapp.idem.step("a", lambda: calls.append("a") or {"n": (1, 2)})
        if testapp.idem.payload.get("bad"):
            testapp.idem.step("b", lambda: object())
        return {"first": first}, 201

    reset_tables(database_url)
    client = app.test_client()
    assert post(client, "/steps", {}, key="k1").get_json() == {"first": {"n": [1, 2]}}
    # Not JSON: a problem+json (step-not-stored, see test_step_not_stored), even
    # where exceptions propagate; the TypeError is its cause, in the log.
    app.config["PROPAGATE_EXCEPTIONS"] = True
    answer = post(client, "/steps", {"bad": True}, key="k2")
    assert answer.status_code == 500
    assert answer.get_json()["type"].endswith("step-not-stored")


def test_recovery_job_releases_abandoned_records_of_other_routes(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    abandon(app, clock)  # /status/201 has no recover=True: it cannot be re-run
    report = recover_abandoned(app)
    assert (report.completed, report.released) == (0, 0)  # lease still live
    assert len(record_rows(app)) == 1
    clock.advance(seconds=61)
    report = recover_abandoned(app)
    assert (report.completed, report.released, report.skipped) == (0, 1, 0)
    assert record_rows(app) == []
    # The key is free again: the client's retry runs the view.
    assert post(client, "/status/201", {}).status_code == 201
    assert ledger_count(app) == 1


def test_recovery_job_leaves_expired_and_completed_records_alone(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    post(client, "/charges", {"amount": 1, "currency": "EUR"})
    abandon(app, clock, key="old")
    clock.advance(hours=25)  # past the TTL: cleanup's business, not recovery's
    report = recover_abandoned(app)
    assert (report.completed, report.released, report.skipped) == (0, 0, 0)
    assert len(record_rows(app)) == 2


@pytest.mark.parametrize("args", [["--limit", "0"], ["--limit", "many"], ["--bogus"]])
def test_cli_recover_rejects_bad_arguments(app: Flask, clock: Clock, args: list[str]) -> None:
    abandon(app, clock)
    clock.advance(seconds=61)
    result = app.test_cli_runner().invoke(args=["idempotency", "recover", *args])
    assert result.exit_code != 0
    assert "Error" in result.output
    assert len(record_rows(app)) == 1  # nothing changed


def test_cli_recover_reports(app: Flask, clock: Clock) -> None:
    abandon(app, clock)
    clock.advance(seconds=61)
    result = app.test_cli_runner().invoke(args=["idempotency", "recover", "--limit", "5"])
    assert result.exit_code == 0
    assert "released 1" in result.output
    assert record_rows(app) == []


def test_released_failure_keeps_recovery_points_for_the_retry(
    database_url: str, clock: Clock
) -> None:
    app = testapp.create_app(database_url, clock=clock)
    calls: list[int] = []

    @app.post("/flaky")
    @testapp.idem.idempotent(lease=dt.timedelta(seconds=30))
    def flaky() -> tuple[dict[str, t.Any], int]:
        charge = testapp.idem.step("charge", lambda: calls.append(1) or "ch_1")
        testapp.write_ledger("flaky")
        if len(calls) == 1 and not testapp.idem.payload.get("retry"):
            return {"error": "email down"}, 503
        return {"charge": charge}, 201

    reset_tables(database_url)
    client = app.test_client()
    assert post(client, "/flaky", {}).status_code == 503
    [record] = record_rows(app)
    assert record["status"] == IN_PROGRESS
    assert record["locked_until"] is None
    assert ledger_count(app) == 0
    # The same request again: resumes at once, the step is not called again.
    calls.append(2)  # so the view now succeeds
    retry = post(client, "/flaky", {})
    assert retry.status_code == 201
    assert retry.get_json() == {"charge": "ch_1"}
    assert calls == [1, 2]
    assert ledger_count(app) == 1


def test_recovery_job_keeps_records_whose_finished_steps_a_retry_resumes(
    database_url: str, clock: Clock
) -> None:
    """A leased view's step finished, then the view failed: the record keeps its
    recovery point, lease ended. The recovery job must not delete it (on a route
    without recover=True, nor after a failed re-run of one with it): the
    client's retry resumes after the step instead of calling it again."""
    app = testapp.create_app(database_url, clock=clock)
    calls: list[str] = []

    def book() -> tuple[dict[str, t.Any], int]:
        route = request.path
        testapp.idem.step("charge", lambda: calls.append(route) or "ch_1")
        if not testapp.idem.payload.get("retry"):
            return {"error": "email provider down"}, 502
        testapp.write_ledger(route)
        return {"ok": True}, 201

    app.post("/book")(testapp.idem.idempotent(lease=30)(book))
    app.post("/book-recoverable", endpoint="book_r")(
        testapp.idem.idempotent(lease=30, recover=True)(book)
    )
    reset_tables(database_url)
    client = app.test_client()
    for path in ("/book", "/book-recoverable"):
        assert post(client, path, {}, key="k").status_code == 502
    clock.advance(seconds=31)
    report = recover_abandoned(app)
    assert report.released == 0
    assert report.kept == 1  # the recoverable one was re-run, failed again, kept
    assert len(record_rows(app)) == 2
    for path in ("/book", "/book-recoverable"):
        assert post(client, path, {"retry": True}, key="k").status_code == 422  # other body
    assert calls == ["/book", "/book-recoverable"]


def test_derived_keys_are_new_for_a_new_operation_and_kept_by_a_resume(
    database_url: str, clock: Clock
) -> None:
    app = testapp.create_app(database_url, clock=clock)
    seen: list[str] = []

    @app.post("/derive")
    @testapp.idem.idempotent(lease=30, ttl=120)
    def derive() -> tuple[dict[str, t.Any], int]:
        seen.append(testapp.idem.derived_key("charge"))
        if testapp.idem.payload.get("fail"):
            raise RuntimeError("crash before the step was saved")
        return {"key": seen[-1]}, 201

    reset_tables(database_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    client = app.test_client()
    assert post(client, "/derive", {}, key="k").status_code == 201
    clock.advance(seconds=121)  # expired: the next use of the key is a new operation
    assert post(client, "/derive", {}, key="k").status_code == 201
    assert seen[0] != seen[1]
    # Within one operation, every attempt derives the same key.
    assert post(client, "/derive", {"fail": True}, key="k2").status_code == 500
    assert post(client, "/derive", {"fail": True}, key="k2").status_code == 500
    assert seen[2] == seen[3]


def test_stored_request_is_re_run_as_sent(database_url: str, clock: Clock) -> None:
    """The recovery job re-runs the request as the client sent it: a path with
    %2F, %3F and %23 in it and its query reach the same route with the same
    values, and a long Content-Type is kept whole."""
    app = testapp.create_app(database_url, clock=clock)
    seen: list[tuple[str, str, str]] = []

    @app.post("/files/<path:name>")
    @testapp.idem.idempotent(lease=30, recover=True)
    def upload(name: str) -> tuple[dict[str, t.Any], int]:
        seen.append((name, request.args.get("q", ""), request.content_type or ""))
        testapp.idem.step("received", lambda: True)  # keeps the record for the job
        if len(seen) == 1:
            raise RuntimeError("crash")
        testapp.write_ledger("upload")
        return {"name": name}, 201

    reset_tables(database_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    content_type = "application/json; profile=" + "x" * 300
    response = app.test_client().post(
        "/files/a%2Fb%3Fc%23d?q=1%262",
        data="{}",
        content_type=content_type,
        headers={"Idempotency-Key": "k"},
    )
    assert response.status_code == 500
    clock.advance(seconds=31)
    report = recover_abandoned(app)
    assert report.completed == 1
    assert seen[0] == seen[1] == ("a/b?c#d", "1&2", content_type)
    assert ledger_count(app, "upload") == 1


def test_step_in_a_request_without_a_key_just_runs(database_url: str, clock: Clock) -> None:
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/keyless-steps")
    @testapp.idem.idempotent(lease=30)
    def keyless_steps() -> tuple[dict[str, t.Any], int]:
        return {"charge": testapp.idem.step("charge", lambda: "ch_1")}, 201

    reset_tables(database_url)
    response = app.test_client().post("/keyless-steps", json={})
    assert response.get_json() == {"charge": "ch_1"}
    assert record_rows(app) == []


def test_derived_key_in_a_request_without_a_key_asks_the_client_for_one(
    database_url: str, clock: Clock
) -> None:
    """A leased route that calls downstream with derived keys, not requiring a key:
    a request without one gets 400 problem+json (not an HTML 500), and nothing
    was called or stored."""
    app = testapp.create_app(database_url, clock=clock)
    calls: list[str] = []

    @app.post("/keyless-derived")
    @testapp.idem.idempotent(lease=30)
    def keyless_derived() -> tuple[dict[str, t.Any], int]:
        charge = testapp.idem.step(
            "charge", lambda: calls.append(testapp.idem.derived_key("charge")) or "ch_1"
        )
        testapp.write_ledger("keyless-derived")
        return {"charge": charge}, 201

    reset_tables(database_url)
    response = app.test_client().post("/keyless-derived", json={})
    problem = assert_problem(response, 400)
    assert problem["type"].endswith("/missing-key")
    assert calls == []
    assert ledger_count(app, "keyless-derived") == 0
    assert record_rows(app) == []
