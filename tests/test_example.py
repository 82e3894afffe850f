"""The example app refuses, with 422, what its database cannot store.

Before, a NUL character or an amount over 2**31 reached PostgreSQL and the
client got an HTML 500; on SQLite the same request was stored, so the two
engines disagreed. Each case runs the example app on PostgreSQL and SQLite and
counts ledger rows and records, not only status codes.
"""

from __future__ import annotations

import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask

from example_app import app as example

CHARGE = {"customer_id": "cus_1", "amount": 1250, "currency": "EUR"}


@pytest.fixture
def app(database_url: str) -> t.Iterator[Flask]:
    app = example.create_app({"SQLALCHEMY_DATABASE_URI": database_url})
    with app.app_context():
        # The tests' own app has a different "ledger" table in the same database.
        example.db.drop_all()
        example.db.create_all()
    yield app
    with app.app_context():
        example.db.engine.dispose()


def post(app: Flask, body: dict[str, t.Any], key: str | None = None) -> t.Any:
    return app.test_client().post(
        "/payments", json=body, headers={"Idempotency-Key": key or str(uuid.uuid4())}
    )


def stored(app: Flask) -> tuple[list[dict[str, t.Any]], int]:
    """(ledger rows, number of idempotency records), read on a fresh connection."""
    with app.app_context(), example.db.engine.connect() as conn:
        ledger = [dict(r._mapping) for r in conn.execute(sa.select(example.LedgerEntry.__table__))]
        records = conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one()
    return ledger, int(records)


REFUSED = {
    "NUL in customer_id": ({"customer_id": "cus\x00evil"}, "customer_id"),
    "NUL in description": ({"description": "a\x00b"}, "description"),
    "amount 2**31": ({"amount": 2**31}, "amount"),
    "amount 2**63": ({"amount": 2**63}, "amount"),
    "amount as a string over 2**31": ({"amount": str(2**31)}, "amount"),
    "fractional amount": ({"amount": 12.5}, "amount"),
    "customer_id over 64 characters": ({"customer_id": "c" * 65}, "customer_id"),
    "description over 200 characters": ({"description": "d" * 201}, "description"),
}


@pytest.mark.parametrize("change", list(REFUSED.values()), ids=list(REFUSED))
def test_what_the_database_cannot_store_is_422_and_nothing_is_stored(
    app: Flask, change: tuple[dict[str, t.Any], str]
) -> None:
    fields, field = change
    response = post(app, {**CHARGE, **fields})
    assert response.status_code == 422, response.data[:300]
    assert response.content_type == "application/problem+json"
    problem = response.get_json()
    assert problem["type"].endswith("/validation-failed")
    assert field in problem["errors"]
    assert stored(app) == ([], 0)


def test_a_lone_surrogate_is_refused_before_the_schema(app: Flask) -> None:
    """Not text at all: the extension's body reader answers 400 before the
    example's schema (which refuses it too, for bodies that reach it otherwise)."""
    response = post(app, {**CHARGE, "description": "caf\ud800"})
    assert response.status_code == 400, response.data[:300]
    assert response.get_json()["type"].endswith("/malformed-body")
    assert stored(app) == ([], 0)


def test_the_limits_are_the_columns_own(app: Flask) -> None:
    """The largest values the schema accepts are stored and read back unchanged,
    on both engines: the limits are not stricter than the columns either."""
    body = {
        "customer_id": "é" * 64,  # 64 characters, 128 bytes in UTF-8
        "amount": 2**31 - 1,
        "currency": "EUR",
        "description": "ü" * 200,
    }
    response = post(app, body)
    assert response.status_code == 201, response.data[:300]
    [row], records = stored(app)
    assert records == 1
    assert (row["customer_id"], row["amount"], row["description"]) == (
        body["customer_id"],
        2**31 - 1,
        body["description"],
    )


def test_number_spellings_of_a_whole_amount_are_one_charge(app: Flask) -> None:
    key = str(uuid.uuid4())
    first = post(app, {**CHARGE, "amount": 1250}, key)
    again = [post(app, {**CHARGE, "amount": a}, key) for a in ("1250", 1250.0)]
    assert first.status_code == 201
    assert [r.status_code for r in again] == [201, 201]
    assert all(r.headers["Idempotent-Replayed"] == "true" for r in again)
    ledger, records = stored(app)
    assert [r["amount"] for r in ledger] == [1250]
    assert records == 1


def test_liveness_does_not_touch_the_database_and_readiness_does(app: Flask) -> None:
    client = app.test_client()
    assert client.get("/healthz").get_json() == {"alive": True}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.get_json()["ready"] is True
    with app.app_context():
        example.db.session.execute(sa.text("DROP TABLE idempotency_keys"))
        example.db.session.commit()
    assert client.get("/healthz").status_code == 200
    not_ready = client.get("/readyz")
    assert not_ready.status_code == 503
    assert not_ready.content_type == "application/problem+json"
    assert not_ready.get_json()["database"] == "error"
