"""Fingerprints across a deploy, the cases a review found: what the request
digest counts for forms (one that does not parse, one parsed before the
extension on one version only), and a field's load parameter the rules version
must see (``fields.Decimal``'s ``places``, the view's name for two routes
sharing a scope). On every engine, through real
requests; orders counted. The digest and version themselves:
:mod:`flask_idempotency._request.rules`; the main cases: test_deploys.py."""

from __future__ import annotations

import enum
import subprocess
import sys
import typing as t

from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from marshmallow import Schema, fields

from flask_idempotency import Idempotency
from flask_idempotency._request import rules
from tests.support.deploys import FIRST, OTHER_BYTES, make_version, order_schema, orders, post
from tests.support.flow import assert_problem

from .test_deploys import KEY_REUSED, RULES_CHANGED


def _send(app: Flask, body: bytes, content_type: str, key: str = "k") -> t.Any:
    return app.test_client().post(
        "/orders", data=body, headers={"Idempotency-Key": key, "Content-Type": content_type}
    )


def test_a_multipart_body_that_does_not_parse_counts_as_its_bytes_across_a_deploy(
    fresh_database: str,
) -> None:
    """Two multipart bodies that do not parse (no boundary) are two requests:
    counted as an empty form they shared one digest, and v2 replayed v1's
    answer to other bytes."""
    app1, db1 = make_version(fresh_database, forms=True)
    app2, _ = make_version(fresh_database, forms=True, exclude=["note"])
    first = _send(app1, b"the first body", "multipart/form-data")
    assert first.status_code == 201, first.get_data(as_text=True)
    again = _send(app2, b"the first body", "multipart/form-data")
    assert again.headers.get("Idempotent-Replayed") == "true"
    other = assert_problem(_send(app2, b"another body", "multipart/form-data"), 422)
    assert other["type"] == RULES_CHANGED
    assert orders(app1, db1) == 1
    with app1.app_context():
        db1.engine.dispose()


def test_a_form_parsed_before_the_extension_on_one_version_only_is_the_same_request(
    fresh_database: str,
) -> None:
    """v1 parses the form before the extension (as Flask-WTF's CSRFProtect
    does), v2 does not and changes the rules: the same urlencoded bytes are
    the same request on either (they answered 422), other values are not."""
    app1, db1 = make_version(fresh_database, forms=True)
    app1.before_request(lambda: (request.form, None)[1])
    app2, _ = make_version(fresh_database, forms=True, exclude=["note"])
    form = "application/x-www-form-urlencoded"
    first = _send(app1, b"total=100&note=gift", form)
    assert first.status_code == 201
    replayed = _send(app2, b"total=100&note=gift", form)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    made = _send(app2, b"total=7", form, key="k2")
    assert made.status_code == 201
    assert _send(app1, b"total=7", form, key="k2").headers.get("Idempotent-Replayed") == "true"
    assert assert_problem(_send(app2, b"total=999", form), 422)["type"] == RULES_CHANGED
    assert orders(app1, db1) == 2
    with app1.app_context():
        db1.engine.dispose()


def _decimal_schema(places: int) -> Schema:
    class OrderSchema(Schema):  # one class name in both versions, as a deploy keeps it
        total = fields.Decimal(required=True, places=places)

    return OrderSchema()


def test_a_changed_field_parameter_is_a_rules_change(fresh_database: str) -> None:
    """``places=2`` becomes ``places=0``: the fingerprint of ``"10.25"``
    changes, so must the rules version (the same bytes answered a false 422
    key-reused); other bytes are refused, one order."""
    app1, db1 = make_version(fresh_database, schema=_decimal_schema(2))
    app2, _ = make_version(fresh_database, schema=_decimal_schema(0))
    body = b'{"total": "10.25"}'
    first = post(app1, "k1", body)
    assert first.status_code == 201
    replayed = post(app2, "k1", body)
    assert replayed.headers.get("Idempotent-Replayed") == "true"
    assert replayed.get_data() == first.get_data()
    assert assert_problem(post(app2, "k1", b'{"total": "10.3"}'), 422)["type"] == RULES_CHANGED
    # The same rules (another instance of the same schema): judged as always,
    # by fingerprint ("10.4" is "10" under places=0), another payload key-reused.
    assert post(app2, "k2", body).status_code == 201
    app3, _ = make_version(fresh_database, schema=_decimal_schema(0))
    assert post(app3, "k2", b'{"total": "10.4"}').headers.get("Idempotent-Replayed") == "true"
    reused = assert_problem(post(app3, "k2", b'{"total": "11"}'), 422)
    assert reused["type"] == KEY_REUSED
    assert orders(app1, db1) == 2
    with app1.app_context():
        db1.engine.dispose()


class Colour(enum.Enum):
    RED = "red"


def rich_schema() -> Schema:
    """Fields whose parameters are classes, functions, Decimals, sets and fields."""

    class RichSchema(Schema):
        colour = fields.Enum(Colour, by_value=True)
        amount = fields.Decimal(places=2, rounding="ROUND_HALF_UP")
        at = fields.DateTime(format="%Y-%m-%d")
        flag = fields.Boolean(truthy={"yes", "y"})
        pair = fields.Tuple((fields.Integer(strict=True), fields.String()))
        custom = fields.Function(deserialize=lambda value: value)
        name = fields.String(validate=lambda value: bool(value))

    return RichSchema()


def test_the_rules_version_is_the_same_in_every_process() -> None:
    """The version names functions and classes, never a ``repr`` holding an
    address: processes of one deploy agree (else every retry would be judged
    by its bytes), and a changed parameter changes it."""
    code = (
        "from tests.unit.request.test_deploys_bytes import rich_schema;"
        "from flask_idempotency._request.rules import compute_version;"
        "print(compute_version(rich_schema(), (), (), None))"
    )
    seen = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    }
    here = rules.compute_version(rich_schema(), (), (), None)
    assert seen == {here}
    assert rules.compute_version(_decimal_schema(2), (), (), None) != rules.compute_version(
        _decimal_schema(0), (), (), None
    )


def _shared_scope_version(url: str, exclude_on_a: list[str]) -> tuple[Flask, t.Any]:
    """Routes ``/a`` and ``/b`` of one service: one scope, one schema object."""
    app = Flask("shared")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    db = SQLAlchemy(app)
    idem = Idempotency(app, db, scope=lambda: "tenant:a")
    schema = order_schema()

    @app.post("/a")
    @idem.idempotent(schema=schema, exclude=exclude_on_a)
    def create_a() -> tuple[dict[str, str], int]:
        return {"route": "a"}, 201

    @app.post("/b")
    @idem.idempotent(schema=schema)
    def create_b() -> tuple[dict[str, str], int]:
        return {"route": "b"}, 201

    with app.app_context():
        db.create_all()
    return app, db


def test_a_rules_change_on_one_of_two_routes_sharing_a_scope_is_told_as_such(
    fresh_database: str,
) -> None:
    """Route B keeps the rules route A had: a retry on A of a record A made
    before its change, with other bytes, is ``fingerprint-rules-changed`` (it
    was ``key-reused``: "another operation", while the first may have run);
    a retry on B of A's record stays ``key-reused``, as across routes."""
    (v1, db1), (v2, _) = (
        _shared_scope_version(fresh_database, []),
        _shared_scope_version(fresh_database, ["note"]),
    )
    headers = {"Idempotency-Key": "shared-1", "Content-Type": "application/json"}
    assert v1.test_client().post("/a", data=FIRST, headers=headers).status_code == 201
    again = v2.test_client().post("/a", data=FIRST, headers=headers)
    assert again.headers.get("Idempotent-Replayed") == "true"
    changed = assert_problem(v2.test_client().post("/a", data=OTHER_BYTES, headers=headers), 422)
    assert changed["type"] == RULES_CHANGED
    on_b = assert_problem(v1.test_client().post("/b", data=FIRST, headers=headers), 422)
    assert on_b["type"] == KEY_REUSED
    with v1.app_context():
        db1.engine.dispose()
