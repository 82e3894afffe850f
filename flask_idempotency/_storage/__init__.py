"""The storage layer: every SQL statement on the extension's tables, and every
difference between database engines.

What the layers above may rely on:

* Every statement runs in the session or connection it is given, in that
  transaction: the record commits or rolls back with the app's rows. A
  connection in autocommit mode is refused (:func:`refuse_autocommit`).
* Nothing checks and then inserts: a claim is a conflict-tolerant insert, and
  every later change is a conditional ``UPDATE``/``DELETE`` on the record's
  fencing token, which only one contender can win. A statement's outcome
  (``True``/``False``) is read from the row it returned, or the fencing token
  read back; a driver's row count only for MySQL's ``UPDATE``, which has no
  ``RETURNING``.
* A wait on another transaction is bounded where asked
  (:meth:`Store.bounded_wait`), and a database that gives up on it raises
  :class:`~flask_idempotency.errors.ClaimWaitExceeded`; any other database
  error propagates as SQLAlchemy raised it, and :mod:`.dberrors` says what it
  means for the client (the one place engine error codes are listed).
* Times that coordinate processes come from the database (:func:`database_now`).
* The answers are the same on PostgreSQL (psycopg2, psycopg 3), SQLite and
  MySQL/MariaDB; an engine without a module of its own gets SQLAlchemy's
  portable statements.

Inside: :mod:`.store` (a request's claim), :mod:`.held` (a holder's fenced
statements), :mod:`.admin` (the jobs' and the operator's), :mod:`.holds` (what keeps a
record from being released: the one rule every entry point follows), :mod:`.locks` (job
locks), :mod:`.outbox`, :mod:`.inbox` and :mod:`.notify` (the messaging
tables' statements, the relay's wake-up channel), :mod:`.readiness` (the
readiness probe's), :mod:`.schema` (the tables and the record as read),
:mod:`.added` (the record table's added columns, and a table from before them),
:mod:`.sql` (the shared building blocks); :mod:`.dialects` (one module per
engine, behind one interface: every difference between engines is there) and
:mod:`.drivers` (the psycopg fast paths, by dialect and driver).
The layers above import from here, not from those modules.
"""

from __future__ import annotations

from . import dberrors
from .dialects import Executor, idle_bound
from .driver_check import configured_urls, missing_driver
from .held import answer_values
from .holds import OVERRIDABLE, Hold, Verdict, release_verdict
from .locks import JobLocks, new_holder_id
from .schema import (
    COMPLETED,
    ERASED,
    IN_PROGRESS,
    INBOX_TABLE_NAME,
    JOB_LOCK_TABLE_NAME,
    MYSQL_DIALECTS,
    OUTBOX_TABLE_NAME,
    TABLE_NAME,
    Record,
    as_utc,
    inbox_table,
    is_unstored,
    job_lock_table,
    outbox_table,
    record_table,
    unstored_mark,
)
from .sql import (
    changed_one,
    database_now,
    new_fencing_token,
    open_transaction,
    operation_values,
    refuse_autocommit,
    returning,
    text_param,
)
from .store import Store

__all__ = [
    "COMPLETED",
    "ERASED",
    "INBOX_TABLE_NAME",
    "IN_PROGRESS",
    "JOB_LOCK_TABLE_NAME",
    "MYSQL_DIALECTS",
    "OUTBOX_TABLE_NAME",
    "OVERRIDABLE",
    "TABLE_NAME",
    "Executor",
    "Hold",
    "JobLocks",
    "Record",
    "Store",
    "Verdict",
    "answer_values",
    "as_utc",
    "changed_one",
    "configured_urls",
    "database_now",
    "dberrors",
    "idle_bound",
    "inbox_table",
    "is_unstored",
    "job_lock_table",
    "missing_driver",
    "new_fencing_token",
    "new_holder_id",
    "open_transaction",
    "operation_values",
    "outbox_table",
    "record_table",
    "refuse_autocommit",
    "release_verdict",
    "returning",
    "text_param",
    "unstored_mark",
]
