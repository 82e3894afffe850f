"""The order service: ``POST /orders`` places an order once per key.

One request is a chain of side effects in three systems, each made safe by the
client's one ``Idempotency-Key`` (K):

* the order row, deduplicated here on (tenant, K);
* the charge at the payments service (``app.py``), sent with
  ``idem.derived_key("charge")``: the same key on every retry and resume of this
  operation, so the payments service charges once;
* the ``order-created`` event, written to the outbox in the order's transaction
  with an id derived from K, relayed to the broker afterwards; the shipping
  service (``shipping.py``) processes each event id once.

The route is leased (``lease=True``): the claim commits before the view calls
the payments service, so a crash after the charge leaves a record the client's
retry resumes, with the same derived key, instead of a fresh operation.

Every route is its tenant's (:func:`tenant`): the scope of its keys, the
tenant stored on each order, and the filter of every read. Another tenant's
order is a 404, as one that does not exist.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import typing as t

from flask import Blueprint, Flask, abort, current_app, request, url_for
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm
from werkzeug.exceptions import HTTPException

from flask_idempotency import Idempotency
from flask_idempotency.client import IdempotentSession

from . import broker
from .app import (
    CUSTOMER_ID_LENGTH,
    ID_MAX,
    AmountSchema,
    create_tables,
    http_problem,
    init_database,
    problem,
)

db = SQLAlchemy()
idem = Idempotency()
logger = logging.getLogger(__name__)

DEFAULT_DATABASE_URL = "sqlite:///orders.sqlite3"
DEFAULT_PAYMENTS_URL = "http://127.0.0.1:5000"
#: Who this service is at the payments service (its X-Merchant).
DEFAULT_PAYMENTS_MERCHANT = "orders"
TENANT_LENGTH = 64
#: What the extension reads the time from (``Idempotency.init_app(clock=...)``).
Clock = t.Callable[[], dt.datetime]


class Order(db.Model):  # type: ignore[name-defined,misc]
    """One row per order: written once per (tenant, key)."""

    __tablename__ = "orders"

    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    tenant: orm.Mapped[str] = orm.mapped_column(db.String(TENANT_LENGTH))
    customer_id: orm.Mapped[str] = orm.mapped_column(db.String(CUSTOMER_ID_LENGTH))
    amount: orm.Mapped[int] = orm.mapped_column(db.Integer)
    currency: orm.Mapped[str] = orm.mapped_column(db.String(3))
    #: The charge at the payments service; none for the shop's orders paid on
    #: delivery (``shop.py``).
    charge_id: orm.Mapped[int | None] = orm.mapped_column(db.Integer)
    created_at: orm.Mapped[dt.datetime] = orm.mapped_column(
        default=lambda: dt.datetime.now(dt.timezone.utc)
    )

    def as_dict(self) -> dict[str, t.Any]:
        return {
            "order_id": self.id,
            "tenant": self.tenant,
            "customer_id": self.customer_id,
            "amount": self.amount,
            "currency": self.currency,
            "charge_id": self.charge_id,
        }


class OrderSchema(AmountSchema):
    """An order: who pays how much (``client_sent_at`` is not fingerprinted)."""


class PaymentFailed(Exception):
    """The payments service refused the charge or could not be reached in time."""

    def __init__(self, status: int | None, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def tenant() -> str:
    """The calling tenant. A stand-in for authentication: a real service takes
    it from the verified credential, never from a header anyone can set."""
    name = request.headers.get("X-Tenant", "")
    if not name or len(name) > TENANT_LENGTH or not name.isprintable():
        abort(401, description="Send your tenant in X-Tenant (1 to 64 printable characters).")
    return name


def charge(order: dict[str, t.Any]) -> dict[str, t.Any]:
    """Charge the order at the payments service and return its charge.

    ``step="charge"`` sends ``idem.derived_key("charge")`` as the key, on the
    first attempt, on every retry the session makes, and on the attempt that
    resumes this operation after a crash: the payments service charges once.
    """
    http: IdempotentSession = current_app.extensions["example_orders_http"]
    body = {k: order[k] for k in ("customer_id", "amount", "currency")}
    try:
        response = http.post(
            current_app.config["PAYMENTS_URL"] + "/payments",
            json={**body, "description": f"order of {tenant()}"},
            headers={"X-Merchant": current_app.config["PAYMENTS_MERCHANT"]},
            step="charge",
            timeout=(3, 5),
        )
    except OSError as exc:  # requests' ConnectionError and Timeout are OSErrors
        logger.warning("payments service unreachable: %s", exc)
        raise PaymentFailed(None, "The payments service could not be reached.") from exc
    if response.status_code not in (200, 201):
        logger.warning("payments service answered %s: %s", response.status_code, response.text)
        raise PaymentFailed(response.status_code, _reason(response))
    return t.cast(dict[str, t.Any], response.json())


def _reason(response: t.Any) -> str:
    """What the client may read of a payments answer: its problem's title and
    detail when it sent one, not its raw body."""
    try:
        answer = response.json()
        return f"{answer['title']}: {answer['detail']}"
    except (ValueError, KeyError, TypeError):
        return f"The payments service answered {response.status_code}."


bp = Blueprint("orders", __name__)


@bp.post("/orders")
@idem.idempotent(
    schema=OrderSchema(),
    exclude=["client_sent_at"],
    lease=True,  # IDEMPOTENCY_LEASE: commit the claim before calling downstream
    required=True,
    scope=lambda: f"tenant:{tenant()}",
)
def create_order() -> t.Any:
    order = idem.payload
    try:
        # A recovery point: a retry that resumes after a crash past this line
        # gets the saved charge without calling the payments service again.
        payment = idem.step("charge", lambda: charge(order))
    except PaymentFailed as exc:
        # A refusal (422, 400) is the answer, stored and replayed. Anything else
        # (unreachable, 5xx, still 409 or 429 after the session's retries) may
        # yet have charged: 502 is not stored, the record stays this operation's,
        # and the client's retry resumes it with the same derived key.
        refused = exc.status is not None and exc.status in (400, 422)
        status = 422 if refused else 502
        return problem(status, "The payment failed", exc.detail)
    row = Order(
        tenant=tenant(),
        customer_id=order["customer_id"],
        amount=order["amount"],
        currency=order["currency"],
        charge_id=payment["charge_id"],
    )
    db.session.add(row)
    db.session.flush()
    # In the order's transaction: the event exists if and only if the order does.
    event_id = idem.emit(broker.ORDER_CREATED, row.as_dict())
    location = url_for("orders.get_order", order_id=row.id)
    return {**row.as_dict(), "event_id": event_id}, 201, {"Location": location}


@bp.get(f"/orders/<int(max={ID_MAX}):order_id>")
def get_order(order_id: int) -> dict[str, t.Any]:
    """One of the caller's orders; another tenant's is a 404, as a missing one."""
    mine = db.select(Order).where(Order.id == order_id, Order.tenant == tenant())
    row: Order | None = db.session.execute(mine).scalar_one_or_none()
    if row is None:
        abort(404)
    return row.as_dict()


@bp.get("/orders")
def list_orders() -> dict[str, t.Any]:
    """The caller's orders, oldest first."""
    mine = db.select(Order).where(Order.tenant == tenant()).order_by(Order.id)
    rows = [o.as_dict() for o in db.session.execute(mine).scalars()]
    return {"count": len(rows), "orders": rows}


def create_app(config: t.Mapping[str, t.Any] | None = None, *, clock: Clock | None = None) -> Flask:
    """Build the order service. ``config`` overrides; otherwise the database is
    ``EXAMPLE_ORDERS_DATABASE_URL`` (default SQLite in the instance folder; with its
    driver, as ``postgresql+psycopg2://user@host/orders``), the payments service
    ``EXAMPLE_PAYMENTS_URL`` (default ``http://127.0.0.1:5000``), where it calls as
    merchant ``EXAMPLE_PAYMENTS_MERCHANT`` (default ``orders``), and the broker
    ``EXAMPLE_BROKER_URL`` (see ``broker.py``). Behind a transaction pooler
    (``EXAMPLE_DATABASE_POOLER=transaction``) its relay LISTENs on
    ``EXAMPLE_ORDERS_LISTEN_URL``, a direct URL to the orders database.
    ``clock`` is the extension's (tests move it)."""
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "EXAMPLE_ORDERS_DATABASE_URL", DEFAULT_DATABASE_URL
    )
    app.config["PAYMENTS_URL"] = os.environ.get("EXAMPLE_PAYMENTS_URL", DEFAULT_PAYMENTS_URL)
    app.config["PAYMENTS_MERCHANT"] = os.environ.get(
        "EXAMPLE_PAYMENTS_MERCHANT", DEFAULT_PAYMENTS_MERCHANT
    )
    app.config["MAX_CONTENT_LENGTH"] = 64 * 1024
    # Longer than the charge can take (connect 3 s + read 5 s per attempt, within
    # the session's 12 s budget), so a live request never loses its lease.
    app.config["IDEMPOTENCY_LEASE"] = dt.timedelta(seconds=30)
    # Behind a transaction pooler (EXAMPLE_DATABASE_POOLER), where its relay
    # LISTENs: the database itself, not the pooler (else the relay polls).
    app.config["IDEMPOTENCY_RELAY_LISTEN_URL"] = os.environ.get("EXAMPLE_ORDERS_LISTEN_URL")
    if config:
        app.config.update(config)
    broker.configure(app)
    app.config.setdefault("IDEMPOTENCY_PUBLISHER", broker.publisher(app))
    # One session per app, shared by its requests' threads: requests' Session is
    # safe for concurrent requests that do not change its settings.
    app.extensions["example_orders_http"] = IdempotentSession(
        total=3, backoff_factor=0.2, backoff_max=2, deadline=12
    )
    init_database(app, db)
    idem.init_app(app, db, clock=clock)
    app.register_blueprint(bp)
    # Every HTTP error as problem+json (404, 405, 401 from tenant(), 413...); the
    # extension's own errors are problem+json already.
    app.register_error_handler(HTTPException, http_problem)
    app.add_url_rule("/readyz", view_func=idem.readiness_view)
    create_tables(app, db)
    return app
