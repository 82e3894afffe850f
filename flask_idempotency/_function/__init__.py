"""Idempotent functions (``idem.function``): work outside HTTP (a scheduled job,
a CLI command, a queue consumer) run at most once per (scope, key), its return
value stored on a record of ``idempotency_keys`` that commits with the
function's writes. Built on the routes' claim, guard and completion; see
docs/functions.md.
"""

from __future__ import annotations

from .api import FunctionAPI, IdempotentFunction
from .call import FunctionOutcome

__all__ = ["FunctionAPI", "FunctionOutcome", "IdempotentFunction"]
