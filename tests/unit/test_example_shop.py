"""The example shop's checkout (example_app/shop.py) through Flask's test client: what
its own code decides, on each engine. A real browser's cases are tests/browser's.

The shop renders its own page for a refused form key, to a browser only: fetch()
and API clients keep the extension's problem+json. A form refused for a wrong
field comes back with a new key and stores no order; another browser's order is
a 404.
"""

from __future__ import annotations

import re
import typing as t
from pathlib import Path

import pytest
from flask import Flask

from example_app import orders, shop
from tests.conftest import run_sql
from tests.support import pgbouncer

BROWSER = {"Accept": "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"}
KEY = re.compile(r'name="idempotency_key" value="([^"]+)"')


@pytest.fixture
def app(database_url: str, tmp_path: Path) -> t.Iterator[Flask]:
    app = shop.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": database_url,
            **pgbouncer.declared(database_url),
            "SECRET_KEY": "shop-tests",
            "EXAMPLE_BROKER_FOLDER": str(tmp_path / "broker"),
        }
    )
    with app.app_context():
        orders.db.drop_all()
        orders.db.create_all()
    yield app
    app.config["IDEMPOTENCY_PUBLISHER"].close()
    with app.app_context():
        orders.db.engine.dispose()


def orders_placed(database_url: str) -> int:
    return int(run_sql(database_url, "SELECT count(*) FROM orders")[0][0])


def rendered_key(client: t.Any) -> str:
    page = client.get("/shop/checkout", headers=BROWSER)
    assert page.status_code == 200
    found = KEY.search(page.get_data(as_text=True))
    assert found, page.get_data(as_text=True)
    return found.group(1)


def checkout(client: t.Any, key: str, quantity: str = "1", **headers: str) -> t.Any:
    form = {"idempotency_key": key, "product": "mug", "quantity": quantity}
    return client.post("/shop/checkout", data=form, headers=headers or BROWSER)


def test_a_refused_form_key_is_the_shops_page_for_a_browser_only(
    app: Flask, database_url: str
) -> None:
    client = app.test_client()
    key = rendered_key(client)
    # The signature's first character changed: the token's shape, a bad signature.
    forged = key[:-27] + ("A" if key[-27] != "A" else "B") + key[-26:]
    page = checkout(client, forged)
    assert (page.status_code, page.mimetype) == (400, "text/html")
    assert "Open a fresh checkout" in page.get_data(as_text=True)
    problem = checkout(client, forged, Accept="application/json")
    assert (problem.status_code, problem.mimetype) == (400, "application/problem+json")
    assert problem.get_json()["type"].endswith("/form-key-invalid")
    answer = client.post(
        "/shop/api/orders",
        json={"product": "mug", "quantity": 1},
        headers={"Idempotency-Key": forged},
    )
    assert (answer.status_code, answer.mimetype) == (400, "application/problem+json")
    assert orders_placed(database_url) == 0


def test_another_browsers_form_is_refused_and_its_order_is_a_404(
    app: Flask, database_url: str
) -> None:
    mine, theirs = app.test_client(), app.test_client()
    key = rendered_key(mine)
    refused = checkout(theirs, key)
    assert refused.status_code == 400
    assert "opened in another session" in refused.get_data(as_text=True)
    assert orders_placed(database_url) == 0
    placed = checkout(mine, key)
    assert placed.status_code == 303
    assert checkout(mine, key).headers["Location"] == placed.headers["Location"]  # replayed
    assert mine.get(placed.headers["Location"]).status_code == 200
    assert theirs.get(placed.headers["Location"]).status_code == 404
    assert orders_placed(database_url) == 1


def test_a_wrong_field_comes_back_with_a_new_key_and_no_order(
    app: Flask, database_url: str
) -> None:
    client = app.test_client()
    key = rendered_key(client)
    refused = checkout(client, key, quantity="eleven")
    assert refused.status_code == 422
    body = refused.get_data(as_text=True)
    assert 'id="quantity-error"' in body
    found = KEY.search(body)
    assert found
    assert found.group(1) != key
    assert orders_placed(database_url) == 0
    assert checkout(client, found.group(1), quantity="3").status_code == 303
    row = run_sql(database_url, "SELECT amount, tenant FROM orders")
    assert [tuple(r) for r in row] == [(3 * shop.PRODUCTS["mug"][1], shop.SHOP_TENANT)]
