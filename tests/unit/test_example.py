"""The example app: what its database cannot store is 422, and every read is its caller's.

Before, a NUL character or an amount over 2**31 reached PostgreSQL and the
client got an HTML 500; on SQLite the same request was stored, so the two
engines disagreed. And every order and charge was readable by anyone: the
order service's reads ignored the tenant, the payments service had one scope
for all its callers (a second caller's key replayed the first's charge). Each
case runs the example on each engine and counts ledger rows, orders, records
and shipments, not only status codes.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from werkzeug.serving import make_server

from example_app import app as example
from example_app import broker, orders, shipping
from tests.conftest import direct_postgres_url, run_sql
from tests.support import pgbouncer
from tests.support.live import ROOT

CHARGE = {"customer_id": "cus_1", "amount": 1250, "currency": "EUR"}
MERCHANT = "shop-1"


@pytest.fixture
def app(database_url: str) -> t.Iterator[Flask]:
    app = example.create_app(
        {"SQLALCHEMY_DATABASE_URI": database_url, **pgbouncer.declared(database_url)}
    )
    with app.app_context():
        # The tests' own app has a different "ledger" table in the same database.
        example.db.drop_all()
        example.db.create_all()
    yield app
    with app.app_context():
        example.db.engine.dispose()


def post(
    app: Flask, body: dict[str, t.Any], key: str | None = None, merchant: str | None = MERCHANT
) -> t.Any:
    headers = {"Idempotency-Key": key or str(uuid.uuid4())}
    if merchant is not None:
        headers["X-Merchant"] = merchant
    return app.test_client().post("/payments", json=body, headers=headers)


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
    # The probe names the cause: the record table is gone (create-tables makes it).
    assert not_ready.get_json()["database"] == "missing_table"


# -- every read is its caller's ------------------------------------------------------------


def test_a_charge_is_its_merchants_own(app: Flask) -> None:
    """Before, one scope served every caller: shop-b's request with shop-a's key
    was answered shop-a's charge (customer, amount), and anyone read the ledger."""
    first = post(app, CHARGE, "same-key", merchant="shop-a")
    second = post(app, {**CHARGE, "customer_id": "cus_b"}, "same-key", merchant="shop-b")
    assert (first.status_code, second.status_code) == (201, 201)
    assert "Idempotent-Replayed" not in second.headers
    assert second.get_json()["customer_id"] == "cus_b"
    ledger, records = stored(app)
    assert sorted((r["merchant"], r["customer_id"]) for r in ledger) == [
        ("shop-a", "cus_1"),
        ("shop-b", "cus_b"),
    ]
    assert records == 2
    client = app.test_client()
    mine = first.get_json()["charge_id"]
    as_a, as_b = {"X-Merchant": "shop-a"}, {"X-Merchant": "shop-b"}
    assert client.get(f"/payments/{mine}", headers=as_a).get_json() == first.get_json()
    theirs = client.get(f"/payments/{mine}", headers=as_b)
    assert theirs.status_code == 404
    assert theirs.content_type == "application/problem+json"
    assert [
        e["customer_id"] for e in client.get("/ledger", headers=as_b).get_json()["entries"]
    ] == ["cus_b"]


def test_a_caller_without_a_merchant_is_refused_and_nothing_is_stored(app: Flask) -> None:
    refused = post(app, CHARGE, merchant=None)
    assert refused.status_code == 401
    assert refused.content_type == "application/problem+json"
    assert "X-Merchant" in refused.get_json()["detail"]
    assert stored(app) == ([], 0)
    assert post(app, CHARGE).status_code == 201
    client = app.test_client()
    for path in ("/ledger", "/payments/1"):
        anonymous = client.get(path)
        assert anonymous.status_code == 401, path
        assert anonymous.content_type == "application/problem+json"


@pytest.fixture
def order_service(database_url: str, tmp_path: Path) -> t.Iterator[Flask]:
    """The order service on the engine under test, charging at a real payments
    service (HTTP, on a SQLite file of its own)."""
    payments = example.create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'pay.db'}"})
    server = make_server("127.0.0.1", 0, payments, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    app = orders.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": database_url,
            **pgbouncer.declared(database_url),
            "PAYMENTS_URL": f"http://127.0.0.1:{server.server_port}",
            "EXAMPLE_BROKER_FOLDER": str(tmp_path / "broker"),
        }
    )
    with app.app_context():
        orders.db.drop_all()
        orders.db.create_all()
    app.extensions["example_payments"] = payments
    yield app
    server.shutdown()
    thread.join(10)
    app.config["IDEMPOTENCY_PUBLISHER"].close()
    for each, db in ((app, orders.db), (payments, example.db)):
        with each.app_context():
            db.engine.dispose()


ORDER = {"customer_id": "cus_1", "amount": 990, "currency": "EUR"}


def test_an_order_is_its_tenants_own(order_service: Flask) -> None:
    """Before, GET /orders/<id> and GET /orders answered any caller, with
    another tenant's orders (or none at all: no X-Tenant)."""
    client = order_service.test_client()
    acme, globex = {"X-Tenant": "acme"}, {"X-Tenant": "globex"}
    placed = {
        name: client.post("/orders", json=ORDER, headers={**who, "Idempotency-Key": "k-1"})
        for name, who in (("acme", acme), ("globex", globex))
    }
    assert [r.status_code for r in placed.values()] == [201, 201]
    ids = {name: r.get_json()["order_id"] for name, r in placed.items()}
    with order_service.app_context():
        rows = orders.db.session.execute(sa.select(orders.Order.id, orders.Order.tenant)).all()
    assert sorted((tenant, i) for i, tenant in rows) == sorted((name, i) for name, i in ids.items())
    own = client.get(f"/orders/{ids['acme']}", headers=acme)
    assert own.status_code == 200
    assert own.get_json()["tenant"] == "acme"
    other = client.get(f"/orders/{ids['acme']}", headers=globex)
    assert other.status_code == 404
    assert other.content_type == "application/problem+json"
    listed = client.get("/orders", headers=globex).get_json()
    assert [o["order_id"] for o in listed["orders"]] == [ids["globex"]]
    for path in ("/orders", f"/orders/{ids['acme']}"):
        assert client.get(path).status_code == 401, path
    # One charge per tenant at the payments service, under the order service's merchant.
    payments = order_service.extensions["example_payments"]
    with payments.app_context(), example.db.engine.connect() as conn:
        merchants = conn.execute(sa.select(example.LedgerEntry.merchant)).scalars().all()
    assert merchants == ["orders", "orders"]


def test_a_message_that_is_no_order_created_event_is_rejected_not_redelivered(
    tmp_path: Path,
) -> None:
    """Before, a delivery without a message id, or with another shape, raised in
    the consumer: the consumer stopped, and the broker delivered the same
    message again to the next one, for ever."""
    tag = uuid.uuid4().hex[:8]
    app = shipping.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'shipping.db'}",
            "EXAMPLE_BROKER_URL": "memory://",
            "EXAMPLE_EXCHANGE": f"orders-{tag}",
            "EXAMPLE_SHIPPING_QUEUE": f"shipping-{tag}",
        }
    )
    with broker.connection(app) as conn:
        queue = broker.shipping_queue(app)(conn.channel())
        queue.declare()
        producer = conn.Producer(serializer="json")
        sends: list[tuple[dict[str, t.Any], str | None]] = [
            ({"order_id": 1, "tenant": "acme"}, None),  # no message id
            ({"note": "not an order"}, "ev-2"),
            ({"order_id": 3, "tenant": "acme"}, "ev-3"),
        ]
        for body, message_id in sends:
            extra = {"message_id": message_id} if message_id else {}
            producer.publish(
                body, exchange=queue.exchange, routing_key=broker.ORDER_CREATED, **extra
            )
    done = shipping.consume(app, idle=0.5)
    assert (done.shipped, done.skipped, done.rejected) == (1, 0, 2)
    assert shipping.consume(app, idle=0.3) == shipping.Consumed()  # nothing comes back
    with app.app_context():
        shipped = shipping.db.session.execute(
            sa.select(shipping.Shipment.order_id, shipping.Shipment.tenant)
        ).all()
        shipping.db.engine.dispose()
    assert [tuple(r) for r in shipped] == [(3, "acme")]
    broker.delete_queue(app)


# -- database URLs name their driver ---------------------------------------------------------

#: A URL whose scheme names no driver: SQLAlchemy picks one (psycopg 3 for a plain
#: postgresql:// under SQLAlchemy 2.1), which the installed extra may not provide.
DRIVERLESS = re.compile(r"\b(?:postgres|postgresql|mysql|mariadb)://")


def test_every_database_url_of_the_example_and_its_docs_names_its_driver() -> None:
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "example_app").glob("*.py")}
    for doc in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = doc.read_text()
        for number, block in enumerate(re.findall(r"^```\S*\n(.*?)^```", text, re.S | re.M)):
            texts[f"{doc.relative_to(ROOT)} block {number}"] = block
    found = {name: DRIVERLESS.findall(text) for name, text in texts.items()}
    assert {name: urls for name, urls in found.items() if urls} == {}


def test_the_fail_fast_settings_reach_postgresql_through_each_driver(pg_url: str) -> None:
    """The example's engine options are libpq parameters: psycopg2 and psycopg 3
    (``pg_url`` is each in turn) both pass them, so the server applies the
    statement timeout either way."""
    if pgbouncer.is_pooled(pg_url):
        pytest.skip(
            "not applicable behind a transaction pooler: the statement timeout is not a"
            " connection's option there (see the test after this one)"
        )
    engine = sa.create_engine(pg_url, **example.engine_options(pg_url))
    try:
        with engine.connect() as conn:
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar_one() == "15s"
    finally:
        engine.dispose()


def test_behind_a_transaction_pooler_each_transaction_has_the_statement_timeout(
    pg_url: str,
) -> None:
    """Declared behind a transaction pooler (EXAMPLE_DATABASE_POOLER), the example
    sends no ``options`` (PgBouncer refuses them) and sets its statement timeout
    in each transaction, where it ends with it: a session after it, on the same
    server connection, has the server's own."""
    app = example.create_app(
        {"SQLALCHEMY_DATABASE_URI": pg_url, "IDEMPOTENCY_DATABASE_POOLER": "transaction"}
    )
    options = app.config["SQLALCHEMY_ENGINE_OPTIONS"]
    assert "options" not in options["connect_args"]
    assert options["connect_args"]["keepalives"] == 1  # the client's own side stays
    if sa.make_url(pg_url).get_driver_name() == "psycopg":
        assert options["connect_args"]["prepare_threshold"] is None
    show = sa.text("SHOW statement_timeout")
    server_default = run_sql(direct_postgres_url(), "SHOW statement_timeout")[0][0]
    assert server_default != "15s"
    try:
        with app.app_context():
            assert example.db.session.execute(show).scalar_one() == "15s"
            example.db.session.rollback()
            with example.db.engine.connect() as conn:
                conn.exec_driver_sql("COMMIT")  # out of the transaction, on the same connection
                assert conn.execute(show).scalar_one() == server_default
                conn.rollback()
    finally:
        with app.app_context():
            example.db.engine.dispose()


@pytest.mark.parametrize("ident", [str(2**31 - 1), str(2**31), str(2**63), "99999999999999999999"])
def test_an_id_past_any_row_is_a_404_problem(app: Flask, order_service: Flask, ident: str) -> None:
    """Before, an id past the id column was a 500: SQLite cannot bind one past 64
    bits (OverflowError), psycopg 3 one past 32 (integer out of range)."""
    for service, path, who in (
        (app, "/payments/", {"X-Merchant": MERCHANT}),
        (order_service, "/orders/", {"X-Tenant": "acme"}),
    ):
        response = service.test_client().get(path + ident, headers=who)
        assert response.status_code == 404, (path, response.get_data(as_text=True))
        assert response.content_type == "application/problem+json"


@pytest.mark.parametrize(
    ("target", "variable"),
    [
        ("example_app", "EXAMPLE_DATABASE_URL"),
        ("example_app.orders:create_app()", "EXAMPLE_ORDERS_DATABASE_URL"),
        ("example_app.shipping:create_app()", "EXAMPLE_SHIPPING_DATABASE_URL"),
    ],
)
def test_the_cli_with_the_database_down_exits_69_in_one_line(
    tmp_path: Path, target: str, variable: str
) -> None:
    """Before, create_app()'s db.create_all() failed the app's import: every
    ``flask --app example_app idempotency ...`` exited 1 with a traceback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = f"postgresql+psycopg2://postgres@127.0.0.1:{port}/x"
    done = subprocess.run(
        [sys.executable, "-m", "flask", "--app", target, "idempotency", "stats"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), variable: down},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 69, done.stderr
    assert "Traceback" not in done.stderr
    *log, error = done.stderr.strip().splitlines()
    assert error.startswith("Error: the database"), error
    assert "is unavailable" in error, error
    assert [line for line in log if "tables not created" in line], log
