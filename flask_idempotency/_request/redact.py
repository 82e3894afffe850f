"""Redacted fields (``redact=``): never kept in the stored request, masked in
what ``flask idempotency show --reveal`` prints.

A redacted field (a card number, a CVC) still counts in the fingerprint, so a
retry with another value is a 422 mismatch; that is why a route with
``redact=`` needs ``IDEMPOTENCY_FINGERPRINT_KEY``: an unkeyed SHA-256 of a
request whose other fields are known would let whoever reads the table try
every card number against it.

What a user may rely on, on a ``recover=True`` route (the only one that keeps
the request):

* a JSON body is kept without the redacted fields: removed, not masked, by
  the same paths as ``exclude=`` (dotted, through lists; with a schema, a
  field's name also removes its ``data_key``), re-encoded as compact UTF-8
  JSON (always re-encoded, never the bytes as sent: a duplicate key's hidden
  value must not stay);
* a form body is kept without the fields (and files) the redacted paths name,
  re-encoded as the form it was; a form has no nesting, so a field's name is
  read as the path it spells with dots or brackets (``card.number``,
  ``card[number]``, ``items[0][note]``), and a path drops the fields under it;
* any other body with a redacted route is refused (415, or 400 for a form that
  does not parse): the extension could not tell whether it holds the fields;
* the recovery job's re-run gets that body, without the fields, and the
  record's own fingerprint (the kept body no longer hashes to it).
"""

from __future__ import annotations

import json
import re
import typing as t

from flask import Flask, request
from marshmallow import Schema, fields

from ..errors import MalformedBodyError, UnsupportedMediaTypeError
from .body import read_body, read_json_body
from .fingerprint import _as_sent
from .forms import consumed, form_fields, is_form, stored_request_body
from .paths import Path, _split_paths, exclude_paths
from .route import RouteOptions

#: What ``show --reveal`` prints in place of a redacted value.
MASK = "[redacted]"


def redact_paths(redact: t.Iterable[str]) -> tuple[Path, ...]:
    """The paths ``redact=`` names, checked as ``exclude=``'s are."""
    return exclude_paths(redact, "redact")


def kept_request(schema: Schema | None, redact: t.Sequence[str]) -> tuple[bytes, str | None]:
    """The body and content type kept for the recovery job: as sent (see
    :func:`.forms.stored_request_body`), without the ``redact`` paths."""
    if not redact:
        return stored_request_body()
    paths = redact_paths(redact)
    if not read_body() and not consumed():
        return stored_request_body()  # no body: nothing to redact
    if request.is_json:
        sent = read_json_body()
        # Always the re-encoding, never the bytes as sent: those could hold a
        # redacted value the parse does not show (a duplicate key's first value).
        kept = _as_sent(schema, sent, paths)
        text = json.dumps(kept, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8"), request.mimetype
    if is_form():
        if form_fields() is None:
            raise MalformedBodyError(
                "The form could not be parsed; this endpoint keeps the request without the "
                "fields it redacts, and cannot tell them apart in it."
            )
        return stored_request_body(drop=form_names(paths), reencode=True)
    raise UnsupportedMediaTypeError(
        "This endpoint keeps the request without the fields it redacts, which only a JSON or "
        f"form body has: send one of those, not {request.mimetype or 'this body'}."
    )


def form_names(paths: t.Sequence[Path]) -> set[str]:
    """The fields and files of the parsed form that ``paths`` name.

    A form has no nesting, so a field's name is read as the path it spells,
    split at dots and brackets (``card.number``, ``card[number]``), list
    indexes (``items[0][note]``, ``cvc[]``) skipped: a field is dropped when a
    path is its whole name or leads to it, as a JSON path drops what is under
    it."""
    names = set(request.form.keys()) | set(request.files.keys())
    return {name for name in names if _named_by(name, paths)}


def _named_by(name: str, paths: t.Sequence[Path]) -> bool:
    spelled = tuple(part for part in re.split(r"[.\[\]]", name) if part)
    unindexed = tuple(part for part in spelled if not part.isdigit())
    return any(
        name == ".".join(path) or spelled[: len(path)] == path or unindexed[: len(path)] == path
        for path in paths
    )


def masked(value: t.Any, paths: t.Sequence[Path]) -> t.Any:
    """``value`` (parsed JSON) with the values at ``paths`` replaced by :data:`MASK`."""
    if not paths:
        return value
    if isinstance(value, list):
        return [masked(item, paths) for item in value]
    if not isinstance(value, dict):
        return value
    dropped, deeper = _split_paths(paths)
    return {
        key: MASK if key in dropped else masked(item, deeper.get(key, []))
        for key, item in value.items()
    }


def app_redacted(app: Flask) -> tuple[Path, ...]:
    """Every path any protected view of ``app`` redacts (a record does not name
    its route, unless it kept the request: ``show`` masks them all)."""
    found: dict[Path, None] = {}
    for view in app.view_functions.values():
        route = getattr(view, "_idempotency_route", None)
        if isinstance(route, RouteOptions):
            for path in redact_paths(route.redact):
                found.update(dict.fromkeys(sorted(spellings(route.schema, path))))
    return tuple(found)


def spellings(shape: t.Any, path: Path) -> set[Path]:
    """``path`` as each spelling a schema gives it: a field's name, its
    ``attribute`` and its ``data_key`` at each level (nested schemas, lists
    and dicts of them included), as a response or a stored result may use any."""
    head, *rest = path
    while isinstance(shape, (fields.List, fields.Mapping)):
        shape = shape.inner if isinstance(shape, fields.List) else shape.value_field
    schema = shape.schema if isinstance(shape, fields.Nested) else shape
    names, inner = {head}, list[t.Any]()
    if isinstance(schema, Schema):
        for name, field in schema.fields.items():
            spelled = {name, field.attribute or name, field.data_key or name}
            if head in spelled:
                names |= spelled
                inner.append(field)
    if not rest:
        return {(name,) for name in names}
    tails = set().union(*(spellings(field, tuple(rest)) for field in inner or [None]))
    return {(name, *tail) for name in names for tail in tails}
