"""A shop for the kit's reconcile tests: each order is marked with its scope and
idempotency key, and the app's reconcile hook finds it (``RECONCILE_MODE``
``"find"``) or cannot tell (``"none"``). ``/orders`` claims in the view's
transaction; ``/leased-orders`` commits its claim first (``lease=``).
"""

from __future__ import annotations

import typing as t

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency.scope import ReconcileAttempt

db = SQLAlchemy()
idem = Idempotency()


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    scope: orm.Mapped[str] = orm.mapped_column(sa.String(512))
    idempotency_key: orm.Mapped[str] = orm.mapped_column(sa.String(255))


def _answer(order: Order) -> t.Any:
    return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


def find_order(attempt: ReconcileAttempt) -> t.Any:
    """The shop's hook: the order its view committed, answered as the view would."""
    order = db.session.execute(
        sa.select(Order).where(Order.scope == attempt.scope, Order.idempotency_key == attempt.key)
    ).scalar_one_or_none()
    return None if order is None else _answer(order)


def _place() -> t.Any:
    order = Order(scope=idem.scope, idempotency_key=idem.key)
    db.session.add(order)
    db.session.commit()  # the kit's kill_after_commit fires here
    return _answer(order)


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(config or {})
    mode = app.config.get("RECONCILE_MODE", "find")
    app.config["IDEMPOTENCY_RECONCILE"] = find_order if mode == "find" else lambda attempt: None
    app.config.setdefault("IDEMPOTENCY_SCOPE", lambda: "tenant:1")
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/orders")
    @idem.idempotent
    def place() -> t.Any:
        return _place()

    @app.post("/leased-orders")
    @idem.idempotent(lease=2, ttl=3600)
    def place_leased() -> t.Any:
        return _place()

    return app
