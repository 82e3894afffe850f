"""What the spec says a problem answer is, the server answers: the body of a real
422 (a reused key) and 400 (a missing key) validates against the schema the spec
documents for that status and media type, and its type is among those listed;
also for an app that answers the problems in its own envelope and tells the
plugin so (``media_type=``, ``schema=``, and ``statuses=`` for the Stripe-like
example, which answers a reused key 400), for a form posted with a key field
of the wrong kind, and for the headers of a replayed 404."""

from __future__ import annotations

import typing as t
from pathlib import Path

import jsonschema
from apiflask import APIFlask
from apispec import APISpec
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask, jsonify
from flask.views import MethodView
from flask_smorest import Api, Blueprint
from flask_sqlalchemy import SQLAlchemy

from example_app import stripe_like
from flask_idempotency import Idempotency, ProblemError
from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import operation, response, valid

ENVELOPE = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}


def resolved(node: t.Any, spec: dict[str, t.Any]) -> t.Any:
    """``node`` with every ``$ref`` to a schema component replaced by the component."""
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].removeprefix("#/components/schemas/")
            return resolved(spec["components"]["schemas"][name], spec)
        return {key: resolved(value, spec) for key, value in node.items()}
    if isinstance(node, list):
        return [resolved(item, spec) for item in node]
    return node


def answers(app: Flask) -> tuple[t.Any, t.Any]:
    """A reused key's answer and a missing key's, on ``POST /orders``."""
    client = app.test_client()
    headers = {"Idempotency-Key": "order-1"}
    assert client.post("/orders", json={"sku": "tea"}, headers=headers).status_code == 201
    return (
        client.post("/orders", json={"sku": "coffee"}, headers=headers),
        client.post("/orders", json={"sku": "tea"}),
    )


def check(spec: dict[str, t.Any], answer: t.Any, slug: str, path: str = "/orders") -> None:
    documented = response(operation(spec, path, "post"), str(answer.status_code))
    assert PROBLEM_TYPE_BASE + slug in documented["x-problem-types"]
    schema = resolved(documented["content"][answer.mimetype]["schema"], spec)
    jsonschema.validate(answer.get_json(), schema)


def test_flask_smorests_problem_answers_are_what_its_spec_says(tmp_path: Path) -> None:
    app = Flask("smorest_orders")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'orders.db'}",
        API_TITLE="Orders",
        API_VERSION="1",
        OPENAPI_VERSION="3.1.0",
    )
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")
    api = Api(app, spec_kwargs={"extra_plugins": [IdempotencyPlugin(app)]})
    blp = Blueprint("orders", "orders")

    @blp.route("/orders")
    class Orders(MethodView):
        @idem.idempotent(required=True)
        @blp.response(201)
        def post(self) -> dict[str, str]:
            return {"status": "placed"}

    api.register_blueprint(blp)
    spec = valid(api.spec.to_dict())
    with app.app_context():
        db.create_all()
    reused, missing = answers(app)
    assert reused.mimetype == missing.mimetype == PROBLEM_JSON
    check(spec, reused, "key-reused")
    check(spec, missing, "missing-key")
    # The schema tells the types apart: another status's type is refused.
    documented = response(operation(spec, "/orders", "post"), "422")
    schema = resolved(documented["content"][PROBLEM_JSON]["schema"], spec)
    other = {**reused.get_json(), "type": PROBLEM_TYPE_BASE + "missing-key"}
    assert not jsonschema.Draft202012Validator(schema).is_valid(other)


def test_an_apps_own_envelope_is_documented_as_the_app_says(tmp_path: Path) -> None:
    app = APIFlask(
        "apiflask_orders",
        spec_plugins=[IdempotencyPlugin(media_type="application/json", schema=ENVELOPE)],
    )
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'orders.db'}")
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")

    @app.errorhandler(ProblemError)
    def stripe_like(problem: ProblemError) -> t.Any:
        return jsonify(error={"type": problem.slug, "message": problem.detail}), problem.code

    @app.post("/orders")
    @idem.idempotent(required=True)
    def place() -> tuple[dict[str, str], int]:
        return {"status": "placed"}, 201

    spec = valid(app.test_client().get("/openapi.json").get_json())
    with app.app_context():
        db.create_all()
    reused, missing = answers(app)
    assert reused.mimetype == missing.mimetype == "application/json"
    assert reused.get_json()["error"]["type"] == "key-reused"
    check(spec, reused, "key-reused")
    check(spec, missing, "missing-key")
    documented = response(operation(spec, "/orders", "post"), "422")
    assert list(documented["content"]) == ["application/json"]


#: The Stripe-like example's error envelope (example_app/stripe_like.py), as
#: docs/openapi.md documents it.
STRIPE_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {
                    "type": "string",
                    "enum": ["api_error", "idempotency_error", "invalid_request_error"],
                },
                "code": {"type": "string"},
                "param": {"type": "string"},
                "message": {"type": "string"},
                "doc_url": {"type": "string"},
            },
        }
    },
}


def test_the_stripe_like_examples_statuses_are_what_its_spec_says(tmp_path: Path) -> None:
    app = stripe_like.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'stripe.db'}",
            "IDEMPOTENCY_REQUIRED": True,
        }
    )
    plugin = IdempotencyPlugin(
        app, media_type="application/json", schema="StripeError", statuses={422: 400}
    )
    spec = APISpec("Stripe-like", "1", "3.1.0", plugins=[FlaskPlugin(), plugin])
    spec.components.schema("StripeError", STRIPE_ERROR)
    with app.test_request_context():
        spec.path(
            view=app.view_functions["stripe_like.create_charge"],
            app=app,
            operations={"post": {"responses": {"200": {"description": "The charge"}}}},
        )
    document = valid(spec.to_dict())
    post = operation(document, "/v1/charges", "post")
    assert sorted(post["responses"]) == ["200", "400", "409", "503"]

    client = app.test_client()
    auth = {"Authorization": "Bearer sk_test_acme"}
    keyed = {**auth, "Idempotency-Key": "order-1"}
    charge = {"amount": "1250", "currency": "eur"}
    assert client.post("/v1/charges", data=charge, headers=keyed).status_code == 200
    reused = client.post("/v1/charges", data={**charge, "amount": "99"}, headers=keyed)
    missing = client.post("/v1/charges", data=charge, headers=auth)
    assert reused.status_code == missing.status_code == 400
    assert reused.get_json()["error"]["code"] == "key-reused"
    assert missing.get_json()["error"]["code"] == "missing-key"
    check(document, reused, "key-reused", "/v1/charges")
    check(document, missing, "missing-key", "/v1/charges")


def form_app(tmp_path: Path, **config: t.Any) -> tuple[Flask, dict[str, t.Any]]:
    app = Flask("form_orders")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'orders.db'}", SECRET_KEY="s", **config
    )
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")

    @app.post("/orders")
    @idem.idempotent
    def place() -> tuple[dict[str, str], int]:
        """Place.
        ---
        post:
          responses:
            201: {description: placed}
        """
        return {"status": "placed"}, 201

    spec = APISpec("Orders", "1", "3.1.0", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=place, app=app)
    with app.app_context():
        db.create_all()
    return app, valid(spec.to_dict())


def test_a_form_keys_problems_are_listed(tmp_path: Path) -> None:
    app, spec = form_app(tmp_path)
    forged = app.test_client().post("/orders", data={"sku": "tea", "idempotency_key": "order-1"})
    assert forged.status_code == 400
    check(spec, forged, "form-key-invalid")
    assert (
        PROBLEM_TYPE_BASE + "form-key-expired"
        in response(operation(spec, "/orders", "post"), "400")["x-problem-types"]
    )


def test_an_app_without_form_keys_lists_none(tmp_path: Path) -> None:
    _, spec = form_app(tmp_path, IDEMPOTENCY_FORM_FIELD=None)
    listed = response(operation(spec, "/orders", "post"), "400")["x-problem-types"]
    assert not [uri for uri in listed if "form-key" in uri]


def test_a_replayed_answer_of_any_stored_status_has_its_headers_documented(
    tmp_path: Path,
) -> None:
    app = Flask("cancellations")
    app.config.update(SQLALCHEMY_DATABASE_URI=f"sqlite:///{tmp_path / 'orders.db'}")
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:1")

    @app.post("/orders/<int:order_id>/cancel")
    @idem.idempotent
    def cancel(order_id: int) -> tuple[dict[str, str], int]:
        """Cancel.
        ---
        post:
          parameters:
          - {name: order_id, in: path, required: true, schema: {type: integer}}
          responses:
            200: {description: cancelled}
            404: {description: no such order}
            409: {description: being shipped}
            default: {description: an error}
        """
        return {"error": "no such order"}, 404

    spec = APISpec("Orders", "1", "3.1.0", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=cancel, app=app)
    post = operation(valid(spec.to_dict()), "/orders/{order_id}/cancel", "post")
    with app.app_context():
        db.create_all()
    client = app.test_client()
    headers = {"Idempotency-Key": "cancel-1"}
    client.post("/orders/1/cancel", headers=headers)
    replay = client.post("/orders/1/cancel", headers=headers)
    assert replay.status_code == 404
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.headers["Idempotency-Key"] == "cancel-1"
    assert {"Idempotent-Replayed", "Idempotency-Key"} <= set(response(post, "404")["headers"])
    # Every answer to a keyed request echoes the key; an answer not stored
    # (a 409, transient) is never a replay.
    for status in ("200", "404", "409", "default"):
        assert "Idempotency-Key" in response(post, status)["headers"], status
    assert "Idempotent-Replayed" not in response(post, "409")["headers"]
    assert "Idempotent-Replayed" in response(post, "default")["headers"]
