"""The implementation of :mod:`flask_idempotency.outbox` (see its documentation)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import hmac
import json
import threading
import typing as t
import uuid

import sqlalchemy as sa
from sqlalchemy import event as sa_event

from .._context import AppState, app_state, current_derived_key, current_request_state
from .._storage import outbox as outbox_sql
from .._storage.notify import CHANNEL as CHANNEL
from .._storage.schema import _text, as_utc, outbox_table
from .._storage.seal import Keyring
from .._telemetry import propagation
from ..errors import EventIdConflictError

#: Set when a transaction that emitted events commits in this process: an
#: in-process relay waits on it instead of sleeping its whole poll interval.
WAKE = threading.Event()

_INFO_FLAG = "idempotency_outbox_emitted"
_watched: set[t.Any] = set()
_wakers: set[t.Callable[[], None]] = set()


@dataclasses.dataclass(frozen=True)
class OutboxEvent:
    """One event as the relay hands it to a publisher (its repr shows no payload)."""

    id: int
    event_id: str
    topic: str
    payload: t.Any
    headers: dict[str, str]
    created_at: dt.datetime
    attempts: int
    #: The trace context of the request that emitted the event (``traceparent``,
    #: ``tracestate``, ``baggage`` if the app opted in; empty without one). The
    #: relay publishes the event under it and puts the publish's context in ``headers``.
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)

    def __repr__(self) -> str:
        # The event signals carry it and a receiver may log it: no payload, no header values.
        return (
            f"OutboxEvent(id={self.id}, event_id={self.event_id!r}, topic={self.topic!r}, "
            f"payload=<{type(self.payload).__name__}>, headers=<{len(self.headers)} headers>, "
            f"created_at={self.created_at!r}, attempts={self.attempts})"
        )

    @classmethod
    def from_row(cls, row: t.Any, ring: Keyring | None = None) -> OutboxEvent:
        """The event of an outbox row, its payload and headers opened with
        ``ring`` (encryption at rest). Raises
        :class:`~flask_idempotency._failures.SealBroken` when they do not open."""
        m = row._mapping
        event_id = t.cast(str, _text(m["event_id"]))
        payload = outbox_sql.open_event_text(ring, event_id, "payload", m["payload"])
        headers = outbox_sql.open_event_text(ring, event_id, "headers", m["headers"])
        return cls(
            id=int(m["id"]),
            event_id=event_id,
            topic=m["topic"],
            payload=json.loads(t.cast(str, payload)),
            headers=json.loads(headers) if headers else {},
            created_at=t.cast(dt.datetime, as_utc(m["created_at"])),
            attempts=int(m["attempts"]),
            trace_context=propagation.carrier_from_text(m.get("trace_context")),
        )


def keyring(state: AppState) -> Keyring | None:
    """The app's ``IDEMPOTENCY_ENCRYPTION_KEYS`` as a keyring; ``None`` when off."""
    return state.store.keyring


def canonical_payload(payload: t.Any) -> str:
    """The JSON text an event's payload is stored as: keys sorted, no spaces."""
    return json.dumps(payload, separators=(",", ":"), sort_keys=True)


def _same_payload(stored: t.Any, text: str) -> bool:
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8")
    if stored == text:
        return True
    try:  # a row written by other means, with other spacing
        return canonical_payload(json.loads(stored)) == text
    except ValueError:
        return False


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


#: The most UTF-8 bytes of an event's topic and id: an AMQP short string (the
#: routing key, the message id) holds 255.
MAX_SHORT_BYTES = 255


def _check_short_text(what: str, value: str) -> None:
    """Refuse, when it is emitted, a topic or event id that no broker could be
    sent: over 255 UTF-8 bytes (AMQP's routing key and message id; a
    255-character column holds 100 characters of 3 bytes, which AMQP does
    not), or not UTF-8 at all (a lone surrogate)."""
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"an event's {what} must be valid Unicode, got {value!r}") from exc
    if size > MAX_SHORT_BYTES:
        raise ValueError(
            f"an event's {what} must be at most {MAX_SHORT_BYTES} bytes in UTF-8 (an AMQP "
            f"routing key or message id), got {size}: {_clip(value, 60)!r}"
        )


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
    identifies the event. ``topic`` (the routing key) and ``event_id`` (the
    message id) must each fit in 255 bytes of UTF-8, AMQP's limit, and a
    topic in 255 characters: a ``ValueError`` here, before anything is added,
    rather than an event that can never be published. Adding an id that
    exists already with the same topic and payload adds nothing (the same
    event, added again: a resumed operation); with another topic or payload it raises
    :class:`~flask_idempotency.errors.EventIdConflictError` and adds nothing,
    leaving the transaction usable. Headers are not compared, nor the trace
    context: the event keeps the one of its first emit. With a current span
    (OpenTelemetry), its context is stored with the event (``trace_context``:
    ``traceparent`` and a bounded ``tracestate``, ``baggage`` only with
    ``IDEMPOTENCY_TRACE_BAGGAGE``) and continued by the relay; an outbox without
    that column (the release before traces) stores none. Inside a protected
    request the event names its operation (``owner_scope``, ``owner_key``), so
    that erasing the operation erases the event's payload too. The event is
    published by the relay once the session's transaction commits, and never if
    it rolls back. Returns ``event_id``. Call in an app context of an app with
    the extension registered.
    """
    if not isinstance(event_id, str) or not event_id or len(event_id) > 64:
        raise ValueError(f"event_id must be 1 to 64 characters, got {event_id!r}")
    _check_short_text("event_id", event_id)
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"an event's topic must be a non-empty string, got {topic!r}")
    _check_short_text("topic", topic)
    state = app_state()
    table = outbox_table(state.db.metadata)
    text = canonical_payload(payload)
    # As a string on every engine: MySQL's VARBINARY type would want bytes
    # (the server stores the string's bytes; see store.text_param).
    values = {
        "event_id": sa.bindparam("event_id", event_id, type_=sa.String()),
        "topic": topic,
        "payload": text,
        "headers": json.dumps(dict(headers)) if headers else None,
        "created_at": now or state.clock(),
        "attempts": 0,
    }
    trace_context = propagation.current_carrier_text(baggage=state.settings.trace_baggage)
    # Only with a context: an untraced emit writes what it always did, and an
    # outbox from before traces (no column; a WARNING says what to run) still works.
    if trace_context is not None and outbox_sql.has_trace_context(session.connection(), table):
        values["trace_context"] = trace_context
    # Emitted by a protected operation: erasing it finds the event.
    owner = current_request_state()
    scope, key = (owner.scope, owner.key) if owner is not None else (None, None)
    if scope is not None and key is not None and outbox_sql.has_owner(session.connection(), table):
        values["owner_scope"] = sa.bindparam("owner_scope", scope, type_=sa.String())
        values["owner_key"] = sa.bindparam("owner_key", key, type_=sa.String())
    sql = outbox_sql.for_session(session)
    ring = keyring(state)
    # Sealed for this event id: a payload copied under another id does not open.
    values = outbox_sql.seal_event(ring, event_id, values)
    if not sql.insert_event(session, table, values):
        _check_same_event(session, table, sql, event_id, topic, text, ring)
    if not session.info.get(_INFO_FLAG):
        # Once per transaction (PostgreSQL: delivered at the commit, dropped with
        # a rollback): a LISTENing relay wakes at once (listener.Listener).
        sql.notify(session)
    session.info[_INFO_FLAG] = True
    return event_id


def _check_same_event(
    session: t.Any,
    table: sa.Table,
    sql: outbox_sql.OutboxDialect,
    event_id: str,
    topic: str,
    text: str,
    ring: Keyring | None,
) -> None:
    """Raise unless the row with ``event_id`` holds ``topic`` and ``text``
    (its payload opened first: a sealed one differs at every seal).

    Raises :class:`~flask_idempotency._failures.SealBroken` when the stored
    payload does not open: it cannot be told the same."""
    existing = sql.existing_event(session, table, event_id)
    if existing is None:  # pragma: no cover - the insert conflicted on this id
        raise RuntimeError(f"outbox insert of {event_id!r} neither wrote nor met a row")
    stored = t.cast(str, outbox_sql.open_event_text(ring, event_id, "payload", existing.payload))
    if existing.topic == topic and _same_payload(stored, text):
        return
    # Sizes, never the payloads (encrypted or not): this message reaches logs.
    raise EventIdConflictError(
        f"outbox event id {event_id!r} already names another event: topic "
        f"{existing.topic!r}, payload of {len(stored)} characters; this one is topic {topic!r}, "
        f"payload of {len(text)} characters. One id is one event: give each event a name of its "
        f"own (idem.emit(..., name=...)) or an event_id of its own (add_event)"
    )


def emit(
    topic: str,
    payload: t.Any,
    headers: t.Mapping[str, str] | None = None,
    *,
    name: str | None = None,
) -> str:
    """``idem.emit``: add an event to the current request's transaction; its id.

    See the module for how the id is made from ``name`` or, without one, from
    the topic and payload, and for :class:`~flask_idempotency.errors.EventIdConflictError`.
    """
    if name is not None and (not isinstance(name, str) or not name or "\x00" in name):
        raise ValueError(f"an event name must be a non-empty string without NUL, got {name!r}")
    text = canonical_payload(payload)
    state = current_request_state()
    if state is not None and not state.optimistic and state.key is not None:
        if name is not None:
            step = "event:" + name
        else:
            content = json.dumps([topic, text], separators=(",", ":"))
            seen = state.event_counts
            n = seen.get(content, 0)
            seen[content] = n + 1
            # Keyed when the fingerprint is: an unkeyed digest in the clear event_id
            # would let a reader of the table confirm a guess of a sealed payload.
            message = json.dumps([topic, text, n]).encode("utf-8")
            secret = app_state().settings.fingerprint_key
            digest = (
                hashlib.sha256(message).hexdigest()
                if secret is None
                else hmac.new(secret, message, hashlib.sha256).hexdigest()
            )
            step = "event#" + digest
        event_id = current_derived_key(step, handed_out=False)
    else:
        event_id = uuid.uuid4().hex
    return add_event(app_state().db.session, topic, payload, event_id=event_id, headers=headers)


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
