"""``flask idempotency release`` refuses what the lease-recovery job refuses: a
live lease, recovery points, a view that committed its own work, a completed
record; it says why in one line and exits 1. ``--override`` names what it sets
aside (a live lease, recovery points), never a committed outcome.

Against the real database (PostgreSQL through both drivers, SQLite, MariaDB),
records as the request path leaves them, and through real requests where the
operation is running.
"""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request

from flask_idempotency._storage import COMPLETED, IN_PROGRESS, new_fencing_token, operation_values
from flask_idempotency.jobs import recover_abandoned
from tests.conftest import Clock, insert_records, ledger_count, record_rows
from tests.support import testapp

SCOPE = "tenant:1"
HOUR = dt.timedelta(hours=1)


def cli(app: Flask, *args: str, input: str | None = None) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)


def put_record(app: Flask, clock: Clock, key: str, **columns: t.Any) -> int:
    """Insert one record as the request path leaves it; its fencing token."""
    now = clock()
    token = new_fencing_token()
    values = {
        "scope": SCOPE,
        "key": key,
        "fencing_token": token,
        **operation_values(
            **{
                "request_hash": "h",
                "status": IN_PROGRESS,
                "created_at": now - HOUR,
                "expires_at": now + 24 * HOUR,
                **columns,
            }
        ),
    }
    with app.app_context(), testapp.db.engine.begin() as conn:
        insert_records(conn, [values])
    return token


def tokens(app: Flask) -> dict[str, int]:
    return {row["key"]: row["fencing_token"] for row in record_rows(app)}


def _held(clock: Clock) -> dict[str, dict[str, t.Any]]:
    now = clock()
    return {
        # The operation is running now.
        "live-lease": {"locked_until": now + dt.timedelta(seconds=30)},
        # A worker died after a step: the retry resumes after it.
        "recovery-points": {
            "locked_until": now - dt.timedelta(seconds=5),
            "recovery_points": '{"charge":"ch_1"}',
        },
        # A kept operation: derived keys handed out, no step finished.
        "derived-keys-handed-out": {
            "locked_until": now - dt.timedelta(seconds=5),
            "recovery_points": "{}",
        },
        # The view committed its own work; its commit stored the outcome.
        "view-committed": {"locked_until": now - dt.timedelta(seconds=5), "response_code": 500},
        "completed": {
            "status": COMPLETED,
            "response_code": 201,
            "response_body": b"{}",
            "completed_at": now - HOUR,
        },
    }


WHY = {
    "live-lease": "its lease is live until",
    "recovery-points": "it holds recovery points",
    "derived-keys-handed-out": "it holds recovery points",
    "view-committed": "its view committed work of its own",
    "completed": "it is completed (201)",
}


@pytest.mark.parametrize("held", list(WHY))
def test_release_refuses_what_the_recovery_job_refuses(app: Flask, clock: Clock, held: str) -> None:
    token = put_record(app, clock, "k", **_held(clock)[held])

    result = cli(app, "release", SCOPE, "k", "--yes")

    assert result.exit_code == 1, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith("Error: not released: " + WHY[held]), line
    assert tokens(app) == {"k": token}
    # The job leaves it too (a view that committed is settled, not deleted), and
    # so do the commands that run the jobs: the record is not expired.
    recover_abandoned(app)
    for command in (["recover"], ["purge"]):
        assert cli(app, *command).exit_code == 0
    assert tokens(app) == {"k": token}


@pytest.mark.parametrize("held", ["live-lease", "recovery-points"])
def test_purge_leaves_an_expired_record_whose_lease_is_live(
    app: Flask, clock: Clock, held: str
) -> None:
    """Past its retention but under a live lease, a record is not expired: its
    holder is still running. Neither purge nor release takes it."""
    now = clock()
    columns = {**_held(clock)[held], "expires_at": now - dt.timedelta(seconds=1)}
    columns["locked_until"] = now + dt.timedelta(seconds=30)
    token = put_record(app, clock, "k", **columns)

    assert cli(app, "purge").exit_code == 0
    assert cli(app, "release", SCOPE, "k", "--yes").exit_code == 1
    assert tokens(app) == {"k": token}
    clock.advance(seconds=31)  # the lease over: now it is expired, and goes
    assert cli(app, "purge").output.startswith("deleted 1 expired record(s)")
    assert record_rows(app) == []


@pytest.mark.parametrize(
    ("held", "override"),
    [
        ("live-lease", "live-lease"),
        ("recovery-points", "recovery-points"),
        ("derived-keys-handed-out", "recovery-points"),
    ],
)
def test_an_override_releases_only_what_it_names_and_says_so(
    app: Flask, clock: Clock, held: str, override: str
) -> None:
    put_record(app, clock, "k", **_held(clock)[held])
    other = "recovery-points" if override == "live-lease" else "live-lease"

    refused = cli(app, "release", SCOPE, "k", "--yes", "--override", other)
    assert refused.exit_code == 1, refused.output
    assert len(record_rows(app)) == 1

    result = cli(app, "release", SCOPE, "k", "--yes", "--override", override)

    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"released, overriding {override}"), result.output
    assert record_rows(app) == []


def test_a_lease_and_recovery_points_both_need_naming(app: Flask, clock: Clock) -> None:
    now = clock()
    put_record(
        app, clock, "k", locked_until=now + dt.timedelta(seconds=30), recovery_points='{"a":1}'
    )
    for override in ("live-lease", "recovery-points"):
        assert cli(app, "release", SCOPE, "k", "--yes", "--override", override).exit_code == 1
    result = cli(
        app,
        "release",
        SCOPE,
        "k",
        "--yes",
        "--override",
        "live-lease",
        "--override",
        "recovery-points",
    )
    assert result.exit_code == 0, result.output
    assert "live-lease" in result.output
    assert "recovery-points" in result.output
    assert record_rows(app) == []


@pytest.mark.parametrize("held", ["view-committed", "completed"])
@pytest.mark.parametrize("option", [["--force"], ["--override", "completed"]])
def test_a_committed_outcome_is_never_overridden(
    app: Flask, clock: Clock, held: str, option: list[str]
) -> None:
    token = put_record(app, clock, "k", **_held(clock)[held])

    result = cli(app, "release", SCOPE, "k", "--yes", *option)

    assert result.exit_code == 2, result.output
    assert "--override" in result.output
    assert tokens(app) == {"k": token}
    # Every override at once still leaves a committed outcome alone.
    both = ["--override", "live-lease", "--override", "recovery-points"]
    assert cli(app, "release", SCOPE, "k", "--yes", *both).exit_code == 1
    assert tokens(app) == {"k": token}


def test_a_stuck_record_and_an_expired_one_are_released(app: Flask, clock: Clock) -> None:
    now = clock()
    put_record(app, clock, "stuck", locked_until=now - dt.timedelta(seconds=1))
    put_record(
        app,
        clock,
        "expired",
        **{**_held(clock)["completed"], "expires_at": now - dt.timedelta(seconds=1)},
    )
    for key in ("stuck", "expired"):
        result = cli(app, "release", SCOPE, key, "--yes")
        assert result.exit_code == 0, result.output
        assert result.output == "released\n"
    assert record_rows(app) == []


def test_a_hold_taken_while_the_operator_confirms_is_kept(
    app: Flask, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The statement re-checks the rule: a step saved during the prompt (same
    fencing token) keeps the record, and the command says why."""
    token = put_record(app, clock, "k", locked_until=clock() - dt.timedelta(seconds=1))
    table = testapp.db.metadata.tables["idempotency_keys"]

    def step_saved_meanwhile(*args: t.Any, **kwargs: t.Any) -> bool:
        with app.app_context(), testapp.db.engine.begin() as conn:
            conn.execute(sa.update(table).values(recovery_points='{"charge":"ch_1"}'))
        return True

    monkeypatch.setattr("click.confirm", step_saved_meanwhile)
    result = cli(app, "release", SCOPE, "k")

    assert result.exit_code == 1, result.output
    assert "not released: it holds recovery points" in result.output
    assert tokens(app) == {"k": token}


def leased_app(database_url: str, clock: Clock) -> tuple[Flask, t.Any]:
    from tests.conftest import reset_tables
    from tests.support.gates import Gates

    gates = Gates()
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/running-charge")
    @testapp.idem.idempotent(lease=30)
    def running_charge() -> tuple[dict[str, t.Any], int]:
        if request.headers.get("X-Who") == "first":
            gates.pause("running")
        row = testapp.write_ledger("running-charge")
        return {"id": row.id}, 201

    reset_tables(database_url)
    return app, gates


def test_release_leaves_a_running_operation_alone(database_url: str, clock: Clock) -> None:
    """The first request runs under its lease; release refuses; the retry is
    answered in progress and the operation runs once."""
    from tests.support.gates import send

    app, gates = leased_app(database_url, clock)
    first = send(app, "/running-charge", {}, key="order-1", **{"X-Who": "first"})
    try:
        assert gates.arrived("running")
        [record] = record_rows(app)
        result = cli(app, "release", record["scope"], "order-1", "--yes")
        assert result.exit_code == 1, result.output
        assert "its lease is live" in result.output
        retry = app.test_client().post(
            "/running-charge", json={}, headers={"Idempotency-Key": "order-1"}
        )
        assert retry.status_code == 409
        assert retry.get_json()["type"].endswith("request-in-progress")
    finally:
        gates.open("running")
    assert first.result().status_code == 201
    assert ledger_count(app, "running-charge") == 1


def test_overriding_a_live_lease_fences_its_holder_out(database_url: str, clock: Clock) -> None:
    """With --override live-lease the retry runs under a new fencing token; the
    holder cut off can store nothing (lease-lost) and its work rolls back."""
    from tests.support.gates import send

    app, gates = leased_app(database_url, clock)
    first = send(app, "/running-charge", {}, key="order-1", **{"X-Who": "first"})
    try:
        assert gates.arrived("running")
        [record] = record_rows(app)
        result = cli(
            app, "release", record["scope"], "order-1", "--yes", "--override", "live-lease"
        )
        assert result.exit_code == 0, result.output
        assert "overriding live-lease" in result.output
        retry = app.test_client().post(
            "/running-charge", json={}, headers={"Idempotency-Key": "order-1"}
        )
        assert retry.status_code == 201
    finally:
        gates.open("running")
    lost = first.result()
    assert lost.status_code == 409
    assert lost.get_json()["type"].endswith("lease-lost")
    [now] = record_rows(app)
    assert now["fencing_token"] != record["fencing_token"]
    assert now["status"] == COMPLETED
    assert ledger_count(app, "running-charge") == 1
