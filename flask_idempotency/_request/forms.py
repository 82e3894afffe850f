"""Form bodies: the fields the fingerprint counts, and a faithful copy to store.

werkzeug parses ``application/x-www-form-urlencoded`` and ``multipart/form-data``
bodies into ``request.form`` and ``request.files``, consuming the raw bytes
unless something read them first. Whatever touches ``request.form`` before the
extension does (Flask-WTF's ``CSRFProtect`` in its ``before_request`` hook, any
hook reading ``request.values``) leaves ``request.get_data()`` empty. So:

* the fingerprint counts a form by its parsed fields, each name with its values
  in order, files by name, filename and SHA-256 of their whole content: the
  same form has the same fingerprint whether or not something parsed it first;
* the stored request of a ``recover=True`` route is the body as sent, or, when
  its bytes are gone, a re-encoding of the parsed form (urlencoded again, or
  multipart with a boundary of ours and the content type that names it) that
  gives the view the same fields and files, and the same fingerprint.

A form that something parsed first and that werkzeug could not parse is an
empty form to everyone, the view included; it counts as one.
"""

from __future__ import annotations

import hashlib
import io
import re
import typing as t
import urllib.parse
import uuid

from flask import request
from werkzeug.datastructures import FileStorage
from werkzeug.exceptions import RequestEntityTooLarge

from ..errors import PayloadTooLargeError
from .body import read_body

URLENCODED = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
FORM_MIMETYPES = frozenset({URLENCODED, MULTIPART})

# Names and filenames written as a plain quoted string; anything else goes in
# the RFC 2231 form (name*=UTF-8''...), which werkzeug decodes exactly.
_PLAIN_PARAMETER = re.compile(r"[A-Za-z0-9 !#$&'()*+,\-./:<=>?@\[\]^_`{|}~]*")


def is_form() -> bool:
    """Whether the request body is a form werkzeug parses."""
    return request.mimetype in FORM_MIMETYPES


def consumed() -> bool:
    """Whether something parsed the form before the extension read the body, so
    that werkzeug kept the fields and files but not the bytes."""
    # werkzeug keeps the parsed form in the request's __dict__ (its
    # cached_property), which is also how it tells itself the stream is spent.
    return (
        is_form() and "form" in request.__dict__ and request.content_length != 0 and not read_body()
    )


def _file_digest(storage: FileStorage) -> str:
    stream = storage.stream
    start = stream.tell()
    stream.seek(0)  # all of it, even if a hook read some already
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(64 * 1024), b""):
        digest.update(block)
    stream.seek(start)  # the view reads the file from where it was
    return digest.hexdigest()


def form_fields() -> dict[str, list[t.Any]] | None:
    """The parsed form as ``{name: [value or file, ...]}``; ``None`` if it does not parse."""
    try:
        parsed: dict[str, list[t.Any]] = {
            name: list(values) for name, values in request.form.lists()
        }
        for name, storages in request.files.lists():
            parsed.setdefault(name, []).extend(
                {"filename": s.filename, "sha256": _file_digest(s)} for s in storages
            )
        if parsed or consumed():
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


# -- the stored request -------------------------------------------------------------


def stored_request_body(
    drop: t.Collection[str] = (), *, reencode: bool = False
) -> tuple[bytes, str | None]:
    """The body and content type to store for the recovery job's re-run.

    The body as sent when the extension could read it; when something parsed
    the form first, or ``reencode`` (a redacting route: the raw bytes could
    hold a spelling of a field the parsed form does not show), a re-encoding
    of the parsed fields and files, without those named in ``drop``.
    """
    body = read_body()
    if not consumed() and not (reencode and is_form()):
        return body, request.content_type
    if request.mimetype == MULTIPART:
        return _multipart(drop)
    pairs = [(name, value) for name, value in request.form.items(multi=True) if name not in drop]
    # "&" is a body that parses to no field: it fingerprints as the form it stands for.
    return urllib.parse.urlencode(pairs).encode("ascii") or b"&", URLENCODED


def _parameter(name: str, value: str | None) -> bytes:
    if value is None:  # werkzeug's name for a part that has none
        return b""
    if _PLAIN_PARAMETER.fullmatch(value):
        return f'; {name}="{value}"'.encode("ascii")
    return f"; {name}*=UTF-8''{urllib.parse.quote(value, safe='')}".encode("ascii")


def _parts(drop: t.Collection[str]) -> list[tuple[bytes, bytes]]:
    """Each part of the form as (headers, content), but those named in ``drop``."""
    parts = []
    for name, value in request.form.items(multi=True):
        if name in drop:
            continue
        parts.append((b"Content-Disposition: form-data" + _parameter("name", name), value.encode()))
    for name, storage in request.files.items(multi=True):
        if name in drop:
            continue
        stream = storage.stream
        start = stream.tell()
        stream.seek(0)
        content = stream.read()
        stream.seek(start)
        headers = (
            b"Content-Disposition: form-data"
            + _parameter("name", name)
            + _parameter("filename", storage.filename or "")
            + b"\r\nContent-Type: "
            + (storage.content_type or "application/octet-stream").encode("latin-1")
        )
        parts.append((headers, content))
    return parts


def _multipart(drop: t.Collection[str] = ()) -> tuple[bytes, str]:
    parts = _parts(drop)
    while True:  # a boundary that occurs in no part (the first one, in practice)
        boundary = f"flask-idempotency-{uuid.uuid4().hex}"
        delimiter = b"--" + boundary.encode("ascii")
        if not any(delimiter in headers or delimiter in content for headers, content in parts):
            break
    body = b"".join(
        delimiter + b"\r\n" + headers + b"\r\n\r\n" + content + b"\r\n"
        for headers, content in parts
    )
    return body + delimiter + b"--\r\n", f"{MULTIPART}; boundary={boundary}"
