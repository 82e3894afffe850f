"""Flask-Idempotency: retried POST requests that are safe.

The view runs at most once per (scope, ``Idempotency-Key``) within the retention
window; retries get the stored response replayed. The record is claimed in the
app's SQLAlchemy session and commits in the same transaction as the business
rows.
"""

from __future__ import annotations

from . import signals
from .errors import (
    ConflictError,
    IdempotencyError,
    InvalidKeyError,
    KeyReusedError,
    LeaseLostError,
    MissingKeyError,
    ProblemError,
)
from .extension import Idempotency
from .models import COMPLETED, IN_PROGRESS, Record

__all__ = [
    "COMPLETED",
    "IN_PROGRESS",
    "ConflictError",
    "Idempotency",
    "IdempotencyError",
    "InvalidKeyError",
    "KeyReusedError",
    "LeaseLostError",
    "MissingKeyError",
    "ProblemError",
    "Record",
    "signals",
]
