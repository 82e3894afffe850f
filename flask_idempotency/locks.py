"""Deprecated: the job locks are internal (``flask_idempotency._storage.locks``).

Kept for one release so that code importing ``flask_idempotency.locks`` runs,
with a :class:`DeprecationWarning` per name it reads.
"""

from __future__ import annotations

from ._deprecated import forward

__all__: list[str] = []

__getattr__ = forward(__name__, "flask_idempotency._storage.locks")
