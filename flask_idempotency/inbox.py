"""The inbox: consumer-side dedupe of events delivered more than once.

A broker delivers at least once; a consumer that must act once per event keeps
the ids it has processed in ``idempotency_inbox``, one row per (consumer,
event_id), inserted in the same transaction as the consumer's work. The insert
decides, as the record's claim does: a conflict-tolerant insert (``ON CONFLICT
DO NOTHING`` on PostgreSQL and SQLite, ``INSERT IGNORE`` on MySQL/MariaDB) that
inserts one row means "do the work"; none means the event was processed (and
committed) already. A concurrent delivery of the same event waits on the first
one's uncommitted row (the primary key), then sees it (the first committed:
skip) or inserts it (the first rolled back: do the work).

Processed ids are kept for ``IDEMPOTENCY_INBOX_TTL`` (7 days by default); an id
past it counts as new, and cleanup (:func:`flask_idempotency.jobs.purge_expired`)
deletes it.
"""

from __future__ import annotations

from ._deprecated import forward
from ._messaging.inbox import DEFAULT_TTL as DEFAULT_TTL
from ._messaging.inbox import MAX_ID_LENGTH as MAX_ID_LENGTH
from ._messaging.inbox import consumer as consumer
from ._messaging.inbox import mark_processed as mark_processed
from ._messaging.inbox import process as process

__all__ = [
    "DEFAULT_TTL",
    "MAX_ID_LENGTH",
    "consumer",
    "mark_processed",
    "process",
]

# The old flat module's other names, its cleanup statements (purge_batch) among them.
__getattr__ = forward(
    __name__, "flask_idempotency._messaging.inbox", "flask_idempotency._storage.inbox"
)
