"""The ``Idempotency-Key`` header: parsing, validation, and the default scope.

A key may be sent as an RFC 8941 Structured Field string (``"abc"``, the form the
IETF draft specifies) or bare (``abc``); both name the same key. Keys are 1 to
255 characters of printable ASCII (space to ``~``); a bare key may not contain a
comma, since servers join repeated headers with commas.
"""

from __future__ import annotations

import hashlib

from flask import request

from .errors import InvalidKeyError

MAX_KEY_LENGTH = 255


def _printable(text: str) -> bool:
    return all(" " <= ch <= "~" for ch in text)


def _unquote_sf_string(value: str) -> str:
    """Decode an RFC 8941 sf-string (``"..."`` with ``\\"`` and ``\\\\`` escapes)."""
    out: list[str] = []
    i = 1
    while i < len(value):
        ch = value[i]
        if ch == "\\":
            if i + 1 >= len(value) or value[i + 1] not in '"\\':
                raise InvalidKeyError(
                    "The Idempotency-Key is a malformed quoted string: "
                    'only \\" and \\\\ may be escaped.'
                )
            out.append(value[i + 1])
            i += 2
            continue
        if ch == '"':
            if i != len(value) - 1:
                raise InvalidKeyError(
                    "The Idempotency-Key is a malformed quoted string: "
                    "text follows the closing quote."
                )
            return "".join(out)
        out.append(ch)
        i += 1
    raise InvalidKeyError("The Idempotency-Key is a malformed quoted string: no closing quote.")


def parse_key(raw: str) -> str:
    """Return the key named by one header value, or raise :class:`InvalidKeyError`.

    ``"abc"`` and ``abc`` both return ``abc``. Surrounding whitespace is ignored.
    """
    value = raw.strip(" \t")
    if not _printable(value):
        raise InvalidKeyError("The Idempotency-Key must be printable ASCII.")
    if value.startswith('"'):
        key = _unquote_sf_string(value)
    elif "," in value:
        # WSGI servers join repeated headers with ", ": a bare key with a comma
        # may be two keys. Quote it ("a,b") to send a comma.
        raise InvalidKeyError(
            "Send exactly one Idempotency-Key; a bare key must not contain a comma "
            '(quote it as a string, "a,b", if it really does).'
        )
    else:
        key = value
    if not key:
        raise InvalidKeyError("The Idempotency-Key must not be empty.")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKeyError(
            f"The Idempotency-Key must be at most {MAX_KEY_LENGTH} characters, got {len(key)}."
        )
    return key


def key_from_request(header: str) -> str | None:
    """The key of the current request, ``None`` when the header is absent.

    More than one header of that name is ambiguous and rejected (WSGI joins them
    with a comma, which :func:`parse_key` refuses outside a quoted string).
    """
    values = request.headers.getlist(header)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError(f"Send exactly one {header} header, got {len(values)}.")
    return parse_key(values[0])


def default_scope() -> str:
    """The endpoint, plus a digest of the ``Authorization`` header when present.

    Two callers with different credentials never share a scope, so a key one of
    them chose can never replay the other's response. Apps with tenants should
    pass their own ``scope`` (for example the tenant id).
    """
    endpoint = request.endpoint or request.path
    auth = request.headers.get("Authorization")
    if not auth:
        return endpoint
    digest = hashlib.sha256(auth.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return f"{endpoint}|{digest}"


def derive_key(scope: str, key: str, step: str) -> str:
    """The key for one downstream call of the operation (scope, key): SHA-256, hex.

    Stable on every retry and resume of the same operation, different for each
    ``step``, and different across scopes, so two tenants that chose the same
    key never collide downstream. Minting a fresh random key per attempt instead
    would let the downstream run the call once per attempt.
    """
    if not step:
        raise ValueError("a derived key needs a non-empty step name")
    # NUL separates the parts; keys are printable ASCII, so refusing it in the
    # scope and step keeps every (scope, key, step) apart.
    if "\x00" in scope or "\x00" in step:
        raise ValueError("a scope or step name must not contain NUL")
    parent = f"{scope}\x00{key}".encode("utf-8", "surrogateescape")
    digest = hashlib.sha256(parent + b"\x00" + step.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()
