"""Flask-Idempotency: retried POST requests that are safe.

The view runs at most once per (scope, ``Idempotency-Key``) within the retention
window; retries get the stored response replayed. The record is claimed in the
app's SQLAlchemy session and commits in the same transaction as the business
rows.
"""

from __future__ import annotations

# The public modules, also reachable as attributes (``flask_idempotency.inbox``):
from . import config as config
from . import errors as errors
from . import forms as forms
from . import inbox as inbox
from . import jobs as jobs
from . import keys as keys
from . import models as models
from . import outbox as outbox
from . import publishers as publishers
from . import relay as relay
from . import scheduler as scheduler
from . import scope as scope
from . import signals
from ._function import FunctionOutcome
from ._storage.schema import COMPLETED, IN_PROGRESS, Record
from .errors import (
    BrokerUnavailable,
    ConflictError,
    DatabaseUnavailableError,
    EventIdConflictError,
    FormKeyError,
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

#: The release, as on PyPI (setup.py reads it from here).
__version__ = "0.1.0.dev0"

__all__ = [
    "COMPLETED",
    "IN_PROGRESS",
    "BrokerUnavailable",
    "ConflictError",
    "DatabaseUnavailableError",
    "EventIdConflictError",
    "FormKeyError",
    "FunctionOutcome",
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
