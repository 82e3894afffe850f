"""The request's headers read from its WSGI environ itself, where werkzeug's
``request.headers`` would walk every header of the request for one; and whether
one of werkzeug's parsed attributes of a request is still its own parse."""

from __future__ import annotations

import typing as t

from werkzeug.datastructures import EnvironHeaders
from werkzeug.wrappers import Request


def header_values(environ: dict[str, t.Any], name: str) -> list[str]:
    """``request.headers.getlist(name)``, read from the WSGI ``environ`` itself:
    werkzeug's walks every header of the request for it. A WSGI server joins a
    repeated header into one value, so there is one value at most.

    The same list for every name (the key a request has must not change with
    the way it is read): getlist compares the name with each header's dashed
    name, so a name with ``_`` (``Idempotency_Key``, ``CONTENT_LENGTH``) names
    no header at all, and a name that is not ASCII is left to getlist itself.
    """
    if not name.isascii():  # upper() and lower() disagree beyond ASCII (U+212A)
        return EnvironHeaders(environ).getlist(name)
    if "_" in name:
        return []
    upper = name.upper().replace("-", "_")
    if upper in _UNPREFIXED:  # werkzeug lists these without an empty value
        value = environ.get(upper)
        return [value] if value else []
    value = environ.get(f"HTTP_{upper}")
    return [] if value is None else [value]


# Headers a WSGI environ keeps without the HTTP_ prefix.
_UNPREFIXED = frozenset({"CONTENT_TYPE", "CONTENT_LENGTH"})


def request_header_values(request: Request, name: str) -> list[str]:
    """``request.headers.getlist(name)``: :func:`header_values` of its environ
    where the headers are werkzeug's view of that environ (a hook or a request
    class that gave the request other headers is asked itself)."""
    headers = request.headers
    if type(headers) is EnvironHeaders and headers.environ is request.environ:
        return header_values(request.environ, name)
    return headers.getlist(name)


def parses_environ(request: Request, name: str) -> bool:
    """Whether ``request.<name>`` (``args``, ``cookies``) is werkzeug's parse of
    the environ, or would be: no hook assigned the attribute and no request
    class replaced it. Only then may an empty environ variable stand for an
    empty value (a hook's query arguments count in the fingerprint, and a
    request class's cookies in the scope, as they always did)."""
    return name not in vars(request) and getattr(type(request), name) is getattr(Request, name)
