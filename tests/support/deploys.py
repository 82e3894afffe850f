"""Two versions of one service for the deploy tests (tests/unit/request/test_deploys.py,
tests/live/test_deploys_live.py): the same route, models and scope, fingerprint
rules as each version sets them. ``python -m tests.support.deploys URL VERSION``
serves version ``v1`` or ``v2`` of :data:`LIVE_VERSIONS` and prints ``READY <port>``.
"""

from __future__ import annotations

import logging
import sys
import typing as t

import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields
from sqlalchemy import orm
from werkzeug.serving import make_server

from flask_idempotency import Idempotency

KEY_1 = "k" * 32 + "-first-fingerprint-key"
KEY_2 = "z" * 32 + "-second-fingerprint-key"


def order_schema(*, default: bool = False, renamed: bool = False) -> Schema:
    """The route's schema: one class name in every version, as a deploy keeps it."""

    class OrderSchema(Schema):
        if renamed:  # the attribute renamed, the wire name kept (data_key)
            amount = fields.Integer(required=True, data_key="total")
        else:
            total = fields.Integer(required=True)
        note = fields.String()
        currency = fields.String(load_default="EUR") if default else fields.String()

    return OrderSchema()


def make_version(
    url: str,
    *,
    schema: Schema | None = None,
    exclude: t.Sequence[str] = (),
    key: str | list[str] | None = None,
    clock: t.Callable[[], t.Any] | None = None,
    forms: bool = False,
    config: t.Mapping[str, t.Any] | None = None,
    before_write: t.Callable[[], None] | None = None,
    **route: t.Any,
) -> tuple[Flask, t.Any]:
    """One version of the service: its own app, models and rules (``route``:
    more options of the route; ``before_write`` runs in the view first)."""
    app = Flask("deploys")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, **(config or {}))
    if key is not None:
        app.config["IDEMPOTENCY_FINGERPRINT_KEY"] = key
    db = SQLAlchemy(app)
    extra = {} if clock is None else {"clock": clock}
    idem = Idempotency(app, db, scope=lambda: "tenant:a", **extra)

    class Order(db.Model):  # type: ignore[name-defined,misc]
        __tablename__ = "deploy_orders"
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
        body: orm.Mapped[str] = orm.mapped_column(sa.Text)

    # A form route has no schema (its fields count as parsed).
    route_schema = None if forms else schema or order_schema()

    @app.post("/orders")
    @idem.idempotent(schema=route_schema, exclude=list(exclude), **route)
    def orders() -> tuple[dict[str, t.Any], int]:
        if before_write is not None:
            before_write()
        order = Order(body=request.headers.get("Idempotency-Key", ""))
        db.session.add(order)
        db.session.flush()
        return {"order": order.id}, 201

    with app.app_context():
        db.create_all()
    return app, db


def orders(app: Flask, db: t.Any) -> int:
    with app.app_context():
        return int(db.session.scalar(sa.text("SELECT count(*) FROM deploy_orders")))


def post(app: Flask, key: str, body: bytes) -> t.Any:
    return app.test_client().post(
        "/orders",
        data=body,
        headers={"Idempotency-Key": key, "Content-Type": "application/json"},
    )


FIRST = b'{"total": 100, "note": "gift"}'
# The same request, as the same operation on the client would not resend it:
# other bytes (key order, spacing, a field's value the new rules ignore).
OTHER_BYTES = b'{"note": "gift",   "total": 100}'


#: The versions the live test serves at once: v2 excludes a field, gains a
#: load_default and makes the second fingerprint key current (v1 accepts it).
LIVE_VERSIONS: dict[str, dict[str, t.Any]] = {
    "v1": {"key": [KEY_1, KEY_2]},
    "v2": {"key": [KEY_2, KEY_1], "exclude": ["note"], "schema": None},
}


def main() -> None:
    url, version = sys.argv[1], sys.argv[2]
    options = dict(LIVE_VERSIONS[version])
    if "schema" in options:
        options["schema"] = order_schema(default=True)
    app, _ = make_version(url, **options)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"READY {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
