"""What a protected operation's OpenAPI document shows, and what an unprotected
one must not: the checks every framework's spec goes through."""

from __future__ import annotations

import re
import typing as t

from openapi_spec_validator import validate

from flask_idempotency.errors import PROBLEM_JSON, PROBLEM_TYPE_BASE

PROBLEM_STATUSES = ("400", "409", "422", "503")


def valid(spec: dict[str, t.Any]) -> dict[str, t.Any]:
    """``spec``, after openapi-spec-validator found it valid (3.0 or 3.1, as it says)."""
    validate(spec)  # type: ignore[arg-type]
    return spec


def operation(spec: dict[str, t.Any], path: str, method: str) -> dict[str, t.Any]:
    return t.cast(dict[str, t.Any], spec["paths"][path][method])


def key_parameter(op: dict[str, t.Any], header: str = "Idempotency-Key") -> dict[str, t.Any]:
    found = [p for p in op.get("parameters", []) if p.get("in") == "header" and p["name"] == header]
    assert len(found) == 1, op.get("parameters")
    return t.cast(dict[str, t.Any], found[0])


def problem_types(op: dict[str, t.Any], status: str) -> list[str]:
    """The problem type URIs ``op`` documents for ``status``, checked against the
    examples (one per type, each its own problem document) and the shared schema."""
    content = response(op, status)["content"][PROBLEM_JSON]
    schema = content["schema"]["allOf"]
    assert schema[0] == {"$ref": "#/components/schemas/IdempotencyProblem"}
    types = t.cast(list[str], schema[1]["properties"]["type"]["enum"])
    assert response(op, status)["x-problem-types"] == types
    examples = content["examples"]
    assert sorted(examples) == sorted(uri.removeprefix(PROBLEM_TYPE_BASE) for uri in types)
    for slug, example in examples.items():
        assert example["value"]["type"] == PROBLEM_TYPE_BASE + slug
        assert example["value"]["status"] == int(status)
    return [uri.removeprefix(PROBLEM_TYPE_BASE) for uri in types]


def response(op: dict[str, t.Any], status: str) -> dict[str, t.Any]:
    responses = op["responses"]
    found = responses.get(status, responses.get(int(status)) if status.isdigit() else None)
    return t.cast(dict[str, t.Any], found)


def assert_protected(
    spec: dict[str, t.Any],
    path: str,
    method: str,
    *,
    required: bool,
    ttl_seconds: float,
    max_length: int = 255,
    pattern: str | None = None,
    uuid: bool = False,
    success: str = "200",
    header: str = "Idempotency-Key",
) -> dict[str, t.Any]:
    """Everything the plugin adds to one protected operation; its ``x-idempotency``."""
    op = operation(spec, path, method)
    parameter = key_parameter(op, header)
    assert parameter["required"] is required
    schema = parameter["schema"]
    assert schema["type"] == "string"
    assert schema["maxLength"] == max_length
    assert schema["minLength"] == 1
    if uuid:
        assert schema["format"] == "uuid"
        assert re.fullmatch(schema["pattern"], "8e03978e-40d5-43e8-bc93-6894a57f9324")
        assert not re.search(schema["pattern"], "not-a-uuid")
    else:
        assert "format" not in schema
    if pattern is not None:
        assert schema["pattern"] == f"^(?=[ -~]*$)(?:{pattern})$"
    elif not uuid:
        assert "pattern" not in schema

    bad_request = problem_types(op, "400")
    assert ("missing-key" in bad_request) is required
    assert {"invalid-key", "malformed-body"} <= set(bad_request)
    assert problem_types(op, "409") == ["request-in-progress", "transaction-conflict", "lease-lost"]
    assert "key-reused" in problem_types(op, "422")
    assert problem_types(op, "503") == ["database-unavailable", "server-misconfigured"]
    for status in ("409", "503"):
        assert "Retry-After" in response(op, status)["headers"]
    for status, answer in op["responses"].items():  # every answer to a keyed request
        assert header in answer["headers"], status  # echoes the key (shared ones copied)

    headers = response(op, success)["headers"]
    assert headers["Idempotent-Replayed"]["schema"] == {"type": "string", "enum": ["true"]}
    assert header in headers

    extension = t.cast(dict[str, t.Any], op["x-idempotency"])
    assert extension["header"] == header
    assert extension["required"] is required
    assert extension["ttl_seconds"] == ttl_seconds
    assert extension["key_max_length"] == max_length
    assert "ttl_seconds" in extension["expiry"]
    return extension


def assert_unprotected(spec: dict[str, t.Any], path: str, method: str) -> None:
    """Nothing of the plugin's on ``path``'s ``method`` operation."""
    op = operation(spec, path, method)
    assert not [p for p in op.get("parameters", []) if p.get("in") == "header"]
    assert "x-idempotency" not in op
    for status, answer in op["responses"].items():
        assert PROBLEM_JSON not in answer.get("content", {}), (path, method, status)
        assert "Idempotent-Replayed" not in answer.get("headers", {}), (path, method, status)
