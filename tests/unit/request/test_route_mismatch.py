"""One key sent to two routes that share a scope (a scope of the app's own that
leaves the endpoint out) answers 422 on the second, and its detail says when only
the route differs, naming the other route; the scope the Quickstart teaches keeps
the routes apart. On every engine, through real requests; rows counted."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, g, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from tests.support.flow import assert_problem


def make_app(url: str, scope: t.Callable[[], str]) -> tuple[Flask, t.Any]:
    app = Flask("routes")
    app.config.update(SQLALCHEMY_DATABASE_URI=url)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=scope)

    class Work(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "work"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
        route: orm.Mapped[str] = orm.mapped_column(sa.String(20))

    @app.before_request
    def authenticate() -> None:
        g.user = request.headers.get("X-User", "alice")

    @app.post("/payments")
    @idem.idempotent
    def payments() -> tuple[dict[str, str], int]:
        db.session.add(Work(route="payments"))
        return {"done": "payment"}, 201

    @app.post("/refunds")
    @idem.idempotent
    def refunds() -> tuple[dict[str, str], int]:
        db.session.add(Work(route="refunds"))
        return {"done": "refund"}, 201

    @app.post("/orders/<int:order>/notes")
    @idem.idempotent
    def notes(order: int) -> tuple[dict[str, str], int]:
        db.session.add(Work(route="notes"))
        return {"done": "note"}, 201

    with app.app_context():
        db.create_all()
    return app, db


def work(app: Flask, db: t.Any) -> list[str]:
    with app.app_context():
        return list(db.session.scalars(sa.text("SELECT route FROM work ORDER BY id")))


@pytest.fixture
def shared(fresh_database: str) -> t.Iterator[tuple[Flask, t.Any]]:
    app, db = make_app(fresh_database, lambda: f"user:{g.user}")
    yield app, db
    with app.app_context():
        db.engine.dispose()


def test_only_the_route_differing_is_said_and_the_other_route_named(
    shared: tuple[Flask, t.Any],
) -> None:
    app, db = shared
    client = app.test_client()
    body = {"amount": 100}
    assert client.post("/payments", json=body, headers={"Idempotency-Key": "k1"}).status_code == 201
    refused = client.post("/refunds", json=body, headers={"Idempotency-Key": "k1"})
    problem = assert_problem(refused, 422)
    assert problem["type"].endswith("key-reused")
    assert "another route (POST /payments)" in problem["detail"]
    assert "only the route differs" in problem["detail"]
    assert work(app, db) == ["payments"]


def test_another_payload_is_the_usual_mismatch(shared: tuple[Flask, t.Any]) -> None:
    app, db = shared
    client = app.test_client()
    headers = {"Idempotency-Key": "k1"}
    assert client.post("/payments", json={"amount": 100}, headers=headers).status_code == 201
    for path, body in (("/refunds", {"amount": 5}), ("/payments", {"amount": 5})):
        problem = assert_problem(client.post(path, json=body, headers=headers), 422)
        assert "different request payload" in problem["detail"]
        assert "another route" not in problem["detail"]
    # The key used first on a route with URL variables: its path is never
    # guessed, the detail is the usual one.
    other = {"Idempotency-Key": "k2"}
    assert client.post("/orders/7/notes", json={"amount": 1}, headers=other).status_code == 201
    problem = assert_problem(client.post("/payments", json={"amount": 1}, headers=other), 422)
    assert "different request payload" in problem["detail"]
    assert work(app, db) == ["payments", "notes"]


def test_the_quickstarts_scope_keeps_each_routes_keys_apart(fresh_database: str) -> None:
    app, db = make_app(fresh_database, lambda: f"{request.endpoint}|user:{g.user}")
    client = app.test_client()
    body = {"amount": 100}
    for path in ("/payments", "/refunds", "/payments"):
        assert client.post(path, json=body, headers={"Idempotency-Key": "k1"}).status_code == 201
    assert work(app, db) == ["payments", "refunds"]
    with app.app_context():
        stored = db.session.scalars(sa.text("SELECT scope FROM idempotency_keys"))
        scopes = sorted(s.decode() if isinstance(s, bytes) else s for s in stored)
    with app.app_context():
        db.engine.dispose()
    assert scopes == ["payments|user:alice", "refunds|user:alice"]
