"""The shipping service: consumes ``order-created`` events and ships each order once.

The broker delivers at least once (the relay may publish an event again after a
crash, the broker redelivers what was not acked), so :func:`ship` goes through
the inbox: the event id and the shipment commit in one transaction, and a
duplicate delivery is skipped.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import typing as t

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency, inbox

from . import broker
from .app import engine_options

db = SQLAlchemy()
idem = Idempotency()  # for its inbox table and the cleanup of expired ids

DEFAULT_DATABASE_URL = "sqlite:///shipping.sqlite3"
CONSUMER = "shipping"


class Shipment(db.Model):  # type: ignore[name-defined,misc]
    """One row per shipped order."""

    __tablename__ = "shipments"

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    order_id: orm.Mapped[int] = orm.mapped_column(db.Integer)
    tenant: orm.Mapped[str] = orm.mapped_column(db.String(64))
    event_id: orm.Mapped[str] = orm.mapped_column(db.String(64))
    created_at: orm.Mapped[dt.datetime] = orm.mapped_column(
        default=lambda: dt.datetime.now(dt.timezone.utc)
    )


@inbox.consumer(CONSUMER, session=lambda: db.session, event_id=lambda event_id, payload: event_id)
def ship(event_id: str, payload: dict[str, t.Any]) -> str:
    """Ship the order of one ``order-created`` event: once per event id. Returns
    ``"shipped"``, or ``None`` (the inbox skipped a duplicate). Needs an app
    context; the inbox commits the shipment with the event id."""
    db.session.add(
        Shipment(order_id=payload["order_id"], tenant=payload["tenant"], event_id=event_id)
    )
    return "shipped"


@dataclasses.dataclass
class Consumed:
    shipped: int = 0
    skipped: int = 0


def consume(app: Flask, *, idle: float = 1.0, limit: int | None = None) -> Consumed:
    """Take ``order-created`` events off the shipping queue and ship them, until
    none has come for ``idle`` seconds (or ``limit`` were taken). A message is
    acked after its transaction commits; one that fails is not acked, so the
    broker delivers it again."""
    done = Consumed()
    taken = 0

    def on_message(body: t.Any, message: t.Any) -> None:
        nonlocal taken
        taken += 1
        event_id = message.properties.get("message_id")
        with app.app_context():
            outcome = ship(event_id, body)
        if outcome is None:
            done.skipped += 1
        else:
            done.shipped += 1
        message.ack()

    with (
        broker.connection(app) as conn,
        conn.Consumer(broker.shipping_queue(app), callbacks=[on_message], accept=["json"]),
    ):
        while limit is None or taken < limit:
            try:
                conn.drain_events(timeout=idle)
            except TimeoutError:  # socket.timeout too
                break
    return done


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """Build the shipping service: its database is ``EXAMPLE_SHIPPING_DATABASE_URL``
    (default SQLite in the instance folder), its broker ``EXAMPLE_BROKER_URL``."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_SHIPPING_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    if config:
        app.config.update(config)
    broker.configure(app)
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
        **engine_options(app.config["SQLALCHEMY_DATABASE_URI"]),
        **app.config.get("SQLALCHEMY_ENGINE_OPTIONS", {}),
    }
    db.init_app(app)
    idem.init_app(app, db)
    with app.app_context():
        db.create_all()
    return app
