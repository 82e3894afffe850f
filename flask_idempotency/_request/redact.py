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
  JSON; a body that holds none of them is kept as sent;
* a form body is kept without the fields (and files) of the redacted names
  (one-part paths: a form has no nesting), re-encoded as the form it was;
* any other body with a redacted route is refused (415, or 400 for a form that
  does not parse): the extension could not tell whether it holds the fields;
* the recovery job's re-run gets that body, without the fields, and the
  record's own fingerprint (the kept body no longer hashes to it).
"""

from __future__ import annotations

import json
import typing as t

from flask import Flask, request
from marshmallow import Schema

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
        kept = _as_sent(schema, sent, paths)
        if kept == sent:
            return stored_request_body()
        text = json.dumps(kept, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8"), request.mimetype
    if is_form():
        if form_fields() is None:
            raise MalformedBodyError(
                "The form could not be parsed; this endpoint keeps the request without the "
                "fields it redacts, and cannot tell them apart in it."
            )
        return stored_request_body(drop={path[0] for path in paths if len(path) == 1})
    raise UnsupportedMediaTypeError(
        "This endpoint keeps the request without the fields it redacts, which only a JSON or "
        f"form body has: send one of those, not {request.mimetype or 'this body'}."
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
            found.update(dict.fromkeys(redact_paths(route.redact)))
    return tuple(found)
