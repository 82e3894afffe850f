"""The fingerprint rules' version, and the request's digest: what lets a
retry be judged across a deploy that changed how a route fingerprints.

A fingerprint depends on the route's rules: its schema, its excluded fields,
the form fields it ignores, the library's canonical form and the fingerprint
key. A record keeps, beside its fingerprint, the version of the rules that
made it (:func:`rules_version`: 16 hex digits of a SHA-256 over a canonical
description of them) and a digest of the request as sent (:func:`request_digest`:
method, path, raw query string, content type and body bytes, which an honest
retry repeats byte for byte). A retry whose route's rules are those of the
record (or of a record from before this feature) is judged by its fingerprint;
one made under other rules is judged by the digest (:func:`judge`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import typing as t
import weakref

from flask import Flask, current_app, request
from marshmallow import Schema, fields, missing

from .._context import app_state, resolve_app
from .._secrets import FINGERPRINT_KEY, fingerprint_keys
from .._storage import Record
from ..errors import RulesChangedError
from . import canonical
from .canonical import canonical_json, json_string
from .fingerprint import exclude_paths, hook_tags, keyed_hmac, read_body
from .forms import FORM_MIMETYPES, form_fields
from .route import RouteOptions

#: Hex digits of a rules version (and of the fingerprint key's identity).
_VERSION_DIGITS = 16
#: What the fingerprint key's identity is an HMAC of (never the key itself).
_KEY_ID_INPUT = b"flask-idempotency fingerprint key identity"
#: Hooks that change what the fields load, and so what the fingerprint counts.
_LOAD_HOOKS = ("pre_load", "post_load")

# Per route (by identity, dropped with it) and rules inputs: the version.
_versions: weakref.WeakKeyDictionary[RouteOptions, dict[t.Hashable, str]] = (
    weakref.WeakKeyDictionary()
)
_versions_lock = threading.Lock()
# Per app: the versions of all its protected routes (:func:`app_versions`).
_app_versions: weakref.WeakKeyDictionary[Flask, tuple[int, frozenset[str]]] = (
    weakref.WeakKeyDictionary()
)


def _options(value: t.Any) -> t.Any:
    """A schema option (``only``, ``exclude``, ``partial``...) as JSON data."""
    if isinstance(value, (set, frozenset, tuple, list)):
        return sorted(str(item) for item in value)
    return value if value is None or isinstance(value, (bool, int, str)) else repr(value)


def describe_schema(schema: Schema, seen: tuple[type[Schema], ...] = ()) -> t.Any:
    """What of ``schema`` decides what its load gives the fingerprint: its
    class, options and load hooks, and each load field's shape (recursively
    through nested schemas; a schema nested in itself is named, not entered)."""
    klass = type(schema)
    name = f"{klass.__module__}.{klass.__qualname__}"
    if klass in seen:
        return {"schema": name, "recursive": True}
    inner = (*seen, klass)
    return {
        "schema": name,
        "options": {
            option: _options(getattr(schema, option, None))
            for option in ("unknown", "many", "partial", "only", "exclude")
        },
        "hooks": sorted(hook_tags(klass).intersection(_LOAD_HOOKS)),
        "fields": [
            _describe_field(field_name, field, inner)
            for field_name, field in sorted(schema.load_fields.items())
        ],
    }


def _describe_field(name: str, field: fields.Field[t.Any], seen: tuple[type[Schema], ...]) -> t.Any:
    klass = type(field)
    shape: dict[str, t.Any] = {
        "name": name,
        "type": f"{klass.__module__}.{klass.__qualname__}",
        "data_key": field.data_key,
        "attribute": field.attribute,
        "required": field.required,
        "allow_none": field.allow_none,
        "load_default": field.load_default is not missing,
    }
    shape["params"] = _field_params(field)
    if isinstance(field, fields.Pluck):
        shape["pluck"] = field.field_name
    if isinstance(field, fields.Nested):
        shape["nested"] = describe_schema(field.schema, seen)
        shape["many"] = bool(getattr(field, "many", False))
    elif isinstance(field, fields.List):
        shape["inner"] = _describe_field("", field.inner, seen)
    elif isinstance(field, fields.Tuple):
        shape["items"] = [_describe_field("", f, seen) for f in field.tuple_fields]
    elif isinstance(field, fields.Mapping):
        for part in ("key_field", "value_field"):
            sub = getattr(field, part)
            shape[part] = None if sub is None else _describe_field("", sub, seen)
    return shape


# A field's attributes the description leaves out of its parameters: named
# above already, described through nested schemas and inner fields, or not
# deciding what a load gives (validators, messages, metadata, dump options).
_NOT_PARAMS = frozenset(
    (
        "name",
        "parent",
        "root",
        "metadata",
        "error_messages",
        "validate",
        "validators",
        "dump_default",
        "load_default",
        "attribute",
        "data_key",
        "required",
        "allow_none",
        "load_only",
        "dump_only",
        "as_string",
        "serialize_func",
        "choices_text",
        "nested",
        "only",
        "exclude",
        "many",
        "unknown",
        "inner",
        "tuple_fields",
        "key_field",
        "value_field",
        "field_name",
    )
)


def _field_params(field: fields.Field[t.Any]) -> dict[str, t.Any]:
    """A field's other load parameters (``fields.Decimal``'s ``places``, a
    ``DateTime``'s ``format``, an ``Enum``'s ``by_value``, ``strict``, the
    field's own load hooks...): each public attribute of the instance, as
    data that is the same in every process (a class or function by its
    qualified name, never a ``repr`` that holds an address)."""
    return {
        name: _param(value)
        for name, value in sorted(vars(field).items())
        if not name.startswith("_") and name not in _NOT_PARAMS
    }


def _param(value: t.Any) -> t.Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, fields.Field):
        return _describe_field("", value, ())
    if isinstance(value, (set, frozenset)):
        return sorted(str(_param(item)) for item in value)
    if isinstance(value, (list, tuple)):
        return [_param(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _param(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, type) or callable(value):
        name = getattr(value, "__qualname__", type(value).__qualname__)
        return f"{getattr(value, '__module__', '')}.{name}"
    text = repr(value)
    if " at 0x" in text:  # a default repr: an address, other in every process
        return f"{type(value).__module__}.{type(value).__qualname__}"
    return text


def key_identity(key: bytes | None) -> str | None:
    """A short name of the fingerprint key: an HMAC of a constant under it
    (never the key, nor anything that helps guess it); ``None`` without one."""
    if key is None:
        return None
    return hmac.new(key, _KEY_ID_INPUT, "sha256").hexdigest()[:_VERSION_DIGITS]


def configured_form_ignored(form_field: str | None) -> tuple[str, ...]:
    """The form fields a route never counts, as configured (the form key's
    field, Flask-WTF's CSRF token): whether or not this request is a form."""
    csrf = current_app.config.get("WTF_CSRF_FIELD_NAME") or "csrf_token"
    return tuple(sorted({name for name in (form_field, csrf) if name}))


def compute_version(
    schema: Schema | None,
    exclude: t.Iterable[str],
    form_ignored: t.Iterable[str],
    key: bytes | None,
    view: str = "",
) -> str:
    """The rules version of a route: 16 hex digits of a SHA-256 over the
    canonical form's version, the view's name, the schema's description, the
    excluded paths and ignored form fields (sorted) and the fingerprint key's
    identity. The view's name keeps two routes with alike rules apart: a
    record whose version another route has now came from that route (a key
    reused across routes sharing a scope), not from this one's earlier rules."""
    description = {
        "canonical": canonical.CANONICAL_FORM_VERSION,
        "view": view,
        "schema": None if schema is None else describe_schema(schema),
        "exclude": sorted(list(path) for path in exclude_paths(exclude)),
        "form_ignored": sorted(form_ignored),
        "key": key_identity(key),
    }
    data = json.dumps(description, sort_keys=True, separators=(",", ":"), default=repr)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()[:_VERSION_DIGITS]


def rules_version(route: RouteOptions, key: bytes | None, form_field: str | None) -> str:
    """:func:`compute_version` of ``route`` under an app's fingerprint ``key``
    and form field, computed once per route and inputs (then a dict lookup)."""
    ignored = configured_form_ignored(form_field)
    inputs = (key, ignored, canonical.CANONICAL_FORM_VERSION)
    known = _versions.get(route)
    if known is not None and inputs in known:
        return known[inputs]
    version = compute_version(route.schema, route.exclude, ignored, key, route.view_name)
    with _versions_lock:
        _versions.setdefault(route, {})[inputs] = version
    return version


def request_digest(key: bytes | None, bound: bytes) -> str:
    """The digest of the current request as sent: method, path, raw query
    string, content type and body bytes. HMAC-SHA256 under ``key`` bound to the
    record (``bound``, :func:`.fingerprint.bound_to`) like the fingerprint;
    SHA-256 without a key.

    A form (urlencoded or multipart) counts as its parsed fields and files
    (each file by its SHA-256), every field included, and its media type
    without parameters, whether or not something parsed it before the
    extension read it: a browser sends the same form with a new random
    boundary on each submission. A form that does not parse counts as its
    bytes (never as an empty form: two such bodies would share a digest)."""
    # A form counts as its parsed fields whether or not something parsed it
    # before the extension (a version with CSRFProtect, one without: the same
    # bytes must agree across them).
    req = request._get_current_object()  # type: ignore[attr-defined]
    form = form_fields() if req.mimetype in FORM_MIMETYPES else None
    if form is not None:
        body, content_type = b"form:" + canonical_json(form), req.mimetype
    else:  # a form that does not parse counts as its bytes, like any other body
        body, content_type = read_body(), req.content_type or ""
    # json.dumps(["request", method, path, query, content type], separators=(",", ":")).
    head = (
        '["request",'
        + ",".join(
            map(
                json_string,
                (req.method.upper(), req.path, req.query_string.decode("latin-1"), content_type),
            )
        )
        + "]"
    )
    digest: hmac.HMAC | hashlib._Hash
    if key is None:
        digest = hashlib.sha256()
    else:
        digest = keyed_hmac(key).copy()
        digest.update(bound)
    digest.update(head.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(body)
    return digest.hexdigest()


class Judged(t.NamedTuple):
    """A retry judged against its record: whether it is the record's request,
    and whether the record was made under rules no route has now (then it was
    judged by its digest, and a mismatch is :class:`RulesChangedError`)."""

    same: bool
    rules_changed: bool


def judge(
    record: Record,
    fingerprint: str,
    version: str | None,
    digest: str | None,
    bound: bytes = b"",
) -> Judged:
    """Whether the request of ``fingerprint`` (under rules ``version``, sent as
    ``digest``; ``bound`` its record's scope and key) is the request of ``record``.

    A record without a rules version (from before this feature, or made
    outside a route), one made under the same rules, or a request without
    them, compare fingerprints, as always. A record made under other rules
    compares the request's bytes: the same bytes are the same request
    whatever the rules now make of them. Its digest may be keyed by an older
    fingerprint key, or by none (a key added since): each is tried (equal
    digests mean equal bytes whichever key made them). Other bytes under rules
    another route of the app has now are a key reused across routes (a scope
    they share): ``rules_changed`` only where no route has the record's rules."""
    if (
        record.rules_version is None
        or version is None
        or record.rules_version == version
        or record.request_digest is None
        or digest is None
    ):
        return Judged(hmac.compare_digest(record.request_hash, fingerprint), False)
    stored = record.request_digest
    if hmac.compare_digest(stored, digest) or any(
        hmac.compare_digest(stored, other) for other in _other_digests(bound)
    ):
        return Judged(True, False)
    return Judged(False, record.rules_version not in app_versions())


def _other_digests(bound: bytes) -> t.Iterator[str]:
    """The request's digest under each older fingerprint key, then under none."""
    older = fingerprint_keys(current_app.config.get(FINGERPRINT_KEY))[1:]
    for key in (*older, None):
        yield request_digest(key, bound)


def app_versions() -> frozenset[str]:
    """The rules version of every protected route of the current app now,
    under its settings: computed once per app (then a lookup)."""
    app = resolve_app()
    known = _app_versions.get(app)
    inputs = canonical.CANONICAL_FORM_VERSION
    if known is not None and known[0] == inputs:
        return known[1]
    state = app_state(app)
    versions = set()
    for view in app.view_functions.values():
        route = getattr(view, "_idempotency_route", None)
        if not isinstance(route, RouteOptions):
            continue
        try:
            settings = state.route_settings.get(route) or route.settings_for(state.settings)
        except ValueError:  # a misconfigured route: its own requests say so, not this 422
            continue
        versions.add(rules_version(route, settings.fingerprint_key, settings.form_field))
    found = frozenset(versions)
    with _versions_lock:
        _app_versions[app] = (inputs, found)
    return found


def rules_changed_error() -> RulesChangedError:
    """The 422 for a retry whose bytes differ from a record made under other rules."""
    return RulesChangedError(
        "This idempotency key was used before this route's fingerprint rules changed "
        "(a deploy changed its schema, excluded fields or fingerprint key), and this "
        "request's bytes differ from the first one's: the server cannot tell whether it "
        "is the same operation. Retry with exactly the bytes first sent, or use a new key "
        "for a new operation."
    )
