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
    """``IDEMPOTENCY_FINGERPRINT_KEY``'s current key as bytes (text is taken as
    UTF-8), or ``None``. A list or tuple names the current key first, then
    older ones (:func:`fingerprint_keys`), each checked alike.

    Refused (naming the setting, never showing the value): anything but text or
    bytes, one shorter than :data:`MIN_FINGERPRINT_KEY`, and none at all while
    ``encryption_keys`` (``IDEMPOTENCY_ENCRYPTION_KEYS`` as configured) is set:
    sealed bodies beside an unkeyed SHA-256 of the request would let whoever
    reads the table confirm a guess of a small body (``{"amount": 100}``).
    """
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"{FINGERPRINT_KEY} is an empty list: give the current key first")
        if any(not isinstance(one, (str, bytes, bytearray)) for one in value):
            kinds = sorted({type(one).__name__ for one in value})
            raise TypeError(
                f"{FINGERPRINT_KEY} as a list takes secrets as text or bytes, got {kinds}"
            )
        keys = [resolve_fingerprint_key(one, None) for one in value]
        return keys[0]
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


def fingerprint_keys(value: t.Any) -> tuple[bytes, ...]:
    """Every key ``IDEMPOTENCY_FINGERPRINT_KEY`` names, the current one first
    (already checked by :func:`resolve_fingerprint_key`); none without one."""
    values = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    return tuple(v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in values)


#: A key id: what the config names a key by, and what a sealed value records.
KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,32}")

#: An id that fails the check but is safe to show: short, and with a character
#: no base64 key has (a space, '!'), as a typo, not a key, would.
_PLAIN_ID = re.compile(r"(?=.*[^A-Za-z0-9+/=_-]).{1,32}")

KeyPairs = tuple[tuple[str, bytes], ...]


#: A 256-bit key in base64, exactly: 43 characters (the last carries 4 bits,
#: its 2 low ones zero) and an optional "=", of one alphabet (standard or URL-safe).
_KEY_TEXT = re.compile(r"(?:[A-Za-z0-9+/]{42}|[A-Za-z0-9_-]{42})[AEIMQUYcgkosw048]=?")


def parse_key(text: str | bytes, name: str) -> bytes:
    """A 256-bit key from its exact base64 (standard or URL-safe, padding
    optional) text, or :class:`ValueError` naming ``name`` (the key's text is
    not shown). Anything else is refused, also 43 characters of the alphabet
    that are no such encoding (a passphrase that happens to fit)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    cleaned = text.strip()
    raw = b""
    if _KEY_TEXT.fullmatch(cleaned):
        padded = cleaned.rstrip("=") + "="
        try:
            raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError):  # pragma: no cover - the pattern checked it
            raw = b""
    if len(raw) != 32:
        raise ValueError(
            f"{name}: a key must be 32 random bytes in base64 (44 characters), e.g. from "
            "`flask idempotency generate-key`; this one is not"
        )
    return raw


ALLOW_CLEAR = "IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR"


def check_encryption_config(config: t.Mapping[str, t.Any]) -> bool:
    """Checks of the app's config that go with encryption keys, at ``init_app``;
    returns ``IDEMPOTENCY_ENCRYPTION_ALLOW_CLEAR`` (``False`` unless set ``True``).

    Refused: encryption keys while the default scope (``IDEMPOTENCY_SCOPE``
    unset) has no ``SECRET_KEY`` to key the proof of a Basic password it keeps
    in clear: a dump would give every password to an offline wordlist."""
    allow = config.get(ALLOW_CLEAR, False)
    if not isinstance(allow, bool):
        raise TypeError(f"{ALLOW_CLEAR} must be True or False, not a {type(allow).__name__}")
    if config.get("IDEMPOTENCY_SCOPE") is None and not config.get("SECRET_KEY"):
        raise ValueError(
            "IDEMPOTENCY_ENCRYPTION_KEYS is set but the app has no SECRET_KEY: the default "
            "scope keeps a proof of each HTTP Basic password (an HMAC keyed with SECRET_KEY) "
            "in clear, and without the secret a dump gives those passwords to an offline "
            "wordlist; set SECRET_KEY (a random secret, kept as long as retries may come) or "
            "IDEMPOTENCY_SCOPE"
        )
    return allow


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
            # The id that fails is not shown when it could be key material (an
            # id and key written the wrong way round): only a short, plain one.
            shown = f" {kid!r}" if isinstance(kid, str) and _PLAIN_ID.fullmatch(kid) else ""
            raise ValueError(
                f"{name}: key id{shown} (key {len(pairs) + 1} of the list) must be 1 to 32 "
                "letters, digits, '.', '_' or '-'"
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
