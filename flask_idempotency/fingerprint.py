"""The request fingerprint: normalize the payload, then SHA-256.

Two requests have the same fingerprint when they have the same method, path,
query arguments and normalized payload:

* with a marshmallow schema, the *loaded* data counts, so ``"500"`` and ``500``
  agree where the schema says Integer, and fields named in ``exclude`` (dotted
  paths for nested fields) are left out;
* without a schema, a JSON body is still canonicalized; any other body counts as
  its bytes;
* canonical JSON has sorted keys, no insignificant whitespace, and integral
  floats written as integers (``500.0`` and ``500`` agree, as in RFC 8785).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import hashlib
import json
import typing as t
import uuid
from decimal import Decimal

from flask import request
from marshmallow import Schema, ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from .errors import (
    MalformedBodyError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
    ValidationProblem,
)

SchemaArg = Schema | type[Schema] | None

_MAX_SAFE_INTEGER = 2**53


def _plain(value: t.Any) -> t.Any:
    """Turn loaded data into plain JSON types, deterministically."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise MalformedBodyError("Numbers must be finite.")
        if value.is_integer() and abs(value) < _MAX_SAFE_INTEGER:
            return int(value)
        return value
    if isinstance(value, t.Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise MalformedBodyError("Numbers must be finite.")
        # One plain form per value: 1.50 == 1.5, 500.00 == 500, -0 == 0.
        return "0" if value.is_zero() else format(value.normalize(), "f")
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        # The same instant written with different offsets is the same payload.
        return value.astimezone(dt.timezone.utc).isoformat()
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    raise TypeError(
        f"flask_idempotency cannot fingerprint a loaded value of type {type(value).__name__}; "
        "return plain data from the schema's load (or a dataclass)"
    )


def canonical_json(value: t.Any) -> bytes:
    """Canonical JSON bytes of ``value``: sorted keys, compact, UTF-8."""
    return json.dumps(
        _plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def without_fields(value: t.Any, exclude: t.Iterable[str]) -> t.Any:
    """A copy of ``value`` without the dotted paths in ``exclude``.

    A path walks into dicts by key and applies to every element of a list, so
    ``items.note`` drops ``note`` from each item.
    """
    result = _plain(value)
    for path in exclude:
        _drop(result, path.split("."))
    return result


def _drop(node: t.Any, parts: list[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _drop(item, parts)
        return
    if not isinstance(node, dict) or parts[0] not in node:
        return
    if len(parts) == 1:
        del node[parts[0]]
    else:
        _drop(node[parts[0]], parts[1:])


def _reject_constant(name: str) -> t.NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def read_json_body() -> t.Any:
    """Parse the request body as strict JSON, answering problem+json when it is not."""
    if not request.is_json:
        raise UnsupportedMediaTypeError(
            "This endpoint takes a JSON body (Content-Type: application/json), "
            f"got {request.mimetype or 'no content type'}."
        )
    data = read_body()
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedBodyError(f"The body is not valid JSON: {exc}") from exc


def read_body() -> bytes:
    """The raw body, cached for the view; over ``MAX_CONTENT_LENGTH`` is 413."""
    try:
        return request.get_data(cache=True)
    except RequestEntityTooLarge as exc:
        raise PayloadTooLargeError(
            f"The body is larger than this server accepts ({request.max_content_length} bytes)."
        ) from exc


def load_payload(schema: Schema | None) -> t.Any:
    """Read the request payload.

    With a schema, the payload is what ``schema.load`` returned; validation errors
    answer 422 with marshmallow's messages under ``errors``. Without one, a JSON
    body is parsed and any other body is returned as bytes.
    """
    if schema is not None:
        raw = read_json_body()
        try:
            return schema.load(raw)
        except ValidationError as exc:
            raise ValidationProblem(
                "The request body failed validation.", extra={"errors": exc.messages}
            ) from exc
    if request.is_json and read_body():
        return read_json_body()
    return read_body()


def compute(method: str, path: str, query: t.Iterable[tuple[str, str]], payload: bytes) -> str:
    """SHA-256 (hex) of method, path, sorted query arguments and payload bytes."""
    digest = hashlib.sha256()
    digest.update(method.upper().encode("ascii"))
    digest.update(b"\x00")
    digest.update(path.encode("utf-8", "surrogateescape"))
    digest.update(b"\x00")
    digest.update(canonical_json(sorted(query)))
    digest.update(b"\x00")
    digest.update(payload)
    return digest.hexdigest()


def request_fingerprint(schema: Schema | None, exclude: t.Sequence[str]) -> tuple[t.Any, str]:
    """Load the current request's payload and fingerprint it: ``(payload, hash)``."""
    payload = load_payload(schema)
    if isinstance(payload, bytes):
        normalized = payload
    else:
        normalized = canonical_json(without_fields(payload, exclude))
    query = [(k, v) for k, values in request.args.lists() for v in values]
    return payload, compute(request.method, request.path, query, normalized)


def resolve_schema(schema: SchemaArg) -> Schema | None:
    """Accept a schema instance or class; instantiate a class once."""
    if schema is None or isinstance(schema, Schema):
        return schema
    if isinstance(schema, type) and issubclass(schema, Schema):
        return schema()
    raise TypeError(f"schema must be a marshmallow Schema instance or class, not {schema!r}")
