"""The payments service: ``POST /payments`` charges a customer once per key."""

from __future__ import annotations

import datetime as dt
import os
import typing as t

from flask import Flask, abort, url_for
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields, validate
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()

DEFAULT_DATABASE_URL = "sqlite:///example.sqlite3"


class LedgerEntry(db.Model):  # type: ignore[name-defined,misc]
    """One row per charge: the side effect that must happen once."""

    __tablename__ = "ledger"

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    customer_id: orm.Mapped[str] = orm.mapped_column(db.String(64))
    amount: orm.Mapped[int]
    currency: orm.Mapped[str] = orm.mapped_column(db.String(3))
    description: orm.Mapped[str | None] = orm.mapped_column(db.String(200))
    created_at: orm.Mapped[dt.datetime] = orm.mapped_column(
        default=lambda: dt.datetime.now(dt.timezone.utc)
    )

    def as_dict(self) -> dict[str, t.Any]:
        return {
            "charge_id": self.id,
            "customer_id": self.customer_id,
            "amount": self.amount,
            "currency": self.currency,
            "description": self.description,
        }


class PaymentSchema(Schema):
    """A charge request. ``client_sent_at`` changes on every retry, so it is
    excluded from the fingerprint."""

    customer_id = fields.String(required=True, validate=validate.Length(min=1, max=64))
    amount = fields.Integer(required=True, strict=False, validate=validate.Range(min=1))
    currency = fields.String(required=True, validate=validate.OneOf(["EUR", "USD", "GBP"]))
    description = fields.String(load_default=None, validate=validate.Length(max=200))
    client_sent_at = fields.AwareDateTime(load_default=None)


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """Build the app. ``config`` overrides; the database comes from
    ``EXAMPLE_DATABASE_URL`` or defaults to SQLite in the instance folder."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    app.config["IDEMPOTENCY_REQUIRED"] = True
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    if config:
        app.config.update(config)
    db.init_app(app)
    idem.init_app(app, db)
    app.register_blueprint(bp)
    with app.app_context():
        db.create_all()
    return app


from flask import Blueprint  # noqa: E402

bp = Blueprint("payments", __name__)


@bp.post("/payments")
@idem.idempotent(schema=PaymentSchema(), exclude=["client_sent_at"])
def create_payment() -> tuple[dict[str, t.Any], int, dict[str, str]]:
    """Charge the customer: write one ledger row. The extension commits it,
    together with the idempotency record."""
    data = idem.payload
    entry = LedgerEntry(
        customer_id=data["customer_id"],
        amount=data["amount"],
        currency=data["currency"],
        description=data["description"],
    )
    db.session.add(entry)
    db.session.flush()  # assigns the id; the commit happens after the view returns
    location = url_for("payments.get_payment", charge_id=entry.id)
    return entry.as_dict(), 201, {"Location": location}


@bp.get("/payments/<int:charge_id>")
def get_payment(charge_id: int) -> dict[str, t.Any]:
    entry = db.session.get(LedgerEntry, charge_id)
    if entry is None:
        abort(404)
    return entry.as_dict()


@bp.get("/ledger")
def ledger() -> dict[str, t.Any]:
    entries = db.session.execute(db.select(LedgerEntry).order_by(LedgerEntry.id)).scalars()
    rows = [e.as_dict() for e in entries]
    return {"count": len(rows), "entries": rows}
