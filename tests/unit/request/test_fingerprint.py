"""The request fingerprint: canonical JSON, exclusions, hashing, body errors.

Unit tests in a plain Flask app's request contexts; at the end, the outside
review's scenarios through the test app on every engine, counting ledger rows.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import enum
import json
import typing as t
import uuid
from decimal import Decimal

import pytest
from flask import Flask, request
from marshmallow import Schema, fields, post_load, pre_load
from werkzeug.wrappers import Response

from flask_idempotency._request.fingerprint import (
    canonical_json,
    compute,
    request_fingerprint,
    resolve_schema,
    without_fields,
)
from flask_idempotency.errors import (
    PROBLEM_JSON,
    MalformedBodyError,
    PayloadTooLargeError,
    ProblemError,
    UnsupportedMediaTypeError,
    ValidationProblem,
)
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.forms import URLENCODED, multipart

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
    # An integral Decimal is the integer of the same value (issue 7, item 6).
    assert canonical_json(Decimal("500.00")) == canonical_json(500) == b"500"


# -- forms: parsed fields and files, not the bytes ------------------------------


def multipart_hash(app: Flask, boundary: str, **kw: t.Any) -> str:
    exclude = kw.pop("exclude", ())
    body, content_type = multipart(boundary, **kw)
    return fingerprint(app, body, content_type=content_type, exclude=exclude)[1]


FORM = {"fields_": [("amount", "100"), ("tag", "a"), ("tag", "b")]}
UPLOAD = {**FORM, "files": [("receipt", "r.txt", b"same file")]}


@pytest.mark.parametrize("form", [FORM, UPLOAD, {}], ids=["fields", "fields-and-file", "empty"])
def test_multipart_boundary_does_not_matter(plain_app: Flask, form: dict[str, t.Any]) -> None:
    assert multipart_hash(plain_app, "boundary-one", **form) == multipart_hash(
        plain_app, "xYz0987654321", **form
    )


@pytest.mark.parametrize(
    "changed",
    [
        {**UPLOAD, "files": [("receipt", "r.txt", b"other file")]},
        {**UPLOAD, "files": [("receipt", "s.txt", b"same file")]},
        {**UPLOAD, "files": [("invoice", "r.txt", b"same file")]},
        {**UPLOAD, "fields_": [("amount", "101"), ("tag", "a"), ("tag", "b")]},
        {**UPLOAD, "fields_": [("amount", "100"), ("tag", "b"), ("tag", "a")]},
        {**UPLOAD, "fields_": [("amount", "100"), ("tag", "a")]},
        FORM,
    ],
    ids=["content", "filename", "file-name", "value", "value-order", "missing-value", "no-file"],
)
def test_multipart_content_counts(plain_app: Flask, changed: dict[str, t.Any]) -> None:
    assert multipart_hash(plain_app, "b1", **UPLOAD) != multipart_hash(plain_app, "b2", **changed)


def test_multipart_name_order_does_not_matter(plain_app: Flask) -> None:
    one = multipart_hash(plain_app, "b1", fields_=[("a", "1"), ("b", "2")])
    two = multipart_hash(plain_app, "b2", fields_=[("b", "2"), ("a", "1")])
    assert one == two


def test_multipart_exclude_applies_to_field_names(plain_app: Flask) -> None:
    one = multipart_hash(
        plain_app, "b1", fields_=[("a", "1"), ("sent_at", "x")], exclude=["sent_at"]
    )
    two = multipart_hash(
        plain_app, "b2", fields_=[("a", "1"), ("sent_at", "y")], exclude=["sent_at"]
    )
    assert one == two


def test_multipart_stays_readable_for_the_view(plain_app: Flask) -> None:
    body, content_type = multipart("b1", **UPLOAD)
    with plain_app.test_request_context(
        method="POST", path="/x", data=body, content_type=content_type
    ):
        from flask import request

        payload, _ = request_fingerprint(None, ())
        assert payload == body
        assert request.get_data() == body
        assert request.form.getlist("tag") == ["a", "b"]
        assert request.files["receipt"].read() == b"same file"


def test_unparseable_multipart_counts_as_bytes(plain_app: Flask) -> None:
    # No boundary parameter: werkzeug parses it as an empty form, silently.
    garbage = b"--x\r\nnot a part\r\n"
    one = fingerprint(plain_app, garbage, content_type="multipart/form-data")[1]
    same = fingerprint(plain_app, garbage, content_type="multipart/form-data")[1]
    other = fingerprint(plain_app, garbage + b"!", content_type="multipart/form-data")[1]
    assert one == same
    assert one != other


def test_multipart_over_max_form_parts_is_413(plain_app: Flask) -> None:
    plain_app.config["MAX_FORM_PARTS"] = 3
    body, content_type = multipart("b", fields_=[(f"f{i}", "v") for i in range(10)])
    with pytest.raises(PayloadTooLargeError):
        fingerprint(plain_app, body, content_type=content_type)


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("a=1&b=2", "b=2&a=1"),
        ("a=x%20y", "a=x+y"),
        ("a=%41", "a=A"),
        ("a=1&b=2&a=3", "b=2&a=1&a=3"),
    ],
)
def test_urlencoded_same_fields_agree(plain_app: Flask, one: str, two: str) -> None:
    assert (
        fingerprint(plain_app, one, content_type=URLENCODED)[1]
        == fingerprint(plain_app, two, content_type=URLENCODED)[1]
    )


@pytest.mark.parametrize(("one", "two"), [("a=1&a=2", "a=2&a=1"), ("a=1", "a=2"), ("a=1", "b=1")])
def test_urlencoded_different_fields_differ(plain_app: Flask, one: str, two: str) -> None:
    assert (
        fingerprint(plain_app, one, content_type=URLENCODED)[1]
        != fingerprint(plain_app, two, content_type=URLENCODED)[1]
    )


def test_form_and_json_of_the_same_shape_differ(plain_app: Flask) -> None:
    form = fingerprint(plain_app, "a=1", content_type=URLENCODED)[1]
    as_json = fingerprint(plain_app, '{"a": ["1"]}')[1]
    assert form != as_json


# -- schema: what the client sent, not what the schema invents ---------------------


class LineSchema(Schema):
    sku = fields.String(required=True)
    line_id = fields.UUID(load_default=uuid.uuid4)


class DefaultsSchema(Schema):
    amount = fields.Integer(required=True)
    order_ref = fields.UUID(load_default=uuid.uuid4, data_key="orderRef")
    received_at = fields.AwareDateTime(load_default=lambda: dt.datetime.now(dt.timezone.utc))
    currency = fields.String(load_default="EUR")
    lines = fields.List(fields.Nested(LineSchema), load_default=list)
    main_line = fields.Nested(LineSchema)
    other_lines = fields.Nested(LineSchema, many=True)
    by_sku = fields.Dict(keys=fields.String(), values=fields.Nested(LineSchema))
    pair = fields.Tuple((fields.Nested(LineSchema), fields.Integer()))


DEFAULTS_BODY = {
    "amount": 5,
    "lines": [{"sku": "a"}, {"sku": "b"}],
    "main_line": {"sku": "m"},
    "other_lines": [{"sku": "o"}],
    "by_sku": {"x": {"sku": "x"}, "y": {"sku": "y"}},
    "pair": [{"sku": "p"}, 1],
}


@pytest.mark.parametrize(
    "body",
    [{"amount": 5}, DEFAULTS_BODY],
    ids=["top-level-defaults", "nested-defaults"],
)
def test_schema_defaults_do_not_count(plain_app: Flask, body: dict[str, t.Any]) -> None:
    schema = DefaultsSchema()
    first_payload, first = fingerprint(plain_app, json.dumps(body), schema=schema)
    second_payload, second = fingerprint(plain_app, json.dumps(body), schema=schema)
    # The view still gets the defaults; they differ on every load...
    assert first_payload["order_ref"] != second_payload["order_ref"]
    assert first_payload["currency"] == "EUR"
    # ...and the fingerprint does not depend on them.
    assert first == second


@pytest.mark.parametrize(
    "change",
    [
        {"orderRef": "12345678-1234-5678-1234-567812345678"},
        {"currency": "EUR"},
        {"lines": [{"sku": "a", "line_id": "12345678-1234-5678-1234-567812345678"}, {"sku": "b"}]},
        {"lines": [{"sku": "a"}, {"sku": "c"}]},
        {"main_line": {"sku": "n"}},
        {"other_lines": [{"sku": "o", "line_id": "12345678-1234-5678-1234-567812345678"}]},
        {"by_sku": {"x": {"sku": "x"}, "y": {"sku": "z"}}},
        {"pair": [{"sku": "p"}, 2]},
    ],
)
def test_sent_values_still_count(plain_app: Flask, change: dict[str, t.Any]) -> None:
    schema = DefaultsSchema()
    base = fingerprint_hash(plain_app, DEFAULTS_BODY, schema=schema)
    assert fingerprint_hash(plain_app, {**DEFAULTS_BODY, **change}, schema=schema) != base


def test_sent_value_equal_to_itself_agrees(plain_app: Flask) -> None:
    body = {"amount": 5, "orderRef": "12345678-1234-5678-1234-567812345678"}
    schema = DefaultsSchema()
    assert fingerprint_hash(plain_app, body, schema=schema) == fingerprint_hash(
        plain_app, body, schema=schema
    )


def test_many_schema_defaults_do_not_count(plain_app: Flask) -> None:
    schema = LineSchema(many=True)
    body = [{"sku": "a"}, {"sku": "b"}]
    assert fingerprint_hash(plain_app, body, schema=schema) == fingerprint_hash(
        plain_app, body, schema=schema
    )
    assert fingerprint_hash(plain_app, body, schema=schema) != fingerprint_hash(
        plain_app, [{"sku": "a"}], schema=schema
    )


class IncludeSchema(Schema):
    class Meta:
        unknown = "include"

    amount = fields.Integer(required=True)
    ref = fields.UUID(load_default=uuid.uuid4)


def test_unknown_included_keys_count(plain_app: Flask) -> None:
    schema = IncludeSchema()
    one = fingerprint_hash(plain_app, {"amount": 1, "extra": "a"}, schema=schema)
    assert one == fingerprint_hash(plain_app, {"amount": 1, "extra": "a"}, schema=schema)
    assert one != fingerprint_hash(plain_app, {"amount": 1, "extra": "b"}, schema=schema)
    assert one != fingerprint_hash(plain_app, {"amount": 1}, schema=schema)


class CamelSchema(Schema):
    """A pre_load hook renames keys: what the fields saw is not what was sent."""

    client_ref = fields.String(load_default=lambda: str(uuid.uuid4()))
    amount = fields.Integer()

    @pre_load
    def snake_case(self, data: dict[str, t.Any], **kwargs: t.Any) -> dict[str, t.Any]:
        return {("client_ref" if k == "clientRef" else k): v for k, v in data.items()}


def test_pre_load_schema_never_merges_different_requests(plain_app: Flask) -> None:
    schema = CamelSchema()
    one = fingerprint_hash(plain_app, {"clientRef": "a", "amount": 1}, schema=schema)
    two = fingerprint_hash(plain_app, {"clientRef": "b", "amount": 1}, schema=schema)
    assert one != two


@dataclasses.dataclass
class Order:
    amount: int
    note: str | None


class ObjectSchema(Schema):
    amount = fields.Integer(required=True)
    note = fields.String(load_default=None)

    @post_load
    def make(self, data: dict[str, t.Any], **kwargs: t.Any) -> Order:
        return Order(**data)


def test_post_load_object_counts_as_is(plain_app: Flask) -> None:
    schema = ObjectSchema()
    payload, one = fingerprint(plain_app, '{"amount": 1}', schema=schema)
    assert payload == Order(1, None)
    assert one == fingerprint_hash(plain_app, {"amount": 1, "note": None}, schema=schema)
    assert one != fingerprint_hash(plain_app, {"amount": 2}, schema=schema)


# -- strings that are not text ---------------------------------------------------

SURROGATE_BODIES = [
    b'{"amount": 1, "note": "\\ud800"}',
    b'{"amount": 1, "note": "ok \\uDFFF end"}',
    b'{"amount": 1, "meta": {"note": "\\udbff"}}',
    b'{"amount": 1, "\\ud800": 1}',
    b'{"amount": 1, "note": "\\ude00\\ud83d"}',
    b'{"amount": 1, "note": "\xed\xa0\x80"}',
    '{"amount": 1, "note": "\ud800"}'.encode("utf-16-le", "surrogatepass"),
]


@pytest.mark.parametrize("schema", [ChargeSchema(), None], ids=["schema", "no-schema"])
@pytest.mark.parametrize("body", SURROGATE_BODIES)
def test_lone_surrogate_is_malformed(plain_app: Flask, schema: Schema | None, body: bytes) -> None:
    with pytest.raises(MalformedBodyError, match="surrogate"):
        fingerprint(plain_app, body, schema=schema)


def test_lone_surrogate_in_excluded_field_is_malformed(plain_app: Flask) -> None:
    with pytest.raises(MalformedBodyError, match="surrogate"):
        fingerprint(
            plain_app, b'{"amount": 1, "note": "\\ud800"}', schema=ChargeSchema(), exclude=["note"]
        )


def test_escaped_surrogate_pair_is_its_character(plain_app: Flask) -> None:
    escaped = fingerprint(plain_app, b'{"note": "\\ud83d\\ude00"}')
    literal = fingerprint(plain_app, '{"note": "\U0001f600"}'.encode())
    assert escaped == literal


def test_escaped_backslash_before_u_is_not_a_surrogate(plain_app: Flask) -> None:
    payload, _ = fingerprint(plain_app, b'{"note": "\\\\ud800"}')
    assert payload == {"note": "\\ud800"}


# -- numbers by exact value -------------------------------------------------------


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ('{"a": 1e16}', '{"a": 10000000000000000}'),
        ('{"a": 9007199254740993.0}', '{"a": 9007199254740992}'),
        ('{"a": -1.2676506002282294e30}', '{"a": -1267650600228229401496703205376}'),
        ('{"a": 1e300}', '{"a": ' + str(int(1e300)) + "}"),
        ('{"a": 1}', '{"a": 1.0000000000000001}'),
        ('{"a": 0.1}', '{"a": 0.10000000000000001}'),
        ('{"a": 0.0025}', '{"a": 2.5e-3}'),
        ('{"a": -0.0}', '{"a": 0}'),
    ],
)
def test_equal_numbers_agree(plain_app: Flask, one: str, two: str) -> None:
    assert fingerprint(plain_app, one)[1] == fingerprint(plain_app, two)[1]


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ('{"a": "500"}', '{"a": 500}'),
        ('{"a": 1e16}', '{"a": 10000000000000001}'),
        ('{"a": 0.1}', '{"a": 0.2}'),
        ('{"a": 1.5}', '{"a": 2}'),
    ],
)
def test_different_numbers_differ(plain_app: Flask, one: str, two: str) -> None:
    assert fingerprint(plain_app, one)[1] != fingerprint(plain_app, two)[1]


@pytest.mark.parametrize(
    "value", [Decimal("500"), Decimal("5E+2"), Decimal("500.000"), 500.0, 500, Decimal("0.5E+3")]
)
def test_integral_numbers_of_every_type_agree(value: t.Any) -> None:
    assert canonical_json(value) == b"500"


def test_large_integral_decimal_is_the_integer() -> None:
    assert canonical_json(Decimal("1E+30")) == canonical_json(10**30)
    assert canonical_json(Decimal(2**100)) == canonical_json(float(2**100))


def test_decimals_count_by_exact_value() -> None:
    # 32 significant digits: more than the default decimal context keeps.
    assert canonical_json(Decimal("1.0000000000000000000000000000001")) != canonical_json(
        Decimal("1")
    )
    assert canonical_json(Decimal("0.10")) == canonical_json(Decimal("0.1"))


@pytest.mark.parametrize(
    ("text", "other"),
    [
        ("1E+999999999", "1E+999999998"),
        ("-1E-999999999", "-1E-999999998"),
        ("1.5E-9999", "1.5E-9998"),
    ],
)
def test_extreme_decimal_exponents_stay_small(text: str, other: str) -> None:
    written = canonical_json(Decimal(text))
    assert len(written) < 100
    assert written != canonical_json(Decimal(other))


class FloatSchema(Schema):
    a = fields.Float()
    d = fields.Decimal()


@pytest.mark.parametrize(
    ("one", "two"),
    [({"a": 1e16}, {"a": 10000000000000000}), ({"d": 1e16}, {"d": "10000000000000000.00"})],
)
def test_schema_numbers_agree_by_value(plain_app: Flask, one: t.Any, two: t.Any) -> None:
    schema = FloatSchema()
    assert fingerprint_hash(plain_app, one, schema=schema) == fingerprint_hash(
        plain_app, two, schema=schema
    )


# -- bodies that cannot be normalized answer 400 ----------------------------------

DEEP = 10_000


@pytest.mark.parametrize("schema", [ChargeSchema(), None], ids=["schema", "no-schema"])
@pytest.mark.parametrize(
    "body",
    ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP],
    ids=["lists", "objects"],
)
def test_deeply_nested_json_is_malformed(
    plain_app: Flask, schema: Schema | None, body: str
) -> None:
    with pytest.raises(MalformedBodyError, match="nested too deeply"):
        fingerprint(plain_app, body, schema=schema)


@pytest.mark.parametrize("depth", [100, 300, 500, 700, 900, 990])
def test_nesting_is_fingerprinted_or_refused_never_crashes(plain_app: Flask, depth: int) -> None:
    body = '{"a":' * depth + "1" + "}" * depth
    try:
        fingerprint(plain_app, body)
    except MalformedBodyError as exc:
        refused: MalformedBodyError | None = exc
    else:
        refused = None
    assert refused is None or refused.code == 400


class StampSchema(Schema):
    amount = fields.Integer(required=True)
    sent_at = fields.AwareDateTime()
    logged_at = fields.DateTime()


EDGE = "0001-01-01T00:00:00+14:00"


@pytest.mark.parametrize("field", ["sent_at", "logged_at"])
def test_excluded_datetime_out_of_utc_range_is_ignored(plain_app: Flask, field: str) -> None:
    schema = StampSchema()
    edge = fingerprint_hash(plain_app, {"amount": 1, field: EDGE}, schema=schema, exclude=[field])
    usual = fingerprint_hash(
        plain_app, {"amount": 1, field: "2026-12-01T10:00:00+01:00"}, schema=schema, exclude=[field]
    )
    assert edge == usual


@pytest.mark.parametrize("field", ["sent_at", "logged_at"])
def test_datetime_out_of_utc_range_is_malformed(plain_app: Flask, field: str) -> None:
    with pytest.raises(MalformedBodyError) as info:
        fingerprint_hash(plain_app, {"amount": 1, field: EDGE}, schema=StampSchema())
    assert info.value.code == 400


# -- every value marshmallow's own fields load into --------------------------------


class Color(enum.Enum):
    RED = "r"
    BLUE = "b"


class Size(enum.IntEnum):
    S = 1
    M = 2


class SkuSchema(Schema):
    sku = fields.String(required=True)
    line_id = fields.UUID(load_default=uuid.uuid4)


class LinesSchema(Schema):
    lines = fields.List(fields.Nested(SkuSchema))


class MethodSchema(Schema):
    cents = fields.Method(deserialize="to_cents")

    def to_cents(self, value: str) -> int:
        return round(float(value) * 100)


MICRO = {"precision": "microseconds"}

# (field, a value, values that mean the same, a value that does not)
FIELD_VALUES: list[tuple[str, t.Any, t.Any, list[t.Any], t.Any]] = [
    ("ip", fields.IP(), "10.0.0.1", [], "10.0.0.2"),
    ("ip-v6", fields.IP(), "::1", ["0:0:0:0:0:0:0:1", "0::1"], "::2"),
    ("ipv4", fields.IPv4(), "192.168.0.1", [], "192.168.0.2"),
    ("ipv6", fields.IPv6(), "2001:db8::1", ["2001:0db8:0:0:0:0:0:1"], "2001:db8::2"),
    ("ip-interface", fields.IPInterface(), "10.0.0.1/24", [], "10.0.0.1/25"),
    ("ipv4-interface", fields.IPv4Interface(), "10.0.0.1/24", [], "10.0.0.2/24"),
    ("ipv6-interface", fields.IPv6Interface(), "2001:db8::1/64", [], "2001:db8::1/48"),
    ("url", fields.Url(), "https://example.com/a", [], "https://example.com/b"),
    ("email", fields.Email(), "a@example.com", [], "b@example.com"),
    ("tuple", fields.Tuple((fields.String(), fields.Integer())), ["a", 1], [["a", "1"]], ["a", 2]),
    ("pluck", fields.Pluck(SkuSchema, "sku"), "a", [], "b"),
    ("pluck-many", fields.Pluck(SkuSchema, "sku", many=True), ["a", "b"], [], ["b", "a"]),
    # The plucked field's own nested defaults (a fresh line_id each) do not count.
    ("pluck-nested", fields.Pluck(LinesSchema, "lines"), [{"sku": "a"}], [], [{"sku": "b"}]),
    ("enum-by-name", fields.Enum(Color), "RED", [], "BLUE"),
    ("enum-by-value", fields.Enum(Color, by_value=True), "r", [], "b"),
    ("int-enum-by-value", fields.Enum(Size, by_value=True), 1, [], 2),
    ("time", fields.Time(), "10:00:00", ["10:00:00.000000"], "10:00:01"),
    ("date", fields.Date(), "2026-01-02", [], "2026-01-03"),
    ("timedelta", fields.TimeDelta(), 60, [60.0], 61),
    ("timedelta-fraction", fields.TimeDelta(**MICRO), 1_500_000, [], 1_500_001),
    (
        "aware",
        fields.AwareDateTime(),
        "2026-01-01T10:00:00+00:00",
        ["2026-01-01T11:00:00+01:00"],
        "2026-01-01T10:00:01+00:00",
    ),
    ("naive", fields.NaiveDateTime(), "2026-01-01T10:00:00", [], "2026-01-01T10:00:01"),
    ("datetime", fields.DateTime(), "2026-01-01T10:00:00Z", [], "2026-01-01T10:00:01Z"),
    ("method", fields.Method(deserialize="to_cents"), "1.50", ["1.5"], "1.51"),
    ("function", fields.Function(deserialize=lambda v: v.strip().lower()), "A", [" a "], "b"),
    ("dict-ip-keys", fields.Dict(keys=fields.IP()), {"::1": 1}, [{"0::1": 1}], {"::2": 1}),
    ("list-ip", fields.List(fields.IP()), ["10.0.0.1"], [], ["10.0.0.2"]),
    ("uuid", fields.UUID(), str(uuid.UUID(int=1)), [uuid.UUID(int=1).hex], str(uuid.UUID(int=2))),
    ("raw", fields.Raw(), {"a": [1, 2.0]}, [{"a": [1.0, 2]}], {"a": [2, 1]}),
]


def one_field_schema(field: fields.Field[t.Any]) -> Schema:
    if isinstance(field, fields.Method):
        schema_class = MethodSchema.from_dict({"value": field}, name="OneFieldSchema")
        return type("OneFieldSchema", (schema_class, MethodSchema), {})()
    return Schema.from_dict({"value": field}, name="OneFieldSchema")()


@pytest.mark.parametrize(
    ("field", "value", "same", "other"),
    [case[1:] for case in FIELD_VALUES],
    ids=[case[0] for case in FIELD_VALUES],
)
def test_every_builtin_field_fingerprints(
    plain_app: Flask, field: fields.Field[t.Any], value: t.Any, same: list[t.Any], other: t.Any
) -> None:
    schema = one_field_schema(field)
    first = fingerprint_hash(plain_app, {"value": value}, schema=schema)
    assert fingerprint_hash(plain_app, {"value": value}, schema=schema) == first
    for equivalent in same:
        assert fingerprint_hash(plain_app, {"value": equivalent}, schema=schema) == first
    assert fingerprint_hash(plain_app, {"value": other}, schema=schema) != first


def test_timedeltas_count_by_exact_value() -> None:
    # 86400000000.000001 seconds is no double: total_seconds() would merge them.
    far = dt.timedelta(days=10**6)
    assert canonical_json(far + dt.timedelta(microseconds=1)) != canonical_json(far)
    assert canonical_json(dt.timedelta(minutes=1)) == canonical_json(dt.timedelta(seconds=60))
    assert canonical_json(dt.timedelta(seconds=-1.5)) == b'"-1.5"'


def test_constant_field_fingerprints(plain_app: Flask) -> None:
    schema = one_field_schema(fields.Constant(42))
    sent = fingerprint_hash(plain_app, {"value": "anything"}, schema=schema)
    assert fingerprint_hash(plain_app, {"value": "else"}, schema=schema) == sent  # loaded: 42
    assert fingerprint_hash(plain_app, {}, schema=schema) != sent  # not sent: not counted


class Device:
    """A custom type a schema's post_load hook or field might load into."""


class DeviceField(fields.Field):
    def _deserialize(self, value: t.Any, attr: t.Any, data: t.Any, **kwargs: t.Any) -> Device:
        return Device()


class DeviceMetaSchema(Schema):
    device = DeviceField()


class DeviceSchema(Schema):
    amount = fields.Integer()
    meta = fields.Nested(DeviceMetaSchema)
    items = fields.List(fields.Nested(DeviceMetaSchema))


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"meta": {"device": "x"}}, "meta.device"),
        ({"items": [{}, {"device": "x"}]}, r"items\[1\]\.device"),
    ],
)
def test_unknown_loaded_type_names_the_field_and_the_type(
    plain_app: Flask, body: dict[str, t.Any], where: str
) -> None:
    with pytest.raises(TypeError, match=where) as info:
        fingerprint_hash(plain_app, body, schema=DeviceSchema())
    message = str(info.value)
    assert "tests.unit.request.test_fingerprint.Device" in message
    assert "DeviceSchema" in message
    assert "exclude" in message  # says how to get out of it


def test_unknown_loaded_type_in_an_excluded_field_is_never_looked_at(plain_app: Flask) -> None:
    one = fingerprint_hash(
        plain_app,
        {"amount": 1, "meta": {"device": "x"}},
        schema=DeviceSchema(),
        exclude=["meta.device"],
    )
    assert one == fingerprint_hash(plain_app, {"amount": 1, "meta": {}}, schema=DeviceSchema())


# -- schemas with pre_load hooks: what the client sent counts there -----------------


class StripSchema(Schema):
    """The review's schema: a pre_load hook and a default the server invents."""

    amount = fields.Integer(required=True)
    order_ref = fields.UUID(load_default=uuid.uuid4)
    note = fields.String(data_key="memo")
    sent_at = fields.String(data_key="sentAt")

    @pre_load
    def strip_strings(self, data: dict[str, t.Any], **kwargs: t.Any) -> dict[str, t.Any]:
        return {k: v.strip() if isinstance(v, str) else v for k, v in data.items()}


def test_pre_load_schema_byte_identical_retry_agrees(plain_app: Flask) -> None:
    schema = StripSchema()
    body = '{"amount": 5}'
    payloads = [fingerprint(plain_app, body, schema=schema) for _ in range(2)]
    assert payloads[0][0]["order_ref"] != payloads[1][0]["order_ref"]  # invented per load
    assert payloads[0][1] == payloads[1][1]


@pytest.mark.parametrize(
    "same",
    [
        '{"memo": "x", "amount": 5}',
        '{ "amount" : 5.0 , "memo":"x" }',
        '{"amount": 5e0, "memo": "\\u0078"}',
    ],
)
def test_pre_load_schema_reordered_retry_agrees(plain_app: Flask, same: str) -> None:
    schema = StripSchema()
    base = fingerprint(plain_app, '{"amount": 5, "memo": "x"}', schema=schema)[1]
    assert fingerprint(plain_app, same, schema=schema)[1] == base


@pytest.mark.parametrize(
    "other",
    [
        '{"amount": 6, "memo": "x"}',
        '{"amount": 5, "memo": "x "}',  # the hook makes them one; the client sent two
        '{"amount": "5", "memo": "x"}',  # "500" and 500 differ at a pre_load level
        '{"amount": 5, "memo": "x", "order_ref": "12345678-1234-5678-1234-567812345678"}',
        '{"amount": 5}',
    ],
)
def test_pre_load_schema_different_requests_differ(plain_app: Flask, other: str) -> None:
    schema = StripSchema()
    base = fingerprint(plain_app, '{"amount": 5, "memo": "x"}', schema=schema)[1]
    assert fingerprint(plain_app, other, schema=schema)[1] != base


@pytest.mark.parametrize("exclude", [["sent_at"], ["sentAt"]], ids=["field-name", "data-key"])
def test_pre_load_schema_excludes_by_the_data_key_sent(
    plain_app: Flask, exclude: list[str]
) -> None:
    schema = StripSchema()
    one = fingerprint(
        plain_app, '{"amount": 5, "sentAt": "10:00"}', schema=schema, exclude=exclude
    )[1]
    two = fingerprint(
        plain_app, '{"amount": 5, "sentAt": "10:05"}', schema=schema, exclude=exclude
    )[1]
    assert one == two
    three = fingerprint(
        plain_app, '{"amount": 6, "sentAt": "10:05"}', schema=schema, exclude=exclude
    )[1]
    assert three != one


class EnvelopeSchema(Schema):
    """No hook here; its nested schema has one."""

    amount = fields.Integer(required=True)
    ref = fields.UUID(load_default=uuid.uuid4)
    meta = fields.Nested(StripSchema, data_key="Meta")
    lines = fields.List(fields.Nested(StripSchema))


def test_pre_load_level_inside_a_schema_without_one(plain_app: Flask) -> None:
    schema = EnvelopeSchema()
    body = {"amount": 1, "Meta": {"amount": 2, "sentAt": "a"}, "lines": [{"amount": 3}]}
    exclude = ["meta.sent_at"]
    base = fingerprint_hash(plain_app, body, schema=schema, exclude=exclude)
    assert fingerprint_hash(plain_app, body, schema=schema, exclude=exclude) == base
    moved = {**body, "Meta": {"amount": 2, "sentAt": "b"}}
    assert fingerprint_hash(plain_app, moved, schema=schema, exclude=exclude) == base
    for other in (
        {**body, "amount": "1"} | {"amount": 9},
        {**body, "Meta": {"amount": "2", "sentAt": "a"}},
        {**body, "lines": [{"amount": 3, "memo": " x"}]},
    ):
        assert fingerprint_hash(plain_app, other, schema=schema, exclude=exclude) != base
    # Outside the pre_load level, loaded values still count: "1" and 1 agree there.
    assert (
        fingerprint_hash(plain_app, {**body, "amount": "1"}, schema=schema, exclude=exclude) == base
    )


class ManyHookSchema(StripSchema):
    pass


def test_pre_load_schema_with_many(plain_app: Flask) -> None:
    schema = ManyHookSchema(many=True)
    body = [{"amount": 1}, {"amount": 2}]
    assert fingerprint_hash(plain_app, body, schema=schema) == fingerprint_hash(
        plain_app, body, schema=schema
    )
    assert fingerprint_hash(plain_app, body, schema=schema) != fingerprint_hash(
        plain_app, body[:1], schema=schema
    )


# -- query arguments, content type, escaped names ------------------------------------


def test_repeated_query_argument_order_counts(plain_app: Flask) -> None:
    body = {"amount": 500}
    assert fingerprint_hash(plain_app, body, query_string="to=a&to=b") != fingerprint_hash(
        plain_app, body, query_string="to=b&to=a"
    )
    assert fingerprint_hash(plain_app, body, query_string="to=a&x=1&to=b") == fingerprint_hash(
        plain_app, body, query_string="x=1&to=a&to=b"
    )


def test_compute_keeps_each_names_values_in_order() -> None:
    assert compute("POST", "/x", [("a", "1"), ("a", "2")], b"") != compute(
        "POST", "/x", [("a", "2"), ("a", "1")], b""
    )
    assert compute("POST", "/x", [("b", "1"), ("a", "2"), ("a", "1")], b"") == compute(
        "POST", "/x", [("a", "2"), ("a", "1"), ("b", "1")], b""
    )


@pytest.mark.parametrize(
    ("one", "two"),
    [
        ("text/plain", "application/json"),
        ("application/json", "application/merge-patch+json"),
        ("application/octet-stream", None),
    ],
)
def test_content_type_of_a_body_counts(plain_app: Flask, one: str, two: str | None) -> None:
    body = '{"amount":5}'
    assert (
        fingerprint(plain_app, body, content_type=one)[1]
        != fingerprint(plain_app, body, content_type=two)[1]
    )


@pytest.mark.parametrize(
    "same", ["application/json; charset=utf-8", "Application/JSON", "application/json;x=y"]
)
def test_content_type_parameters_and_case_do_not_count(plain_app: Flask, same: str) -> None:
    body = '{"amount": 5}'
    assert fingerprint(plain_app, body, content_type=same)[1] == fingerprint(plain_app, body)[1]


def test_content_type_without_a_body_does_not_count(plain_app: Flask) -> None:
    assert (
        fingerprint(plain_app, b"", content_type="text/plain")[1]
        == fingerprint(plain_app, b"", content_type=None)[1]
    )


def test_form_content_type_counts(plain_app: Flask) -> None:
    body, content_type = multipart("b", fields_=[("a", "1")])
    as_multipart = fingerprint(plain_app, body, content_type=content_type)[1]
    as_urlencoded = fingerprint(plain_app, "a=1", content_type=URLENCODED)[1]
    assert as_multipart != as_urlencoded


ESCAPED = {
    "client.sent_at": "x",
    "client": {"sent_at": "y"},
    "a\\b": 1,
    "meta": {"trace.id": "t", "keep": 1},
}


@pytest.mark.parametrize(
    ("exclude", "gone"),
    [
        ([r"client\.sent_at"], [("client.sent_at",)]),
        (["client.sent_at"], [("client", "sent_at")]),
        ([r"meta.trace\.id"], [("meta", "trace.id")]),
        ([r"a\\b"], [("a\\b",)]),
    ],
)
def test_exclude_escapes_dots_in_names(exclude: list[str], gone: list[tuple[str, ...]]) -> None:
    expected = copy.deepcopy(ESCAPED)
    for path in gone:
        node = expected
        for part in path[:-1]:
            node = node[part]
        del node[path[-1]]
    assert without_fields(ESCAPED, exclude) == expected


@pytest.mark.parametrize("bad", [r"a\b", "a\\", r"meta\trace"])
def test_exclude_with_an_unknown_escape_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="escape"):
        without_fields({}, [bad])


def test_exclude_escaped_form_field(plain_app: Flask) -> None:
    def form(sent_at: str) -> str:
        return fingerprint(
            plain_app,
            f"order.note=x&client.sent_at={sent_at}",
            content_type=URLENCODED,
            exclude=[r"client\.sent_at"],
        )[1]

    assert form("10:00:00") == form("10:00:05")


# -- through the app, on every engine: the outside review's scenarios ---------------


def review_app(database_url: str) -> Flask:
    app = testapp.create_app(database_url, clock=Clock())

    @app.post("/devices")
    @testapp.idem.idempotent(schema=one_field_schema(fields.IP(required=True)))
    def devices() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("devices")
        return {"id": row.id, "ip": str(testapp.idem.payload["value"])}, 201

    @app.post("/orders")
    @testapp.idem.idempotent(schema=StripSchema, exclude=["sent_at"])
    def orders() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("orders", testapp.idem.payload["amount"])
        return {"id": row.id, "order_ref": str(testapp.idem.payload["order_ref"])}, 201

    @app.post("/transfer")
    @testapp.idem.idempotent()
    def transfer() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("transfer")
        return {"id": row.id, "to": request.args.getlist("to")}, 201

    @app.post("/form-order")
    @testapp.idem.idempotent(exclude=[r"client\.sent_at"])
    def form_order() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("form-order")
        return {"id": row.id, "note": request.form.get("order.note")}, 201

    reset_tables(database_url)
    return app


def send(client: t.Any, path: str, key: str, **kw: t.Any) -> t.Any:
    return client.post(path, headers={"Idempotency-Key": key}, **kw)


def test_ip_field_route_runs_once_and_replays(database_url: str) -> None:
    app = review_app(database_url)
    client = app.test_client()
    first = send(client, "/devices", "d-1", json={"value": "::1"})
    assert first.status_code == 201, first.get_data(as_text=True)
    again = send(client, "/devices", "d-1", json={"value": "0:0:0:0:0:0:0:1"})
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    other = send(client, "/devices", "d-1", json={"value": "::2"})
    assert other.status_code == 422
    assert ledger_count(app, "devices") == 1
    assert len(record_rows(app)) == 1


def test_pre_load_schema_honest_retry_replays(database_url: str) -> None:
    app = review_app(database_url)
    client = app.test_client()
    first = send(client, "/orders", "o-1", json={"amount": 5, "sentAt": "10:00"})
    assert first.status_code == 201
    retry = send(
        client,
        "/orders",
        "o-1",
        data='{"sentAt": "10:05", "amount": 5.0}',
        content_type="application/json",
    )
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.get_json() == first.get_json()
    assert send(client, "/orders", "o-1", json={"amount": 6}).status_code == 422
    assert ledger_count(app, "orders") == 1


def test_reordered_repeated_query_is_another_request(database_url: str) -> None:
    app = review_app(database_url)
    client = app.test_client()
    assert send(client, "/transfer?to=a&to=b", "q", data=b"").status_code == 201
    assert send(client, "/transfer?to=b&to=a", "q", data=b"").status_code == 422
    replay = send(client, "/transfer?to=a&to=b", "q", data=b"")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "transfer") == 1


def test_same_bytes_as_another_content_type_is_another_request(database_url: str) -> None:
    app = review_app(database_url)
    client = app.test_client()
    first = send(client, "/transfer", "ct", data='{"amount":5}', content_type="application/json")
    assert first.status_code == 201
    other = send(client, "/transfer", "ct", data='{"amount":5}', content_type="text/plain")
    assert other.status_code == 422
    assert ledger_count(app, "transfer") == 1


def test_excluded_dotted_form_field_is_left_out(database_url: str) -> None:
    app = review_app(database_url)
    client = app.test_client()
    first = send(client, "/form-order", "f", data={"order.note": "x", "client.sent_at": "10:00:00"})
    assert first.status_code == 201
    retry = send(client, "/form-order", "f", data={"order.note": "x", "client.sent_at": "10:00:05"})
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert send(client, "/form-order", "f", data={"order.note": "y"}).status_code == 422
    assert ledger_count(app, "form-order") == 1


@pytest.mark.parametrize(
    ("exclude", "error"),
    [("note", TypeError), ([1], TypeError), ([r"a\b"], ValueError), (["ok", "x\\"], ValueError)],
)
def test_wrong_exclude_is_refused_when_the_route_is_decorated(
    exclude: t.Any, error: type[Exception]
) -> None:
    with pytest.raises(error):
        testapp.idem.idempotent(exclude=exclude)
