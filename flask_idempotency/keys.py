"""The ``Idempotency-Key`` header (parsing, validation, formats) and derived keys.

A key may be sent as an RFC 8941 Structured Field string (``"abc"``, the form the
IETF draft specifies) or bare (``abc``); both name the same key. Keys are 1 to
255 characters of printable ASCII (space to ``~``); a bare key may not contain a
comma, since servers join repeated headers with commas. An app may ask for less:
a shorter maximum (``IDEMPOTENCY_KEY_MAX_LENGTH``) and a format the whole key
must match (``IDEMPOTENCY_KEY_FORMAT``: ``"uuid"`` or a regular expression).

The scope a key lives in is :mod:`flask_idempotency.scope`'s business.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import typing as t

from flask import request

from .errors import InvalidKeyError

__all__ = [
    "KEY_FORMATS",
    "MAX_KEY_LENGTH",
    "KeyFormat",
    "derive_key",
    "derive_scoped_key",
    "parse_key",
    "quote_key",
    "scoped_parent_key",
]

#: The most characters a key may have: the size of the record's key column.
MAX_KEY_LENGTH = 255
logger = logging.getLogger("flask_idempotency")


def printable(text: str) -> bool:
    # " " to "~": the ASCII characters str.isprintable() accepts.
    return text.isascii() and text.isprintable()


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


# -- the key ------------------------------------------------------------------------


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


def parse_key(raw: str, *, max_length: int = MAX_KEY_LENGTH) -> str:
    """Return the key named by one header value, or raise :class:`InvalidKeyError`.

    ``"abc"`` and ``abc`` both return ``abc``. Surrounding whitespace is ignored.
    A key longer than ``max_length`` characters (after unquoting) is refused.
    """
    value = raw.strip(" \t")
    if not printable(value):
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
    if len(key) > max_length:
        raise InvalidKeyError(
            f"The Idempotency-Key must be at most {max_length} characters, got {len(key)}.",
            reason="too_long",
        )
    return key


@dataclasses.dataclass(frozen=True)
class KeyFormat:
    """A format the whole key must match (``IDEMPOTENCY_KEY_FORMAT``, ``key_format=``)."""

    #: Matched with ``fullmatch`` against the unquoted key.
    pattern: re.Pattern[str]
    #: ``"uuid"``, ``"uuid4"``, ``"uuid7"`` or ``"regex"``: what the problem
    #: document's ``expected_format`` says.
    kind: str

    def check(self, key: str) -> None:
        """Raise :class:`InvalidKeyError` (400) naming the format when ``key`` does not match."""
        if self.pattern.fullmatch(key) is not None:
            return
        if self.kind.startswith("uuid"):
            version = self.kind[len("uuid") :]
            which = f"a version {version} UUID" if version else "a UUID"
            example = _UUID_EXAMPLES.get(version, _UUID_EXAMPLE)
            raise InvalidKeyError(
                f"The Idempotency-Key must be {which}: 32 hexadecimal digits in groups "
                f'8-4-4-4-12 separated by hyphens, such as "{example}".',
                extra={"expected_format": self.kind},
            )
        raise InvalidKeyError(
            "The Idempotency-Key must match the regular expression "
            f"{self.pattern.pattern!r} (the whole key).",
            extra={"expected_format": "regex", "pattern": self.pattern.pattern},
        )


_UUID_EXAMPLE = "8e03978e-40d5-43e8-bc93-6894a57f9324"  # version 4
_UUID_EXAMPLES = {"7": "01936f5e-6b7a-7cc3-9d2e-5f0a8b1c2d3e"}
_HEX = "[0-9a-fA-F]"


def _uuid_pattern(version: str) -> re.Pattern[str]:
    """The canonical textual form (RFC 9562): hex digits of either case, with
    hyphens; no braces, no ``urn:uuid:`` prefix, no hyphen-less form. With a
    ``version`` digit, that version and the RFC 9562 variant (``8``-``b``)."""
    if not version:
        return re.compile(f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}", re.ASCII)
    return re.compile(
        f"{_HEX}{{8}}-{_HEX}{{4}}-{version}{_HEX}{{3}}-[89abAB]{_HEX}{{3}}-{_HEX}{{12}}", re.ASCII
    )


_UUID = KeyFormat(_uuid_pattern(""), "uuid")

#: The format names ``IDEMPOTENCY_KEY_FORMAT`` (and ``key_format=``) accept.
KEY_FORMATS: dict[str, KeyFormat] = {
    "uuid": _UUID,
    "uuid4": KeyFormat(_uuid_pattern("4"), "uuid4"),
    "uuid7": KeyFormat(_uuid_pattern("7"), "uuid7"),
}
# A string of these characters only is a format's name, never a pattern: a
# misspelt or unknown name ("UUIDv4", "ulid") is refused at start-up instead
# of becoming a regular expression that refuses every key.
_NAME = re.compile(r"[A-Za-z0-9_-]+")


def resolve_key_format(value: t.Any, name: str) -> KeyFormat | None:
    """Check a key format setting at start-up; raise ``TypeError``/``ValueError`` if wrong.

    ``None``: any key (printable ASCII). A name of :data:`KEY_FORMATS`
    (``"uuid"``: a canonical UUID of any version; ``"uuid4"``, ``"uuid7"``: of
    that version), in any case. A compiled :class:`re.Pattern` of ``str``, or
    a string with a character other than letters, digits, ``-`` and ``_``: a
    regular expression the whole key must match. A string of those characters
    alone that names no format is refused (pass ``re.compile(...)`` for such a
    pattern). ``name`` is the setting, for the messages.
    """
    if value is None:
        return None
    if isinstance(value, KeyFormat):
        return value
    if isinstance(value, re.Pattern):
        if not isinstance(value.pattern, str):
            raise TypeError(f"{name} must be a str pattern, not a bytes pattern")
        return KeyFormat(value, "regex")
    if isinstance(value, str):
        if not value:
            raise ValueError(f'{name} must not be empty (None accepts any key, "uuid" a UUID)')
        known = KEY_FORMATS.get(value.lower())
        if known is not None:
            return known
        if _NAME.fullmatch(value):
            names = ", ".join(f'"{n}"' for n in KEY_FORMATS)
            raise ValueError(
                f"{name}: {value!r} is not a key format this extension knows ({names}); "
                f"for a regular expression of letters, digits, '-' and '_' alone, pass "
                f"re.compile({value!r})"
            )
        try:
            return KeyFormat(re.compile(value), "regex")
        except re.error as exc:
            raise ValueError(
                f"{name} is not a valid regular expression: {value!r}: {exc}"
            ) from None
    raise TypeError(
        f'{name} must be None, a format name ("uuid", "uuid4", "uuid7"), a regular '
        f"expression (str) or a compiled re.Pattern, not {value!r}"
    )


def resolve_key_max_length(value: t.Any, name: str) -> int:
    """Check a maximum key length setting at start-up: an int from 1 to 255."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if value > MAX_KEY_LENGTH:
        raise ValueError(
            f"{name} must be at most {MAX_KEY_LENGTH}, the size of the idempotency "
            f"key column; got {value}"
        )
    return value


def key_from_request(
    header: str,
    *,
    max_length: int = MAX_KEY_LENGTH,
    key_format: KeyFormat | None = None,
) -> str | None:
    """The key of the current request, ``None`` when the header is absent.

    More than one header of that name is ambiguous and rejected (WSGI joins them
    with a comma, which :func:`parse_key` refuses outside a quoted string). A key
    longer than ``max_length``, or not matching ``key_format``, raises
    :class:`InvalidKeyError` (400). The length is checked before the format, so a
    pattern never runs on more than ``max_length`` characters.
    """
    return key_from_values(
        request.headers.getlist(header), header, max_length=max_length, key_format=key_format
    )


def key_from_values(
    values: t.Sequence[str],
    header: str,
    *,
    max_length: int = MAX_KEY_LENGTH,
    key_format: KeyFormat | None = None,
) -> str | None:
    """:func:`key_from_request` for the header's ``values``, already read."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKeyError(f"Send exactly one {header} header, got {len(values)}.")
    key = parse_key(values[0], max_length=max_length)
    if key_format is not None:
        key_format.check(key)
    return key


# -- keys across services ------------------------------------------------------------


def quote_key(key: str) -> str:
    """``key`` as an RFC 8941 Structured Field string (``"abc"``), whatever it holds.

    The form the IETF draft specifies, and one :func:`parse_key` reads back as
    ``key``: a comma or a quote in the key survives the trip.
    """
    return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _child_key(parent: bytes, step: str, errors: str) -> str:
    if not step:
        raise ValueError("a derived key needs a non-empty step name")
    if "\x00" in step:
        raise ValueError("a scope, step or operation must not contain NUL")
    return hashlib.sha256(parent + b"\x00" + step.encode("utf-8", errors)).hexdigest()


def derive_key(parent_key: str, step: str) -> str:
    """The key for ``step`` of the operation named ``parent_key``.

    Exactly ``sha256((parent_key + "\\x00" + step).encode("utf-8")).hexdigest()``
    (64 lowercase hex digits), so a service written in any language computes the
    same child key from the same parent and step. An empty ``step``, or a NUL
    in it, raises :class:`ValueError` (NUL is the separator: refusing it keeps
    every (parent, step) pair apart, since keys are printable ASCII).
    """
    return _child_key(parent_key.encode("utf-8"), step, "strict")


def scoped_parent_key(scope: str, key: str, *, operation: str = "") -> str:
    """The parent key ``idem.derived_key`` derives from: scope, key and operation.

    ``scope + "\\x00" + key``, plus ``"\\x00" + operation`` when there is one.
    """
    if "\x00" in scope or "\x00" in operation:
        raise ValueError("a scope, step or operation must not contain NUL")
    return f"{scope}\x00{key}\x00{operation}" if operation else f"{scope}\x00{key}"


def derive_scoped_key(scope: str, key: str, step: str, *, operation: str = "") -> str:
    """The key for one downstream call of the operation (scope, key): SHA-256, hex.

    ``derive_key(scoped_parent_key(scope, key, operation=operation), step)``.
    Stable on every retry and resume of the same operation, different for each
    ``step``, and different across scopes, so two tenants that chose the same
    key never collide downstream; ``operation`` (when the operation began) sets
    apart two operations that used the same key one after the other, across an
    expiry. Minting a fresh random key per attempt instead would let the
    downstream run the call once per attempt.

    The scope may hold undecodable bytes of a URL (``surrogateescape``): they are
    encoded back as those bytes, as they always were; for any other text this is
    byte for byte :func:`derive_key`.
    """
    parent = scoped_parent_key(scope, key, operation=operation)
    if operation:
        # The operation was always encoded strictly (it is a timestamp): keep it.
        operation.encode("utf-8")
    return _child_key(parent.encode("utf-8", "surrogateescape"), step, "surrogateescape")
