"""Optimistic routes: the completed record is written at the end of the view's
transaction. Every guarantee of a claimed route must hold for views whose only
effects are writes to the same database; what such a route cannot keep, it refuses.
"""

from __future__ import annotations

import concurrent.futures
import json
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request

from flask_idempotency import Idempotency
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.gates import Gates, send
from tests.support.live import LiveServer

CHARGE = {"amount": 700, "currency": "EUR"}


def post(client: t.Any, body: t.Any, key: str = "k1", path: str = "/optimistic") -> t.Any:
    return client.post(
        path,
        data=json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": key},
    )


def test_new_key_commits_the_work_and_the_completed_record_together(app: Flask) -> None:
    client = app.test_client()
    first = post(client, CHARGE)
    assert first.status_code == 201
    assert ledger_count(app, "optimistic") == 1
    [row] = record_rows(app)
    assert row["status"] == "completed"
    assert row["response_code"] == 201
    assert row["locked_until"] is None
    assert json.loads(row["response_body"]) == first.get_json()


def test_retry_replays_and_its_writes_roll_back(app: Flask) -> None:
    client = app.test_client()
    first = post(client, CHARGE)
    for _ in range(3):
        again = post(client, CHARGE)
        assert again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_data() == first.get_data()
        assert again.headers["Location"] == first.headers["Location"]
    assert ledger_count(app, "optimistic") == 1
    assert len(record_rows(app)) == 1


def test_key_reused_with_another_payload_is_422_and_nothing_more_is_written(app: Flask) -> None:
    client = app.test_client()
    post(client, CHARGE)
    reused = post(client, {**CHARGE, "amount": 701})
    assert reused.status_code == 422
    assert reused.mimetype == "application/problem+json"
    assert ledger_count(app, "optimistic") == 1
    [row] = record_rows(app)
    assert json.loads(row["response_body"])["amount"] == 700


def test_expired_record_is_replaced_by_a_new_operation(app: Flask, clock: Clock) -> None:
    client = app.test_client()
    first = post(client, CHARGE)
    clock.advance(hours=25)
    second = post(client, CHARGE)
    assert second.status_code == 201
    assert second.headers.get("Idempotent-Replayed") is None
    assert second.get_json()["id"] != first.get_json()["id"]
    assert ledger_count(app, "optimistic") == 2
    [row] = record_rows(app)  # replaced in place, not a second record
    assert json.loads(row["response_body"]) == second.get_json()


def test_unstored_answer_keeps_nothing_and_the_retry_runs(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    app = make_app()
    attempts: list[int] = []

    @app.post("/flaky")
    @testapp.idem.idempotent(optimistic=True)
    def flaky() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("flaky")
        attempts.append(row.id)
        return ({"id": row.id}, 503) if len(attempts) == 1 else ({"id": row.id}, 201)

    client = app.test_client()
    assert post(client, {}, path="/flaky").status_code == 503
    assert ledger_count(app, "flaky") == 0
    assert record_rows(app) == []
    assert post(client, {}, path="/flaky").status_code == 201
    assert ledger_count(app, "flaky") == 1


def test_view_that_raises_leaves_nothing(make_app: t.Callable[..., Flask]) -> None:
    app = make_app()

    @app.post("/fails")
    @testapp.idem.idempotent(optimistic=True)
    def fails() -> t.NoReturn:
        testapp.write_ledger("fails")
        raise RuntimeError("boom")

    client = app.test_client()
    assert post(client, {}, path="/fails").status_code == 500
    assert ledger_count(app, "fails") == 0
    assert record_rows(app) == []


def test_view_may_not_commit(make_app: t.Callable[..., Flask]) -> None:
    app = make_app()

    @app.post("/commits")
    @testapp.idem.idempotent(optimistic=True)
    def commits() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("commits")
        testapp.db.session.commit()
        return {}, 201

    response = post(app.test_client(), {}, path="/commits")
    assert response.status_code == 500
    assert ledger_count(app, "commits") == 0
    assert record_rows(app) == []


@pytest.mark.parametrize("call", ["step", "derived_key"])
def test_view_may_not_reach_outside_the_transaction(
    make_app: t.Callable[..., Flask], call: str
) -> None:
    app = make_app()
    downstream: list[str] = []
    errors: list[str] = []

    @app.post("/calls-out")
    @testapp.idem.idempotent(optimistic=True)
    def calls_out() -> tuple[dict[str, t.Any], int]:
        try:
            if call == "step":
                testapp.idem.step("charge", lambda: downstream.append("charged"))
            else:
                downstream.append(testapp.idem.derived_key("charge"))
        except RuntimeError as exc:
            errors.append(str(exc))
            raise
        return {}, 201

    assert post(app.test_client(), {}, path="/calls-out").status_code == 500
    assert downstream == []
    assert errors
    assert "optimistic" in errors[0]
    assert record_rows(app) == []


@pytest.mark.parametrize("option", [{"lease": 30}, {"recover": True}, {"manual": True}])
def test_options_that_need_a_record_before_the_view_are_refused(option: dict[str, t.Any]) -> None:
    with pytest.raises(ValueError, match="optimistic"):
        Idempotency().idempotent(optimistic=True, **option)


def test_concurrent_duplicate_rolls_back_and_replays_the_winner(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """Both run the view; the first to insert the record wins; the other's ledger
    row rolls back at the conflict and it answers with the winner's response."""
    gates = Gates()
    app = make_app()

    @app.post("/held")
    @testapp.idem.idempotent(optimistic=True)
    def held() -> tuple[dict[str, t.Any], int]:
        who = request.headers.get("X-Who", "")
        row = testapp.write_ledger("held")
        if who == "first":
            gates.pause("first")
        return {"id": row.id, "who": who}, 201

    first = send(app, "/held", {}, **{"X-Who": "first"})
    try:
        assert gates.arrived("first")
        second = send(app, "/held", {}, **{"X-Who": "second"})
        if database_url.startswith("sqlite"):
            # SQLite has one writer: the second waits for the first's write lock.
            second.done(0.5)
        else:
            second.result()
    finally:
        gates.open("first")
    answers = [first.result(), second.result()]
    assert {a.status_code for a in answers} == {201}
    bodies = {a.get_data() for a in answers}
    assert len(bodies) == 1, bodies  # one answer, the winner's, for both
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 1
    assert ledger_count(app, "held") == 1
    assert len(record_rows(app)) == 1


def test_business_unique_conflict_with_the_winner_replays_it(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """A view that inserts a row with a unique business key fails on the
    duplicate's committed row; the duplicate's answer is the winner's, not a 500."""
    gates = Gates()
    app = make_app()
    with app.app_context():
        testapp.db.session.execute(
            sa.text("CREATE TABLE IF NOT EXISTS opt_orders (ref VARCHAR(50) PRIMARY KEY)")
        )
        testapp.db.session.execute(sa.text("DELETE FROM opt_orders"))
        testapp.db.session.commit()

    @app.post("/order")
    @testapp.idem.idempotent(optimistic=True)
    def order() -> tuple[dict[str, t.Any], int]:
        who = request.headers.get("X-Who", "")
        if who == "second":
            gates.pause("second")
        testapp.db.session.execute(sa.text("INSERT INTO opt_orders (ref) VALUES ('o-1')"))
        return {"ref": "o-1", "who": who}, 201

    second = send(app, "/order", {}, **{"X-Who": "second"})
    try:
        assert gates.arrived("second")
        first = send(app, "/order", {}, **{"X-Who": "first"}).result()
    finally:
        gates.open("second")
    assert first.status_code == 201
    late = second.result()
    assert late.status_code == 201, late.get_data(as_text=True)
    assert late.headers["Idempotent-Replayed"] == "true"
    assert late.get_json() == {"ref": "o-1", "who": "first"}
    with app.app_context():
        count = testapp.db.session.execute(sa.text("SELECT count(*) FROM opt_orders")).scalar()
        testapp.db.session.execute(sa.text("DROP TABLE opt_orders"))
        testapp.db.session.commit()
    assert count == 1


def test_live_concurrent_duplicates_make_one_charge(pg_url: str) -> None:
    """Real HTTP, a threaded server, 12 simultaneous requests with one key and
    a view slow enough that they all run it: one ledger row, one record, one answer."""
    # The test app's own tables, recreated: another test may have left a table of
    # the same name and another shape (a ledger without its route column).
    reset_tables(pg_url)
    server = LiveServer("tests", pg_url).start()
    try:
        app = testapp.create_app(pg_url)
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            replies = list(
                pool.map(
                    lambda _: server.post("/optimistic?delay=0.3", CHARGE, "live-1"), range(12)
                )
            )
        assert {r.status for r in replies} == {201}, [r.body for r in replies]
        assert len({r.body for r in replies}) == 1
        assert sum(not r.replayed for r in replies) == 1
        assert ledger_count(app, "optimistic") == 1
        assert len(record_rows(app)) == 1
        with app.app_context():
            testapp.db.engine.dispose()
    finally:
        server.stop()


def test_retry_whose_view_answers_an_unstored_status_replays_or_refuses(
    make_app: t.Callable[..., Flask],
) -> None:
    """A retry's view may answer differently (409 "exists", a 500, an exception):
    the record decides the answer, as on a claimed route: the replay for the same
    payload, 422 for another."""
    app = make_app()

    @app.post("/orders")
    @testapp.idem.idempotent(optimistic=True)
    def orders() -> tuple[dict[str, t.Any], int]:
        if ledger_count(app, "orders"):
            if request.headers.get("X-Raise"):
                raise RuntimeError("the view fails on a retry")
            return {"error": "order exists"}, 409
        row = testapp.write_ledger("orders")
        return {"id": row.id}, 201

    client = app.test_client()
    first = post(client, {"n": 1}, path="/orders")
    assert first.status_code == 201
    retry = post(client, {"n": 1}, path="/orders")
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_data() == first.get_data()
    assert post(client, {"n": 2}, path="/orders").status_code == 422
    raising = {"Idempotency-Key": "k1", "X-Raise": "1"}
    other = client.post("/orders", json={"n": 2}, headers=raising)
    assert other.status_code == 422
    raised = client.post("/orders", json={"n": 1}, headers=raising)
    assert raised.status_code == 201
    assert raised.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "orders") == 1


@pytest.mark.parametrize("how", ["connection", "sql"])
@pytest.mark.parametrize("optimistic", [True, False])
def test_commit_around_the_session_is_refused(
    database_url: str, make_app: t.Callable[..., Flask], how: str, optimistic: bool
) -> None:
    """A commit the session's hooks cannot see (the connection's own commit(),
    COMMIT as SQL) would commit business rows without the record (optimistic) or
    without the fenced lease renewal (claimed): refused, nothing commits, ever."""
    app = make_app(IDEMPOTENCY_LEASE=1)

    @app.post("/sneaky")
    @testapp.idem.idempotent(optimistic=optimistic)
    def sneaky() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("sneaky")
        if how == "connection":
            testapp.db.session.connection().commit()
        else:
            testapp.db.session.execute(sa.text("COMMIT"))
        return {}, 201

    client = app.test_client()
    assert [post(client, {}, path="/sneaky").status_code for _ in range(3)] == [500] * 3
    assert ledger_count(app, "sneaky") == 0
    assert record_rows(app) == []


def test_a_savepoint_first_does_not_commit_on_sqlite(make_app: t.Callable[..., Flask]) -> None:
    """Python's sqlite3 opens no transaction before a SAVEPOINT, so releasing one
    would commit; the optimistic route opens the transaction before the view."""
    app = make_app()

    @app.post("/nested")
    @testapp.idem.idempotent(optimistic=True)
    def nested() -> tuple[dict[str, t.Any], int]:
        with testapp.db.session.begin_nested():
            testapp.write_ledger("nested")
        return {"ok": True}, 201

    client = app.test_client()
    answers = [post(client, {}, path="/nested") for _ in range(3)]
    assert [a.status_code for a in answers] == [201] * 3
    assert [a.headers.get("Idempotent-Replayed") for a in answers] == [None, "true", "true"]
    assert ledger_count(app, "nested") == 1


def test_conflicts_send_the_request_conflict_signal(
    database_url: str, make_app: t.Callable[..., Flask]
) -> None:
    """A duplicate blocked past the wait at the record's insert answers 409 and
    sends request_conflict, as on a claimed route."""
    from flask_idempotency import signals

    gates = Gates()
    app = make_app(IDEMPOTENCY_WAIT=0.5)
    seen: list[str] = []

    def conflict(sender: t.Any, **kw: t.Any) -> None:
        seen.append(kw["key"])

    @app.post("/slow-commit")
    @testapp.idem.idempotent(optimistic=True)
    def slow_commit() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("slow-commit")
        return {"who": request.headers.get("X-Who", "")}, 201

    def hold_first(session: t.Any) -> None:
        if request.headers.get("X-Who") == "first":
            gates.pause("first")

    # The first request holds its inserted record, uncommitted, just before COMMIT.
    with app.app_context():
        sa.event.listen(testapp.db.session.session_factory, "before_commit", hold_first)
    signals.request_conflict.connect(conflict, app, weak=False)
    try:
        first = send(app, "/slow-commit", {}, **{"X-Who": "first"})
        assert gates.arrived("first")
        try:
            dup = send(app, "/slow-commit", {}, **{"X-Who": "dup"}).result()
        finally:
            gates.open("first")
        assert first.result().status_code == 201
    finally:
        signals.request_conflict.disconnect(conflict, app)
        with app.app_context():
            sa.event.remove(testapp.db.session.session_factory, "before_commit", hold_first)
    assert dup.status_code == 409
    assert ledger_count(app, "slow-commit") == 1
    if database_url.startswith("sqlite"):
        # One writer: the duplicate's view write waits first, on the write lock,
        # and the engine's busy timeout answers (409 as a database conflict).
        assert seen == []
    else:
        assert seen == ["K"]
