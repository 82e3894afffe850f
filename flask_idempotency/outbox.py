"""The transactional outbox: events written in the business transaction.

``idem.emit(topic, payload)`` inside an idempotent view (or :func:`add_event`
anywhere, with an explicit id) inserts one ``idempotency_outbox`` row through
the app's session, in the same transaction as the view's writes and the
record. The event exists exactly when the business change does: a rollback
takes it away with the rows, it was never committed, and the relay
(:mod:`flask_idempotency.relay`) never sees it.

Event ids. An event's id names the logical event, not its position among the
emits of an attempt, so a retried or resumed operation gives each event the id
it had before, whatever else the view emits first or in which order. In an
idempotent request with a key:

* ``idem.emit(topic, payload, name="order-created")``: the id is
  ``idem.derived_key("event:" + name)``. The name is the event's identity in
  the operation; one name is one event, whatever its topic.
* ``idem.emit(topic, payload)`` without a name: the event's content names it:
  ``idem.derived_key("event#" + <SHA-256 of the topic, payload and n>)``, where the
  payload is the canonical JSON (keys sorted, no spaces) and ``n`` counts the
  earlier emits of the very same topic and payload in this attempt (0 for the
  first). A payload that differs between attempts (a timestamp, a random
  number) makes a different event: give such events a ``name``.

Not a counter per topic: that is still a position, and a resumed view that
emits another event of the same topic first would meet the earlier event's id.

The row commits only with the business rows (a crashed attempt committed
nothing, so its re-run writes the event for the first time), and the insert is
conflict-tolerant on ``event_id`` (``ON CONFLICT DO NOTHING`` on PostgreSQL and
SQLite, ``ON DUPLICATE KEY UPDATE`` a no-op on MySQL, not ``INSERT IGNORE``,
which would also swallow truncation errors). When the id exists already, the
stored event is compared with this one: the same topic and payload (headers are
not compared: a trace id may differ per attempt) is the same event, added once,
so a leased view that committed an event, crashed and resumes re-emits it
without failing and without a second row; another topic or payload raises
:class:`~flask_idempotency.errors.EventIdConflictError`, in the caller's
transaction, which stays usable. An id is never handed back for an event that
was not written. :func:`add_event` (explicit ids) follows the same rule.

Optimistic routes may emit (the event is a write in the view's transaction),
but have no operation time to derive from, and a request without a key has no
operation at all: there the id is random (``uuid4().hex``) and ``name`` has no
effect. That is enough because the event commits only with the winning record:
a duplicate's whole transaction, event included, rolls back when it meets the
winner's record.

Wake-ups: a commit that carried events sets :data:`WAKE` in this process (an
``after_commit`` hook on the app's sessions) and calls every callback given to
:func:`on_commit` (a relay's :class:`~flask_idempotency.relay.Listener` and so
the scheduler's relay job wake up), and on PostgreSQL the first emit
of a transaction also runs ``pg_notify('idempotency_outbox', '')``, which
PostgreSQL delivers at the commit (and drops on rollback), so a relay that
LISTENs wakes at once instead of waiting for its next poll. Both only shorten
the wait: the relay polls regardless, so a lost wake-up (an emit in a savepoint
rolled back before a later one) only delays an event to the next poll.
"""

from __future__ import annotations

from ._deprecated import forward
from ._messaging.outbox import CHANNEL as CHANNEL
from ._messaging.outbox import OutboxEvent as OutboxEvent
from ._messaging.outbox import add_event as add_event

__all__ = ["CHANNEL", "OutboxEvent", "add_event"]

__getattr__ = forward(__name__, "flask_idempotency._messaging.outbox")
