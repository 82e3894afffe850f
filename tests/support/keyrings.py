"""Two keys with ids for the rotation tests (A the old one, B the new one), in
the spellings IDEMPOTENCY_ENCRYPTION_KEYS takes, and apps made with them."""

from __future__ import annotations

import base64
import typing as t

from flask import Flask

from tests.support.sealing import sealed_config

#: (id, key): the same bytes as tests/support/sealing.py's, under upper-case ids.
KEY_A = ("A", bytes(range(32)))
KEY_B = ("B", bytes(range(100, 132)))


def key_line(key: tuple[str, bytes]) -> str:
    """``id:base64key``, as IDEMPOTENCY_ENCRYPTION_KEYS takes a key."""
    return f"{key[0]}:{base64.urlsafe_b64encode(key[1]).decode()}"


def keys_text(*keys: tuple[str, bytes]) -> str:
    """``keys`` as one string, as an environment variable holds the setting."""
    return ",".join(key_line(k) for k in keys)


def keys_config(*keys: tuple[str, bytes]) -> dict[str, t.Any]:
    """The config that sets ``keys`` (the first seals); none: encryption off."""
    return sealed_config(*(key_line(k) for k in keys)) if keys else {}


def keys_app(factory: t.Callable[..., Flask], url: str, keys: str) -> Flask:
    """``factory(url)`` with ``keys`` (:func:`keys_text`; empty: encryption off),
    set as an environment variable would set it."""
    if not keys:
        return factory(url)
    config = sealed_config(keys)
    config["IDEMPOTENCY_ENCRYPTION_KEYS"] = keys  # the one-string spelling
    return factory(url, **config)
