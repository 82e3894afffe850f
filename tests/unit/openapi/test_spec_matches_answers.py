"""What the spec says a problem answer is, the server answers: the body of a real
422 (a reused key) and 400 (a missing key) validates against the schema the spec
documents for that status and media type, and its type is among those listed;
also for an app that answers the problems in its own envelope and tells the
plugin so (``media_type=``, ``schema=``)."""

from __future__ import annotations

import typing as t
from pathlib import Path

import jsonschema
from apiflask import APIFlask
from flask import Flask, jsonify
from flask.views import MethodView
from flask_smorest import Api, Blueprint
from flask_sqlalchemy import SQLAlchemy

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


def check(spec: dict[str, t.Any], answer: t.Any, slug: str) -> None:
    documented = response(operation(spec, "/orders", "post"), str(answer.status_code))
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
