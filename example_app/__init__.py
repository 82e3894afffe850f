"""A small payments service: one ledger row per charge, made safe to retry.

Run it with ``python -m example_app`` (SQLite by default; set
``EXAMPLE_DATABASE_URL`` for another database, with its driver:
``postgresql+psycopg2://user@host/payments`` with the ``[postgresql]`` extra,
``postgresql+psycopg://...`` with ``[psycopg]``, ``mysql+pymysql://...`` with
``[mysql]``). Every call names its merchant in ``X-Merchant``.
"""

from __future__ import annotations

from .app import create_app, db, idem

__all__ = ["create_app", "db", "idem"]
