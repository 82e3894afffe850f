"""APIFlask's spec with the plugin on (``APIFlask(..., spec_plugins=[IdempotencyPlugin()])``):
served at ``/openapi.json`` and built by ``app.spec`` in an app context; each
protected operation documented and no other (APIFlask registers one rule per
method, so the plugin finds the view by path and method); valid as OpenAPI 3.0 and
3.1."""

from __future__ import annotations

import typing as t

import pytest
from apiflask import APIFlask, Schema
from apiflask.fields import Integer, String
from flask.views import MethodView
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import assert_protected, assert_unprotected, valid


class PaymentIn(Schema):
    amount = Integer(required=True)
    currency = String(required=True)


class PaymentOut(Schema):
    id = Integer()
    amount = Integer()


def make_app(openapi_version: str = "3.0.3") -> APIFlask:
    app = APIFlask("apiflask_shop", spec_plugins=[IdempotencyPlugin()])
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", OPENAPI_VERSION=openapi_version)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db)

    @app.get("/payments")
    @app.output(PaymentOut(many=True))
    def payments() -> list[dict[str, t.Any]]:
        return []

    @app.post("/payments")
    @idem.idempotent(required=True, ttl=900, key_format="uuid4")
    @app.input(PaymentIn)
    @app.output(PaymentOut, status_code=201)
    def pay(json_data: dict[str, t.Any]) -> dict[str, t.Any]:
        return {"id": 1, **json_data}

    @app.put("/payments/<int:payment_id>")
    @app.input(PaymentIn)
    @app.output(PaymentOut)
    def replace(payment_id: int, json_data: dict[str, t.Any]) -> dict[str, t.Any]:
        return {"id": payment_id}

    class Carts(MethodView):
        decorators = [idem.idempotent(ttl=60)]

        @app.output(PaymentOut)
        def get(self) -> dict[str, t.Any]:
            return {}

        @app.output(PaymentOut, status_code=201)
        def post(self) -> dict[str, t.Any]:
            return {}

    app.add_url_rule("/carts", view_func=Carts.as_view("carts"))

    class Wallets(MethodView):
        @app.output(PaymentOut)
        def get(self) -> dict[str, t.Any]:
            return {}

        @idem.idempotent(key_format=r"w-[0-9]+", key_max_length=20)
        @app.output(PaymentOut, status_code=201)
        def post(self) -> dict[str, t.Any]:
            return {}

    app.add_url_rule("/wallets", view_func=Wallets.as_view("wallets"))
    return app


@pytest.mark.parametrize("version", ["3.0.3", "3.1.0"])
def test_the_served_spec_shows_each_protected_operation(version: str) -> None:
    app = make_app(version)
    spec = valid(app.test_client().get("/openapi.json").get_json())
    assert spec["openapi"] == version
    payments = assert_protected(
        spec, "/payments", "post", required=True, uuid=True, ttl_seconds=900, success="201"
    )
    assert payments["key_format"] == "uuid4"
    assert_protected(spec, "/carts", "post", required=False, ttl_seconds=60, success="201")
    assert_unprotected(spec, "/payments", "get")
    assert_unprotected(spec, "/payments/{payment_id}", "put")
    assert_unprotected(spec, "/carts", "get")
    # A MethodView whose post alone is decorated.
    assert_protected(
        spec,
        "/wallets",
        "post",
        required=False,
        pattern="w-[0-9]+",
        max_length=20,
        ttl_seconds=86400,
        success="201",
    )
    assert_unprotected(spec, "/wallets", "get")


def test_app_spec_in_an_app_context_and_outside_one() -> None:
    app = make_app()
    with app.app_context():
        spec = valid(t.cast(dict[str, t.Any], app.spec))
    assert_protected(
        spec, "/payments", "post", required=True, uuid=True, ttl_seconds=900, success="201"
    )
    # Without an app given, the plugin documents the current app: outside any
    # context there is none, and it says how to give one.
    with pytest.raises(RuntimeError, match=r"IdempotencyPlugin\(app\)"):
        app.spec  # noqa: B018
