"""Keys for the encryption-at-rest tests, and the config that sets them."""

from __future__ import annotations

import base64
import typing as t

from flask import Flask

from flask_idempotency._context import app_state
from flask_idempotency._storage import seal

#: Two keys, with their ids: A is the old one, B the new one of a rotation.
KEY_A = ("A", bytes(range(32)))
KEY_B = ("B", bytes(range(100, 132)))


def key_line(key: tuple[str, bytes]) -> str:
    """``id:base64key``, as IDEMPOTENCY_ENCRYPTION_KEYS takes a key."""
    return f"{key[0]}:{base64.urlsafe_b64encode(key[1]).decode()}"


def keys_config(*keys: tuple[str, bytes]) -> dict[str, t.Any]:
    """The config that sets ``keys`` (the first seals); none: encryption off."""
    return {"IDEMPOTENCY_ENCRYPTION_KEYS": [key_line(k) for k in keys]} if keys else {}


def use_keys(app: Flask, *keys: tuple[str, bytes]) -> Flask:
    """``app`` with ``keys`` (interim, until the setting lands)."""
    with app.app_context():
        ring = seal.Keyring(keys=tuple(keys)) if keys else None
        app_state(app).store.keyring = ring  # type: ignore[attr-defined]
    return app


def keys_text(*keys: tuple[str, bytes]) -> str:
    """``keys`` as one string, as an environment variable holds the setting."""
    return ",".join(key_line(k) for k in keys)


def keys_app(factory: t.Callable[..., Flask], url: str, keys: str) -> Flask:
    """``factory(url)`` with the keys of ``keys`` (:func:`keys_text`)."""
    ring = []
    for line in filter(None, keys.split(",")):
        kid, _, key = line.partition(":")
        ring.append((kid, seal.parse_key(key, "keys")))
    return use_keys(factory(url), *ring)
