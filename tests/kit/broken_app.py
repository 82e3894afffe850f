"""A deliberately broken payments route: a response cache in front of the handler.

It looks idempotent: a retry with the same key gets the cached response. But
the cache is written after the charge commits, in a transaction of its own, so
a crash between the two leaves the charge without its cached answer, and the
retry charges again. The kit's crash-after-commit test must catch it.
"""

from __future__ import annotations

import json
import typing as t

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

db = SQLAlchemy()


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "charges"

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    merchant: orm.Mapped[str] = orm.mapped_column(db.String(64))
    amount: orm.Mapped[int] = orm.mapped_column(db.Integer)


class CachedResponse(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "response_cache"

    key: orm.Mapped[str] = orm.mapped_column(db.String(255), primary_key=True)
    status: orm.Mapped[int] = orm.mapped_column(db.Integer)
    body: orm.Mapped[str] = orm.mapped_column(db.Text)


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite://"
    app.config.update(config or {})
    db.init_app(app)

    @app.post("/payments")
    def create_payment() -> t.Any:
        key = request.headers.get("Idempotency-Key", "")
        cached = db.session.get(CachedResponse, key)
        if cached is not None:  # the "replay"
            return json.loads(cached.body), cached.status
        charge = Charge(merchant=request.headers["X-Merchant"], amount=request.json["amount"])
        db.session.add(charge)
        db.session.commit()  # the charge is committed ...
        body = {"charge_id": charge.id, "amount": charge.amount}
        db.session.add(CachedResponse(key=key, status=201, body=json.dumps(body)))
        db.session.commit()  # ... and only then its answer cached: the bug
        return body, 201

    return app
