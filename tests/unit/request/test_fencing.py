"""Fencing tokens never repeat for a key, and a new operation starts clean.

A holder that lost its key (its lease ended and the record was deleted by the
recovery job, a failed reclaim, cleanup or an operator, then claimed afresh by
another request) must not complete the new operation's record, and the new
operation must not inherit anything of the old one. Real threads, the real
database (PostgreSQL and SQLite), a controllable clock; side effects are counted
in the ledger.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request

from flask_idempotency import Idempotency
from flask_idempotency._maintenance.jobs import purge_expired, recover_abandoned
from tests.conftest import Clock, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem
from tests.support.gates import Gates, send

LEASE = 30
TTL = 120


def ledger_amounts(app: Flask) -> list[int | None]:
    with app.app_context(), testapp.db.engine.connect() as conn:
        stmt = sa.select(testapp.Ledger.amount).order_by(testapp.Ledger.id)
        return list(conn.execute(stmt).scalars())


def pay_app(database_url: str, clock: Clock, gates: Gates) -> Flask:
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/pay")
    @testapp.idem.idempotent(lease=LEASE, ttl=TTL)
    def pay() -> tuple[dict[str, t.Any], int]:
        who = request.headers["X-Who"]
        if who == "B":  # a retry whose downstream call fails
            return {"error": "psp timeout"}, 503
        gates.pause(who)
        row = testapp.write_ledger("pay", testapp.idem.payload["amount"])
        return {"charged": row.amount, "by": who}, 201

    reset_tables(database_url)
    return app


def _delete_by_recovery_job(app: Flask, clock: Clock) -> None:
    clock.advance(seconds=LEASE + 1)
    assert recover_abandoned(app).released == 1


def _delete_by_failed_reclaim(app: Flask, clock: Clock) -> None:
    clock.advance(seconds=LEASE + 1)
    failed = send(app, "/pay", {"amount": 100}, **{"X-Who": "B"}).result()
    assert failed.status_code == 503
    assert record_rows(app) == []


def _delete_by_purge(app: Flask, clock: Clock) -> None:
    clock.advance(seconds=TTL + 1)  # the holder is still running, past retention
    assert purge_expired(app).deleted == 1


def _delete_by_operator(app: Flask, clock: Clock) -> None:
    [record] = record_rows(app)
    result = app.test_cli_runner().invoke(
        args=[
            "idempotency",
            "release",
            record["scope"],
            record["key"],
            "--yes",
            "--override",  # the holder is running: the operator cuts it off, by name
            "live-lease",
        ]
    )
    assert result.exit_code == 0, result.output
    assert record_rows(app) == []


@pytest.mark.parametrize(
    "delete",
    [_delete_by_recovery_job, _delete_by_failed_reclaim, _delete_by_purge, _delete_by_operator],
    ids=["recovery-job", "failed-reclaim", "purge", "cli-release"],
)
def test_holder_whose_record_was_deleted_cannot_complete_the_next_operation(
    database_url: str, clock: Clock, delete: t.Callable[[Flask, Clock], None]
) -> None:
    gates = Gates()
    app = pay_app(database_url, clock, gates)
    first = send(app, "/pay", {"amount": 100}, **{"X-Who": "A"})
    assert gates.arrived("A")
    [claimed_by_a] = record_rows(app)
    delete(app, clock)
    second = send(app, "/pay", {"amount": 200}, **{"X-Who": "C"})
    assert gates.arrived("C")
    [claimed_by_c] = record_rows(app)
    assert claimed_by_c["fencing_token"] != claimed_by_a["fencing_token"]

    gates.open("A")  # the overtaken holder finishes first
    overtaken = first.result()
    assert_problem(overtaken, 409)
    assert overtaken.get_json()["type"].endswith("lease-lost")
    gates.open("C")
    assert second.result().get_json() == {"charged": 200, "by": "C"}

    # C's client retries its payment of 200: it gets its own answer, not A's.
    retry = send(app, "/pay", {"amount": 200}, **{"X-Who": "C2"}).result()
    assert retry.headers.get("Idempotent-Replayed") == "true"
    assert retry.get_json() == {"charged": 200, "by": "C"}
    assert ledger_amounts(app) == [200]
    [record] = record_rows(app)
    assert record["status"] == "completed"
    assert json.loads(record["response_body"]) == {"charged": 200, "by": "C"}


def test_tokens_differ_across_every_claim_of_a_key(database_url: str, clock: Clock) -> None:
    """Ten operations on one key, each after the previous expired and was purged:
    ten tokens."""
    app = testapp.create_app(database_url, clock=clock)
    reset_tables(database_url)
    client = app.test_client()
    seen = set()
    for i in range(10):
        response = client.post("/short-ttl", json={"i": i}, headers={"Idempotency-Key": "same"})
        assert response.status_code == 201
        [record] = record_rows(app)
        seen.add(record["fencing_token"])
        clock.advance(minutes=6)
        assert purge_expired(app).deleted == 1
    assert len(seen) == 10
    assert all(0 < token < 2**63 for token in seen)


def test_failed_request_leaves_alone_the_record_a_duplicate_claimed_after_its_rollback(
    pg_url: str, clock: Clock
) -> None:
    """A fails with 500 while D waits on A's uncommitted claim (PostgreSQL blocks
    D on the unique index). A rolls back; D claims the key and commits it from
    its view; A's release must not delete D's record. The listener below makes
    A slow between its rollback and whatever it does next, as a busy machine
    would, so that D's claim comes first."""
    gates = Gates()
    app = testapp.create_app(pg_url, clock=clock)

    @app.post("/flaky")
    @testapp.idem.idempotent()
    def flaky() -> tuple[dict[str, t.Any], int]:
        who = request.headers["X-Who"]
        if who == "A":
            gates.pause("A")
            return {"error": "downstream failed"}, 500
        row = testapp.write_ledger("flaky")
        testapp.db.session.commit()  # the record is durable from here on
        gates.pause("D")
        return {"id": row.id}, 201

    def slow_after_rollback(session: t.Any) -> None:
        if request and request.headers.get("X-Who") == "A":
            time.sleep(0.5)

    with app.app_context():
        factory = testapp.db.session.session_factory
    sa.event.listen(factory, "after_rollback", slow_after_rollback)
    try:
        reset_tables(pg_url)
        a = send(app, "/flaky", {}, **{"X-Who": "A"})
        assert gates.arrived("A")
        d = send(app, "/flaky", {}, **{"X-Who": "D"})
        assert not d.done(0.3)  # D waits on A's claim
        gates.open("A")
        assert a.result().status_code == 500
        assert gates.arrived("D")
        time.sleep(0.3)  # anything A still had to do, it has done by now
        [record] = record_rows(app)
        assert record["status"] == "in_progress"
        gates.open("D")
        assert d.result().status_code == 201
    finally:
        gates.open_all()
        sa.event.remove(factory, "after_rollback", slow_after_rollback)
    [record] = record_rows(app)
    assert record["status"] == "completed"
    replay = send(app, "/flaky", {}, **{"X-Who": "D"}).result()
    assert replay.headers.get("Idempotent-Replayed") == "true"
    with app.app_context(), testapp.db.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM ledger")).scalar_one() == 1


# -- a replaced record starts clean -----------------------------------------------


def test_replaced_record_keeps_no_recovery_points_of_the_old_operation(
    database_url: str, clock: Clock
) -> None:
    """The old operation charged 4200 and died; long after, the key is reused for
    a new operation of 9999, which is interrupted and resumed. The resumed
    attempt must charge 9999, not book the old charge of 4200."""
    gates = Gates()
    app = testapp.create_app(database_url, clock=clock)
    charges: list[int] = []

    @app.post("/order")
    @testapp.idem.idempotent(lease=LEASE, ttl=TTL)
    def order() -> tuple[dict[str, t.Any], int]:
        amount = testapp.idem.payload["amount"]
        if request.headers.get("X-Pause"):
            gates.pause("slow")  # a worker that stalls before its first step

        def charge() -> dict[str, int]:
            charges.append(amount)
            return {"charged": amount}

        charged = testapp.idem.step("charge", charge)
        if amount == 4200:
            raise RuntimeError("crash after the charge")  # keeps the point, ends the lease
        testapp.write_ledger("order", charged["charged"])
        return charged, 201

    reset_tables(database_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    client = app.test_client()
    first = client.post("/order", json={"amount": 4200}, headers={"Idempotency-Key": "K"})
    assert first.status_code == 500
    [record] = record_rows(app)
    assert json.loads(record["recovery_points"]) == {"charge": {"charged": 4200}}

    clock.advance(seconds=TTL + 1)  # the old operation has expired; the key is free
    stalled = send(app, "/order", {"amount": 9999}, **{"X-Pause": "1"})
    try:
        assert gates.arrived("slow")
        [record] = record_rows(app)
        assert record["recovery_points"] is None  # the new operation starts clean
        clock.advance(seconds=LEASE + 1)  # its lease ends; the client retries
        resumed = client.post("/order", json={"amount": 9999}, headers={"Idempotency-Key": "K"})
    finally:
        gates.open("slow")
    assert stalled.result().status_code == 409  # overtaken: lease lost
    assert resumed.status_code == 201
    assert resumed.get_json() == {"charged": 9999}
    assert charges == [4200, 9999]  # the new operation ran its own step
    assert ledger_amounts(app) == [9999]
    [record] = record_rows(app)
    assert json.loads(record["recovery_points"]) == {"charge": {"charged": 9999}}


def test_replaced_record_keeps_no_stored_request_of_the_old_operation(
    database_url: str, clock: Clock
) -> None:
    """Two routes share a scope (a tenant); the old operation stored its request
    for the recovery job. The new operation, on a route that stores none, must
    not leave the old request behind for the job to re-run."""
    app = testapp.create_app(database_url, clock=clock)
    gates = Gates()

    def tenant() -> str:
        return "tenant:acme"

    @app.post("/refund")
    @testapp.idem.idempotent(scope=tenant, lease=LEASE, ttl=TTL, recover=True)
    def refund() -> tuple[dict[str, t.Any], int]:
        testapp.idem.step("psp", lambda: "refunded")
        raise RuntimeError("crash")

    @app.post("/note")
    @testapp.idem.idempotent(scope=tenant, lease=LEASE, ttl=TTL)
    def note() -> tuple[dict[str, t.Any], int]:
        gates.pause("note")
        testapp.write_ledger("note")
        return {"noted": True}, 201

    reset_tables(database_url)
    app.config["PROPAGATE_EXCEPTIONS"] = False
    client = app.test_client()
    assert client.post("/refund", json={}, headers={"Idempotency-Key": "K"}).status_code == 500
    [record] = record_rows(app)
    assert record["request_path"] == "/refund"

    clock.advance(seconds=TTL + 1)
    noting = send(app, "/note", {}, key="K")
    assert gates.arrived("note")
    [record] = record_rows(app)
    assert record["request_method"] is None
    assert record["request_path"] is None
    assert record["request_body"] is None
    assert record["recovery_points"] is None
    gates.open("note")
    assert noting.result().status_code == 201
    with app.app_context(), testapp.db.engine.connect() as conn:
        routes = conn.execute(sa.select(testapp.Ledger.route)).scalars().all()
    assert routes == ["note"]


# -- settings that would let a record expire under a live lease ----------------------


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"IDEMPOTENCY_TTL": 60, "IDEMPOTENCY_LEASE": 60}, "must be longer than the"),
        ({"IDEMPOTENCY_TTL": 30, "IDEMPOTENCY_LEASE": 60}, "must be longer than the"),
        ({"IDEMPOTENCY_TTL": 0}, "ttl must be positive"),
        ({"IDEMPOTENCY_LEASE": 0}, "lease must be positive"),
    ],
)
def test_init_app_refuses_a_ttl_not_longer_than_the_lease(
    config: dict[str, t.Any], match: str
) -> None:
    from flask_sqlalchemy import SQLAlchemy

    app = Flask("bad")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", **config)
    db = SQLAlchemy(app)
    with pytest.raises(ValueError, match=match):
        Idempotency(app, db)


def test_route_options_are_checked_at_decoration() -> None:
    idem = Idempotency()
    with pytest.raises(ValueError, match="must be longer than the"):
        idem.idempotent(ttl=30, lease=60)
    with pytest.raises(ValueError, match="lease must be positive"):
        idem.idempotent(ttl=30, lease=dt.timedelta(0))


def test_route_lease_is_checked_against_the_apps_ttl_whenever_both_are_known() -> None:
    from flask_sqlalchemy import SQLAlchemy

    def make_app() -> tuple[Flask, t.Any]:
        app = Flask("routes")
        app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", IDEMPOTENCY_TTL=120)
        return app, SQLAlchemy(app)

    def export() -> str:
        return "ok"

    # Decorated first, registered later: init_app refuses.
    idem = Idempotency()
    idem.idempotent(lease=600)(export)
    app, db = make_app()
    with pytest.raises(ValueError, match="must be longer than the"):
        idem.init_app(app, db)

    # Registered first, decorated later: the decoration refuses.
    idem = Idempotency()
    app, db = make_app()
    idem.init_app(app, db)
    with pytest.raises(ValueError, match="must be longer than the"):
        idem.idempotent(lease=600)(export)
    idem.idempotent(lease=60)(export)  # shorter than the ttl: fine


# -- retention never overrides a live lease ------------------------------------------


def test_a_live_lease_outlasts_the_retention(database_url: str, clock: Clock) -> None:
    """A holder that keeps renewing its lease past the record's retention keeps the
    key: neither a retry nor cleanup treats the record as expired while the lease
    runs, so no second operation starts beside it."""
    gates = Gates()
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/heartbeat")
    @testapp.idem.idempotent(lease=LEASE, ttl=TTL)
    def heartbeat() -> tuple[dict[str, t.Any], int]:
        if request.headers["X-Who"] == "A":
            for beat in range(6):  # each step renews the 30 s lease; 25 s apart
                testapp.idem.step(f"beat-{beat}", lambda beat=beat: beat)
                gates.pause(f"beat-{beat}")
        row = testapp.write_ledger("heartbeat")
        return {"id": row.id, "by": request.headers["X-Who"]}, 201

    reset_tables(database_url)
    a = send(app, "/heartbeat", {}, **{"X-Who": "A"})
    try:
        for beat in range(6):
            assert gates.arrived(f"beat-{beat}")
            clock.advance(seconds=25 if beat < 5 else 5)
            if beat < 5:
                gates.open(f"beat-{beat}")
        # Now 130 s after the claim: past the 120 s retention, inside the lease
        # the last step renewed at 125 s.
        retry = send(app, "/heartbeat", {}, **{"X-Who": "B"}).result()
        assert_problem(retry, 409)
        assert purge_expired(app).deleted == 0
        [record] = record_rows(app)
        assert record["status"] == "in_progress"
    finally:
        gates.open_all()
    assert a.result().get_json()["by"] == "A"
    assert ledger_amounts(app) == [None]


@pytest.mark.parametrize("zone", [dt.timezone(dt.timedelta(hours=5)), dt.timezone.utc])
def test_jobs_read_the_clock_in_utc(database_url: str, clock: Clock, zone: dt.tzinfo) -> None:
    """A clock that answers in another zone (still the same instant) must not make
    cleanup delete live records or the recovery job release live leases."""
    app = testapp.create_app(database_url, clock=lambda: clock().astimezone(zone))
    gates = Gates()

    @app.post("/held")
    @testapp.idem.idempotent(lease=LEASE)
    def held() -> tuple[dict[str, t.Any], int]:
        gates.pause("held")
        return {}, 201

    reset_tables(database_url)
    app.test_client().post("/short-ttl", json={}, headers={"Idempotency-Key": "live"})
    holder = send(app, "/held", {})
    try:
        assert gates.arrived("held")
        assert purge_expired(app).deleted == 0
        assert recover_abandoned(app).released == 0
        assert len(record_rows(app)) == 2
    finally:
        gates.open_all()
    assert holder.result().status_code == 201
