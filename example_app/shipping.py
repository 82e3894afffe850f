"""The shipping service: consumes ``order-created`` events and ships each order once.

The broker delivers at least once (the relay may publish an event again after a
crash, the broker redelivers what was not acked), so :func:`ship` goes through
the inbox: the event id and the shipment commit in one transaction, and a
duplicate delivery is skipped.

The event id is the only identity the consumer keys on. The order service
derives it from the tenant's scope and key, so two tenants' events never share
one; the tenant a shipment records is the one the order service wrote into the
event. A message that is no order-created event (no message id, another
shape) is rejected, not processed under a made-up id, and not redelivered for
ever either.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import os
import typing as t

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency, inbox

from . import broker
from .app import create_tables, init_database

db = SQLAlchemy()
idem = Idempotency()  # for its inbox table and the cleanup of expired ids

DEFAULT_DATABASE_URL = "sqlite:///shipping.sqlite3"
CONSUMER = "shipping"
logger = logging.getLogger(__name__)


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


def _event_id(event_id: str, payload: t.Any, headers: t.Any = None) -> str:
    return event_id


def _headers(event_id: str, payload: t.Any, headers: t.Any = None) -> t.Any:
    return headers


@inbox.consumer(CONSUMER, session=lambda: db.session, event_id=_event_id, headers=_headers)
def ship(
    event_id: str, payload: dict[str, t.Any], headers: t.Mapping[str, t.Any] | None = None
) -> str:
    """Ship the order of one ``order-created`` event: once per event id. Returns
    ``"shipped"``, or ``None`` (the inbox skipped a duplicate). Needs an app
    context; the inbox commits the shipment with the event id. ``headers``
    (the message's) carry the order request's trace context: with
    OpenTelemetry the shipment joins the order's trace."""
    db.session.add(
        Shipment(order_id=payload["order_id"], tenant=payload["tenant"], event_id=event_id)
    )
    return "shipped"


@dataclasses.dataclass
class Consumed:
    shipped: int = 0
    skipped: int = 0
    rejected: int = 0  #: not order-created events: refused, not redelivered


def order_created(event_id: t.Any, body: t.Any) -> bool:
    """Whether a delivery is an order-created event this service can ship: a
    message id, and the order and tenant the order service writes."""
    return (
        isinstance(event_id, str)
        and bool(event_id)
        and isinstance(body, dict)
        and isinstance(body.get("order_id"), int)
        and isinstance(body.get("tenant"), str)
    )


def consume(app: Flask, *, idle: float = 1.0, limit: int | None = None) -> Consumed:
    """Take ``order-created`` events off the shipping queue and ship them, until
    none has come for ``idle`` seconds (or ``limit`` were taken). A message is
    acked after its transaction commits; one that fails is not acked, so the
    broker delivers it again; one that is no order-created event is rejected
    (a broker with a dead-letter exchange keeps it there)."""
    done = Consumed()
    taken = 0

    def on_message(body: t.Any, message: t.Any) -> None:
        nonlocal taken
        taken += 1
        event_id = message.properties.get("message_id")
        if not order_created(event_id, body):
            logger.error("rejected a message that is no order-created event: id %r", event_id)
            message.reject()
            done.rejected += 1
            return
        with app.app_context():
            outcome = ship(event_id, body, message.headers)
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
    (default SQLite in the instance folder; with its driver, as
    ``postgresql+psycopg2://user@host/shipping``), its broker ``EXAMPLE_BROKER_URL``."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_SHIPPING_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    if config:
        app.config.update(config)
    broker.configure(app)
    init_database(app, db)
    idem.init_app(app, db)
    create_tables(app, db)
    return app
