"""Secrets in the configuration, resolved and checked without ever being echoed:
the key of the request fingerprint (``IDEMPOTENCY_FINGERPRINT_KEY``) and the
encryption keys with their ids (``IDEMPOTENCY_ENCRYPTION_KEYS``).

Kept out of :mod:`._config` (which calls them) so that the key parsing lives in
one place, below both the settings and the storage that seals with the keys
(:mod:`._storage.seal`).
"""

from __future__ import annotations

import base64
import binascii
import re
import typing as t

#: The shortest secret ``IDEMPOTENCY_FINGERPRINT_KEY`` takes (characters, or bytes).
MIN_FINGERPRINT_KEY = 32

FINGERPRINT_KEY = "IDEMPOTENCY_FINGERPRINT_KEY"
#: How to make one, for the errors and the docs.
MAKE_ONE = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def resolve_fingerprint_key(value: t.Any, encryption_keys: t.Any) -> bytes | None:
    """``IDEMPOTENCY_FINGERPRINT_KEY`` as bytes (text is taken as UTF-8), or ``None``.

    Refused (naming the setting, never showing the value): anything but text or
    bytes, one shorter than :data:`MIN_FINGERPRINT_KEY`, and none at all while
    ``encryption_keys`` (``IDEMPOTENCY_ENCRYPTION_KEYS`` as configured) is set:
    sealed bodies beside an unkeyed SHA-256 of the request would let whoever
    reads the table confirm a guess of a small body (``{"amount": 100}``).
    """
    if value is None:
        if encryption_keys:
            raise ValueError(
                f"IDEMPOTENCY_ENCRYPTION_KEYS is set but {FINGERPRINT_KEY} is not: with sealed "
                "bodies the fingerprint must be keyed, or whoever reads the table could confirm "
                'a guess of a small body (such as {"amount": 100}) against its hash; make a '
                f"key with: {MAKE_ONE}"
            )
        return None
    if not isinstance(value, (str, bytes, bytearray)):
        raise TypeError(
            f"{FINGERPRINT_KEY} must be a secret as text or bytes, not a {type(value).__name__}"
        )
    if len(value) < MIN_FINGERPRINT_KEY:
        raise ValueError(
            f"{FINGERPRINT_KEY} must be at least {MIN_FINGERPRINT_KEY} characters (or bytes) "
            f"of a random secret, got {len(value)}; make one with: {MAKE_ONE}"
        )
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


#: A key id: what the config names a key by, and what a sealed value records.
KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")

KeyPairs = tuple[tuple[str, bytes], ...]


def parse_key(text: str | bytes, name: str) -> bytes:
    """A 256-bit key from its base64 (standard or URL-safe, padding optional)
    text, or :class:`ValueError` naming ``name`` (the key's text is not shown)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    cleaned = text.strip()
    padded = cleaned + "=" * (-len(cleaned) % 4)
    try:
        raw = base64.urlsafe_b64decode(padded.replace("+", "-").replace("/", "_"))
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ValueError(
            f"{name}: a key must be 32 random bytes in base64 (44 characters), e.g. from "
            "`flask idempotency generate-key`; this one is not"
        )
    return raw


def _pair(item: t.Any, name: str) -> tuple[str, t.Any]:
    """One ``"id:key"`` string or ``(id, key)`` pair, as (id, key text or bytes)."""
    if isinstance(item, str):
        kid, sep, key = item.partition(":")
        if not sep:
            raise ValueError(f'{name}: each key is written "id:base64key"; one has no id')
        return kid.strip(), key
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise TypeError(
        f'{name}: each key is an "id:base64key" string or an (id, key) pair, not a '
        f"{type(item).__name__}"
    )


def resolve_encryption_keys(
    value: t.Any, name: str = "IDEMPOTENCY_ENCRYPTION_KEYS"
) -> KeyPairs | None:
    """``None`` (encryption off), or the configured keys as (id, 32 bytes), the
    first the one that seals. Spellings: a list of ``"id:base64key"`` strings,
    a list of ``(id, key)`` pairs, a dict ``{id: key}`` (in its order), or one
    string ``"id:key,id:key"`` (an environment variable); a key is base64 text
    or its 32 bytes. A bad id, a bad key, an id given twice, or no key at all
    is refused with an error naming ``name``."""
    if value is None:
        return None
    if isinstance(value, str):
        items: list[t.Any] = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, t.Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(
            f"{name} must be None, a list of keys with ids, a dict {{id: key}} or a string "
            f'"id:key,id:key"; got a {type(value).__name__}'
        )
    if not items:
        raise ValueError(f"{name} names no key: set None to turn encryption off")
    pairs: list[tuple[str, bytes]] = []
    for item in items:
        kid, key = _pair(item, name)
        if not isinstance(kid, str) or not KEY_ID.fullmatch(kid):
            raise ValueError(
                f"{name}: key id {kid!r} must be 1 to 32 letters, digits, '.', '_' or '-'"
            )
        if any(kid == seen for seen, _ in pairs):
            raise ValueError(f"{name}: key id {kid!r} is configured twice")
        if isinstance(key, (bytes, bytearray)) and len(key) == 32:
            raw = bytes(key)
        elif isinstance(key, (str, bytes)):
            raw = parse_key(key, f"{name}, key {kid!r}")
        else:
            raise TypeError(f"{name}: key {kid!r} must be base64 text, not a {type(key).__name__}")
        pairs.append((kid, raw))
    return tuple(pairs)
