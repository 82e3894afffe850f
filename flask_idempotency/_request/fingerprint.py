"""The request fingerprint: normalize the payload, then SHA-256, or
HMAC-SHA256 under ``IDEMPOTENCY_FINGERPRINT_KEY`` (over the same bytes).

Two requests have the same fingerprint when they have the same method, path,
query arguments, media type of the body and normalized payload. An honest retry
of a request always has the fingerprint of the original:

* query arguments count sorted by name, each name's values in the order sent
  (``?to=a&to=b`` is not ``?to=b&to=a``);
* the media type counts when there is a body, lower-cased and without its
  parameters (``text/plain`` is not ``application/json``; ``; charset=utf-8``
  changes nothing);
* with a marshmallow schema, the *loaded* values of the fields the client sent
  count, so ``"500"`` and ``500`` agree where the schema says Integer; values
  the schema fills in for fields the client left out (``load_default``, fresh
  per load for a callable such as ``uuid4``) do not. Where a schema level has a
  ``pre_load`` hook the extension cannot tell what the hook made of the data,
  so there the JSON the client sent counts, canonicalized: key order, spacing
  and number spelling change nothing, ``"500"`` and ``500`` differ. Loaded data
  that is not a dict (a ``post_load`` object) counts whole, and so do keys a
  ``post_load`` hook adds;
* fields named in ``exclude`` are left out, before anything else is
  normalized: dotted paths for nested fields (applied through lists), where
  ``\\.`` is a dot inside a name and ``\\\\`` a backslash; at a ``pre_load``
  level a name drops the field's data key as sent (and a key of that name);
* without a schema, a JSON body is still canonicalized; a form body counts as
  its parsed fields (see :mod:`.forms`), whoever parsed it first; any other
  body counts as its bytes;
* canonical JSON has sorted keys and no insignificant whitespace; numbers count
  by their exact value: an integral float or Decimal of any magnitude is the
  integer of that value (``1e16`` and ``10000000000000000`` agree), other
  floats compare as IEEE doubles (``1`` and ``1.0000000000000001`` agree, as in
  RFC 8785), other Decimals by exact value. Without a schema, the string
  ``"500"`` and the number ``500`` stay different.

Every value marshmallow's own fields load into has a canonical form (ipaddress
objects and timedeltas among them). A loaded value of a type the fingerprint
does not know is a programming error: a ``TypeError`` that names the field,
the type and the schema, at the first request that carries it.

A payload that cannot be normalized (a lone surrogate, nesting deeper than the
parser goes, a non-finite number, an aware datetime outside the UTC range)
answers 400 and stores nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import inspect
import operator
import typing as t

from flask import request
from marshmallow import Schema, ValidationError, fields

from ..errors import MalformedBodyError, ValidationProblem
from .body import parse_json, read_json_body

# read_body and stored_request_body are re-exported: the request flow reads the
# body, and the request it stores for recovery, through this module.
from .body import read_body as read_body
from .canonical import UnknownValueError as UnknownValueError
from .canonical import canonical_json as canonical_json
from .canonical import json_string
from .forms import FORM_MIMETYPES, form_fields
from .forms import consumed as form_consumed
from .forms import stored_request_body as stored_request_body
from .paths import Path, _split_paths, _without
from .paths import exclude_paths as exclude_paths
from .paths import without_fields as without_fields
from .wsgi import parses_environ

SchemaArg = Schema | type[Schema] | None

# -- what the client sent, in the schema's loaded data ---------------------------


@functools.cache
def hook_tags(schema_class: type[Schema]) -> frozenset[str]:
    """The tags of the hooks ``schema_class`` (or a base) declares (``pre_load``...)."""
    found: set[str] = set()
    for klass in inspect.getmro(schema_class):
        for attr in vars(klass).values():
            hooks = getattr(attr, "__marshmallow_hook__", None) or {}
            # marshmallow 3 keys hooks by (tag, many), marshmallow 4 by tag.
            found.update(k[0] if isinstance(k, tuple) else k for k in hooks)
    return frozenset(found)


def _has_pre_load(schema_class: type[Schema]) -> bool:
    """Whether a ``pre_load`` hook may change the data the fields see."""
    return "pre_load" in hook_tags(schema_class)


def _pairwise(sent: t.Any, loaded: t.Any, each: t.Callable[[t.Any, t.Any], t.Any]) -> t.Any:
    if isinstance(sent, list) and isinstance(loaded, list) and len(sent) == len(loaded):
        return [each(s, v) for s, v in zip(sent, loaded, strict=True)]
    return loaded


def sent_only(schema: Schema, sent: t.Any, loaded: t.Any, exclude: t.Sequence[Path] = ()) -> t.Any:
    """What counts of ``loaded``, the data ``schema.load`` made of the JSON ``sent``.

    The loaded values of the fields the client sent, without the values
    ``schema`` filled in for fields not in ``sent``; recurses through Nested
    (many or not), Pluck, List, Tuple and Dict values. Keys that are no
    declared field (``unknown=INCLUDE``, or added by a ``post_load`` hook) are
    kept: pruning a value a hook derived from sent data could let two different
    requests agree. At a schema level with a ``pre_load`` hook, what counts is
    ``sent`` itself, without the data keys of the fields in ``exclude`` (the
    paths still to apply at this level). The other excluded fields are left for
    :func:`without_fields`.
    """
    if _has_pre_load(type(schema)):
        return _as_sent(schema, sent, exclude)
    if schema.many:
        return _pairwise(sent, loaded, lambda s, v: _one_sent_only(schema, s, v, exclude))
    return _one_sent_only(schema, sent, loaded, exclude)


def _one_sent_only(schema: Schema, sent: t.Any, loaded: t.Any, exclude: t.Sequence[Path]) -> t.Any:
    if not isinstance(loaded, dict) or not isinstance(sent, t.Mapping):
        return loaded
    declared: dict[str, list[tuple[str, fields.Field[t.Any], bool]]] = {}
    for name, field in schema.load_fields.items():
        attribute = field.attribute or name
        data_key = field.data_key if field.data_key is not None else name
        declared.setdefault(attribute.split(".")[0], []).append((data_key, field, "." in attribute))
    dropped, deeper = _split_paths(exclude)
    result = {}
    for key, value in loaded.items():
        if key in dropped:
            continue  # excluded: never looked at
        candidates = declared.get(key)
        if candidates is None:
            result[key] = value
            continue
        present = [c for c in candidates if c[0] in sent]
        if not present:
            continue  # the schema made this value up; the client did not send it
        if len(present) == 1 and not present[0][2]:
            data_key, field, _ = present[0]
            result[key] = _field_sent_only(field, sent[data_key], value, deeper.get(key, []))
        else:
            result[key] = value
    return result


def _field_sent_only(
    field: fields.Field[t.Any], sent: t.Any, loaded: t.Any, exclude: t.Sequence[Path]
) -> t.Any:
    if isinstance(field, fields.Pluck):
        # What the nested schema loaded: the plucked value under its data key.
        plucked = field.schema.fields[field.field_name]
        key = plucked.data_key if plucked.data_key is not None else field.field_name
        wrapped = [{key: s} for s in sent] if field.many and isinstance(sent, list) else {key: sent}
        return sent_only(field.schema, wrapped, loaded, exclude)
    if isinstance(field, fields.Nested):
        return sent_only(field.schema, sent, loaded, exclude)
    if isinstance(field, fields.List):
        inner = field.inner
        return _pairwise(sent, loaded, lambda s, v: _field_sent_only(inner, s, v, exclude))
    if isinstance(field, fields.Tuple):
        if isinstance(sent, list) and isinstance(loaded, tuple) and len(sent) == len(loaded):
            return tuple(
                _field_sent_only(f, s, v, exclude)
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
            _, deeper = _split_paths(exclude)
            return {
                key: _field_sent_only(values, s, v, deeper.get(str(key), []))
                for s, (key, v) in zip(sent.values(), loaded.items(), strict=True)
            }
    return loaded


# A string: marshmallow 3's Field is not subscriptable at run time.
Shape: t.TypeAlias = "Schema | fields.Field[t.Any] | None"


def _as_sent(shape: Shape, sent: t.Any, exclude: t.Sequence[Path]) -> t.Any:
    """``sent`` as the client sent it, without the excluded fields' data keys.

    ``shape`` (a schema, a field or ``None``) says which data key each field
    name stands for; a name also drops a key spelled like it.
    """
    if not exclude:
        return sent
    if isinstance(sent, list):
        return [_as_sent(_item_shape(shape, i), item, exclude) for i, item in enumerate(sent)]
    if not isinstance(sent, dict):
        return sent
    schema = shape.schema if isinstance(shape, fields.Nested) else shape
    by_key: dict[str, fields.Field[t.Any]] = {}
    keys_of: dict[str, set[str]] = {}
    if isinstance(schema, Schema):
        for name, field in schema.load_fields.items():
            key = field.data_key if field.data_key is not None else name
            by_key[key] = field
            keys_of.setdefault(field.attribute or name, set()).add(key)
    values = shape.value_field if isinstance(shape, fields.Mapping) else None
    dropped, deeper = _split_paths(
        (key, *rest) for head, *rest in exclude for key in {head, *keys_of.get(head, ())}
    )
    return {
        key: _as_sent(by_key.get(key, values), value, deeper.get(key, []))
        for key, value in sent.items()
        if key not in dropped
    }


def _item_shape(shape: Shape, index: int) -> Shape:
    if isinstance(shape, fields.List):
        return shape.inner
    if isinstance(shape, fields.Tuple):
        tuple_fields = shape.tuple_fields
        return tuple_fields[index] if index < len(tuple_fields) else None
    return shape  # a schema or Nested with many=True: each item is one of it


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
    body = read_body()
    if body and request.is_json:
        return parse_json(body)
    return body


@functools.lru_cache(maxsize=16)
def keyed_hmac(key: bytes) -> hmac.HMAC:
    """The HMAC-SHA256 of ``key`` before any input, built once per key: each
    fingerprint ``.copy()``-s it rather than hashing the key's pads again."""
    return hmac.new(key, digestmod="sha256")


def compute(
    method: str,
    path: str,
    query: t.Iterable[tuple[str, str]],
    payload: bytes,
    mimetype: str | None = None,
    *,
    key: bytes | None = None,
    bound: bytes = b"",
) -> str:
    """SHA-256 (hex) of method, path, query arguments, media type and payload
    bytes; with ``key`` (``IDEMPOTENCY_FINGERPRINT_KEY``), HMAC-SHA256 of
    ``bound`` (the record's framed scope and key, :func:`bound_to`) and the same:
    a keyed fingerprint differs across records, so a reader of the table who is
    also a client cannot confirm a guess by sending it in a scope of their own.

    Query arguments are sorted by name only: each name keeps its values in the
    order given. ``mimetype`` is the body's media type (``None`` without a body).
    """
    ordered = sorted(query, key=operator.itemgetter(0)) if query else []
    # A JSON array ends where it ends: no part can run into the next one.
    # json.dumps([method, path, ordered, mimetype], separators=(",", ":")).
    args = ",".join(f"[{json_string(k)},{json_string(v)}]" for k, v in ordered)
    kind = "null" if mimetype is None else json_string(mimetype)
    head = f"[{json_string(method.upper())},{json_string(path)},[{args}],{kind}]"
    digest: hmac.HMAC | hashlib._Hash
    if key is None:
        digest = hashlib.sha256(head.encode("ascii"))
    else:
        digest = keyed_hmac(key).copy()
        digest.update(bound)
        digest.update(head.encode("ascii"))
    digest.update(b"\x00")
    digest.update(payload)
    return digest.hexdigest()


def bound_to(scope: str, idempotency_key: str) -> bytes:
    """What binds a keyed fingerprint to its record: the scope and the key, each
    length-prefixed (no two records share these bytes)."""
    parts = (scope.encode("utf-8"), idempotency_key.encode("utf-8"))
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def _normalized(value: t.Any, exclude: t.Sequence[Path]) -> bytes:
    try:
        return canonical_json(_without(value, exclude))
    except RecursionError:
        raise MalformedBodyError("The body is nested too deeply.") from None
    except (OverflowError, ValueError) as exc:  # e.g. 0001-01-01T00:00+14:00 in UTC
        raise MalformedBodyError(f"The body holds a value that cannot be compared: {exc}") from exc


# Not frozen: a frozen dataclass sets each field by object.__setattr__ (slow).
@dataclasses.dataclass(slots=True)
class NormalizedRequest:
    """The current request, normalized once: everything its fingerprint counts
    but the path, so the hash for another path costs one SHA-256 of these bytes
    (the 422's check whether only the route differs), not another parse."""

    method: str
    query: tuple[tuple[str, str], ...]
    body: bytes
    mimetype: str | None
    #: What the body was normalized from (the schema, the JSON sent and what
    #: the schema loaded), for :meth:`renormalized`.
    schema: Schema | None = dataclasses.field(default=None, repr=False, compare=False)
    raw: t.Any = dataclasses.field(default=None, repr=False, compare=False)
    payload: t.Any = dataclasses.field(default=None, repr=False, compare=False)
    #: The fingerprint's key (``IDEMPOTENCY_FINGERPRINT_KEY``); ``None``: SHA-256.
    key: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    #: The record it is for (:func:`bound_to`), counted first by a keyed fingerprint.
    bound: bytes = dataclasses.field(default=b"", repr=False, compare=False)

    def fingerprint(self, path: str) -> str:
        """The hash of this request as sent to ``path``."""
        return compute(
            self.method, path, self.query, self.body, self.mimetype, key=self.key, bound=self.bound
        )

    def renormalized(
        self, exclude: t.Iterable[str], form_ignored: t.Collection[str] = ()
    ) -> NormalizedRequest:
        """This request normalized with other excluded (and ignored form) fields,
        under the same schema (and key): the payload is not loaded again."""
        return _normalize(
            self.schema, self.raw, self.payload, exclude, form_ignored, self.key, self.bound
        )


def normalize_request(
    schema: Schema | None,
    exclude: t.Iterable[str],
    form_ignored: t.Collection[str] = (),
    key: bytes | None = None,
    bound: bytes = b"",
) -> tuple[t.Any, NormalizedRequest]:
    """Load the current request's payload and normalize it: ``(payload, normalized)``.

    ``form_ignored`` names the fields of a form body that never count (the
    form's key, the CSRF token: both change with each rendering of one form).
    ``key``: the fingerprint's (``IDEMPOTENCY_FINGERPRINT_KEY``), if any;
    ``bound``: the record's scope and key (:func:`bound_to`) a keyed one counts."""
    if schema is not None:
        raw = read_json_body()
        payload = _load(schema, raw)
    else:
        raw = payload = load_payload(None)
    return payload, _normalize(schema, raw, payload, exclude, form_ignored, key, bound)


def _normalize(
    schema: Schema | None,
    raw: t.Any,
    payload: t.Any,
    exclude: t.Iterable[str],
    form_ignored: t.Collection[str],
    key: bytes | None = None,
    bound: bytes = b"",
) -> NormalizedRequest:
    paths = exclude_paths(exclude)
    req = request._get_current_object()  # type: ignore[attr-defined]
    if schema is not None:
        try:
            normalized = _normalized(sent_only(schema, raw, payload, paths), paths)
        except RecursionError:
            raise MalformedBodyError("The JSON body is nested too deeply.") from None
        except UnknownValueError as exc:
            exc.schema_name = type(schema).__qualname__
            raise
    elif not isinstance(payload, bytes):
        normalized = _normalized(payload, paths)
    elif req.mimetype in FORM_MIMETYPES and (payload or form_consumed()):
        form = form_fields()
        if form is not None and form_ignored:
            form = {name: v for name, v in form.items() if name not in form_ignored}
        # A form that does not parse counts as its bytes, like any other body.
        normalized = payload if form is None else b"form:" + _normalized(form, paths)
    else:
        normalized = payload
    # No query string: werkzeug's parse skipped (not args a hook or class gave).
    parsed = req.environ.get("QUERY_STRING") or not parses_environ(req, "args")
    pairs = req.args.lists() if parsed else ()
    query = tuple((k, v) for k, values in pairs for v in values)
    mimetype = req.mimetype if normalized else None
    return NormalizedRequest(
        req.method,
        query,
        normalized,
        mimetype,
        schema=schema,
        raw=raw,
        payload=payload,
        key=key,
        bound=bound,
    )


def request_fingerprint(
    schema: Schema | None,
    exclude: t.Iterable[str],
    form_ignored: t.Collection[str] = (),
    *,
    path: str | None = None,
    key: bytes | None = None,
) -> tuple[t.Any, str]:
    """Load the current request's payload and fingerprint it: ``(payload, hash)``.

    ``form_ignored`` and ``key`` as for :func:`normalize_request`. ``path``: the
    hash as if the same request had been sent to that path; default the request's own."""
    payload, normalized = normalize_request(schema, exclude, form_ignored, key)
    return payload, normalized.fingerprint(request.path if path is None else path)


def resolve_schema(schema: SchemaArg) -> Schema | None:
    """Accept a schema instance or class; instantiate a class once."""
    if schema is None or isinstance(schema, Schema):
        return schema
    if isinstance(schema, type) and issubclass(schema, Schema):
        return schema()
    raise TypeError(f"schema must be a marshmallow Schema instance or class, not {schema!r}")
