"""The outbox relay: publishes committed events, in id order, at least once.

:func:`relay_batch` runs one batch, and no transaction stays open while the
broker is talked to:

1. take: in one short transaction, select the pending rows (unpublished, not
   parked, due) in id order, ``LIMIT batch``, read from the pending index for
   the batch's rows alone, and lease them: ``next_attempt_at``
   is set to now + ``IDEMPOTENCY_OUTBOX_LEASE``, so they are not due for anyone
   else, and the transaction commits. "Now", for leases and backoffs, is the
   database's clock (read from the database server), the one
   every relay on every host compares with, unless the app was given a clock
   of its own (``Idempotency(clock=...)``, as tests do). On PostgreSQL and MySQL/MariaDB the
   select is ``FOR UPDATE SKIP LOCKED``, so relays taking at once take disjoint
   rows without waiting; on SQLite the transaction first takes the database's
   write lock (SQLite has one writer), so a second relay waits for the first's
   take and then sees its rows leased;
2. publish each event through the publisher, outside any transaction, and mark
   what it published (for a broker: what it confirmed) in short transactions of
   their own, every :data:`MARK_EVERY` (50 ms) of publishing and at the batch's
   end: ``published_at``; a failed publish
   at once: ``attempts + 1``, ``last_error`` and an exponential backoff
   (``next_attempt_at``), parked (``failed_at``) at
   ``IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS``. A publisher with ``publish_many``
   (:class:`~flask_idempotency.publishers.KombuPublisher`: pipelined publisher
   confirms) is handed up to :data:`PIPELINE` (500) events at a time instead;
   each such run's published events are marked in one statement when it
   returns, its failures recorded in one transaction, and an event still
   counts as published only on its own confirm;
3. give back what it did not try (``next_attempt_at`` cleared: due at once)
   when the broker is unreachable (:class:`BrokerUnavailable` ends the batch)
   or when half the lease has passed (the batch stops there, so it never
   publishes past its lease, and a next batch takes the rest).

Parking counts real failures only: a publish that raised, a message the
broker refused (a nack). :class:`BrokerUnavailable` is not the event's failure:
the event keeps its attempts, records the error in ``last_error``, stays due
and is the first tried by the next run (one connection attempt per run while
the broker is away); after an outage of any length the events flow at once, in
order, and one later ordinary error is one failure, not the last of many.

A server-side timeout (``idle_in_transaction_session_timeout``,
``idle_session_timeout``, MySQL's ``wait_timeout``) cannot end a batch halfway:
no transaction is open during a publish, and a mark that finds its pooled
connection closed by the server is run once more on a new one.

Delivery is at least once. A relay that dies, or loses its database, after the
broker took an event and before the event's mark committed leaves the row
leased and unpublished (at most those published in its last 50 ms of
publishing, and the one in flight, or the run being published together); once
the lease runs out, the next run
publishes it again. No order of "publish" and "mark" avoids that without a
transaction spanning the broker and the database; consumers deduplicate on
``event_id``.
A relay interrupted by any exception, ``KeyboardInterrupt`` and ``SystemExit``
included, marks what it published and gives back the rest before re-raising,
when the database lets it. Each mark is fenced by the lease: a relay whose lease ran out
(a publish that outlasted it) never backs off or gives back a row that another
relay took since; its "published" mark always stands.

Every run selects all pending rows: there is no high-water mark over ids, so
an event whose transaction took its id early and committed late (after events
with higher ids were published) is published by the next run.
Order: one relay publishes in id order within and across runs, except that
an event waiting out its backoff lets later events pass it. Several relays at
once take disjoint batches and publish them side by side, so a later event can
reach the broker first: a consumer that needs one entity's events in order
checks a version or sequence of its own, or the app runs a single relay.
"""

from __future__ import annotations

from ._deprecated import forward
from ._messaging.admin import outbox_stats as outbox_stats
from ._messaging.admin import purge_published as purge_published
from ._messaging.admin import retry_parked as retry_parked
from ._messaging.relay import Publisher as Publisher
from ._messaging.relay import RelayRun as RelayRun
from ._messaging.relay import relay_batch as relay_batch
from ._messaging.relay import relay_once as relay_once
from .errors import BrokerUnavailable as BrokerUnavailable

__all__ = [
    "BrokerUnavailable",
    "Publisher",
    "RelayRun",
    "outbox_stats",
    "purge_published",
    "relay_batch",
    "relay_once",
    "retry_parked",
]

# The old flat module's other names: the batch, the listener, the operator
# functions and the outbox's cleanup statements (purge_published_batch).
__getattr__ = forward(
    __name__,
    "flask_idempotency._messaging.relay",
    "flask_idempotency._messaging.listener",
    "flask_idempotency._messaging.admin",
    "flask_idempotency._storage.outbox",
)
