"""Components an operation refers to: a shared parameter for the key's header is
the app's own (no second one of the plugin's: a duplicate is an invalid spec),
and a shared response gets the operation's idempotency as a copy, even one
registered after ``spec.path()`` (apispec allows it; the plugin finishes the
operation when the spec is rendered)."""

from __future__ import annotations

import typing as t

import pytest
from apispec import APISpec
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import operation, problem_types, response, valid

KEY = {"name": "Idempotency-Key", "required": True, "schema": {"type": "string", "format": "uuid"}}
CONFLICT = {
    "description": "Out of stock",
    "content": {"application/json": {"schema": {"type": "object"}}},
}


def shop(docstring: str) -> tuple[APISpec, t.Callable[[], None]]:
    """A spec and the function that documents ``POST /orders`` (``docstring``) in it."""
    app = Flask("components")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://")
    idem = Idempotency(app, SQLAlchemy(app))

    @app.post("/orders")
    @idem.idempotent
    def place() -> dict[str, str]:
        return {}

    place.__doc__ = docstring
    spec = APISpec("Shop", "1", "3.1.0", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])

    def document() -> None:
        with app.test_request_context():
            spec.path(view=place, app=app)

    return spec, document


WITH_KEY = """Place.
---
post:
  parameters:
  - IdemKey
  responses:
    201: {description: placed}
"""


@pytest.mark.parametrize("registered", ["before", "after"])
def test_a_shared_parameter_for_the_key_is_kept_alone(registered: str) -> None:
    spec, document = shop(WITH_KEY)
    if registered == "before":
        spec.components.parameter("IdemKey", "header", KEY)
    document()
    if registered == "after":
        spec.components.parameter("IdemKey", "header", KEY)
    op = operation(valid(spec.to_dict()), "/orders", "post")
    assert op["parameters"] == [{"$ref": "#/components/parameters/IdemKey"}]
    assert spec.to_dict()["components"]["parameters"]["IdemKey"]["schema"]["format"] == "uuid"


def test_a_shared_parameter_for_another_header_keeps_the_plugins() -> None:
    spec, document = shop(WITH_KEY)
    document()
    spec.components.parameter("IdemKey", "header", {**KEY, "name": "X-Tenant"})
    op = operation(valid(spec.to_dict()), "/orders", "post")
    assert [p.get("name", p.get("$ref")) for p in op["parameters"]] == [
        "#/components/parameters/IdemKey",
        "Idempotency-Key",
    ]


@pytest.mark.parametrize("registered", ["before", "after"])
def test_a_shared_response_becomes_the_operations_copy_with_its_problems(
    registered: str,
) -> None:
    spec, document = shop(
        "Place.\n---\npost:\n  responses:\n    201: {description: placed}\n    409: Conflict\n"
    )
    if registered == "before":
        spec.components.response("Conflict", CONFLICT)
    document()
    if registered == "after":
        spec.components.response("Conflict", CONFLICT)
    rendered = valid(spec.to_dict())
    op = operation(rendered, "/orders", "post")
    conflict = response(op, "409")
    assert conflict["description"] == "Out of stock"
    assert list(conflict["content"]) == ["application/json", PROBLEM_JSON]
    assert problem_types(op, "409") == ["request-in-progress", "transaction-conflict", "lease-lost"]
    assert {"Retry-After", "Idempotency-Key"} <= set(conflict["headers"])
    # The shared component itself is as the app registered it.
    assert rendered["components"]["responses"]["Conflict"] == CONFLICT
    assert "IdempotencyProblem" in rendered["components"]["schemas"]
    # Rendered again: the same document.
    assert spec.to_dict() == rendered
