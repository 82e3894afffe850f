"""A view that manages its own transaction stays safe.

Whatever the view does with ``db.session`` (roll back, commit, savepoints,
close, several of each), every commit that carries its business rows carries
the claimed record, and the request ends with one side effect per key. On
PostgreSQL and SQLite, counting ledger rows and records; concurrency with real
threads.
"""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request
from sqlalchemy.exc import IntegrityError

from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem
from tests.support.gates import Gates, send

db = testapp.db
idem = testapp.idem


class Customer(db.Model):  # type: ignore[name-defined,misc]
    """A business table with a unique constraint, for get-or-create."""

    __tablename__ = "customers"
    email: sa.orm.Mapped[str] = sa.orm.mapped_column(db.String(100), primary_key=True)


def charge(route: str) -> tuple[dict[str, t.Any], int]:
    row = testapp.write_ledger(route, 100)
    return {"charged": row.id}, 201


def get_or_create_customer(after_rollback: t.Callable[[], None] = lambda: None) -> None:
    try:
        db.session.add(Customer(email="a@example.com"))
        db.session.flush()
    except IntegrityError:
        db.session.rollback()
        after_rollback()
    db.session.execute(sa.select(Customer)).scalars().all()


def view_app(database_url: str, clock: Clock, gates: Gates | None = None) -> Flask:
    app = testapp.create_app(database_url, clock=clock)

    @app.post("/get-or-create")
    @idem.idempotent()
    def get_or_create() -> tuple[dict[str, t.Any], int]:
        get_or_create_customer()
        return charge("get-or-create")

    @app.post("/rollback-then-commit")
    @idem.idempotent()
    def rollback_then_commit() -> tuple[dict[str, t.Any], int]:
        db.session.rollback()  # "a clean slate" before the real work
        answer = charge("rollback-then-commit")
        db.session.commit()  # the view commits its own work
        return answer

    @app.post("/rollback-only")
    @idem.idempotent()
    def rollback_only() -> tuple[dict[str, t.Any], int]:
        answer = charge("rollback-only")
        db.session.commit()
        db.session.rollback()  # nothing left to undo; the view returns without the db
        return answer

    @app.post("/rollback-and-return")
    @idem.idempotent()
    def rollback_and_return() -> tuple[dict[str, t.Any], int]:
        db.session.rollback()
        return {"charged": "elsewhere"}, 201

    @app.post("/commit-rollback-commit")
    @idem.idempotent()
    def commit_rollback_commit() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("commit-rollback-commit", 1)
        db.session.commit()
        testapp.write_ledger("commit-rollback-commit", 2)  # undone below
        db.session.rollback()
        testapp.write_ledger("commit-rollback-commit", 3)
        db.session.commit()
        testapp.write_ledger("commit-rollback-commit", 4)  # committed by the extension
        return {"ok": True}, 201

    @app.post("/savepoints")
    @idem.idempotent()
    def savepoints() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("savepoints", 1)
        try:
            with db.session.begin_nested():
                testapp.write_ledger("savepoints", 2)
                raise ValueError("undo the savepoint")
        except ValueError:
            pass
        with db.session.begin_nested():
            testapp.write_ledger("savepoints", 3)
        return {"ok": True}, 201

    @app.post("/close")
    @idem.idempotent()
    def close() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("close", 1)
        db.session.close()  # gives the connection back, rolling the transaction back
        return charge("close")

    @app.post("/rollback-then-fail")
    @idem.idempotent()
    def rollback_then_fail() -> tuple[dict[str, t.Any], int]:
        db.session.rollback()
        testapp.write_ledger("rollback-then-fail")
        db.session.commit()
        testapp.write_ledger("rollback-then-fail")
        return {"error": "downstream failed"}, 503

    if gates is not None:

        @app.post("/raced")
        @idem.idempotent()
        def raced() -> tuple[dict[str, t.Any], int]:
            who = request.headers["X-Who"]
            if who == "A":
                # Rolls back (the claim goes with it) and stalls right there.
                get_or_create_customer(lambda: gates.pause("A"))
            return charge(f"raced-{who}")

        @app.post("/closed-then-raced")
        @idem.idempotent()
        def closed_then_raced() -> tuple[dict[str, t.Any], int]:
            who = request.headers["X-Who"]
            if who == "A":
                testapp.write_ledger("closed")
                db.session.close()  # the claim goes with the transaction
                gates.pause("A")
            return charge(f"raced-{who}")

        @app.post("/leased-commits")
        @idem.idempotent(lease=30)
        def leased_commits() -> tuple[dict[str, t.Any], int]:
            who = request.headers["X-Who"]
            if who == "A":
                gates.pause("A")
            testapp.write_ledger(f"leased-commits-{who}")
            db.session.commit()
            return {"by": who}, 201

    reset_tables(database_url)
    with app.app_context(), db.engine.begin() as conn:
        conn.execute(sa.insert(Customer.__table__).values(email="a@example.com"))
    return app


def post(client: t.Any, path: str, key: str = "K", **headers: str) -> t.Any:
    return client.post(path, json={}, headers={"Idempotency-Key": key, **headers})


def routes(app: Flask) -> list[tuple[str, int | None]]:
    with app.app_context(), db.engine.connect() as conn:
        stmt = sa.select(testapp.Ledger.route, testapp.Ledger.amount).order_by(testapp.Ledger.id)
        return [(r, a) for r, a in conn.execute(stmt)]


@pytest.mark.parametrize(
    "path",
    ["/get-or-create", "/rollback-then-commit", "/rollback-only", "/close"],
)
def test_view_that_rolls_back_ends_with_one_charge_and_a_replay(
    database_url: str, clock: Clock, path: str
) -> None:
    app = view_app(database_url, clock)
    client = app.test_client()
    first = post(client, path)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert first.headers.get("Idempotent-Replayed") is None
    for _ in range(2):
        again = post(client, path)
        assert again.status_code == 201
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_json() == first.get_json()
    assert ledger_count(app, path.lstrip("/")) == 1
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_view_that_rolls_back_and_returns_without_the_database_is_recorded(
    database_url: str, clock: Clock
) -> None:
    app = view_app(database_url, clock)
    client = app.test_client()
    assert post(client, "/rollback-and-return").status_code == 201
    assert post(client, "/rollback-and-return").headers["Idempotent-Replayed"] == "true"
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_commits_and_rollbacks_in_one_view_keep_exactly_what_was_committed(
    database_url: str, clock: Clock
) -> None:
    app = view_app(database_url, clock)
    client = app.test_client()
    assert post(client, "/commit-rollback-commit").status_code == 201
    assert post(client, "/commit-rollback-commit").headers["Idempotent-Replayed"] == "true"
    assert [a for _, a in routes(app)] == [1, 3, 4]
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_savepoints_rolled_back_keep_the_claim(database_url: str, clock: Clock) -> None:
    app = view_app(database_url, clock)
    client = app.test_client()
    assert post(client, "/savepoints").status_code == 201
    assert post(client, "/savepoints").headers["Idempotent-Replayed"] == "true"
    assert [a for _, a in routes(app)] == [1, 3]


def test_view_that_rolls_back_commits_then_fails_never_runs_twice(
    database_url: str, clock: Clock
) -> None:
    """The view committed one row itself, then answered 503: that row stays (the
    view committed it), so the operation happened; the 503 is recorded and
    replayed, and the view never runs again for this key."""
    app = view_app(database_url, clock)
    client = app.test_client()
    assert post(client, "/rollback-then-fail").status_code == 503
    retry = post(client, "/rollback-then-fail")
    assert retry.status_code == 503
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "rollback-then-fail") == 1
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_key_is_claimed_again_at_the_rollback_so_a_duplicate_waits_and_replays(
    database_url: str, clock: Clock
) -> None:
    """A's view rolls back (the claim goes with it) and stalls right there, before
    any other statement. The key is claimed again at the rollback itself, so D
    cannot run the view meanwhile: it waits on A's claim, then replays A."""
    gates = Gates()
    app = view_app(database_url, clock, gates)
    a = send(app, "/raced", {}, **{"X-Who": "A"})
    try:
        assert gates.arrived("A")
        d = send(app, "/raced", {}, **{"X-Who": "D"})
        assert not d.done(0.5)  # D waits on A's claim instead of running
    finally:
        gates.open("A")
    assert a.result().status_code == 201
    replay = d.result()
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.get_json() == a.result().get_json()
    assert routes(app) == [("raced-A", 100)]


def test_duplicate_that_took_the_key_after_a_close_wins_and_the_view_writes_nothing(
    database_url: str, clock: Clock
) -> None:
    """A's view closes its session (the claim goes with it; it is claimed again only
    at A's next statement) and stalls; D takes the key and finishes. When A goes
    on, its next statement finds the key taken: it answers 409 lease-lost, its
    writes never commit, and a retry replays D."""
    gates = Gates()
    app = view_app(database_url, clock, gates)
    a = send(app, "/closed-then-raced", {}, **{"X-Who": "A"})
    try:
        assert gates.arrived("A")
        d = send(app, "/closed-then-raced", {}, **{"X-Who": "D"}).result()
        assert d.status_code == 201
    finally:
        gates.open("A")
    lost = a.result()
    assert_problem(lost, 409)
    assert lost.get_json()["type"].endswith("lease-lost")
    assert routes(app) == [("raced-D", 100)]
    retry = send(app, "/closed-then-raced", {}, **{"X-Who": "A"}).result()
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_json() == d.get_json()
    assert routes(app) == [("raced-D", 100)]


def test_holder_overtaken_after_its_lease_cannot_commit_business_rows(
    database_url: str, clock: Clock
) -> None:
    """A's claim is committed (leased) and A stalls past its lease; B reclaims
    and completes. A's own commit of a business row must fail: the row never
    lands, A's client gets 409 lease-lost."""
    gates = Gates()
    app = view_app(database_url, clock, gates)
    a = send(app, "/leased-commits", {}, **{"X-Who": "A"})
    try:
        assert gates.arrived("A")
        clock.advance(seconds=31)
        b = send(app, "/leased-commits", {}, **{"X-Who": "B"}).result()
        assert b.get_json() == {"by": "B"}
    finally:
        gates.open("A")
    lost = a.result()
    assert_problem(lost, 409)
    assert lost.get_json()["type"].endswith("lease-lost")
    assert routes(app) == [("leased-commits-B", None)]


def test_view_commit_renews_the_lease(database_url: str, clock: Clock) -> None:
    """Once the view has committed, the record is in progress under a lease that
    each further commit of the view extends."""
    app = view_app(database_url, clock)
    seen: list[dt.datetime] = []

    @app.post("/long")
    @idem.idempotent()
    def long() -> tuple[dict[str, t.Any], int]:
        for _ in range(2):
            testapp.write_ledger("long")
            db.session.commit()
            [record] = record_rows(app)
            seen.append(record["locked_until"])
            clock.advance(seconds=10)
        return {"ok": True}, 201

    assert post(app.test_client(), "/long").status_code == 201
    assert seen[1] - seen[0] == dt.timedelta(seconds=10)
    assert ledger_count(app, "long") == 2
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_view_that_removes_its_session_keeps_the_claim_on_the_new_one(
    database_url: str, clock: Clock
) -> None:
    """db.session.remove() closes the session (the claim goes with it) and the
    view's next db.session is a new one: the claim follows it, the charge the view
    writes there commits with the record, and retries replay it."""
    app = view_app(database_url, clock)

    @app.post("/remove-then-write")
    @idem.idempotent()
    def remove_then_write() -> tuple[dict[str, t.Any], int]:
        db.session.remove()  # e.g. a helper that "resets" the session
        return charge("remove-then-write")

    client = app.test_client()
    first = post(client, "/remove-then-write")
    assert first.status_code == 201
    for _ in range(2):
        again = post(client, "/remove-then-write")
        assert again.headers["Idempotent-Replayed"] == "true"
        assert again.get_json() == first.get_json()
    assert routes(app) == [("remove-then-write", 100)]
    [record] = record_rows(app)
    assert record["status"] == "completed"


def test_view_that_removes_its_session_and_commits_keeps_duplicates_out(
    database_url: str, clock: Clock
) -> None:
    """remove(), write, commit, then more work: the commit on the new session
    carries the claim, so a duplicate arriving meanwhile finds the key held
    (409) instead of running the view a second time."""
    gates = Gates()
    app = view_app(database_url, clock, gates)

    @app.post("/remove-then-commit")
    @idem.idempotent()
    def remove_then_commit() -> tuple[dict[str, t.Any], int]:
        db.session.remove()
        answer = charge("remove-then-commit")
        db.session.commit()
        if request.headers["X-Who"] == "A":
            gates.pause("A")  # more work after the commit
        return answer

    a = send(app, "/remove-then-commit", {}, **{"X-Who": "A"})
    try:
        assert gates.arrived("A")
        duplicate = send(app, "/remove-then-commit", {}, **{"X-Who": "D"}).result()
        assert_problem(duplicate, 409)
    finally:
        gates.open("A")
    assert a.result().status_code == 201
    retry = send(app, "/remove-then-commit", {}, **{"X-Who": "D"}).result()
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert routes(app) == [("remove-then-commit", 100)]


def test_view_that_commits_then_raises_never_runs_twice(database_url: str, clock: Clock) -> None:
    """The order is saved and committed, then a call fails with an exception: the
    order stays, the failure is recorded (500 failed-after-commit) and replayed,
    and the retry never saves the order again."""
    app = view_app(database_url, clock)
    app.config["PROPAGATE_EXCEPTIONS"] = False

    @app.post("/commit-then-raise")
    @idem.idempotent()
    def commit_then_raise() -> tuple[dict[str, t.Any], int]:
        charge("commit-then-raise")
        db.session.commit()  # the order is saved
        raise TimeoutError("the payment provider timed out")

    client = app.test_client()
    assert post(client, "/commit-then-raise").status_code == 500
    for _ in range(2):
        retry = post(client, "/commit-then-raise")
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert_problem(retry, 500)
        assert retry.get_json()["type"].endswith("/failed-after-commit")
    assert routes(app) == [("commit-then-raise", 100)]


def test_first_commit_of_a_view_starts_its_lease(database_url: str, clock: Clock) -> None:
    """A view works 45 s before its first commit, under a 60 s lease: the lease
    counts from that commit, so 20 s later a retry still finds the key held."""
    gates = Gates()
    app = view_app(database_url, clock, gates)

    @app.post("/slow-commit")
    @idem.idempotent()
    def slow_commit() -> tuple[dict[str, t.Any], int]:
        if request.headers["X-Who"] == "A":
            gates.pause("before-commit")
        answer = charge("slow-commit")
        db.session.commit()
        if request.headers["X-Who"] == "A":
            gates.pause("after-commit")
        return answer

    a = send(app, "/slow-commit", {}, **{"X-Who": "A"})
    try:
        assert gates.arrived("before-commit")
        clock.advance(seconds=45)
        gates.open("before-commit")
        assert gates.arrived("after-commit")
        clock.advance(seconds=20)
        retry = send(app, "/slow-commit", {}, **{"X-Who": "B"}).result()
        assert_problem(retry, 409)
        assert retry.get_json()["type"].endswith("request-in-progress")
    finally:
        gates.open_all()
    assert a.result().status_code == 201
    assert routes(app) == [("slow-commit", 100)]
