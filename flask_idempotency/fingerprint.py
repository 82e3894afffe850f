"""The request fingerprint: normalize the payload, then SHA-256.

Two requests have the same fingerprint when they have the same method, path,
query arguments and normalized payload. An honest retry of a request always
has the fingerprint of the original:

* with a marshmallow schema, the *loaded* values of the fields the client sent
  count, so ``"500"`` and ``500`` agree where the schema says Integer; values
  the schema fills in for fields the client left out (``load_default``, fresh
  per load for a callable such as ``uuid4``) do not. Where a schema has a
  ``pre_load`` hook the extension cannot tell what was sent, so its whole
  loaded data counts there; so does loaded data that is not a dict (a
  ``post_load`` object), and keys a ``post_load`` hook adds;
* fields named in ``exclude`` (dotted paths for nested fields, applied through
  lists) are left out, before anything else is normalized;
* without a schema, a JSON body is still canonicalized; a form body
  (``application/x-www-form-urlencoded`` or ``multipart/form-data``) counts as
  its parsed fields, each name with its values in order, files by name,
  filename and SHA-256 of their content (so a new multipart boundary, the
  order of names, or ``%20`` for ``+`` change nothing); any other body counts
  as its bytes;
* canonical JSON has sorted keys and no insignificant whitespace; numbers count
  by their exact value: an integral float or Decimal of any magnitude is the
  integer of that value (``1e16`` and ``10000000000000000`` agree), other
  floats compare as IEEE doubles (``1`` and ``1.0000000000000001`` agree, as in
  RFC 8785), other Decimals by exact value. Without a schema, the string
  ``"500"`` and the number ``500`` stay different.

A payload that cannot be normalized (a lone surrogate, nesting deeper than the
parser goes, a non-finite number, an aware datetime outside the UTC range)
answers 400 and stores nothing.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import functools
import hashlib
import inspect
import io
import json
import math
import typing as t
import uuid
from decimal import Decimal

from flask import request
from marshmallow import Schema, ValidationError, fields
from werkzeug.datastructures import FileStorage
from werkzeug.exceptions import RequestEntityTooLarge

# read_body is re-exported: the request flow reads the body through this module.
from .body import read_body as read_body
from .body import read_json_body
from .errors import MalformedBodyError, PayloadTooLargeError, ValidationProblem

SchemaArg = Schema | type[Schema] | None

FORM_MIMETYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})
# Integral Decimals with more digits than Python turns into text by default are
# written as coefficient and exponent instead (no JSON integer can be that long).
_MAX_INTEGER_DIGITS = 4300
# Beyond this many decimal places, non-integral Decimals use exponent notation,
# so that "1E-999999999" does not expand into a billion zeros.
_MAX_PLAIN_PLACES = 1000


def _decimal(value: Decimal) -> int | str:
    """One form per exact value: an int when integral, else its digits as a string."""
    if not value.is_finite():
        raise MalformedBodyError("Numbers must be finite.")
    # Exact: Decimal.normalize() would round to the context's 28 digits.
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    written = "".join(map(str, digits))
    coefficient = written.rstrip("0")
    if not coefficient:
        return 0
    exponent += len(written) - len(coefficient)
    minus = "-" if sign else ""
    if exponent >= 0:
        if len(coefficient) + exponent <= _MAX_INTEGER_DIGITS:
            return int(value)
        return f"{minus}{coefficient}E+{exponent}"
    places = -exponent
    if places > _MAX_PLAIN_PLACES:
        return f"{minus}{coefficient}E{exponent}"
    if len(coefficient) > places:
        return f"{minus}{coefficient[:-places]}.{coefficient[-places:]}"
    return f"{minus}0.{coefficient.rjust(places, '0')}"


def _plain(value: t.Any) -> t.Any:
    """Turn loaded data into plain JSON types, deterministically."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedBodyError("Numbers must be finite.")
        # Exact value: 1e16 is the integer 10000000000000000, whatever its size.
        return int(value) if value.is_integer() else value
    if isinstance(value, t.Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Decimal):
        return _decimal(value)
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
        return _plain(_dataclass_fields(value))
    raise TypeError(
        f"flask_idempotency cannot fingerprint a loaded value of type {type(value).__name__}; "
        "return plain data from the schema's load (or a dataclass)"
    )


def _dataclass_fields(value: t.Any) -> dict[str, t.Any]:
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def canonical_json(value: t.Any) -> bytes:
    """Canonical JSON bytes of ``value``: sorted keys, compact, UTF-8."""
    return json.dumps(
        _plain(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    ).encode("utf-8")


def without_fields(value: t.Any, exclude: t.Iterable[str]) -> t.Any:
    """A plain copy of ``value`` without the dotted paths in ``exclude``.

    A path walks into dicts by key and applies to every element of a list, so
    ``items.note`` drops ``note`` from each item. The excluded values are
    dropped before the rest is normalized: they are never looked at.
    """
    return _plain(_without(value, [path.split(".") for path in exclude]))


def _without(node: t.Any, paths: list[list[str]]) -> t.Any:
    if not paths:
        return node
    if isinstance(node, (list, tuple)):
        return [_without(item, paths) for item in node]
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = _dataclass_fields(node)
    if not isinstance(node, t.Mapping):
        return node
    dropped = {p[0] for p in paths if len(p) == 1}
    deeper: dict[str, list[list[str]]] = {}
    for p in paths:
        if len(p) > 1:
            deeper.setdefault(p[0], []).append(p[1:])
    return {
        k: _without(v, deeper.get(str(k), [])) for k, v in node.items() if str(k) not in dropped
    }


# -- what the client sent, in the schema's loaded data ---------------------------


@functools.cache
def _has_pre_load(schema_class: type[Schema]) -> bool:
    """Whether a ``pre_load`` hook may change the data the fields see."""
    for klass in inspect.getmro(schema_class):
        for attr in vars(klass).values():
            hooks = getattr(attr, "__marshmallow_hook__", None) or {}
            # marshmallow 3 keys hooks by (tag, many), marshmallow 4 by tag.
            if any((k[0] if isinstance(k, tuple) else k) == "pre_load" for k in hooks):
                return True
    return False


def _pairwise(sent: t.Any, loaded: t.Any, each: t.Callable[[t.Any, t.Any], t.Any]) -> t.Any:
    if isinstance(sent, list) and isinstance(loaded, list) and len(sent) == len(loaded):
        return [each(s, v) for s, v in zip(sent, loaded, strict=True)]
    return loaded


def sent_only(schema: Schema, sent: t.Any, loaded: t.Any) -> t.Any:
    """``loaded`` without the values ``schema`` filled in for fields not in ``sent``.

    ``sent`` is the JSON the client sent, ``loaded`` what ``schema.load`` made
    of it. Recurses through Nested (many or not), List, Tuple and Dict values.
    Keys that are no declared field (``unknown=INCLUDE``, or added by a
    ``post_load`` hook) are kept: pruning a value a hook derived from sent data
    could let two different requests agree.
    """
    if schema.many:
        return _pairwise(sent, loaded, lambda s, v: _one_sent_only(schema, s, v))
    return _one_sent_only(schema, sent, loaded)


def _one_sent_only(schema: Schema, sent: t.Any, loaded: t.Any) -> t.Any:
    if (
        not isinstance(loaded, dict)
        or not isinstance(sent, t.Mapping)
        or _has_pre_load(type(schema))
    ):
        return loaded
    declared: dict[str, list[tuple[str, fields.Field[t.Any], bool]]] = {}
    for name, field in schema.load_fields.items():
        attribute = field.attribute or name
        data_key = field.data_key if field.data_key is not None else name
        declared.setdefault(attribute.split(".")[0], []).append((data_key, field, "." in attribute))
    result = {}
    for key, value in loaded.items():
        candidates = declared.get(key)
        if candidates is None:
            result[key] = value
            continue
        present = [c for c in candidates if c[0] in sent]
        if not present:
            continue  # the schema made this value up; the client did not send it
        if len(present) == 1 and not present[0][2]:
            data_key, field, _ = present[0]
            result[key] = _field_sent_only(field, sent[data_key], value)
        else:
            result[key] = value
    return result


def _field_sent_only(field: fields.Field[t.Any], sent: t.Any, loaded: t.Any) -> t.Any:
    if isinstance(field, fields.Pluck):
        return loaded
    if isinstance(field, fields.Nested):
        return sent_only(field.schema, sent, loaded)
    if isinstance(field, fields.List):
        inner = field.inner
        return _pairwise(sent, loaded, lambda s, v: _field_sent_only(inner, s, v))
    if isinstance(field, fields.Tuple):
        if isinstance(sent, list) and isinstance(loaded, tuple) and len(sent) == len(loaded):
            return tuple(
                _field_sent_only(f, s, v)
                for f, s, v in zip(field.tuple_fields, sent, loaded, strict=True)
            )
        return loaded
    if isinstance(field, fields.Mapping) and field.value_field is not None:
        values = field.value_field
        # marshmallow builds the loaded dict in the order of the sent one; when
        # no two keys merged, the two line up item by item.
        if (
            isinstance(sent, t.Mapping)
            and isinstance(loaded, t.Mapping)
            and len(sent) == len(loaded)
        ):
            return {
                key: _field_sent_only(values, s, v)
                for s, (key, v) in zip(sent.values(), loaded.items(), strict=True)
            }
    return loaded


# -- forms ------------------------------------------------------------------------


def _file_digest(storage: FileStorage) -> str:
    stream = storage.stream
    start = stream.tell()
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(64 * 1024), b""):
        digest.update(block)
    stream.seek(start)  # the view reads the file from where it was
    return digest.hexdigest()


def _form_fields() -> dict[str, list[t.Any]] | None:
    """The parsed form as ``{name: [value or file, ...]}``; ``None`` if it does not parse."""
    try:
        parsed: dict[str, list[t.Any]] = {
            name: list(values) for name, values in request.form.lists()
        }
        for name, storages in request.files.lists():
            parsed.setdefault(name, []).extend(
                {"filename": s.filename, "sha256": _file_digest(s)} for s in storages
            )
        if parsed:
            return parsed
        # werkzeug answers an unparseable form with an empty one: tell them apart.
        body = read_body()
        parser = request.make_form_data_parser()
        parser.silent = False
        parser.parse(io.BytesIO(body), request.mimetype, len(body), request.mimetype_params)
    except RequestEntityTooLarge:
        raise PayloadTooLargeError(
            "The form is larger than this server accepts (MAX_FORM_MEMORY_SIZE, MAX_FORM_PARTS)."
        ) from None
    except ValueError:
        return None
    return parsed


# -- the fingerprint --------------------------------------------------------------


def _load(schema: Schema, raw: t.Any) -> t.Any:
    try:
        return schema.load(raw)
    except ValidationError as exc:
        raise ValidationProblem(
            "The request body failed validation.", extra={"errors": exc.messages}
        ) from exc
    except RecursionError:
        raise MalformedBodyError("The JSON body is nested too deeply.") from None


def load_payload(schema: Schema | None) -> t.Any:
    """Read the request payload.

    With a schema, the payload is what ``schema.load`` returned; validation errors
    answer 422 with marshmallow's messages under ``errors``. Without one, a JSON
    body is parsed and any other body is returned as bytes.
    """
    if schema is not None:
        return _load(schema, read_json_body())
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


def _normalized(value: t.Any, exclude: t.Sequence[str]) -> bytes:
    try:
        return canonical_json(without_fields(value, exclude))
    except RecursionError:
        raise MalformedBodyError("The body is nested too deeply.") from None
    except (OverflowError, ValueError) as exc:  # e.g. 0001-01-01T00:00+14:00 in UTC
        raise MalformedBodyError(f"The body holds a value that cannot be compared: {exc}") from exc


def request_fingerprint(schema: Schema | None, exclude: t.Sequence[str]) -> tuple[t.Any, str]:
    """Load the current request's payload and fingerprint it: ``(payload, hash)``."""
    if schema is not None:
        raw = read_json_body()
        payload = _load(schema, raw)
        try:
            covered = sent_only(schema, raw, payload)
        except RecursionError:
            raise MalformedBodyError("The JSON body is nested too deeply.") from None
        normalized = _normalized(covered, exclude)
    else:
        payload = load_payload(None)
        if not isinstance(payload, bytes):
            normalized = _normalized(payload, exclude)
        elif payload and request.mimetype in FORM_MIMETYPES:
            form = _form_fields()
            # A form that does not parse counts as its bytes, like any other body.
            normalized = payload if form is None else b"form:" + _normalized(form, exclude)
        else:
            normalized = payload
    query = [(k, v) for k, values in request.args.lists() for v in values]
    return payload, compute(request.method, request.path, query, normalized)


def resolve_schema(schema: SchemaArg) -> Schema | None:
    """Accept a schema instance or class; instantiate a class once."""
    if schema is None or isinstance(schema, Schema):
        return schema
    if isinstance(schema, type) and issubclass(schema, Schema):
        return schema()
    raise TypeError(f"schema must be a marshmallow Schema instance or class, not {schema!r}")
