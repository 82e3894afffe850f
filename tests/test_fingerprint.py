"""Unit tests of the request fingerprint: canonical JSON, exclusions, hashing, body errors.

Pure: a plain Flask app for request contexts, no database.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import typing as t
import uuid
from decimal import Decimal

import pytest
from flask import Flask
from marshmallow import Schema, fields
from werkzeug.wrappers import Response

from flask_idempotency.errors import (
    PROBLEM_JSON,
    MalformedBodyError,
    PayloadTooLargeError,
    ProblemError,
    UnsupportedMediaTypeError,
    ValidationProblem,
)
from flask_idempotency.fingerprint import (
    canonical_json,
    compute,
    request_fingerprint,
    resolve_schema,
    without_fields,
)

JSON = "application/json"


class MetaSchema(Schema):
    note = fields.String()
    trace_id = fields.String()


class ChargeSchema(Schema):
    amount = fields.Integer(required=True)
    currency = fields.String()
    note = fields.String()
    meta = fields.Nested(MetaSchema)


@pytest.fixture
def plain_app() -> Flask:
    return Flask(__name__)


def fingerprint(
    app: Flask,
    data: str | bytes,
    *,
    schema: Schema | None = None,
    exclude: t.Sequence[str] = (),
    path: str = "/x",
    method: str = "POST",
    query_string: str = "",
    content_type: str | None = JSON,
) -> tuple[t.Any, str]:
    with app.test_request_context(
        method=method,
        path=path,
        query_string=query_string,
        data=data,
        content_type=content_type,
    ):
        return request_fingerprint(schema, exclude)


def fingerprint_hash(app: Flask, body: t.Any, **kw: t.Any) -> str:
    return fingerprint(app, json.dumps(body), **kw)[1]


# -- canonical_json -------------------------------------------------------------


def test_key_order_and_whitespace_do_not_matter() -> None:
    a = json.loads('{"b": 1, "a": {"y": [1, 2], "x": null}}')
    b = json.loads('{\n  "a" : { "x":null ,"y":[ 1,2 ] },\n  "b":1\n}')
    assert canonical_json(a) == canonical_json(b)
    assert canonical_json(a) == b'{"a":{"x":null,"y":[1,2]},"b":1}'


def test_list_order_matters() -> None:
    assert canonical_json([1, 2]) != canonical_json([2, 1])


@pytest.mark.parametrize("value", [500, 500.0, json.loads("500.0"), json.loads("5e2")])
def test_integral_numbers_agree(value: t.Any) -> None:
    assert canonical_json({"amount": value}) == b'{"amount":500}'


def test_fractional_float_and_bool_are_kept() -> None:
    assert canonical_json({"a": 0.5, "b": True, "c": 1}) == b'{"a":0.5,"b":true,"c":1}'


def test_non_ascii_is_utf8_not_escaped() -> None:
    assert canonical_json({"k": "caf\u00e9"}) == '{"k":"caf\u00e9"}'.encode()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_float_is_malformed(value: float) -> None:
    with pytest.raises(MalformedBodyError, match="finite"):
        canonical_json({"a": value})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (Decimal("1.25"), b'"1.25"'),
        (dt.datetime(2024, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc), b'"2024-01-02T03:04:05+00:00"'),
        (dt.date(2024, 1, 2), b'"2024-01-02"'),
        (
            uuid.UUID("12345678-1234-5678-1234-567812345678"),
            b'"12345678-1234-5678-1234-567812345678"',
        ),
        ({"c", "a", "b"}, b'["a","b","c"]'),
        (frozenset({3, 1, 2}), b"[1,2,3]"),
        ((1, "a"), b'[1,"a"]'),
    ],
)
def test_rich_types_canonicalize(value: t.Any, expected: bytes) -> None:
    assert canonical_json(value) == expected
    assert canonical_json(value) == canonical_json(copy.deepcopy(value))


def test_integral_decimals_agree() -> None:
    assert canonical_json(Decimal("500")) == canonical_json(Decimal("500.00"))
    assert canonical_json(Decimal("500")) == canonical_json(Decimal("5E+2"))
    assert canonical_json(Decimal("500")) != canonical_json(Decimal("501"))


@pytest.mark.parametrize(("a", "b"), [("1.50", "1.5"), ("-0", "0")])
def test_equal_decimals_agree(a: str, b: str) -> None:
    assert Decimal(a) == Decimal(b)
    assert canonical_json(Decimal(a)) == canonical_json(Decimal(b))


class PriceSchema(Schema):
    price = fields.Decimal()


def test_schema_decimal_string_and_number_agree(plain_app: Flask) -> None:
    # Loaded: Decimal('1.50') and Decimal('1.5'), equal values; the hashes differ.
    as_string = fingerprint_hash(plain_app, {"price": "1.50"}, schema=PriceSchema())
    as_number = fingerprint_hash(plain_app, {"price": 1.50}, schema=PriceSchema())
    assert as_string == as_number


def test_set_order_is_independent_of_insertion() -> None:
    words = [f"w{i}" for i in range(50)]
    forward = set(words)
    backward = set(reversed(words))
    assert canonical_json(forward) == canonical_json(backward)
    assert json.loads(canonical_json(forward)) == sorted(words)


def test_unknown_type_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="cannot fingerprint"):
        canonical_json({"a": object()})


# -- without_fields -------------------------------------------------------------

PAYLOAD = {
    "amount": 500,
    "note": "top",
    "meta": {"note": "n", "trace_id": "t1", "deep": {"x": 1, "y": 2}},
    "items": [{"sku": "a", "note": "n1"}, {"sku": "b"}, {"sku": "c", "note": "n3"}],
}


@pytest.mark.parametrize(
    ("exclude", "expected"),
    [
        ([], PAYLOAD),
        (["note"], {k: v for k, v in PAYLOAD.items() if k != "note"}),
        (
            ["meta.trace_id"],
            {**PAYLOAD, "meta": {"note": "n", "deep": {"x": 1, "y": 2}}},
        ),
        (
            ["meta.deep.x"],
            {**PAYLOAD, "meta": {"note": "n", "trace_id": "t1", "deep": {"y": 2}}},
        ),
        (
            ["items.note"],
            {**PAYLOAD, "items": [{"sku": "a"}, {"sku": "b"}, {"sku": "c"}]},
        ),
        (
            ["note", "meta", "items"],
            {"amount": 500},
        ),
    ],
)
def test_without_fields_drops_paths(exclude: list[str], expected: dict[str, t.Any]) -> None:
    assert without_fields(PAYLOAD, exclude) == expected


def test_without_fields_applies_to_top_level_list() -> None:
    assert without_fields([{"a": 1, "b": 2}, {"a": 3}], ["a"]) == [{"b": 2}, {}]


@pytest.mark.parametrize(
    "exclude",
    [["missing"], ["meta.missing"], ["amount.sub"], ["missing.deep.path"], ["items.sku.x"]],
)
def test_without_fields_ignores_missing_paths(exclude: list[str]) -> None:
    assert without_fields(PAYLOAD, exclude) == PAYLOAD


def test_without_fields_does_not_mutate_input() -> None:
    payload = copy.deepcopy(PAYLOAD)
    without_fields(payload, ["note", "meta.trace_id", "items.note"])
    assert payload == PAYLOAD


# -- compute --------------------------------------------------------------------


def test_compute_is_sha256_hex() -> None:
    digest = compute("POST", "/x", [], b"{}")
    assert len(digest) == 64
    int(digest, 16)


def test_compute_method_is_case_insensitive() -> None:
    assert compute("post", "/x", [], b"{}") == compute("POST", "/x", [], b"{}")


def test_compute_query_order_does_not_matter() -> None:
    assert compute("POST", "/x", [("a", "1"), ("b", "2")], b"") == compute(
        "POST", "/x", [("b", "2"), ("a", "1")], b""
    )


@pytest.mark.parametrize(
    "changed",
    [
        ("PUT", "/x", [("a", "1")], b"{}"),
        ("POST", "/y", [("a", "1")], b"{}"),
        ("POST", "/x", [("a", "2")], b"{}"),
        ("POST", "/x", [], b"{}"),
        ("POST", "/x", [("a", "1")], b"[]"),
    ],
)
def test_compute_depends_on_every_part(
    changed: tuple[str, str, list[tuple[str, str]], bytes],
) -> None:
    assert compute(*changed) != compute("POST", "/x", [("a", "1")], b"{}")


# -- request_fingerprint with a schema ------------------------------------------


def test_schema_loaded_data_counts(plain_app: Flask) -> None:
    schema = ChargeSchema()
    payload, as_string = fingerprint(plain_app, '{"amount": "500"}', schema=schema)
    _, as_int = fingerprint(plain_app, '{"amount": 500}', schema=schema)
    assert payload == {"amount": 500}
    assert as_string == as_int


def test_schema_value_change_changes_hash(plain_app: Flask) -> None:
    schema = ChargeSchema()
    assert fingerprint_hash(plain_app, {"amount": 500}, schema=schema) != fingerprint_hash(
        plain_app, {"amount": 501}, schema=schema
    )


@pytest.mark.parametrize(
    ("exclude", "first", "second"),
    [
        (["note"], {"amount": 500, "note": "a"}, {"amount": 500, "note": "b"}),
        (["note"], {"amount": 500, "note": "a"}, {"amount": 500}),
        (
            ["meta.trace_id"],
            {"amount": 500, "meta": {"note": "n", "trace_id": "t1"}},
            {"amount": 500, "meta": {"note": "n", "trace_id": "t2"}},
        ),
    ],
)
def test_excluded_field_does_not_change_hash(
    plain_app: Flask, exclude: list[str], first: t.Any, second: t.Any
) -> None:
    schema = ChargeSchema()
    assert fingerprint_hash(plain_app, first, schema=schema, exclude=exclude) == fingerprint_hash(
        plain_app, second, schema=schema, exclude=exclude
    )
    # ... and the same pair differs when nothing is excluded.
    assert fingerprint_hash(plain_app, first, schema=schema) != fingerprint_hash(
        plain_app, second, schema=schema
    )


@pytest.mark.parametrize(
    ("exclude", "first", "second"),
    [
        (["note"], {"amount": 500, "note": "a"}, {"amount": 501, "note": "a"}),
        (["note"], {"amount": 500, "currency": "EUR"}, {"amount": 500, "currency": "USD"}),
        (
            ["meta.trace_id"],
            {"amount": 500, "meta": {"note": "n1", "trace_id": "t"}},
            {"amount": 500, "meta": {"note": "n2", "trace_id": "t"}},
        ),
    ],
)
def test_non_excluded_change_changes_hash(
    plain_app: Flask, exclude: list[str], first: t.Any, second: t.Any
) -> None:
    schema = ChargeSchema()
    assert fingerprint_hash(plain_app, first, schema=schema, exclude=exclude) != fingerprint_hash(
        plain_app, second, schema=schema, exclude=exclude
    )


def test_exclusion_does_not_alter_returned_payload(plain_app: Flask) -> None:
    payload, _ = fingerprint(
        plain_app, '{"amount": 5, "note": "x"}', schema=ChargeSchema(), exclude=["note"]
    )
    assert payload == {"amount": 5, "note": "x"}


@pytest.mark.parametrize(
    "changes",
    [
        {"path": "/y"},
        {"query_string": "a=1"},
        {"method": "PUT"},
    ],
)
def test_request_line_changes_hash(plain_app: Flask, changes: dict[str, str]) -> None:
    body = {"amount": 500}
    base = fingerprint_hash(plain_app, body, schema=ChargeSchema())
    assert fingerprint_hash(plain_app, body, schema=ChargeSchema(), **changes) != base


def test_query_value_changes_hash(plain_app: Flask) -> None:
    body = {"amount": 500}
    one = fingerprint_hash(plain_app, body, query_string="a=1")
    two = fingerprint_hash(plain_app, body, query_string="a=2")
    assert one != two


def test_query_argument_order_does_not_matter(plain_app: Flask) -> None:
    body = {"amount": 500}
    assert fingerprint_hash(plain_app, body, query_string="a=1&b=2") == fingerprint_hash(
        plain_app, body, query_string="b=2&a=1"
    )


# -- request_fingerprint without a schema ---------------------------------------


def test_no_schema_json_is_canonicalized(plain_app: Flask) -> None:
    payload, first = fingerprint(plain_app, '{"b": 1, "a": [1, 2.0]}')
    _, second = fingerprint(plain_app, '{ "a":[1,2], "b":1 }')
    assert payload == {"b": 1, "a": [1, 2.0]}
    assert first == second
    _, third = fingerprint(plain_app, '{"a": [1, 3], "b": 1}')
    assert third != first


def test_no_schema_exclude_applies_to_json(plain_app: Flask) -> None:
    assert fingerprint_hash(plain_app, {"a": 1, "t": "x"}, exclude=["t"]) == fingerprint_hash(
        plain_app, {"a": 1, "t": "y"}, exclude=["t"]
    )


@pytest.mark.parametrize("content_type", ["text/plain", "application/octet-stream", None])
def test_no_schema_non_json_hashes_bytes(plain_app: Flask, content_type: str | None) -> None:
    payload, first = fingerprint(plain_app, b"hello world", content_type=content_type)
    assert payload == b"hello world"
    _, again = fingerprint(plain_app, b"hello world", content_type=content_type)
    _, other = fingerprint(plain_app, b"hello  world", content_type=content_type)
    assert first == again
    assert first != other


def test_no_schema_non_json_bytes_are_not_canonicalized(plain_app: Flask) -> None:
    # JSON-looking text sent as text/plain counts as its bytes, whitespace included.
    _, first = fingerprint(plain_app, '{"a": 1}', content_type="text/plain")
    _, second = fingerprint(plain_app, '{"a":1}', content_type="text/plain")
    assert first != second


def test_no_schema_empty_json_body_is_accepted(plain_app: Flask) -> None:
    payload, digest = fingerprint(plain_app, b"")
    assert payload == b""
    assert digest == compute("POST", "/x", [], b"")


# -- request_fingerprint errors -------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_schema_needs_json_content_type(plain_app: Flask, content_type: str | None) -> None:
    with pytest.raises(UnsupportedMediaTypeError) as info:
        fingerprint(plain_app, '{"amount": 500}', schema=ChargeSchema(), content_type=content_type)
    assert info.value.code == 415


@pytest.mark.parametrize("schema", [ChargeSchema(), None])
@pytest.mark.parametrize("body", ['{"amount": 500', "not json", b'{"a": "\xff"}', "{'a': 1}"])
def test_malformed_json_is_400(plain_app: Flask, schema: Schema | None, body: str | bytes) -> None:
    with pytest.raises(MalformedBodyError) as info:
        fingerprint(plain_app, body, schema=schema)
    assert info.value.code == 400


@pytest.mark.parametrize("schema", [ChargeSchema(), None])
@pytest.mark.parametrize(
    "body", ['{"amount": NaN}', '{"amount": Infinity}', '{"amount": -Infinity}', "NaN"]
)
def test_non_finite_json_literal_is_malformed(
    plain_app: Flask, schema: Schema | None, body: str
) -> None:
    with pytest.raises(MalformedBodyError, match="not valid JSON"):
        fingerprint(plain_app, body, schema=schema)


def test_overflowing_number_without_schema_is_malformed(plain_app: Flask) -> None:
    with pytest.raises(MalformedBodyError, match="finite"):
        fingerprint(plain_app, '{"amount": 1e400}')


@pytest.mark.parametrize(
    "body",
    [
        {"amount": "abc"},
        {},
        {"amount": 1, "unknown": True},
        {"amount": 1, "meta": {"note": 5}},
    ],
)
def test_validation_failure_is_422_with_messages(plain_app: Flask, body: t.Any) -> None:
    schema = ChargeSchema()
    expected = schema.validate(body)
    assert expected  # the body really is invalid
    with pytest.raises(ValidationProblem) as info:
        fingerprint(plain_app, json.dumps(body), schema=schema)
    error = info.value
    assert error.code == 422
    problem = error.problem()
    assert problem["status"] == 422
    assert problem["errors"] == expected
    response = error.get_response()
    assert isinstance(response, Response)
    assert response.status_code == 422
    assert response.mimetype == PROBLEM_JSON
    assert json.loads(response.get_data(as_text=True))["errors"] == expected


@pytest.mark.parametrize(
    ("schema", "content_type"),
    [(ChargeSchema(), JSON), (None, JSON), (None, "text/plain")],
)
def test_body_over_max_content_length_is_413(
    plain_app: Flask, schema: Schema | None, content_type: str
) -> None:
    plain_app.config["MAX_CONTENT_LENGTH"] = 16
    body = json.dumps({"amount": 500, "note": "x" * 20})
    assert len(body) > 16
    with pytest.raises(PayloadTooLargeError) as info:
        fingerprint(plain_app, body, schema=schema, content_type=content_type)
    assert info.value.code == 413


def test_body_at_max_content_length_is_accepted(plain_app: Flask) -> None:
    body = '{"amount": 500}'
    plain_app.config["MAX_CONTENT_LENGTH"] = len(body)
    payload, _ = fingerprint(plain_app, body, schema=ChargeSchema())
    assert payload == {"amount": 500}


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (MalformedBodyError, 400),
        (UnsupportedMediaTypeError, 415),
        (PayloadTooLargeError, 413),
        (ValidationProblem, 422),
    ],
)
def test_body_errors_are_problem_json(error: type[ProblemError], status: int) -> None:
    response = error("why").get_response()
    assert isinstance(response, Response)
    assert response.status_code == status
    assert response.mimetype == PROBLEM_JSON
    body = json.loads(response.get_data(as_text=True))
    assert body["status"] == status
    assert body["detail"] == "why"
    assert body["type"].endswith(error.slug)
    assert body["title"] == error.title


# -- resolve_schema -------------------------------------------------------------


def test_resolve_schema_keeps_instance() -> None:
    schema = ChargeSchema()
    assert resolve_schema(schema) is schema


def test_resolve_schema_instantiates_class() -> None:
    resolved = resolve_schema(ChargeSchema)
    assert isinstance(resolved, ChargeSchema)


def test_resolve_schema_passes_none() -> None:
    assert resolve_schema(None) is None


@pytest.mark.parametrize("bad", [dict, {"amount": fields.Integer()}, "ChargeSchema", 1, object()])
def test_resolve_schema_rejects_other_things(bad: t.Any) -> None:
    with pytest.raises(TypeError, match="marshmallow Schema"):
        resolve_schema(bad)


def test_same_instant_with_different_offsets_agrees() -> None:
    import datetime as dt

    utc = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.timezone.utc)
    cet = utc.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert canonical_json({"at": utc}) == canonical_json({"at": cet})
    assert canonical_json(Decimal("500.00")) == b'"500"'
