"""The record table, ``idempotency_keys``, defined on the app's own metadata.

One row per (scope, key). It lives in the app's database, next to the business
tables, because the point of the record is to commit in the same transaction as
the side effect it guards. Its ``status`` is ``IN_PROGRESS``, ``COMPLETED`` or
``ERASED`` (a tombstone left by erasure, answered 410 until it expires).
"""

from __future__ import annotations

from ._deprecated import forward
from ._storage.schema import COMPLETED as COMPLETED
from ._storage.schema import ERASED as ERASED
from ._storage.schema import IN_PROGRESS as IN_PROGRESS
from ._storage.schema import INBOX_TABLE_NAME as INBOX_TABLE_NAME
from ._storage.schema import JOB_LOCK_TABLE_NAME as JOB_LOCK_TABLE_NAME
from ._storage.schema import OUTBOX_TABLE_NAME as OUTBOX_TABLE_NAME
from ._storage.schema import TABLE_NAME as TABLE_NAME
from ._storage.schema import Record as Record
from ._storage.schema import inbox_table as inbox_table
from ._storage.schema import job_lock_table as job_lock_table
from ._storage.schema import outbox_table as outbox_table
from ._storage.schema import record_table as record_table

__all__ = [
    "COMPLETED",
    "ERASED",
    "INBOX_TABLE_NAME",
    "IN_PROGRESS",
    "JOB_LOCK_TABLE_NAME",
    "OUTBOX_TABLE_NAME",
    "TABLE_NAME",
    "Record",
    "inbox_table",
    "job_lock_table",
    "outbox_table",
    "record_table",
]

__getattr__ = forward(__name__, "flask_idempotency._storage.schema")
