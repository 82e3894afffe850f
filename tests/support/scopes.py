"""The scopes the test app's scope routes store, computed as the README
documents them, for the scope, key and record tests."""

from __future__ import annotations

import hashlib
import hmac

from flask import Flask

#: The endpoint of the test app's scope route, the first part of its scopes.
ENDPOINT = "t.scope_charge"


def basic_scope(app: Flask, user: str, password: str, endpoint: str = ENDPOINT) -> str:
    return f"{endpoint}|basic:{user}:{basic_proof(app, user, password)}"


def basic_proof(app: Flask, user: str, password: str) -> str:
    """The documented Basic proof: the first 32 hex of HMAC-SHA256, keyed with SECRET_KEY."""
    secret = app.secret_key or b""
    key = secret.encode() if isinstance(secret, str) else secret
    message = b"flask-idempotency basic scope\x00" + f"{user}:{password}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]
