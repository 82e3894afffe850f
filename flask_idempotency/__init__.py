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
    DatabaseUnavailableError,
    EventIdConflictError,
    IdempotencyError,
    InvalidKeyError,
    KeyReusedError,
    LeaseLostError,
    LengthRequiredError,
    MalformedBodyError,
    MissingKeyError,
    NothingToRecoverError,
    PayloadTooLargeError,
    ProblemError,
    TransactionConflictError,
    UnsupportedMediaTypeError,
    ValidationProblem,
)
from .extension import Idempotency
from .keys import derive_key
from .models import COMPLETED, IN_PROGRESS, Record

#: The release, as on PyPI (setup.py reads it from here).
__version__ = "0.1.0.dev0"

__all__ = [
    "COMPLETED",
    "IN_PROGRESS",
    "ConflictError",
    "DatabaseUnavailableError",
    "EventIdConflictError",
    "Idempotency",
    "IdempotencyError",
    "InvalidKeyError",
    "KeyReusedError",
    "LeaseLostError",
    "LengthRequiredError",
    "MalformedBodyError",
    "MissingKeyError",
    "NothingToRecoverError",
    "PayloadTooLargeError",
    "ProblemError",
    "Record",
    "TransactionConflictError",
    "UnsupportedMediaTypeError",
    "ValidationProblem",
    "derive_key",
    "signals",
]
