"""Secrets in the configuration, resolved and checked without ever being echoed:
the key of the request fingerprint (``IDEMPOTENCY_FINGERPRINT_KEY``)."""

from __future__ import annotations

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
