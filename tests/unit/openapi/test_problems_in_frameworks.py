"""flask-smorest and APIFlask each register an ``HTTPException`` handler that answers
their own JSON envelope; the extension's problems still answer
``application/problem+json``, as their specs (with the plugin) say: a key reused
with another payload is a 422 problem on each, on every engine, and its view ran
once (rows counted). The flask-smorest view is a MethodView whose ``post`` is
decorated itself."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from apiflask import APIFlask
from flask import Flask
from flask.views import MethodView
from flask_smorest import Api, Blueprint
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE


def smorest_app(url: str) -> tuple[Flask, SQLAlchemy]:
    app = Flask("smorest_orders")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url, API_TITLE="Orders", API_VERSION="1", OPENAPI_VERSION="3.0.3"
    )
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")
    api = Api(app)
    blp = Blueprint("orders", "orders")
    order = model(db)

    @blp.route("/orders")
    class Orders(MethodView):
        @idem.idempotent(required=True)
        def post(self) -> tuple[dict[str, str], int]:
            db.session.add(order(route="smorest"))
            return {"status": "placed"}, 201

    api.register_blueprint(blp)
    return app, db


def apiflask_app(url: str) -> tuple[Flask, SQLAlchemy]:
    app = APIFlask("apiflask_orders")
    app.config.update(SQLALCHEMY_DATABASE_URI=url)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")
    order = model(db)

    @app.post("/orders")
    @idem.idempotent(required=True)
    def place() -> tuple[dict[str, str], int]:
        db.session.add(order(route="apiflask"))
        return {"status": "placed"}, 201

    return app, db


def model(db: SQLAlchemy) -> t.Any:
    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "orders"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
        route: orm.Mapped[str] = orm.mapped_column(sa.String(20))

    return Order


@pytest.mark.parametrize("framework", [smorest_app, apiflask_app])
def test_a_reused_key_is_a_problem_not_the_frameworks_envelope(
    fresh_database: str, framework: t.Callable[[str], tuple[Flask, SQLAlchemy]]
) -> None:
    app, db = framework(fresh_database)
    with app.app_context():
        db.create_all()
    try:
        client = app.test_client()
        headers = {"Idempotency-Key": "order-1"}
        first = client.post("/orders", json={"sku": "tea"}, headers=headers)
        assert first.status_code == 201
        reused = client.post("/orders", json={"sku": "coffee"}, headers=headers)
        assert reused.status_code == 422
        assert reused.mimetype == PROBLEM_JSON
        assert reused.get_json()["type"] == PROBLEM_TYPE_BASE + "key-reused"
        assert reused.headers["Idempotency-Key"] == "order-1"
        replayed = client.post("/orders", json={"sku": "tea"}, headers=headers)
        assert replayed.status_code == 201
        assert replayed.headers["Idempotent-Replayed"] == "true"
        missing = client.post("/orders", json={"sku": "tea"})
        assert missing.status_code == 400
        assert missing.mimetype == PROBLEM_JSON
        with app.app_context():
            assert db.session.scalar(sa.text("SELECT count(*) FROM orders")) == 1
    finally:
        with app.app_context():
            db.engine.dispose()
