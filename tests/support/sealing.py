"""Encryption at rest in tests: keys, the config that turns it on, and a look at
what the database holds in clear."""

from __future__ import annotations

import base64
import typing as t

from flask import Flask

from flask_idempotency import config
from tests.conftest import record_rows

#: Two fixed keys (tests must be repeatable), in the config's text form.
KEY_A = "a:" + base64.urlsafe_b64encode(bytes(range(32))).decode()
KEY_B = "b:" + base64.urlsafe_b64encode(bytes(range(100, 132))).decode()
#: The secret of the keyed fingerprint, where this version has the setting.
FINGERPRINT_SECRET = base64.urlsafe_b64encode(b"f" * 32).decode()


def sealed_config(*keys: str) -> dict[str, t.Any]:
    """The config that turns encryption at rest on with ``keys`` (first seals;
    default :data:`KEY_A`), and the keyed fingerprint's secret it goes with (and
    the ``SECRET_KEY`` init_app asks for beside keys, for the default scope)."""
    found: dict[str, t.Any] = {
        "IDEMPOTENCY_ENCRYPTION_KEYS": list(keys or (KEY_A,)),
        "SECRET_KEY": "tests-secret-key",
    }
    if "FINGERPRINT_KEY" in config.DEFAULTS:
        found["IDEMPOTENCY_FINGERPRINT_KEY"] = FINGERPRINT_SECRET
    return found


def fingerprint_config() -> dict[str, t.Any]:
    """:func:`sealed_config` without the keys: the keyed fingerprint alone (a
    record written so replays once encryption is turned on: changing the
    fingerprint's key, not sealing, is what turns a retry into a mismatch)."""
    found = sealed_config()
    del found["IDEMPOTENCY_ENCRYPTION_KEYS"]
    return found


def _text(value: t.Any) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("latin-1")
    return "" if value is None else str(value)


def clear_in_rows(app: Flask, marker: str) -> list[str]:
    """``"key.column"`` of every record column whose stored value shows
    ``marker`` in clear (read raw, without the extension)."""
    return [
        f"{row['key']}.{column}"
        for row in record_rows(app)
        for column, value in row.items()
        if marker in _text(value)
    ]
