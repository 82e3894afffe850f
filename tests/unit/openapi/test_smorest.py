"""flask-smorest's spec with the plugin on (``spec_kwargs={"extra_plugins": [...]}``):
function views and MethodViews (the decorator in the class's ``decorators`` or on a
method), each protected operation documented and no other, the app's own
responses kept, the spec valid as OpenAPI 3.0 and 3.1."""

from __future__ import annotations

import typing as t

import pytest
from flask import Flask
from flask.views import MethodView
from flask_smorest import Api, Blueprint
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import (
    assert_protected,
    assert_unprotected,
    operation,
    problem_types,
    response,
    valid,
)


class OrderSchema(Schema):
    sku = fields.String(required=True)
    quantity = fields.Integer(required=True)


def make_app(openapi_version: str = "3.0.3", **config: t.Any) -> tuple[Api, Idempotency]:
    app = Flask("smorest_shop")
    app.config.update(
        SQLALCHEMY_DATABASE_URI="sqlite://",
        API_TITLE="Shop",
        API_VERSION="1",
        OPENAPI_VERSION=openapi_version,
        **config,
    )
    db = SQLAlchemy(app)
    idem = Idempotency(app, db)
    api = Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})
    return api, idem


def shop(openapi_version: str = "3.0.3", **config: t.Any) -> dict[str, t.Any]:
    """A shop's spec: orders (a MethodView, protected by its ``decorators``),
    payments (a MethodView whose ``post`` alone is decorated), refunds (a leased
    function view), notes (undecorated) and a health check."""
    api, idem = make_app(openapi_version, **config)
    blp = Blueprint("orders", "orders", url_prefix="/orders")

    @blp.route("/")
    class Orders(MethodView):
        decorators = [idem.idempotent(required=True, key_format="uuid", ttl=3600)]

        @blp.response(200, OrderSchema(many=True))
        def get(self) -> list[dict[str, t.Any]]:
            return []

        @blp.arguments(OrderSchema)
        @blp.response(201, OrderSchema)
        @blp.alt_response(409, description="Out of stock")
        def post(self, order: dict[str, t.Any]) -> dict[str, t.Any]:
            return order

    @blp.route("/<int:order_id>/payments")
    class Payments(MethodView):
        @blp.response(200, OrderSchema)
        def get(self, order_id: int) -> dict[str, t.Any]:
            return {}

        @idem.idempotent(key_max_length=64, schema=OrderSchema)
        @blp.response(201, OrderSchema)
        def post(self, order_id: int) -> dict[str, t.Any]:
            return {}

    @blp.route("/<int:order_id>/refunds", methods=["POST"])
    @idem.idempotent(lease=30, ttl=600, key_format=r"[a-z]{3}-\d+")
    @blp.response(202, OrderSchema)
    def refund(order_id: int) -> dict[str, t.Any]:
        return {}

    @blp.route("/<int:order_id>/notes", methods=["POST"])
    @blp.response(201, OrderSchema)
    def note(order_id: int) -> dict[str, t.Any]:
        return {}

    @blp.route("/health", methods=["GET"])
    @blp.response(200)
    def health() -> dict[str, t.Any]:
        return {}

    api.register_blueprint(blp)
    return valid(api.spec.to_dict())


@pytest.mark.parametrize("version", ["3.0.3", "3.1.0"])
def test_each_protected_operation_shows_the_key_problems_and_expiry(version: str) -> None:
    spec = shop(version)
    orders = assert_protected(
        spec, "/orders/", "post", required=True, uuid=True, ttl_seconds=3600, success="201"
    )
    assert orders["key_format"] == "uuid"
    assert "lease_seconds" not in orders
    payments = assert_protected(
        spec,
        "/orders/{order_id}/payments",
        "post",
        required=False,
        max_length=64,
        ttl_seconds=86400,
        success="201",
    )
    assert payments["key_format"] is None
    # The route's schema loads the body for its fingerprint: it may refuse it.
    assert problem_types(operation(spec, "/orders/{order_id}/payments", "post"), "422") == [
        "key-reused",
        "validation-failed",
    ]
    refunds = assert_protected(
        spec,
        "/orders/{order_id}/refunds",
        "post",
        required=False,
        pattern=r"[a-z]{3}-\d+",
        ttl_seconds=600,
        success="202",
    )
    assert refunds["key_format"] == "regex"
    assert refunds["key_pattern"] == r"[a-z]{3}-\d+"
    # A leased route: its lease, and that an operation that may have happened is
    # kept past the ttl until it is settled.
    assert refunds["lease_seconds"] == 30
    assert "live lease" in refunds["expiry"]
    assert "lease_seconds" in refunds["expiry"]
    assert spec["components"]["schemas"]["IdempotencyProblem"]["required"] == [
        "type",
        "title",
        "status",
    ]


def test_safe_methods_and_undecorated_views_show_nothing() -> None:
    spec = shop()
    assert_unprotected(spec, "/orders/", "get")  # under the class's decorators
    assert_unprotected(spec, "/orders/{order_id}/payments", "get")  # its post alone decorated
    assert_unprotected(spec, "/orders/{order_id}/notes", "post")
    assert_unprotected(spec, "/orders/health", "get")


def test_the_apps_own_responses_are_kept_beside_the_problems() -> None:
    post = operation(shop(), "/orders/", "post")
    conflict = response(post, "409")
    assert conflict["description"] == "Out of stock"
    assert PROBLEM_JSON in conflict["content"]
    # flask-smorest's shared 422 (a body its arguments refuse) stays, as a copy
    # that lists key-reused beside it.
    unprocessable = response(post, "422")
    assert unprocessable["description"] == "Unprocessable Entity"
    assert unprocessable["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"
    }
    assert problem_types(post, "422") == ["key-reused"]


def test_the_apps_settings_name_the_header_and_its_defaults() -> None:
    spec = shop(
        IDEMPOTENCY_HEADER="X-Request-Key",
        IDEMPOTENCY_REQUIRED=True,
        IDEMPOTENCY_KEY_MAX_LENGTH=40,
        IDEMPOTENCY_TTL=120,
    )
    assert_protected(
        spec,
        "/orders/{order_id}/payments",
        "post",
        header="X-Request-Key",
        required=True,
        max_length=64,  # the route's own
        ttl_seconds=120,
        success="201",
    )
    assert_protected(
        spec,
        "/orders/{order_id}/refunds",
        "post",
        header="X-Request-Key",
        required=True,
        max_length=40,
        pattern=r"[a-z]{3}-\d+",
        ttl_seconds=600,
        success="202",
    )


def test_a_spec_without_protected_operations_has_no_problem_schema() -> None:
    api, _ = make_app()
    blp = Blueprint("plain", "plain")

    @blp.route("/notes", methods=["POST"])
    @blp.response(201)
    def note() -> dict[str, t.Any]:
        return {}

    api.register_blueprint(blp)
    spec = valid(api.spec.to_dict())
    assert "IdempotencyProblem" not in spec.get("components", {}).get("schemas", {})
    assert_unprotected(spec, "/notes", "post")


def test_openapi_2_is_refused() -> None:
    with pytest.raises(ValueError, match=r"OpenAPI 3\.0 and 3\.1"):
        make_app("2.0")
