"""The billing app: a ``charges`` table and the idempotent functions that write it.

``charge_invoice`` runs in one transaction: its record is claimed in
``db.session``, and the charge row and the stored result commit together, once
per invoice (within the retention window). ``settle_invoice`` calls a payment
processor over HTTP, which cannot join that transaction, so it is leased: its
record commits first and each call outside the database is a recovery point
(``idem.step``) sent with a derived key; a call that resumes it after a crash
skips the steps that finished.

The database comes from the environment as Flask reads it
(``FLASK_SQLALCHEMY_DATABASE_URI``), or from ``create_app``'s ``config``.
"""

from __future__ import annotations

import json
import typing as t
import urllib.request

from flask import Flask, current_app
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency

db = SQLAlchemy()
idem = Idempotency()


class Charge(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "charges"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    invoice_id: orm.Mapped[str] = orm.mapped_column(db.String(64))
    amount: orm.Mapped[int]
    #: The processor's payment (settle_invoice), when there is one.
    payment_id: orm.Mapped[str | None] = orm.mapped_column(db.String(64))


@idem.function(scope="billing.charge", key="invoice_id", exclude=("attempt",))
def charge_invoice(invoice_id: str, amount: int, attempt: int = 0) -> dict[str, t.Any]:
    """Charge ``amount`` for ``invoice_id``, once: a repeat returns this result.

    ``attempt`` (a retry counter of the caller) is excluded from the fingerprint:
    a retry that counts differently is the same operation. The same invoice with
    another amount is refused (``KeyReusedError``).
    """
    charge = Charge(invoice_id=invoice_id, amount=amount)
    db.session.add(charge)
    db.session.flush()  # the id, for the result; the commit is the function's
    return {"charge_id": charge.id, "invoice_id": invoice_id, "amount": amount}


def _post(path: str, body: dict[str, t.Any], key: str) -> dict[str, t.Any]:
    """POST JSON to the payment processor with an ``Idempotency-Key``."""
    request = urllib.request.Request(
        current_app.config["BILLING_PROCESSOR_URL"] + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Idempotency-Key": key},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return t.cast("dict[str, t.Any]", json.load(answer))


@idem.function(scope="billing.settle", key="invoice_id", lease=True)
def settle_invoice(invoice_id: str, amount: int) -> dict[str, t.Any]:
    """Take the payment at the processor, send the receipt, record the charge.

    Leased (``IDEMPOTENCY_LEASE``): its record commits before it runs, so a
    second call while it runs is refused (``OperationInProgressError``, with
    ``retry_after``); after a crash, the first call past the lease resumes it,
    and the steps that finished are not called again.
    """
    body = {"invoice_id": invoice_id, "amount": amount}
    payment = idem.step("payment", lambda: _post("/payments", body, idem.derived_key("payment")))
    idem.step(
        "receipt",
        lambda: _post("/receipts", {**body, "payment": payment["id"]}, idem.derived_key("receipt")),
    )
    charge = Charge(invoice_id=invoice_id, amount=amount, payment_id=payment["id"])
    db.session.add(charge)
    db.session.flush()
    return {"charge_id": charge.id, "payment_id": payment["id"]}


def create_app(config: t.Mapping[str, t.Any] | None = None) -> Flask:
    """The app; ``config`` overrides what the environment sets."""
    from .command import charge_invoice_command

    app = Flask("billing")
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///billing.sqlite3"
    app.config["BILLING_PROCESSOR_URL"] = "http://127.0.0.1:8025"
    app.config.from_prefixed_env()
    app.config.update(config or {})
    db.init_app(app)
    idem.init_app(app, db)
    app.cli.add_command(charge_invoice_command)
    return app
