"""The implementation of :mod:`flask_idempotency.inbox` (see its documentation)."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import logging
import random
import threading
import time
import typing as t
import weakref

import sqlalchemy as sa
from flask import current_app, has_app_context
from sqlalchemy.orm import Session, scoped_session

from .. import _telemetry as telemetry
from .. import signals
from .._context import find_app_state
from .._storage import INBOX_TABLE_NAME as INBOX_TABLE_NAME
from .._storage import as_utc, dberrors
from .._storage import inbox as inbox_sql
from .._storage import inbox_table as inbox_table
from .._telemetry import propagation

#: How long a processed id is kept when neither ``ttl=`` nor the app's
#: ``IDEMPOTENCY_INBOX_TTL`` says otherwise.
DEFAULT_TTL = dt.timedelta(days=7)

logger = logging.getLogger("flask_idempotency")
_DEFAULT_TTL_TOLD = threading.Event()

#: The longest consumer name or event id the inbox keeps (characters).
MAX_ID_LENGTH = 255

#: ``Session.info`` key: the transaction (a weak reference) in which this
#: session wrote an inbox row it has not committed yet.
_ROW_PENDING = "flask_idempotency.inbox_row_pending"


def holds_inbox_row(session: Session) -> bool:
    """Whether ``session``'s current transaction holds an inbox row it wrote
    (:func:`mark_processed`) and has not committed yet: committing it now, before
    the consumer's work is done, would mark the event processed without it
    (``idem.function`` refuses to be called then)."""
    held = session.info.get(_ROW_PENDING)
    transaction = session.get_transaction()
    return held is not None and transaction is not None and held() is transaction


def _utc_now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _app_state() -> t.Any:
    return find_app_state()


def _resolve_ttl(ttl: dt.timedelta | float | None) -> dt.timedelta:
    if ttl is None:
        state = _app_state()
        if state is not None:
            return t.cast(dt.timedelta, state.settings.inbox_ttl)
        if not _DEFAULT_TTL_TOLD.is_set():
            # A consumer thread of its own (a broker callback) has no app context,
            # so the app's setting cannot be read: say so once rather than keep
            # ids for a window nobody chose.
            _DEFAULT_TTL_TOLD.set()
            logger.warning(
                "inbox: outside an app context, IDEMPOTENCY_INBOX_TTL cannot be read; "
                "processed ids are kept for the default %s. Pass ttl=, or deliver "
                "inside app.app_context().",
                DEFAULT_TTL,
            )
        return DEFAULT_TTL
    value = ttl if isinstance(ttl, dt.timedelta) else dt.timedelta(seconds=ttl)
    if value <= dt.timedelta(0):
        raise ValueError(f"the inbox ttl must be positive, got {value}")
    return value


def _resolve_now(now: dt.datetime | None) -> dt.datetime:
    if now is not None:
        return now
    state = _app_state()
    return state.clock() if state is not None else _utc_now()


def _id_text(event_id: str | int) -> str:
    """An event id as the inbox keeps it: a string, or an integer (not a bool)
    in decimal (``7`` and ``"7"`` are the same id)."""
    if isinstance(event_id, int) and not isinstance(event_id, bool):
        return str(event_id)
    if not isinstance(event_id, str):
        raise TypeError(
            f"an inbox event_id must be a string or an integer, got "
            f"{type(event_id).__name__} {event_id!r}"
        )
    return event_id


def mark_processed(
    session: Session | scoped_session[t.Any],
    consumer: str,
    event_id: str | int,
    *,
    ttl: dt.timedelta | float | None = None,
    now: dt.datetime | None = None,
) -> bool:
    """Insert (consumer, event_id) in ``session``'s transaction; ``True`` if this
    delivery must do the work, ``False`` if the event was processed already.

    Waits for a concurrent delivery's transaction holding the same id. Nothing
    is committed: the row commits (or rolls back) with the caller's work. An
    integer ``event_id`` is kept in decimal (``7`` is ``"7"``); another type
    raises ``TypeError``.
    """
    event_id = _id_text(event_id)
    if not isinstance(consumer, str):
        raise TypeError(f"an inbox consumer must be a string, got {type(consumer).__name__}")
    if not consumer or not event_id:
        raise ValueError("consumer and event_id must be non-empty strings")
    if len(consumer) > MAX_ID_LENGTH or len(event_id) > MAX_ID_LENGTH:
        # The columns hold 255 characters; refused here, before the insert, so
        # the caller sees why rather than a driver error that differs per engine.
        raise ValueError(f"consumer and event_id must be at most {MAX_ID_LENGTH} characters")
    now = _resolve_now(now)
    expires = now + _resolve_ttl(ttl)
    params = {
        "consumer": consumer,
        "event_id": event_id,
        "processed_at": now,
        "expires_at": expires,
    }
    dialect = session.get_bind().dialect
    # The insert may meet an expired row that cleanup deletes before the read
    # or the renewal below: no row then means "not processed", so insert again.
    for _ in range(ATTEMPTS):
        if inbox_sql.insert(session, dialect, params):
            return _row_pending(session)
        # The id is there, committed. Only an expired one is taken over; a live
        # one is left without a write lock (on MySQL every waiter holds a shared
        # lock on it after INSERT IGNORE: a write by each would deadlock them).
        # The read locks on MySQL, so that it sees the latest row whatever the
        # snapshot. (On PostgreSQL an insert that conflicts with a row its
        # REPEATABLE READ snapshot cannot see fails as a serialization error:
        # the read sees the row the insert met, unless it was deleted since.)
        expires_at = inbox_sql.read_expiry(session, dialect, consumer, event_id)
        if expires_at is None:
            continue  # deleted since the insert met it (cleanup): insert again
        if t.cast(dt.datetime, as_utc(expires_at)) > now:
            return False  # processed, and still within its window
        renewed = inbox_sql.renew(
            session,
            dialect,
            {
                "processed_at": now,
                "expires_at": expires,
                "w_consumer": consumer,
                "w_event_id": event_id,
                "w_now": now,
            },
        )
        if renewed:
            return _row_pending(session)
        # Renewed by a concurrent delivery (the insert now meets its live row:
        # processed) or deleted by cleanup (the insert writes it: fresh).
    raise RuntimeError(
        f"inbox: the id {event_id!r} of {consumer!r} was in the way of the insert and gone "
        f"by the read, {ATTEMPTS} times in a row"
    )


@contextlib.contextmanager
def process(
    session: Session | scoped_session[t.Any],
    *,
    consumer: str,
    event_id: str | int,
    commit: bool = False,
    ttl: dt.timedelta | float | None = None,
    now: dt.datetime | None = None,
    headers: t.Mapping[str, t.Any] | None = None,
) -> t.Iterator[bool]:
    """Process one delivery of ``event_id`` for ``consumer`` at most once::

        with inbox.process(db.session, consumer="billing", event_id=eid, commit=True) as fresh:
            if fresh:
                db.session.add(Invoice(...))

    ``fresh`` is ``True`` when this delivery must do the work, ``False`` when
    the event was processed (and committed) already: skip it. Enter it first in
    the transaction (on SQLite a transaction that has read before it writes
    cannot wait for another writer).

    The inbox row is inserted in ``session``'s transaction, so it commits with
    the work. The block does not commit unless ``commit=True``: without it the
    caller commits (and a row never committed is a delivery never processed).
    An exception leaving the block rolls the session back (the work and the
    inbox row alike, and anything else pending in it) and propagates, so the
    redelivery does the work. A duplicate sends
    :data:`~flask_idempotency.signals.event_skipped_duplicate`.

    ``headers``: the message's headers (a mapping, as the broker client gives
    them). With OpenTelemetry, the delivery (the inbox's insert, the block,
    the commit) runs under a CONSUMER span ``idempotency.inbox process``
    whose parent is the trace context the headers carry (``traceparent``,
    ``tracestate``, as the relay publishes them), so the consumer's work
    joins the trace of the request that emitted the event; without them,
    under the current span. The span says whether the delivery was a
    duplicate (``idempotency.inbox.duplicate``) and records an exception.
    """
    # A scoped session: the registry's current session.
    current = session() if isinstance(session, scoped_session) else session
    event_id = _id_text(event_id)
    with propagation.consuming(headers, consumer=consumer) as span:
        try:
            fresh = _mark_retrying(current, consumer, event_id, ttl=ttl, now=now)
            propagation.set_attribute(span, "idempotency.inbox.duplicate", not fresh)
            if not fresh:
                _skipped(consumer, event_id)
            yield fresh
            if commit:
                current.commit()
        except BaseException:
            current.rollback()
            raise


#: Attempts at the insert when the database picks it as a deadlock victim.
ATTEMPTS = 5


def _row_pending(session: Session | scoped_session[t.Any]) -> bool:
    """Note that ``session``'s transaction now holds an inbox row (see
    :func:`holds_inbox_row`); ``True``, the delivery's verdict."""
    current = session() if isinstance(session, scoped_session) else session
    transaction = current.get_transaction()
    if transaction is not None:
        current.info[_ROW_PENDING] = weakref.ref(transaction)
    return True


def _mark_retrying(
    session: Session,
    consumer: str,
    event_id: str,
    *,
    ttl: dt.timedelta | float | None,
    now: dt.datetime | None,
) -> bool:
    """:func:`mark_processed`, run again when the database picks it as a deadlock
    victim (on MySQL/MariaDB, deliveries waiting on a first one that rolls back
    deadlock each other), provided the transaction held nothing before it: then
    the rollback loses nothing of the caller's."""
    retry = not session.in_transaction()
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return mark_processed(session, consumer, event_id, ttl=ttl, now=now)
        except sa.exc.DBAPIError as exc:
            if not retry or attempt == ATTEMPTS or not dberrors.deadlock_victim(exc):
                raise
            session.rollback()
            time.sleep(random.uniform(0, 0.01 * attempt))
    raise AssertionError("unreachable")


def _skipped(consumer: str, event_id: str) -> None:
    telemetry.inbox_duplicate(consumer)
    sender = current_app._get_current_object() if has_app_context() else None  # type: ignore[attr-defined]
    signals.event_skipped_duplicate.send(sender, consumer=consumer, event_id=event_id)


F = t.TypeVar("F", bound=t.Callable[..., t.Any])

SessionArg = t.Union[Session, "scoped_session[t.Any]", t.Callable[[], t.Any]]


def consumer(
    name: str,
    *,
    session: SessionArg,
    event_id: t.Callable[..., str | int],
    ttl: dt.timedelta | float | None = None,
    headers: t.Callable[..., t.Mapping[str, t.Any] | None] | None = None,
) -> t.Callable[[F], F]:
    """Make a plain function (a broker callback, a Celery task) process each event
    once for the consumer ``name``::

        @inbox.consumer("billing", session=lambda: db.session, event_id=lambda msg: msg["id"])
        def bill(msg): ...

    ``event_id`` is called with the function's arguments and returns the id
    (a string, or an integer, kept in decimal).
    ``session`` is a session, or a callable returning one (called per delivery).
    Each call inserts the id in the session's transaction, runs the function and
    commits (the function's work, anything else pending in the session, and the
    id together). A duplicate does not run the function and returns ``None``
    (the signal ``event_skipped_duplicate`` tells it apart). An exception rolls
    the session back and propagates: the redelivery runs the function again.

    ``headers``, like ``event_id``, is called with the function's arguments and
    returns the message's headers (or ``None``): each delivery then continues
    the trace they carry (see :func:`process`)::

        @inbox.consumer("billing", session=lambda: db.session,
                        event_id=lambda body, message: message.properties["message_id"],
                        headers=lambda body, message: message.headers)
        def bill(body, message): ...
    """

    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: t.Any, **kwargs: t.Any) -> t.Any:
            s = session if isinstance(session, (Session, scoped_session)) else session()
            eid = event_id(*args, **kwargs)
            carried = headers(*args, **kwargs) if headers is not None else None
            with process(
                s, consumer=name, event_id=eid, ttl=ttl, commit=True, headers=carried
            ) as fresh:
                if not fresh:
                    return None
                return func(*args, **kwargs)

        return t.cast(F, wrapper)

    return decorate
