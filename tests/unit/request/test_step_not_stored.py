"""A step whose result cannot be saved (not JSON) answers 500 problem+json
``step-not-stored``, never an HTML 500; its function ran once and never runs
again for the key; the developer gets an ERROR line with the ``TypeError``.
"""

from __future__ import annotations

import datetime as dt
import logging
import typing as t

import pytest
from flask import Flask

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
    [logged] = [r for r in caplog.records if "not JSON-serializable" in r.getMessage()]
    assert logged.exc_info is not None
    assert isinstance(logged.exc_info[1], TypeError)
    assert len(CALLS) == 1
    [record] = record_rows(app)
    assert record["status"] == "in_progress"
    assert record["recovery_points"] is not None
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
    done = client.post("/charge-object", json={}, headers={"Idempotency-Key": "k"})
    assert done.status_code == 201
    assert ledger_count(app, "charge-object") == 1
    assert len(CALLS) == 2
