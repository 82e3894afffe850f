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
