"""The transactional outbox: events written in the business transaction.

``idem.emit(topic, payload)`` inside an idempotent view (or :func:`add_event`
anywhere, with an explicit id) inserts one ``idempotency_outbox`` row through
the app's session, in the same transaction as the view's writes and the
record. The event exists exactly when the business change does: a rollback
takes it away with the rows, it was never committed, and the relay
(:mod:`flask_idempotency.relay`) never sees it.

Event ids. In an idempotent request with a key, the id of the n-th emit
(0-based, counted per request) is ``idem.derived_key(f"event:{topic}:{n}")``:
the same on every retry and resume of the operation, different for a new
operation on an expired key. Two things keep an event from being written
twice, and both hold: the row only commits with the business rows (a crashed
attempt committed nothing, so its re-run writes the event for the first time),
and the insert is conflict-tolerant on ``event_id`` (``ON CONFLICT DO NOTHING``
on PostgreSQL and SQLite, ``ON DUPLICATE KEY UPDATE`` a no-op on MySQL, not
``INSERT IGNORE``, which would also swallow truncation errors), so a leased
view that committed part of its work, crashed and resumes re-emits without
failing and without a second row.

Optimistic routes may emit (the event is a write in the view's transaction),
but have no operation time to derive from, and a request without a key has no
operation at all: there the id is random (``uuid4().hex``). That is enough
because the event commits only with the winning record: a duplicate's whole
transaction, event included, rolls back when it meets the winner's record.

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

import dataclasses
import datetime as dt
import json
import threading
import typing as t
import uuid

import sqlalchemy as sa
from flask import g
from sqlalchemy import event as sa_event
from sqlalchemy.dialects import mysql, postgresql, sqlite

from .models import MYSQL_DIALECTS, _text, as_utc, outbox_table
from .state import app_state

#: Set when a transaction that emitted events commits in this process: an
#: in-process relay waits on it instead of sleeping its whole poll interval.
WAKE = threading.Event()

#: The PostgreSQL channel a transaction that emitted notifies.
CHANNEL = "idempotency_outbox"

_INFO_FLAG = "idempotency_outbox_emitted"
_COUNTER = "_idempotency_outbox_emits"
_watched: set[t.Any] = set()
_wakers: set[t.Callable[[], None]] = set()


@dataclasses.dataclass(frozen=True)
class OutboxEvent:
    """One event as the relay hands it to a publisher."""

    id: int
    event_id: str
    topic: str
    payload: t.Any
    headers: dict[str, str]
    created_at: dt.datetime
    attempts: int

    @classmethod
    def from_row(cls, row: t.Any) -> OutboxEvent:
        m = row._mapping
        return cls(
            id=int(m["id"]),
            event_id=t.cast(str, _text(m["event_id"])),
            topic=m["topic"],
            payload=json.loads(m["payload"]),
            headers=json.loads(m["headers"]) if m["headers"] else {},
            created_at=t.cast(dt.datetime, as_utc(m["created_at"])),
            attempts=int(m["attempts"]),
        )


def _insert(table: sa.Table, dialect: str, values: dict[str, t.Any]) -> t.Any:
    if dialect == "postgresql":
        return (
            postgresql.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["event_id"])
        )
    if dialect == "sqlite":
        return (
            sqlite.insert(table)
            .values(**values)
            .on_conflict_do_nothing(index_elements=["event_id"])
        )
    if dialect in MYSQL_DIALECTS:
        stmt = mysql.insert(table).values(**values)
        return stmt.on_duplicate_key_update(event_id=stmt.inserted.event_id)
    return sa.insert(table).values(**values)


def add_event(
    session: t.Any,
    topic: str,
    payload: t.Any,
    *,
    event_id: str,
    headers: t.Mapping[str, str] | None = None,
    now: dt.datetime | None = None,
) -> str:
    """Insert an event through ``session`` (in its current transaction).

    ``payload`` must be JSON-serializable; ``event_id`` (at most 64 characters)
    identifies the event: adding an id that exists already adds nothing. The
    event is published by the relay once the session's transaction commits,
    and never if it rolls back. Returns ``event_id``. Call in an app context
    of an app with the extension registered.
    """
    if not event_id or len(event_id) > 64:
        raise ValueError(f"event_id must be 1 to 64 characters, got {event_id!r}")
    state = app_state()
    table = outbox_table(state.db.metadata)
    values = {
        # As a string on every engine: MySQL's VARBINARY type would want bytes
        # (the server stores the string's bytes; see store.text_param).
        "event_id": sa.bindparam("event_id", event_id, type_=sa.String()),
        "topic": topic,
        "payload": json.dumps(payload, separators=(",", ":"), sort_keys=True),
        "headers": json.dumps(dict(headers)) if headers else None,
        "created_at": now or state.clock(),
        "attempts": 0,
    }
    dialect = session.get_bind().dialect.name
    session.execute(_insert(table, dialect, values))
    if dialect == "postgresql" and not session.info.get(_INFO_FLAG):
        # Once per transaction; PostgreSQL delivers it at the commit, and drops it
        # with a rollback. A LISTENing relay wakes at once (relay.Listener).
        session.execute(sa.text(f"SELECT pg_notify('{CHANNEL}', '')"))
    session.info[_INFO_FLAG] = True
    return event_id


def emit(topic: str, payload: t.Any, headers: t.Mapping[str, str] | None = None) -> str:
    """``idem.emit``: add an event to the current request's transaction (see module)."""
    from .extension import current_derived_key

    state = g.get("_idempotency")
    n = g.get(_COUNTER, 0)
    setattr(g, _COUNTER, n + 1)
    if state is not None and not state.optimistic and state.key is not None:
        event_id = current_derived_key(f"event:{topic}:{n}", handed_out=False)
    else:
        event_id = uuid.uuid4().hex
    return add_event(app_state().db.session, topic, payload, event_id=event_id, headers=headers)


def end_request() -> None:
    """Forget the request's emit count (called when the request ends)."""
    g.pop(_COUNTER, None)


def on_commit(callback: t.Callable[[], None]) -> None:
    """Call ``callback()`` (in the committing thread, so it must be quick and
    must not raise) after each commit in this process that carried events."""
    _wakers.add(callback)


def remove_on_commit(callback: t.Callable[[], None]) -> None:
    """Stop calling ``callback``; a callback not registered is ignored."""
    _wakers.discard(callback)


def _after_commit(session: t.Any) -> None:
    if session.info.pop(_INFO_FLAG, False):
        WAKE.set()
        for wake in list(_wakers):
            wake()


def _after_rollback(session: t.Any) -> None:
    session.info.pop(_INFO_FLAG, None)


def listen(session_factory: t.Any) -> None:
    """Wake the in-process relay when a transaction that emitted commits."""
    if session_factory in _watched:
        return
    sa_event.listen(session_factory, "after_commit", _after_commit)
    sa_event.listen(session_factory, "after_rollback", _after_rollback)
    _watched.add(session_factory)
