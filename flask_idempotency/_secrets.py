"""The secrets the settings carry, read and checked: the encryption keys
(``IDEMPOTENCY_ENCRYPTION_KEYS``) with their ids.

Kept out of :mod:`._config` (which calls it) so that the key parsing lives in
one place, below both the settings and the storage that seals with the keys
(:mod:`._storage.seal`). Nothing here echoes a key's text in an error.
"""

from __future__ import annotations

import base64
import binascii
import re
import typing as t

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


def resolve_encryption_keys(value: t.Any, name: str) -> KeyPairs | None:
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
