"""A correct app whose model has a UUID primary key (very common)."""
import uuid

import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()


class Invoice(db.Model):
    __tablename__ = "invoices"
    id: orm.Mapped[uuid.UUID] = orm.mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    total: orm.Mapped[int]


def create_app(config=None):
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    app.config["IDEMPOTENCY_SCOPE"] = lambda: "user:1"
    app.config.update(config or {})
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/invoices")
    @idem.idempotent
    def create_invoice():
        inv = Invoice(total=request.get_json()["total"])
        db.session.add(inv)
        db.session.flush()
        return {"id": str(inv.id)}, 201

    return app
