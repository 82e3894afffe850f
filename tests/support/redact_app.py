"""An app with redacted routes (``redact=``) and a keyed fingerprint, for
tests/unit/request/test_redact.py and the ``show`` tests of test_cli_records.py.

Every secret a client sends carries :data:`MARKER`, so a test can look for it
in rows, dumps, reprs, logs and the CLI's output.
"""

from __future__ import annotations

import dataclasses
import typing as t

import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields

from flask_idempotency import Idempotency

#: The fingerprint key of the app (the length it must have at least).
FINGERPRINT_KEY = "test-fingerprint-key-0123456789abcdef"
MARKER = "MARKER-4242"
SCOPE = "user:1"


class CardSchema(Schema):
    amount = fields.Integer(required=True)
    card_number = fields.String(data_key="cardNumber")


class WalletSchema(Schema):
    owner_card = fields.Nested(CardSchema, data_key="ownerCard")


@dataclasses.dataclass
class RedactApp:
    app: Flask
    db: SQLAlchemy
    idem: Idempotency
    #: What each run of a view saw: (path, body as parsed JSON or form fields).
    seen: list[tuple[str, t.Any]]

    def rows(self) -> list[dict[str, t.Any]]:
        """Every record row, read raw (no Record in between)."""
        with self.app.app_context(), self.db.engine.connect() as conn:
            table = self.db.metadata.tables["idempotency_keys"]
            return [dict(row._mapping) for row in conn.execute(sa.select(table))]

    def row(self, key: str) -> dict[str, t.Any]:
        [found] = [r for r in self.rows() if _text(r["key"]) == key]
        return found


def _text(value: t.Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _sent() -> t.Any:
    if request.is_json:
        return request.get_json()
    return {name: request.form.getlist(name) for name in request.form} | {
        name: [f.filename for f in request.files.getlist(name)] for name in request.files
    }


def make_app(url: str, *, clock: t.Any = None, **config: t.Any) -> RedactApp:
    """The app on ``url``; ``config`` overrides (``IDEMPOTENCY_FINGERPRINT_KEY=None``
    is a config without the key). A request with ``X-Crash`` fails after its
    first step, leaving its record for the recovery job."""
    app = Flask("redact")
    app.config.update(SQLALCHEMY_DATABASE_URI=url, IDEMPOTENCY_FINGERPRINT_KEY=FINGERPRINT_KEY)
    app.config.update(config)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: SCOPE, clock=clock)
    seen: list[tuple[str, t.Any]] = []

    def crash_after_a_step(result: t.Any) -> None:
        idem.step("received", lambda: result)
        if request.headers.get("X-Crash"):
            raise RuntimeError("crash")

    @app.post("/pay")
    @idem.idempotent(lease=30, recover=True, redact=["card.number", "cvc"])
    def pay() -> tuple[dict[str, t.Any], int]:
        sent = _sent()
        seen.append(("/pay", sent))
        card = sent.get("card", {}) if isinstance(sent, dict) else {}
        crash_after_a_step({"card": {"number": card.get("number"), "brand": "visa"}})
        # The answer echoes the card number: stored (sealed, with encryption),
        # masked by show --reveal.
        return {"charged": sent.get("amount"), "card": {"number": card.get("number")}}, 201

    @app.post("/form-pay")
    @idem.idempotent(lease=30, recover=True, redact=["card_number", "scan"])
    def form_pay() -> tuple[dict[str, t.Any], int]:
        seen.append(("/form-pay", _sent()))
        crash_after_a_step(True)
        return {"ok": True}, 201

    @app.post("/schema-pay")
    @idem.idempotent(schema=CardSchema, lease=30, recover=True, redact=["card_number"])
    def schema_pay() -> tuple[dict[str, t.Any], int]:
        seen.append(("/schema-pay", dict(idem.payload)))
        crash_after_a_step(True)
        return {"ok": True}, 201

    @app.post("/wallet-pay")
    @idem.idempotent(schema=WalletSchema, lease=30, recover=True, redact=["owner_card.card_number"])
    def wallet_pay() -> tuple[dict[str, t.Any], int]:
        number = idem.payload["owner_card"]["card_number"]
        # The step's result under the attributes, the answer under the data keys.
        idem.step("received", lambda: {"owner_card": {"card_number": number}})
        return {"ownerCard": {"cardNumber": number, "amount": 1}}, 201

    @app.post("/one-time")
    @idem.idempotent(lease=30, recover=True, redact=["otp"], exclude=["otp"])
    def one_time() -> tuple[dict[str, t.Any], int]:
        seen.append(("/one-time", _sent()))
        crash_after_a_step(True)
        return {"ok": True}, 201

    @app.post("/plain")
    @idem.idempotent
    def plain() -> tuple[dict[str, t.Any], int]:
        seen.append(("/plain", _sent()))
        return {"ok": True}, 201

    @app.post("/optimistic")
    @idem.idempotent(optimistic=True)
    def optimistic() -> tuple[dict[str, t.Any], int]:
        seen.append(("/optimistic", _sent()))
        return {"ok": True}, 201

    with app.app_context():
        db.create_all()
    return RedactApp(app, db, idem, seen)
