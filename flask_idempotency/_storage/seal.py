"""Encryption at rest: what is sealed, how, and with which key.

A sealed value is AES-256-GCM ciphertext under a key derived for that value
alone, bound to its place (table, column and the row's identity: scope and key
for a record, event id for an outbox row) by associated data. So:

* a value copied into another record, another column or another event fails to
  open (:class:`~flask_idempotency._failures.SealBroken`), and is never read as
  that record's;
* each value names the id of the configured key it was sealed with, so records
  sealed before a rotation still open while the old key is configured, and one
  whose key is gone fails with that id in the error;
* a subkey per value (HMAC-SHA256 of the key and a random 128-bit salt) lifts
  GCM's limit of about 2**32 random nonces per key: a busy API seals billions
  of values a month.

Binary columns hold ``MAGIC + len(id) + id + salt + nonce + ciphertext``; text
columns (JSON) hold ``"fis1:" + id + ":" + base64url(salt + nonce + ciphertext)``.
Neither can be mistaken for what the columns held in clear: the binary prefix
starts with the bytes 0x00 0xFF, never in UTF-8 text; ``fis1:`` starts no JSON
document. A value in clear (written before encryption was turned on) is read
as it is: :func:`is_sealed` tells them apart.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hmac
import logging
import os
import typing as t

from .._failures import SealBroken
from .._secrets import KEY_ID as KEY_ID
from .._secrets import check_encryption_config
from .._secrets import parse_key as parse_key
from .schema import OUTBOX_TABLE_NAME

#: The first bytes of a sealed binary value.
MAGIC = b"\x00\xffFIS1"
#: The first characters of a sealed text value.
TEXT_PREFIX = "fis1:"
_SALT = 16
_NONCE = 12
_TAG = 16
_AAD_VERSION = b"flask-idempotency/seal/1"
logger = logging.getLogger("flask_idempotency")
_V = t.TypeVar("_V", str, bytes)
_SUBKEY = b"flask-idempotency/seal/1/subkey"

#: The record's columns that are sealed: text (JSON) and binary.
RECORD_TEXT = ("response_headers", "recovery_points", "request_path")
RECORD_BINARY = ("response_body", "request_body")
#: The outbox's sealed columns (text).
OUTBOX_TEXT = ("payload", "headers")


def _aead() -> t.Any:
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError as exc:  # pragma: no cover - the crypto extra is missing
        raise RuntimeError(
            "IDEMPOTENCY_ENCRYPTION_KEYS needs the cryptography package: "
            "pip install 'flask-idempotency[crypto]'"
        ) from exc
    return AESGCM


def _framed(part: bytes) -> bytes:
    return len(part).to_bytes(4, "big") + part


@functools.lru_cache(maxsize=64)
def _place(table: str, column: str) -> bytes:
    # The same for every value of a column: framed once, not per value.
    return _framed(_AAD_VERSION) + _framed(table.encode()) + _framed(column.encode())


def associated_data(table: str, column: str, *identity: str) -> bytes:
    """What binds a sealed value to its place: the table, the column and the
    row's identity, each length-prefixed (no two places share a byte string)."""
    return _place(table, column) + b"".join(_framed(i.encode()) for i in identity)


def is_sealed(value: str | bytes | bytearray | memoryview | None) -> bool:
    """Whether a stored value is sealed (``False`` for ``None`` and clear values)."""
    if isinstance(value, str):
        return value.startswith(TEXT_PREFIX)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _binary_id(bytes(value)) is not None
    return False


def _binary_id(raw: bytes) -> str | None:
    # The whole structure, not the prefix alone: a clear body (a client's upload,
    # a binary answer) may start with MAGIC, and must still read as itself.
    if raw[: len(MAGIC)] != MAGIC or len(raw) <= len(MAGIC):
        return None
    n = raw[len(MAGIC)]
    start = len(MAGIC) + 1
    if not 1 <= n <= 32 or len(raw) < start + n + _SALT + _NONCE + _TAG:
        return None
    kid = raw[start : start + n].decode("ascii", "replace")
    return kid if KEY_ID.fullmatch(kid) else None


def key_id_of(value: str | bytes | bytearray | memoryview | None) -> str | None:
    """The id of the key a sealed value names; ``None`` for a clear value."""
    if not is_sealed(value):
        return None
    if isinstance(value, str):
        return value[len(TEXT_PREFIX) :].split(":", 1)[0]
    return _binary_id(bytes(t.cast(bytes, value)))


def new_key_text() -> str:
    """A fresh random 256-bit key, in URL-safe base64."""
    return base64.urlsafe_b64encode(os.urandom(32)).decode("ascii")


@dataclasses.dataclass(frozen=True, repr=False)
class Keyring:
    """The configured keys: ``keys[0]`` seals, every one of them opens.

    ``allow_clear`` (``IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR``): a value in clear in
    a sealed column reads as itself (records from before encryption was turned
    on); without it such a value is unreadable, as one that does not open: a
    writer of the database cannot put an answer of its choosing in clear."""

    keys: tuple[tuple[str, bytes], ...]
    allow_clear: bool = False

    def __repr__(self) -> str:
        # Never the keys: a repr ends up in debuggers and error trackers.
        ids = [kid for kid, _ in self.keys]
        return f"Keyring(ids={ids!r}, allow_clear={self.allow_clear!r})"

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a keyring needs at least one key")
        seen: set[str] = set()
        for kid, key in self.keys:
            if not isinstance(kid, str) or not KEY_ID.fullmatch(kid):
                # Not shown: what fails here may be a key written in the id's place.
                raise ValueError("a key id must be 1 to 32 letters, digits, '.', '_' or '-'")
            if kid in seen:
                raise ValueError(f"key id {kid!r} is configured twice")
            if len(key) != 32:
                raise ValueError(f"key {kid!r} must be 32 bytes")
            seen.add(kid)
        aead = _aead()
        object.__setattr__(self, "_by_id", {kid: key for kid, key in self.keys})
        object.__setattr__(self, "_aead", aead)
        object.__setattr__(self, "_reused", set())

    @property
    def current(self) -> str:
        """The id of the key that seals new values."""
        return self.keys[0][0]

    def has(self, kid: str) -> bool:
        return kid in self._by_id  # type: ignore[attr-defined]

    def _cipher(self, key: bytes, salt: bytes) -> t.Any:
        # hmac.digest: OpenSSL's one-shot HMAC, without the Python object of hmac.new.
        subkey = hmac.digest(key, _SUBKEY + salt, "sha256")
        return self._aead(subkey)  # type: ignore[attr-defined]

    def _seal_raw(self, data: bytes, aad: bytes) -> tuple[str, bytes]:
        kid, key = self.keys[0]
        salt, nonce = os.urandom(_SALT), os.urandom(_NONCE)
        return kid, salt + nonce + self._cipher(key, salt).encrypt(nonce, data, aad)

    def _open_raw(self, kid: str, blob: bytes, aad: bytes, where: str) -> bytes:
        key = self._by_id.get(kid)  # type: ignore[attr-defined]
        if key is None:
            raise SealBroken(where, kid, "its key id is not configured")
        if len(blob) < _SALT + _NONCE + _TAG:
            raise SealBroken(where, kid, "it is truncated")
        salt, nonce, body = blob[:_SALT], blob[_SALT : _SALT + _NONCE], blob[_SALT + _NONCE :]
        try:
            return bytes(self._cipher(key, salt).decrypt(nonce, body, aad))
        except Exception as exc:  # cryptography's InvalidTag: altered or not this place's
            for other, other_key in self.keys:
                # An id given to another key (ids named by role: "current"): a
                # value the old key opens is authentic all the same (its AAD
                # still binds it to this place).
                if other == kid:
                    continue
                try:
                    opened = bytes(self._cipher(other_key, salt).decrypt(nonce, body, aad))
                except Exception:  # not this key either
                    continue
                self._warn_reused(kid, other)
                return opened
            raise SealBroken(
                where,
                kid,
                "it does not open under any configured key: altered, sealed for "
                "another record, or its id now names another key (an id names one key forever)",
            ) from exc

    def _warn_reused(self, kid: str, other: str) -> None:
        if kid in self._reused:  # type: ignore[attr-defined]
            return
        self._reused.add(kid)  # type: ignore[attr-defined]
        logger.warning(
            "a value sealed under key id %r opened only with the key configured as %r: the id "
            "%r now names another key; an id must name one key forever (give a new key a new id)",
            kid,
            other,
            kid,
        )

    def seal_bytes(self, data: bytes, aad: bytes) -> bytes:
        """``data`` sealed for the place ``aad`` names, as a binary column holds it."""
        kid, blob = self._seal_raw(data, aad)
        raw_id = kid.encode("ascii")
        return MAGIC + bytes([len(raw_id)]) + raw_id + blob

    def open_bytes(self, value: bytes, aad: bytes, where: str) -> bytes:
        """A binary value opened; a clear value as it is. :class:`SealBroken` when
        it names a key not configured, or does not open for ``aad``."""
        value = bytes(value)
        kid = _binary_id(value)
        if kid is None:
            return self._clear(value, where)
        start = len(MAGIC) + 1
        return self._open_raw(kid, value[start + len(kid) :], aad, where)

    def _clear(self, value: _V, where: str) -> _V:
        if not self.allow_clear:
            raise SealBroken(
                where,
                "-",
                "it is in clear where a sealed value belongs (IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR "
                "is off)",
            )
        return value

    def seal_text(self, text: str, aad: bytes) -> str:
        """``text`` sealed for the place ``aad`` names, as a text column holds it."""
        kid, blob = self._seal_raw(text.encode("utf-8"), aad)
        return f"{TEXT_PREFIX}{kid}:{base64.urlsafe_b64encode(blob).decode('ascii')}"

    def open_text(self, value: str, aad: bytes, where: str) -> str:
        """A text value opened; a clear value as it is (see :meth:`open_bytes`)."""
        if not is_sealed(value):
            return self._clear(value, where)
        kid, _, encoded = value[len(TEXT_PREFIX) :].partition(":")
        try:
            blob = base64.urlsafe_b64decode(encoded.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError) as exc:
            raise SealBroken(where, kid, "it is not valid base64") from exc
        try:
            return self._open_raw(kid, blob, aad, where).decode("utf-8")
        except UnicodeDecodeError as exc:  # pragma: no cover - GCM authenticated it
            raise SealBroken(where, kid, "it is not UTF-8 text") from exc


def keyring_of(
    keys: tuple[tuple[str, bytes], ...] | None, config: t.Mapping[str, t.Any] | None = None
) -> Keyring | None:
    """The keyring of ``IDEMPOTENCY_ENCRYPTION_KEYS`` as the settings resolved
    them (built once, at ``init_app``); ``None`` when encryption at rest is off.
    ``config``: the app's, for ``IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR`` and the
    checks of :func:`._secrets.check_encryption_config`."""
    if not keys:
        return None
    return Keyring(keys, allow_clear=check_encryption_config(config or {}))


def seal_record(
    ring: Keyring | None, table: str, scope: str, key: str, values: t.Mapping[str, t.Any]
) -> dict[str, t.Any]:
    """``values`` (columns of a record, in clear) with every sealed column that
    is set sealed for (scope, key); a copy, unchanged without a keyring.

    Every value is sealed, also one that looks sealed already: a request body
    is the client's, and may start with :data:`MAGIC` (left in clear, it
    would be read as a sealed value that does not open)."""
    out = dict(values)
    if ring is None:
        return out
    for column in RECORD_TEXT:
        value = out.get(column)
        if isinstance(value, str):
            out[column] = ring.seal_text(value, associated_data(table, column, scope, key))
    for column in RECORD_BINARY:
        value = out.get(column)
        if isinstance(value, (bytes, bytearray, memoryview)):
            out[column] = ring.seal_bytes(bytes(value), associated_data(table, column, scope, key))
    return out


def open_record(
    ring: Keyring | None, table: str, scope: str, key: str, values: t.Mapping[str, t.Any]
) -> dict[str, t.Any]:
    """``values`` as read (columns of a record) with its sealed columns opened.

    Raises :class:`SealBroken` for a sealed value that does not open, when
    values are sealed and no keyring is configured, or for a clear value under a
    keyring that does not allow clear values (``Keyring.allow_clear``)."""
    out = dict(values)
    for column in (*RECORD_TEXT, *RECORD_BINARY):
        value = out.get(column)
        if value is None or (ring is None and not is_sealed(value)):
            continue
        where = f"{table}.{column} of ({scope!r}, {key!r})"
        if ring is None:  # never a ciphertext replayed as a body
            raise SealBroken(where, key_id_of(value) or "?", "encryption is not configured")
        aad = associated_data(table, column, scope, key)
        if isinstance(value, str):
            out[column] = ring.open_text(value, aad, where)
        else:
            out[column] = ring.open_bytes(value, aad, where)
    return out


def seal_event(ring: Keyring | None, event_id: str, values: dict[str, t.Any]) -> dict[str, t.Any]:
    """``values`` (an outbox row's) with ``payload`` and ``headers``, where set
    and in clear, sealed for ``event_id``; unchanged without a keyring."""
    if ring is None:
        return values
    out = dict(values)
    for column in OUTBOX_TEXT:
        value = out.get(column)
        if isinstance(value, str) and not is_sealed(value):
            aad = associated_data(OUTBOX_TABLE_NAME, column, event_id)
            out[column] = ring.seal_text(value, aad)
    return out


def open_event_text(
    ring: Keyring | None, event_id: str, column: str, value: str | bytes | None
) -> str | None:
    """An outbox row's ``payload`` or ``headers`` as stored, opened (a clear
    value as it is). Raises :class:`~flask_idempotency._failures.SealBroken`
    for a sealed value that does not open for ``event_id`` (its key id not
    configured, encryption off, altered, or copied from another event)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value).decode("utf-8")
    if value is None or not is_sealed(value):
        return value
    where = f"{OUTBOX_TABLE_NAME}.{column} of event {event_id!r}"
    if ring is None:
        raise SealBroken(where, key_id_of(value) or "?", "encryption is not configured")
    return ring.open_text(value, associated_data(OUTBOX_TABLE_NAME, column, event_id), where)
