"""The page a browser that sent a form gets instead of a problem document.

A person who submitted an HTML form reads the answer in the browser: a JSON
problem document is no page for them. :func:`wanted` decides (the request came
from a form and its ``Accept`` prefers HTML); :func:`render` writes the page.
Below :mod:`flask_idempotency.errors`, which calls both.
"""

from __future__ import annotations

import html
import typing as t

from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

#: Set in the WSGI environ of a request whose key came from a rendered form
#: (its field, or a form token in the header).
FORM_REQUEST = "flask_idempotency.form_key"
# Bodies only a browser's form (or a client imitating one) sends.
_FORM_TYPES = ("application/x-www-form-urlencoded", "multipart/form-data")


def wanted(environ: t.Any, problem_json: str, *, from_form: bool = False) -> bool:
    """Whether the request of ``environ`` (the current request's when ``None``)
    gets a page: it sent a form (``from_form``, a form key, or a form body) and
    its ``Accept`` prefers ``text/html`` to ``problem_json`` and JSON (a tie
    goes to the document)."""
    if environ is None:
        from flask import has_request_context, request

        if not has_request_context():
            return False
        environ = request.environ
    form_body = str(environ.get("CONTENT_TYPE", "")).lower().startswith(_FORM_TYPES)
    if not (from_form or environ.get(FORM_REQUEST) or form_body):
        return False
    accept = parse_accept_header(environ.get("HTTP_ACCEPT"), MIMEAccept)
    return accept.best_match([problem_json, "application/json", "text/html"]) == "text/html"


def render(title: str, text: str) -> str:
    """A plain page: ``title`` and ``text``, escaped; no script, no link."""
    title = html.escape(title)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{title}</title></head><body><h1>{title}</h1>"
        f"<p>{html.escape(text)}</p></body></html>\n"
    )
