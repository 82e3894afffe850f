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
from marshmallow import Schema, fields
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency._request import claim, fingerprint
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


def test_a_route_that_counts_a_field_this_one_excludes_is_named_only_when_it_would_match(
    fresh_database: str,
) -> None:
    """Route /a leaves ``ts`` out, /b counts it: a record made on /b with
    ``{x: 1}`` is named by a request to /a with ``{x: 1}``, not with
    ``{x: 1, ts: 5}`` (/b would not have matched that payload)."""
    app = Flask("exclude")
    app.config.update(SQLALCHEMY_DATABASE_URI=fresh_database)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "user:1")
    ran: list[str] = []

    @app.post("/a")
    @idem.idempotent(exclude=["ts"])
    def a() -> tuple[dict[str, str], int]:
        ran.append("a")
        return {"a": "done"}, 201

    @app.post("/b")
    @idem.idempotent
    def b() -> tuple[dict[str, str], int]:
        ran.append("b")
        return {"b": "done"}, 201

    with app.app_context():
        db.create_all()
    client = app.test_client()
    try:
        for key, sent, named in (("k1", {"x": 1}, True), ("k2", {"x": 1, "ts": 5}, False)):
            headers = {"Idempotency-Key": key}
            assert client.post("/b", json={"x": 1}, headers=headers).status_code == 201
            problem = assert_problem(client.post("/a", json=sent, headers=headers), 422)
            assert ("another route (POST /b)" in problem["detail"]) is named, problem
        # The other way round: /a's record of {x: 1, ts: 5} is what /a makes of
        # {x: 1} with any ts, so /b's request is named with or without ts.
        headers = {"Idempotency-Key": "k3"}
        assert client.post("/a", json={"x": 1, "ts": 5}, headers=headers).status_code == 201
        for sent in ({"x": 1, "ts": 6}, {"x": 1}):
            problem = assert_problem(client.post("/b", json=sent, headers=headers), 422)
            assert "another route (POST /a)" in problem["detail"]
        problem = assert_problem(client.post("/b", json={"x": 2}, headers=headers), 422)
        assert "different request payload" in problem["detail"]
        with app.app_context():
            rows = db.session.scalar(sa.text("SELECT count(*) FROM idempotency_keys"))
        assert (ran, rows) == (["b", "b", "a"], 3)
    finally:
        with app.app_context():
            db.engine.dispose()


class Item(Schema):
    sku = fields.String()
    qty = fields.Integer()


class CountingOrder(Schema):
    """Counts its loads: the 422's hint must not load the body per route."""

    loads = 0
    items = fields.List(fields.Nested(Item))
    ref = fields.String()

    def load(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        type(self).loads += 1
        return super().load(*args, **kwargs)


class OtherOrder(Schema):
    items = fields.List(fields.Nested(Item))
    ref = fields.String()


def test_a_mismatch_costs_one_load_and_a_bounded_number_of_hashes(
    fresh_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An app with many routes of the method: plain ones (never tried: not the
    extension's), decorated ones with another schema (never tried: their schema
    is theirs), and more look-alike decorated ones than the hint tries. A 422
    loads the body once, as the first request does, and hashes it at most
    ``_ROUTE_HINT_CANDIDATES + 1`` times; the route it names is a look-alike
    among the first ones."""
    app = Flask("many")
    app.config.update(SQLALCHEMY_DATABASE_URI=fresh_database)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "user:1")
    for i in range(300):
        app.add_url_rule(f"/plain{i}", f"plain{i}", lambda: "x", methods=["POST"])
    for i in range(30):
        view = idem.idempotent(schema=OtherOrder)(lambda: ({"other": 1}, 201))
        app.add_url_rule(f"/other{i}", f"other{i}", view, methods=["POST"])
    for i in range(3 * claim._ROUTE_HINT_CANDIDATES):
        view = idem.idempotent(schema=CountingOrder)(lambda: ({"alike": 1}, 201))
        app.add_url_rule(f"/alike{i}", f"alike{i}", view, methods=["POST"])
    with app.app_context():
        db.create_all()
    hashes: list[str] = []
    compute = fingerprint.compute

    def counting(*args: t.Any, **kwargs: t.Any) -> str:
        hashes.append(args[1])
        return compute(*args, **kwargs)

    monkeypatch.setattr(fingerprint, "compute", counting)
    client = app.test_client()
    body = {"items": [{"sku": f"s{i}", "qty": i} for i in range(200)], "ref": "a"}
    try:
        before = CountingOrder.loads
        made = client.post("/alike1", json=body, headers={"Idempotency-Key": "k"})
        assert made.status_code == 201
        first = CountingOrder.loads - before
        problem = assert_problem(
            client.post("/alike0", json=body, headers={"Idempotency-Key": "k"}), 422
        )
        assert "another route (POST /alike1)" in problem["detail"]
        assert CountingOrder.loads - before == 2 * first == 2  # one load each
        # The record made on the last look-alike: past the cap, the usual detail.
        last = f"/alike{3 * claim._ROUTE_HINT_CANDIDATES - 1}"
        assert client.post(last, json=body, headers={"Idempotency-Key": "k2"}).status_code == 201
        hashes.clear()
        problem = assert_problem(
            client.post("/alike0", json=body, headers={"Idempotency-Key": "k2"}), 422
        )
        assert "different request payload" in problem["detail"]
        assert len(hashes) == 1 + claim._ROUTE_HINT_CANDIDATES
        assert not [p for p in hashes if p.startswith(("/plain", "/other"))]
        with app.app_context():
            rows = db.session.scalar(sa.text("SELECT count(*) FROM idempotency_keys"))
        assert rows == 2
    finally:
        with app.app_context():
            db.engine.dispose()
