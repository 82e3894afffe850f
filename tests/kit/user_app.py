"""A user's own app for the kit's regression tests (the outside review's
cases): a key header of its own (``X-Request-Id``), Core inserts, a downstream
call made on the request's thread or from a worker thread, a charge written
with Core then an ORM audit row, and models keyed by a UUID and by a timestamp.
``create_app(config)`` applies its config before ``init_app``;
``create_bare()`` takes none, and ``app`` is a built instance.
"""

from __future__ import annotations

import datetime as dt
import json
import typing as t
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from flask import Flask, current_app, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()

notes = sa.Table(
    "notes",
    db.metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("body", sa.String(200)),
)
charges = sa.Table(
    "charges",
    db.metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("amount", sa.Integer),
)


class Audit(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "audit"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    what: orm.Mapped[str] = orm.mapped_column(sa.String(64))


class Invoice(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "invoices"
    id: orm.Mapped[uuid.UUID] = orm.mapped_column(sa.Uuid, primary_key=True, default=uuid.uuid4)
    total: orm.Mapped[int]


class Slot(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "slots"
    at: orm.Mapped[dt.datetime] = orm.mapped_column(sa.DateTime(timezone=True), primary_key=True)
    room: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)


def _index(body: str) -> t.Any:
    """The downstream call, with the key forwarded in the app's own header."""
    req = urllib.request.Request(
        current_app.config["DOWNSTREAM_URL"] + "/index",
        data=json.dumps({"body": body}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **idem.forward_headers()},
    )
    with urllib.request.urlopen(req, timeout=5) as answer:
        return json.load(answer)


def _configure(app: Flask) -> None:
    app.config.setdefault("SQLALCHEMY_DATABASE_URI", "sqlite://")
    app.config.setdefault("IDEMPOTENCY_HEADER", "X-Request-Id")
    app.config.setdefault("IDEMPOTENCY_SCOPE", lambda: "tenant:1")
    app.config.setdefault("DOWNSTREAM_URL", "http://127.0.0.1:1")
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/notes")
    @idem.idempotent
    def create_note() -> t.Any:
        body = request.get_json()["body"]
        db.session.execute(sa.insert(notes).values(body=body))
        return {"indexed": _index(body)["id"]}, 201

    @app.post("/notes-parallel")
    @idem.idempotent
    def create_note_parallel() -> t.Any:
        # The downstream call from a worker thread (to call several services at
        # once): made outside the request's thread and context.
        body = request.get_json()["body"]
        db.session.execute(sa.insert(notes).values(body=body))
        url = current_app.config["DOWNSTREAM_URL"] + "/index"
        headers = {"Content-Type": "application/json", **idem.forward_headers()}

        def call() -> t.Any:
            req = urllib.request.Request(
                url, data=json.dumps({"body": body}).encode(), method="POST", headers=headers
            )
            with urllib.request.urlopen(req, timeout=5) as answer:
                return json.load(answer)

        with ThreadPoolExecutor(1) as pool:
            indexed = pool.submit(call).result(timeout=10)
        return {"indexed": indexed["id"]}, 201

    @app.post("/notes-thread-write")
    @idem.idempotent
    def create_note_from_a_thread() -> t.Any:
        # A write from a worker thread, on a connection of its own: outside the
        # request, its transaction and its context.
        body = request.get_json()["body"]
        this_app = current_app._get_current_object()  # type: ignore[attr-defined]

        def write() -> None:
            with this_app.app_context(), db.engine.begin() as conn:
                conn.execute(sa.insert(notes).values(body=body + " (thread)"))

        with ThreadPoolExecutor(1) as pool:
            pool.submit(write).result(timeout=10)
        db.session.execute(sa.insert(notes).values(body=body))
        return {"ok": True}, 201

    @app.post("/pay")
    @idem.idempotent
    def pay() -> t.Any:
        # The charge with Core, committed at once; then an ORM audit row.
        db.session.execute(sa.insert(charges).values(amount=request.get_json()["amount"]))
        db.session.commit()
        db.session.add(Audit(what="charged"))
        return {"ok": True}, 201

    @app.post("/invoices")
    @idem.idempotent
    def create_invoice() -> t.Any:
        invoice = Invoice(total=request.get_json()["total"])
        db.session.add(invoice)
        db.session.flush()
        return {"id": str(invoice.id)}, 201

    @app.post("/slots")
    @idem.idempotent
    def book_slot() -> t.Any:
        at = dt.datetime.fromisoformat(request.get_json()["at"])
        db.session.add(Slot(at=at, room=1))
        return {"at": at.isoformat()}, 201


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config.update(config or {})
    _configure(app)
    return app


def create_bare() -> Flask:
    """A factory without parameters: the kit can only apply its config after."""
    app = Flask(__name__)
    _configure(app)
    return app


app = create_bare()
