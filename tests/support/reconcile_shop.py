"""The shop of the reconcile tests: each order is marked with its scope and
idempotency key, and the app's reconcile hook (:class:`Hook`) finds it, or
misbehaves as a test tells it. ``/orders`` claims in the view's transaction,
``/leased-orders`` commits its claim first, ``/gift-orders`` has a hook of its
own, ``/manual-orders`` is in manual mode (keeping its request); an ``X-Fail``
header makes the view fail after its commit."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Blueprint, Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import event, orm

from flask_idempotency import Idempotency
from flask_idempotency.scope import ReconcileAttempt
from tests.conftest import Clock
from tests.support.flow import post
from tests.support.tables import recreate_tables

db = SQLAlchemy()
idem = Idempotency()
bp = Blueprint("shop", __name__)

LEASE = 5  # seconds: the clock is moved past it, nobody waits


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "reconcile_orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    scope: orm.Mapped[str] = orm.mapped_column(db.String(512))
    idempotency_key: orm.Mapped[str] = orm.mapped_column(db.String(255))


FAILURES: dict[str, type[BaseException]] = {
    "exception": RuntimeError,
    "systemexit": SystemExit,
    "keyboard": KeyboardInterrupt,
}


def _place() -> t.Any:
    order = Order(scope=idem.scope, idempotency_key=idem.key)
    db.session.add(order)
    db.session.commit()  # the order is durable now, whatever comes next
    failure = request.headers.get("X-Fail")  # not in the fingerprint
    if failure:
        raise FAILURES[failure]("after the view's commit")
    return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


@bp.post("/orders")
@idem.idempotent
def place() -> t.Any:
    return _place()


@bp.post("/leased-orders")
@idem.idempotent(lease=LEASE, ttl=3600)
def place_leased() -> t.Any:
    return _place()


@bp.post("/gift-orders")
@idem.idempotent(reconcile=lambda attempt: ({"own": attempt.scope}, 200))
def place_gift() -> t.Any:
    return _place()


@bp.post("/recoverable-orders")
@idem.idempotent(lease=LEASE, ttl=3600, recover=True)
def place_recoverable() -> t.Any:
    return _place()


@bp.post("/manual-orders")
@idem.idempotent(manual=True, lease=LEASE, ttl=3600, recover=True)
def place_manual() -> t.Any:
    if idem.previous is not None:  # the view decides, never the hook
        return {"previous": idem.previous.response_code}, 200
    return _place()


class Hook:
    """The shop's hook: finds the order by (scope, key); or misbehaves as told."""

    def __init__(self) -> None:
        self.mode = "find"
        self.calls: list[ReconcileAttempt] = []

    def __call__(self, attempt: ReconcileAttempt) -> t.Any:
        self.calls.append(attempt)
        if self.mode == "none":
            return None
        if self.mode == "interrupt":
            raise KeyboardInterrupt
        if self.mode == "raise":
            raise LookupError("the orders service is down")
        if self.mode == "500":
            return {"error": "x"}, 500
        if self.mode == "409":  # not a stored status
            return {"error": "x"}, 409
        order = db.session.execute(
            sa.select(Order).where(
                Order.scope == attempt.scope, Order.idempotency_key == attempt.key
            )
        ).scalar_one_or_none()
        if order is None:
            return None
        return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


def make_app(url: str, clock: Clock, hook: Hook, **config: t.Any) -> Flask:
    app = Flask(__name__)
    defaults = {
        "SQLALCHEMY_DATABASE_URI": url,
        "IDEMPOTENCY_SCOPE": lambda: "tenant-1",
        "IDEMPOTENCY_RECONCILE": hook,
        "IDEMPOTENCY_LEASE": LEASE,
    }
    app.config.update({**defaults, **config})
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.register_blueprint(bp)
    recreate_tables(db.metadata, url)
    return app


def orders(app: Flask) -> list[int]:
    with app.app_context():
        return list(db.session.execute(sa.select(Order.id)).scalars())


def raw_record(app: Flask) -> dict[str, t.Any]:
    with app.app_context(), db.engine.connect() as conn:
        [row] = conn.execute(sa.text("SELECT * FROM idempotency_keys")).mappings()
        return dict(row)


def fail_after_commit(app: Flask, route: str, failure: str, key: str = "k1") -> None:
    client = app.test_client()
    fail = {"X-Fail": failure}
    if failure == "exception":
        # The app's own error: Flask's 500 (the record holds failed-after-commit).
        assert post(client, route, {}, key=key, headers=fail).status_code == 500
    else:
        with pytest.raises(FAILURES[failure]):
            post(client, route, {}, key=key, headers=fail)


def assert_rebuilt(answer: t.Any, order_id: int) -> None:
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json() == {"id": order_id}
    assert answer.headers["Location"] == f"/orders/{order_id}"
    assert answer.headers["Idempotent-Replayed"] == "true"


def refuse_completions(app: Flask) -> t.Callable[[], None]:
    """Every completion of a record fails at the statement, as a database gone
    after the view's commit: the record stays in progress, as after a SIGKILL."""
    with app.app_context():
        engine = db.engine

    def refuse(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        head = " ".join(statement.split()).lower()
        if head.startswith("update idempotency_keys set status"):
            raise ConnectionError("the database went away")

    event.listen(engine, "before_cursor_execute", refuse)
    return lambda: event.remove(engine, "before_cursor_execute", refuse)
