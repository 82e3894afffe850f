"""Reading the request body: whole, or refused.

The fingerprint and the view must judge the same, complete body. werkzeug stops
reading a streamed body (``Transfer-Encoding: chunked``) at ``MAX_CONTENT_LENGTH``
without an error, so a view would run on its first bytes; this module reads the
body once, checks that nothing was left over, and caches it on the request for
the view.

What a user may rely on, for every protected request:

* a body over ``MAX_CONTENT_LENGTH``, declared or streamed, answers 413;
* a body that cannot be read whole (the client went away, broken chunked
  encoding, any error of the server's input stream) answers 400;
* a chunked body the WSGI server does not deliver (it does not set
  ``wsgi.input_terminated``) answers 411 instead of counting as empty;
* a JSON body is strict JSON: no ``NaN``/``Infinity``, no lone surrogate
  (``"\\ud800"``), not nested deeper than the parser can go (400);
* the view still reads the body as usual: ``request.get_data()``,
  ``get_json()``, ``form`` and ``files`` all work after the extension read it.
"""

from __future__ import annotations

import json
import re
import typing as t

from flask import Request, request
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_set_header

from ..errors import (
    LengthRequiredError,
    MalformedBodyError,
    PayloadTooLargeError,
    ProblemError,
    UnsupportedMediaTypeError,
)

#: The body's bytes, kept on the request object once read and checked, so the
#: check (which may read from the server's stream) runs once per request and
#: every later read is one attribute lookup. On the request, not in its WSGI
#: environ: a middleware that serves a second request from a copy of the
#: environ (a batch, a sub-request) must not have it judged by the first body.
_CHECKED_ATTR = "_flask_idempotency_body"

# A JSON escape of a UTF-16 surrogate, and the UTF-8 bytes of a raw surrogate
# (which ``json.loads`` lets through, as it decodes with "surrogatepass").
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _too_large(limit: int | None) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"The body is larger than this server accepts ({limit} bytes).")


def _is_chunked(environ: t.Mapping[str, t.Any]) -> bool:
    return "chunked" in parse_set_header(environ.get("HTTP_TRANSFER_ENCODING"))


def read_body() -> bytes:
    """The whole request body, cached on the request so the view can read it again.

    Over ``MAX_CONTENT_LENGTH`` answers 413; unreadable answers 400; a chunked
    body the server does not terminate answers 411 (see the module docstring).
    """
    req = request._get_current_object()  # type: ignore[attr-defined]
    checked = req.__dict__.get(_CHECKED_ATTR)
    if checked is not None:
        return t.cast(bytes, checked)
    return _read_checked(req, req.environ)


def _read_checked(request: Request, environ: dict[str, t.Any]) -> bytes:
    """:func:`read_body`'s first read: from the server, whole or refused."""
    streamed = request.content_length is None
    terminated = "wsgi.input_terminated" in environ
    if streamed and not terminated and _is_chunked(environ):
        # werkzeug would hand the view an empty body: nothing may run on it.
        raise LengthRequiredError(
            "This server cannot read a chunked request body; send it with Content-Length."
        )
    limit = request.max_content_length
    try:
        data = request.get_data(cache=True)
        # werkzeug reads a terminated stream up to the limit and stops there,
        # silently: only one more byte from the server tells whole from cut.
        cut = streamed and terminated and limit is not None and len(data) >= limit
        if cut and environ["wsgi.input"].read(1):
            raise _too_large(limit)
    except RequestEntityTooLarge:
        raise _too_large(limit) from None
    except ProblemError:
        raise
    except Exception as exc:  # whatever the server's input raises: the body is not whole
        raise MalformedBodyError(
            f"The request body could not be read whole: {type(exc).__name__}: {exc}"
        ) from exc
    setattr(request, _CHECKED_ATTR, data)
    return data


def _reject_constant(name: str) -> t.NoReturn:
    raise ValueError(f"{name} is not valid JSON")


#: The strict parser: ``NaN``, ``Infinity`` and ``-Infinity`` are refused.
_STRICT = json.JSONDecoder(parse_constant=_reject_constant)


def _has_lone_surrogate(value: t.Any) -> bool:
    """Whether any string or key in parsed JSON holds a surrogate code point.

    ``json`` joins a valid escaped pair into one character, so any surrogate
    left is a lone one. Iterative: the depth of the data does not matter.
    """
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return True
        elif isinstance(node, dict):
            for key, item in node.items():
                if _SURROGATE.search(key):
                    return True
                stack.append(item)
        elif isinstance(node, list):
            stack.extend(node)
    return False


def parse_json(data: bytes) -> t.Any:
    """Parse ``data`` as strict JSON; anything else answers 400 (``MalformedBodyError``)."""
    encoding = json.detect_encoding(data)
    try:
        # What json.loads does with bytes, with one decoder built at import.
        value = _STRICT.decode(data.decode(encoding, "surrogatepass"))
    except RecursionError:
        raise MalformedBodyError("The JSON body is nested too deeply.") from None
    except ValueError as exc:  # UnicodeDecodeError is one
        raise MalformedBodyError(f"The body is not valid JSON: {exc}") from exc
    # Only bodies that could hold a surrogate are walked: an escape in the
    # D800-DFFF range, raw surrogate bytes, or a UTF-16/32 encoding. The
    # substring tests skip both searches for almost every body.
    suspect = (
        (b"\\u" in data and _SURROGATE_ESCAPE.search(data) is not None)
        or (b"\xed" in data and _RAW_SURROGATE.search(data) is not None)
        or encoding not in ("utf-8", "utf-8-sig")
    )
    if suspect and _has_lone_surrogate(value):
        raise MalformedBodyError(
            "The JSON body holds a lone surrogate (U+D800 to U+DFFF), which is not text."
        )
    return value


def read_json_body() -> t.Any:
    """The request body parsed as strict JSON; 415 when the content type is not JSON."""
    if not request.is_json:
        raise UnsupportedMediaTypeError(
            "This endpoint takes a JSON body (Content-Type: application/json), "
            f"got {request.mimetype or 'no content type'}."
        )
    return parse_json(read_body())
