"""A small app for the outbox tests: one order row per request, events emitted
with it. Also the ``flask --app`` target of the killed-relay test
(``tests.outbox_app:from_env``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import typing as t

from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency.outbox import OutboxEvent

db = SQLAlchemy()
idem = Idempotency()


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "outbox_orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    amount: orm.Mapped[int]


def _order() -> t.Any:
    body = request.get_json()
    order = Order(amount=body["amount"])
    db.session.add(order)
    db.session.flush()
    ids = [idem.emit("order.created", {"order": order.id, "amount": body["amount"]})]
    if body.get("twice"):
        ids.append(idem.emit("order.created", {"order": order.id, "again": True}))
    if body.get("fail"):
        return jsonify(error="boom", events=ids), 500
    return jsonify(order=order.id, events=ids), 201


def create_app(
    database_url: str, *, clock: t.Callable[[], dt.datetime] | None = None, **config: t.Any
) -> Flask:
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=database_url, **config)
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.add_url_rule("/orders", "orders", idem.idempotent()(_order), methods=["POST"])
    app.add_url_rule(
        "/fast-orders", "fast_orders", idem.idempotent(optimistic=True)(_order), methods=["POST"]
    )
    return app


class FilePublisher:
    """Appends each event id to a file; with OUTBOX_KILL_AFTER_PUBLISH set, the
    process kills itself (SIGKILL) right after the first publish, before the
    relay marks anything."""

    def __init__(self, path: str) -> None:
        self.path = path

    def publish(self, event: OutboxEvent) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"event_id": event.event_id, "id": event.id}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if os.environ.get("OUTBOX_KILL_AFTER_PUBLISH"):
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> Flask:
    """Extra config (JSON) from ``OUTBOX_TEST_CONFIG``, e.g. ``IDEMPOTENCY_RELAY_EVERY``."""
    return create_app(
        os.environ["OUTBOX_TEST_DB"],
        IDEMPOTENCY_PUBLISHER=FilePublisher(os.environ["OUTBOX_TEST_FILE"]),
        **json.loads(os.environ.get("OUTBOX_TEST_CONFIG", "{}")),
    )
