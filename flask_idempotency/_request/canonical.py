"""Canonical JSON of loaded data: one written form per value.

Sorted keys, no insignificant whitespace, UTF-8. Numbers count by their exact
value: an integral float or Decimal of any magnitude is the integer of that
value, other floats compare as IEEE doubles (as in RFC 8785), other Decimals
and timedeltas by exact value. Every type marshmallow's own fields load into
has its form: datetimes (an aware one as the same instant in UTC), dates,
times, timedeltas (seconds), UUIDs, Enums (their value), ipaddress objects
(compressed), bytes (base64), sets (sorted), dataclasses (their fields). Any
other type is a programming error, :class:`UnknownValueError`.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as dt
import enum
import ipaddress
import json
import math
import typing as t
import uuid
from decimal import Decimal

from ..errors import MalformedBodyError

#: The version of the canonical form this module writes: part of every route's
#: fingerprint rules (:mod:`.rules`). Bump it with any change to the bytes
#: :func:`canonical_json` gives for some value, so that records fingerprinted
#: before a deploy are compared by the request's bytes, not its new form.
CANONICAL_FORM_VERSION = 1

# Integral Decimals with more digits than Python turns into text by default are
# written as coefficient and exponent instead (no JSON integer can be that long).
_MAX_INTEGER_DIGITS = 4300
# Beyond this many decimal places, non-integral Decimals use exponent notation,
# so that "1E-999999999" does not expand into a billion zeros.
_MAX_PLAIN_PLACES = 1000

_IP_TYPES = (
    ipaddress.IPv4Address,
    ipaddress.IPv6Address,
    ipaddress.IPv4Network,
    ipaddress.IPv6Network,
)  # the interface types are subclasses of the address types


def _decimal(value: Decimal) -> int | str:
    """One form per exact value: an int when integral, else its digits as a string."""
    if not value.is_finite():
        raise MalformedBodyError("Numbers must be finite.")
    # Exact: Decimal.normalize() would round to the context's 28 digits.
    sign, digits, exponent = value.as_tuple()
    assert isinstance(exponent, int)
    written = "".join(map(str, digits))
    coefficient = written.rstrip("0")
    if not coefficient:
        return 0
    exponent += len(written) - len(coefficient)
    minus = "-" if sign else ""
    if exponent >= 0:
        if len(coefficient) + exponent <= _MAX_INTEGER_DIGITS:
            return int(value)
        return f"{minus}{coefficient}E+{exponent}"
    places = -exponent
    if places > _MAX_PLAIN_PLACES:
        return f"{minus}{coefficient}E{exponent}"
    if len(coefficient) > places:
        return f"{minus}{coefficient[:-places]}.{coefficient[-places:]}"
    return f"{minus}0.{coefficient.rjust(places, '0')}"


class UnknownValueError(TypeError):
    """A loaded value of a type the fingerprint does not know: a programming error.

    Its message names where the value is (``items[1].device``), its type and,
    when it came from a schema, which one.
    """

    def __init__(self, value: t.Any) -> None:
        super().__init__()
        kind = type(value)
        self.type_name = f"{kind.__module__}.{kind.__qualname__}"
        self.path: list[str | int] = []
        self.schema_name: str | None = None

    def __str__(self) -> str:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path)
        origin = f" loaded by {self.schema_name}" if self.schema_name else ""
        return (
            f"flask_idempotency cannot fingerprint "
            f"{f'the value at {where[1:]}' if where else 'the payload'}, "
            f"a {self.type_name}{origin}. The fingerprint takes plain data (str, int, float, "
            "bool, None, lists, dicts), Decimal, datetime, date, time, timedelta, UUID, Enum, "
            "ipaddress objects, bytes and dataclasses: load one of those, or name the field "
            "in exclude."
        )


def plain(value: t.Any) -> t.Any:
    """Turn loaded data into plain JSON types, deterministically."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MalformedBodyError("Numbers must be finite.")
        # Exact value: 1e16 is the integer 10000000000000000, whatever its size.
        return int(value) if value.is_integer() else value
    if isinstance(value, t.Mapping):
        mapped = {}
        for k, v in value.items():
            try:
                mapped[str(k)] = plain(v)
            except UnknownValueError as exc:
                exc.path.insert(0, str(k))
                raise
        return mapped
    if isinstance(value, (list, tuple)):
        items = []
        for i, v in enumerate(value):
            try:
                items.append(plain(v))
            except UnknownValueError as exc:
                exc.path.insert(0, i)
                raise
        return items
    if isinstance(value, (set, frozenset)):
        members = [plain(v) for v in value]
        return sorted(members, key=lambda v: json.dumps(v, sort_keys=True))
    if isinstance(value, Decimal):
        return _decimal(value)
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        # The same instant written with different offsets is the same payload.
        return value.astimezone(dt.timezone.utc).isoformat()
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        # Seconds by exact value: a double would merge microseconds apart at 2**53.
        whole = value.days * 86400 + value.seconds
        return _decimal(Decimal(whole) + Decimal(value.microseconds).scaleb(-6))
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, _IP_TYPES):
        return str(value)  # the compressed form: "::1" however it was written
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclass_fields(value))
    raise UnknownValueError(value)


def dataclass_fields(value: t.Any) -> dict[str, t.Any]:
    """A dataclass instance's fields by name."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}


def canonical_json(value: t.Any) -> bytes:
    """Canonical JSON bytes of ``value``: sorted keys, compact, UTF-8."""
    return _CANONICAL.encode(plain(value)).encode("utf-8")


#: ``value`` as ``json.dumps`` writes a str (ASCII, escaped): the C escaper called
#: directly. The heads of a fingerprint and of a digest are written with it, the
#: text ``json.dumps`` makes of them, without its encoder's set-up per call.
json_string: t.Callable[[str], str] = json.encoder.encode_basestring_ascii

#: ``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
#: with one encoder built at import (dumps builds one per call when given options).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
