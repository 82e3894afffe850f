"""Plain apispec with its ``FlaskPlugin``: ``spec.path(view=..., app=app)`` documents
a view from its docstring, and the plugin adds the idempotency of the protected
methods among them."""

from __future__ import annotations

from apispec import APISpec
from apispec.ext.marshmallow import MarshmallowPlugin
from apispec_webframeworks.flask import FlaskPlugin
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency.openapi import IdempotencyPlugin
from tests.unit.openapi.checks import assert_protected, assert_unprotected, valid


def test_a_docstring_documented_view_gets_its_protection() -> None:
    app = Flask("apispec_shop")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://", IDEMPOTENCY_REQUIRED=True)
    db = SQLAlchemy(app)
    idem = Idempotency(app, db)

    @app.route("/transfers", methods=["GET", "POST"])
    @idem.idempotent(ttl=300)
    def transfers() -> dict[str, str]:
        """Transfers.
        ---
        get:
          responses:
            200:
              description: the transfers
        post:
          responses:
            201:
              description: the transfer made
        """
        return {}

    spec = APISpec(
        "Bank",
        "1",
        "3.1.0",
        plugins=[FlaskPlugin(), MarshmallowPlugin(), IdempotencyPlugin(app)],
    )
    with app.test_request_context():
        spec.path(view=transfers, app=app)
    document = valid(spec.to_dict())
    assert_protected(document, "/transfers", "post", required=True, ttl_seconds=300, success="201")
    assert_unprotected(document, "/transfers", "get")


def test_a_key_header_the_app_documents_for_the_whole_path_stays_alone() -> None:
    """A path-level parameter applies to each operation of the path: the plugin
    adds no operation-level one beside it (which would override the app's)."""
    app = Flask("apispec_path_level")
    app.config.update(SQLALCHEMY_DATABASE_URI="sqlite://")
    db = SQLAlchemy(app)
    idem = Idempotency(app, db)

    @app.post("/payouts")
    @idem.idempotent()
    def payouts() -> dict[str, str]:
        """Payouts.
        ---
        post:
          responses:
            201:
              description: the payout made
        """
        return {}

    theirs = {
        "name": "Idempotency-Key",
        "in": "header",
        "required": True,
        "description": "Ours, for every operation of the path.",
        "schema": {"type": "string"},
    }
    spec = APISpec("Bank", "1", "3.1.0", plugins=[FlaskPlugin(), IdempotencyPlugin(app)])
    with app.test_request_context():
        spec.path(view=payouts, app=app, parameters=[theirs])
    document = valid(spec.to_dict())
    path = document["paths"]["/payouts"]
    assert path["parameters"] == [theirs]
    operation_headers = [p for p in path["post"].get("parameters", []) if p.get("in") == "header"]
    assert operation_headers == []
    assert "x-idempotency" in path["post"]
