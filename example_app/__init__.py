"""A small payments service: one ledger row per charge, made safe to retry.

Run it with ``python -m example_app`` (SQLite by default; set
``EXAMPLE_DATABASE_URL`` for PostgreSQL).
"""

from __future__ import annotations

from .app import create_app, db, idem

__all__ = ["create_app", "db", "idem"]
