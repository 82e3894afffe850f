"""A route's own ``ttl=`` is bound by a lease only on a leased route.

``@idem.idempotent(ttl=30)`` without ``lease=`` starts (the app's lease of 60 s
does not apply to it), keeps its answer for 30 s, and a record its view committed
while still running is never taken by a retry as long as its lease runs, even past
the ttl. A leased route whose ttl does not outlive its lease is refused, naming the
view and the option. On every engine, through real requests.
"""

from __future__ import annotations

import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from tests.conftest import Clock


def make_app(url: str, clock: Clock, idem: Idempotency, **config: t.Any) -> tuple[Flask, t.Any]:
    """An app with an ``orders`` table; ``db.Order`` is its model."""
    app = Flask("retention")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, **config)
    db = SQLAlchemy(app)

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "orders"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)

    db.Order = Order
    idem.init_app(app, db, clock=clock)
    with app.app_context():
        db.create_all()
    return app, db


def orders(app: Flask, db: t.Any) -> int:
    with app.app_context():
        return int(db.session.execute(sa.text("SELECT COUNT(*) FROM orders")).scalar_one())


def test_a_short_ttl_without_a_lease_starts_and_keeps_its_answer_for_that_ttl(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)  # IDEMPOTENCY_LEASE: 60 s

    @app.post("/orders")
    @idem.idempotent(ttl=30)
    def create() -> tuple[dict[str, int], int]:
        db.session.add(db.Order())
        return {"orders": 1}, 201

    client = app.test_client()
    headers = {"Idempotency-Key": "k1"}
    assert client.post("/orders", json={}, headers=headers).status_code == 201
    clock.advance(seconds=29)
    replayed = client.post("/orders", json={}, headers=headers)
    assert replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert orders(app, db) == 1
    clock.advance(seconds=2)  # past the route's ttl: the key is forgotten
    assert client.post("/orders", json={}, headers=headers).status_code == 201
    assert orders(app, db) == 2
    with app.app_context():
        db.engine.dispose()


def test_a_record_committed_mid_view_is_not_taken_past_the_ttl_while_its_lease_runs(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)
    committed, finish = threading.Event(), threading.Event()

    @app.post("/orders")
    @idem.idempotent(ttl=30)
    def create() -> tuple[dict[str, int], int]:
        db.session.add(db.Order())
        db.session.commit()  # the record is durable now, in progress under the lease
        committed.set()
        assert finish.wait(30)
        return {"orders": 1}, 201

    headers = {"Idempotency-Key": "k1"}
    first: list[t.Any] = []
    runner = threading.Thread(
        target=lambda: first.append(app.test_client().post("/orders", json={}, headers=headers))
    )
    runner.start()
    try:
        assert committed.wait(30)
        clock.advance(seconds=45)  # past the ttl (30 s), within the lease (60 s)
        retry = app.test_client().post("/orders", json={}, headers=headers)
        assert retry.status_code == 409, retry.get_data(as_text=True)
        assert orders(app, db) == 1  # the retry did not run the view beside the first
    finally:
        finish.set()
        runner.join(30)
    assert first[0].status_code == 201
    assert orders(app, db) == 1
    with app.app_context():
        db.engine.dispose()


def test_a_leased_route_whose_ttl_does_not_outlive_the_apps_lease_names_the_view(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()

    def charge() -> str:
        return "ok"

    idem.idempotent(ttl=30, lease=True)(charge)
    with pytest.raises(ValueError, match="must be longer than") as refused:
        make_app(fresh_database, clock, idem)
    message = str(refused.value)
    assert f"{__name__}." in message
    assert "charge" in message
    assert "ttl= (0:00:30)" in message
    assert "lease=True: IDEMPOTENCY_LEASE) (0:01:00)" in message


def test_a_route_lease_longer_than_the_apps_ttl_is_refused_naming_the_view(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, _db = make_app(fresh_database, clock, idem, IDEMPOTENCY_TTL=120)

    def slow_export() -> str:
        return "ok"

    with pytest.raises(ValueError, match=r"slow_export: the ttl \(IDEMPOTENCY_TTL\) \(0:02:00\)"):
        idem.idempotent(lease=600)(slow_export)
    with app.app_context():
        _db.engine.dispose()


def keys(app: Flask, db: t.Any) -> list[t.Any]:
    """The record table's rows: status, response code, completed_at, expires_at."""
    with app.app_context():
        rows = db.session.execute(
            sa.text(
                "SELECT scope, status, response_code, completed_at, expires_at "
                "FROM idempotency_keys"
            )
        ).all()
        db.session.remove()
        return list(rows)


def committed_then_hung(
    app: Flask, db: t.Any, idem: Idempotency
) -> tuple[threading.Event, threading.Event]:
    """A ``ttl=30`` route (no lease=) whose view commits an order, then hangs (its
    worker as good as dead) until the second event is set; its first event: it
    committed. The view raises once let go, as a dying worker would."""
    committed, let_go = threading.Event(), threading.Event()

    @app.post("/orders")
    @idem.idempotent(ttl=30)
    def create() -> tuple[dict[str, int], int]:
        db.session.add(db.Order())
        db.session.commit()  # the order is durable: the operation happened
        committed.set()
        assert let_go.wait(30)
        raise RuntimeError("the worker died")

    return committed, let_go


def started(app: Flask) -> threading.Thread:
    def first() -> None:
        app.test_client().post("/orders", json={}, headers={"Idempotency-Key": "k1"})

    runner = threading.Thread(target=first, daemon=True)
    runner.start()
    return runner


def test_a_committed_view_is_not_run_again_by_the_retry_after_its_lease_past_a_short_ttl(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)  # IDEMPOTENCY_LEASE: 60 s
    committed, let_go = committed_then_hung(app, db, idem)
    runner = started(app)
    try:
        assert committed.wait(30)
        clock.advance(seconds=61)  # past the ttl (30 s) and the lease (60 s)
        retry = app.test_client().post("/orders", json={}, headers={"Idempotency-Key": "k1"})
        # The view's commit stored its outcome: the retry replays it, never re-runs.
        assert retry.status_code == 500, retry.get_data(as_text=True)
        assert orders(app, db) == 1
        [row] = keys(app, db)
        assert (row.status, row.response_code) == ("completed", 500)
    finally:
        let_go.set()
        runner.join(30)
    assert orders(app, db) == 1
    with app.app_context():
        db.engine.dispose()


def test_jobs_and_cli_keep_a_committed_view_past_a_short_ttl_and_recovery_settles_it(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)
    committed, let_go = committed_then_hung(app, db, idem)
    runner = started(app)
    cli = app.test_cli_runner()
    try:
        assert committed.wait(30)
        [row] = keys(app, db)
        clock.advance(seconds=61)  # ttl and lease over, the view committed
        assert "deleted 0" in cli.invoke(args=["idempotency", "purge"]).output
        refused = cli.invoke(args=["idempotency", "release", row.scope, "k1", "--yes"])
        assert refused.exit_code == 1, refused.output
        assert "view committed" in refused.output
        assert [r.status for r in keys(app, db)] == ["in_progress"]
        assert "completed 1" in cli.invoke(args=["idempotency", "recover"]).output
        [settled] = keys(app, db)
        assert (settled.status, settled.response_code) == ("completed", 500)
        # Kept for its ttl from its settlement, then purged like any answer.
        clock.advance(seconds=29)
        assert "deleted 0" in cli.invoke(args=["idempotency", "purge"]).output
        clock.advance(seconds=2)
        assert "deleted 1" in cli.invoke(args=["idempotency", "purge"]).output
        assert keys(app, db) == []
    finally:
        let_go.set()
        runner.join(30)
    assert orders(app, db) == 1
    with app.app_context():
        db.engine.dispose()


def test_an_answer_is_kept_for_its_ttl_from_its_completion_when_the_view_outlived_it(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)

    @app.post("/orders")
    @idem.idempotent(ttl=30)
    def create() -> tuple[dict[str, int], int]:
        db.session.add(db.Order())
        clock.advance(seconds=40)  # the view runs longer than its ttl
        return {"orders": 1}, 201

    client = app.test_client()
    headers = {"Idempotency-Key": "k1"}
    assert client.post("/orders", json={}, headers=headers).status_code == 201
    [row] = keys(app, db)
    assert row.status == "completed"
    clock.advance(seconds=29)
    replayed = client.post("/orders", json={}, headers=headers)
    assert replayed.status_code == 201
    assert replayed.headers["Idempotent-Replayed"] == "true"
    assert orders(app, db) == 1
    clock.advance(seconds=2)  # 30 s after the completion: forgotten
    assert client.post("/orders", json={}, headers=headers).status_code == 201
    assert orders(app, db) == 2
    with app.app_context():
        db.engine.dispose()


def test_stats_count_a_request_running_past_its_ttl_as_in_progress(
    fresh_database: str, clock: Clock
) -> None:
    idem = Idempotency()
    app, db = make_app(fresh_database, clock, idem)
    committed, let_go = threading.Event(), threading.Event()

    @app.post("/orders")
    @idem.idempotent(ttl=30)
    def create() -> tuple[dict[str, int], int]:
        db.session.add(db.Order())
        db.session.commit()
        committed.set()
        assert let_go.wait(30)
        return {"orders": 1}, 201

    runner = started(app)
    try:
        assert committed.wait(30)
        clock.advance(seconds=40)  # past the ttl, within the lease
        with app.app_context():
            stats = idem.stats()
        assert [r.status for r in keys(app, db)] == ["in_progress"]
        assert (stats.live, stats.in_progress, stats.expired_awaiting_cleanup) == (1, 1, 0)
        assert stats.oldest_in_progress is not None
    finally:
        let_go.set()
        runner.join(30)
    assert orders(app, db) == 1
    with app.app_context():
        db.engine.dispose()


def test_the_test_apps_own_leases_leave_the_apps_ttl_free() -> None:
    """The test app's routes with a lease of their own (60 s) carry a ttl of their
    own, so a test or a review script (``../shared/repros``) may give the app a ttl
    shorter than that lease: the refusal above is for a route that takes the app's."""
    # A fresh interpreter: other test modules put leased routes of their own on the
    # test app's shared Idempotency object, which init_app checks too.
    script = (
        "from tests.support import testapp\n"
        "app = testapp.create_app('sqlite://', IDEMPOTENCY_TTL=3, IDEMPOTENCY_LEASE=1)\n"
        "assert app.config['IDEMPOTENCY_TTL'] == 3\n"
    )
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
