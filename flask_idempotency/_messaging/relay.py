"""The relay's batch: take and lease, publish, mark, give back (the algorithm
:mod:`flask_idempotency.relay` documents), and the publisher it publishes through.

Its statements are in ``_storage.leases`` (``Leases``); how a relay waits between
batches is :mod:`.listener`, the operator functions :mod:`.admin`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import importlib
import logging
import time
import typing as t

from flask import Flask

from .. import _telemetry as telemetry
from .. import signals
from .._confirms import Unsent, out_of_time
from .._context import app_state
from .._failures import SealBroken
from .._storage import outbox_table
from .._storage.leases import Leases
from .._storage.schema import _text, as_utc
from .._storage.seal import Keyring
from ..errors import BrokerUnavailable
from .outbox import OutboxEvent, keyring
from .publishing import BrokerReports, PublishMany, publish_many_of, publish_one, publish_together
from .publishing import error_type as error_type
from .publishing import messaging_system as messaging_system

logger = logging.getLogger("flask_idempotency")

#: Backoff after the n-th failure: BASE * 2**(n-1), at most CAP.
BACKOFF_BASE = dt.timedelta(seconds=1)
BACKOFF_CAP = dt.timedelta(minutes=10)


class Publisher(t.Protocol):
    """What the relay publishes through.

    ``publish(event)`` returns once the event is safely handed over (for a
    broker: confirmed), and raises on any failure; the relay then retries it
    later. Raise :class:`BrokerUnavailable` when the broker is unreachable
    rather than the event refused. A publish should end within a bound (a
    timeout) well under half of ``IDEMPOTENCY_OUTBOX_LEASE``: a publish that
    outlasts the lease may meet another relay publishing the same event.
    ``event`` has ``topic``, ``event_id``, ``payload`` (decoded JSON) and
    ``headers`` (a dict); see :class:`~flask_idempotency.outbox.OutboxEvent`.
    When the event was emitted under a trace, ``headers`` also carries the
    W3C trace context (``traceparent``, ``tracestate``): put the headers on
    the message, so the consumer continues the trace.

    A publisher may also have ``publish_many(events)``, returning each event's
    outcome in order: ``None`` once it is handed over, else the exception
    ``publish`` would have raised for it (:class:`BrokerUnavailable` for each
    event not handed over because the broker went away). The relay then hands
    it up to 500 events at a time instead of calling ``publish`` per event,
    unless the publisher's ``publish`` is overridden where ``publish_many`` is
    not (a subclass's hook around each publish keeps running). A raised
    exception is every event's failure.
    """

    def publish(self, event: OutboxEvent) -> None: ...


def backoff(attempts: int) -> dt.timedelta:
    """The wait after the ``attempts``-th failed publish."""
    factor: int = 2 ** max(0, min(attempts - 1, 30))
    return min(BACKOFF_CAP, BACKOFF_BASE * factor)


def resolve_publisher(value: t.Any) -> Publisher | None:
    """``IDEMPOTENCY_PUBLISHER``: an object with ``publish``, or ``"module:attr"``
    naming one, or a class or factory called without arguments to make one."""
    if value is None:
        return None
    if isinstance(value, str):
        module, _, attr = value.partition(":")
        if not attr:
            raise ValueError(f"IDEMPOTENCY_PUBLISHER must be 'module:attribute', got {value!r}")
        value = getattr(importlib.import_module(module), attr)
        if isinstance(value, type) or (not hasattr(value, "publish") and callable(value)):
            value = value()
    if not hasattr(value, "publish"):
        raise TypeError(f"IDEMPOTENCY_PUBLISHER has no publish(event) method: {value!r}")
    return t.cast(Publisher, value)


def app_publisher(app: Flask) -> Publisher | None:
    """The publisher configured on ``app`` (``IDEMPOTENCY_PUBLISHER``), resolved once."""
    cache = app.extensions.setdefault("idempotency_publisher", {})
    raw = app.config.get("IDEMPOTENCY_PUBLISHER")
    if cache.get("raw") is not raw or "publisher" not in cache:
        cache["raw"], cache["publisher"] = raw, resolve_publisher(raw)
    return t.cast("Publisher | None", cache["publisher"])


@dataclasses.dataclass(frozen=True)
class RelayRun:
    """What one batch of the relay did (:func:`relay_batch`)."""

    batch: int  #: the most rows the batch could take
    taken: int  #: pending rows it took (leased, tried or not)
    published: int  #: events published and marked
    failed: int  #: publishes that failed for the event (backed off, or parked; not an outage)
    broker_unavailable: bool  #: it ended early on :class:`BrokerUnavailable`
    #: rows it gave back untried because half its lease had passed
    released: int = 0

    @property
    def more(self) -> bool:
        """Whether a next batch at once may find work: this one was full (a
        failed publish does not make it short) or stopped at half its lease,
        and the broker answered."""
        full = self.taken >= self.batch or self.released > 0
        return full and not self.broker_unavailable


def relay_once(app: Flask, publisher: Publisher | None = None, *, batch: int = 100) -> int:
    """Publish one batch of pending events; the number published.

    ``publisher`` defaults to the app's ``IDEMPOTENCY_PUBLISHER``. See the
    module for the locking and the at-least-once guarantee. To drain the
    outbox, loop on :func:`relay_batch` while :attr:`RelayRun.more`: fewer
    published than ``batch`` does not mean nothing is left (a failed publish).
    """
    return relay_batch(app, publisher, batch=batch).published


def relay_batch(app: Flask, publisher: Publisher | None = None, *, batch: int = 100) -> RelayRun:
    """:func:`relay_once`, telling what the batch did."""
    if batch < 1:
        raise ValueError("batch must be at least 1")
    with app.app_context():
        state = app_state(app)
        if publisher is None:
            publisher = app_publisher(app)
            if publisher is None:
                raise RuntimeError("no outbox publisher: set IDEMPOTENCY_PUBLISHER")
        settings = state.settings
        leases = Leases(
            state.db.engine,
            outbox_table(state.db.metadata),
            state.clock,
            database_clock=not state.custom_clock,
        )
        run = _Batch(
            leases, settings.outbox_lease, settings.outbox_max_attempts, keyring(state)
        ).run(publisher, batch)
    for ev in run.published:
        signals.event_published.send(app, event=ev)
    for ev, error in run.parked:
        logger.error(
            "outbox event %s parked after %d attempts: %s",
            ev.id,
            # One attempt for an event that does not open where it is (parked at once).
            min(ev.attempts + 1, settings.outbox_max_attempts),
            error,
        )
        signals.event_parked.send(app, event=ev, error=error)
    return RelayRun(
        batch,
        run.taken,
        len(run.published),
        run.failed,
        run.unavailable,
        run.released,
    )


#: Seconds of publishing after which the events published since the last mark
#: are marked (in one short transaction: a commit per event would cost the
#: relay most of its throughput). A publish that stalls holds back the marks of
#: the events published in the 50 ms before it; a relay that dies leaves them
#: to be sent again once its lease has run out.
MARK_EVERY = 0.05


_BROKER = BrokerReports()

#: The most events handed to a publisher's ``publish_many`` at once; each such
#: run of events is marked in one statement once the publisher returns.
PIPELINE = 500

#: Seconds on a clock that only goes forward: how long a batch has been publishing.
#: (A test may replace it; the lease itself is on the database's clock.)
_elapsed_clock: t.Callable[[], float] = time.monotonic


@dataclasses.dataclass
class _Outcome:
    taken: int = 0
    published: list[OutboxEvent] = dataclasses.field(default_factory=list)
    parked: list[tuple[OutboxEvent, str]] = dataclasses.field(default_factory=list)
    failed: int = 0
    unavailable: bool = False
    released: int = 0


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:4000]


class _Batch:
    """One batch: take and lease, publish and mark each, give back the rest.

    An event whose payload or headers do not open (encryption at rest:
    :class:`SealBroken`) is never published (no ciphertext, no guess): when
    its key id is not configured here it fails as a publish does (backed off,
    parked after the most attempts; another relay configured with the key may
    publish it meanwhile, as in a rolling deploy of a new key); when it does
    not open with a configured key (altered, or copied under another event id)
    no configuration can fix it and it is parked at once. Either way
    ``last_error`` names the key id, and the rest of the batch goes on.
    """

    def __init__(
        self,
        leases: Leases,
        lease: dt.timedelta,
        max_attempts: int,
        ring: Keyring | None = None,
    ) -> None:
        self.leases, self.lease, self.max_attempts = leases, lease, max_attempts
        self.ring = ring
        #: The taken events that did not open, by row id.
        self.unopened: dict[int, SealBroken] = {}

    def _make(self, row: t.Any) -> OutboxEvent:
        try:
            return OutboxEvent.from_row(row, self.ring)
        except SealBroken as exc:
            self.unopened[int(row.id)] = exc
            # Carries no payload or headers: only what a failure names.
            clear = row._mapping
            return OutboxEvent(
                id=int(row.id),
                event_id=t.cast(str, _text(clear["event_id"])),
                topic=clear["topic"],
                payload=None,
                headers={},
                created_at=t.cast(dt.datetime, as_utc(clear["created_at"])),
                attempts=int(clear["attempts"]),
            )

    def run(self, publisher: Publisher, batch: int) -> _Outcome:
        outcome = _Outcome()
        leased_until, events = self.leases.take(batch, self.lease, self._make)
        outcome.taken = len(events)
        telemetry.batch_taken(len(events))
        system = messaging_system(publisher)
        many = publish_many_of(publisher)
        # Half the lease, on this process's own clock: the rest of the lease is
        # the margin for the publish under way when it runs out.
        stop_at = _elapsed_clock() + self.lease.total_seconds() / 2
        unmarked: list[OutboxEvent] = []  # published, their mark not yet written
        since = 0.0  # when the oldest of them was published
        tried = 0  # events[:tried] were published, failed, or given back
        finished = False
        try:
            while tried < len(events):
                if _elapsed_clock() >= stop_at:
                    outcome.released = len(events) - tried
                    break
                if many is not None:
                    chunk = events[tried : tried + PIPELINE]
                    late = out_of_time.set(lambda: _elapsed_clock() >= stop_at)
                    try:
                        ended = self._together(
                            publisher, many, chunk, system, leased_until, outcome
                        )
                    finally:
                        out_of_time.reset(late)
                    tried += len(chunk)
                    if ended:
                        if not outcome.unavailable:  # out of time: the later chunks untried too
                            outcome.released += len(events) - tried
                        break
                    continue
                ev = events[tried]
                broken = self.unopened.get(ev.id)
                if broken is not None:
                    tried += 1
                    self._unopened(ev, broken, leased_until, outcome)
                    continue
                try:
                    publish_one(publisher, ev, system)
                except BrokerUnavailable as exc:
                    _BROKER.down(publisher, ev, exc)
                    tried += 1
                    self.leases.give_back([ev.id], leased_until, _error_text(exc))
                    outcome.unavailable = True
                    break
                except Exception as exc:
                    logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, exc)
                    tried += 1
                    error = _error_text(exc)
                    if self._fail(ev, leased_until, error):
                        outcome.parked.append((ev, error))
                    outcome.failed += 1
                else:
                    _BROKER.up(publisher)
                    tried += 1
                    if not unmarked:
                        since = _elapsed_clock()
                    unmarked.append(ev)
                    if _elapsed_clock() - since >= MARK_EVERY:
                        self._flush(unmarked, outcome)
            self._flush(unmarked, outcome)
            if tried < len(events):
                rest = [ev.id for ev in events[tried:]]
                self.leases.give_back(rest, leased_until, None)
            finished = True
        finally:
            if not finished:
                # Interrupted (any exception, KeyboardInterrupt, SystemExit, a
                # failed mark): mark what the broker took, and make the rest due
                # again at once rather than at the end of the lease, if the
                # database still answers. The events being published then may
                # have reached the broker: they are sent again (at least once).
                with contextlib.suppress(Exception):
                    self._flush(unmarked, outcome)
                with contextlib.suppress(Exception):
                    rest = [ev.id for ev in events[tried:]]
                    if rest:
                        self.leases.give_back(rest, leased_until, None)
        return outcome

    def _together(
        self,
        publisher: Publisher,
        many: PublishMany,
        chunk: list[OutboxEvent],
        system: str,
        leased_until: dt.datetime,
        outcome: _Outcome,
    ) -> bool:
        """Publish ``chunk`` through ``publish_many``, then mark its published
        events in one statement and record its failures in one transaction;
        whether the batch ends here (the broker was away, or the batch ran out
        of time: the events not published are given back)."""
        failures: list[tuple[OutboxEvent, str, bool]] = []  # (event, error, park at once)
        sendable = []
        for ev in chunk:
            broken = self.unopened.get(ev.id)
            if broken is None:
                sendable.append(ev)
                continue
            logger.error("outbox event %s (%s) not published: %s", ev.id, ev.topic, broken)
            at_once = self.ring is not None and self.ring.has(broken.key_id)
            failures.append((ev, _error_text(broken), at_once))
        results = publish_together(many, sendable, system) if sendable else []
        published: list[OutboxEvent] = []
        away: list[tuple[OutboxEvent, BaseException]] = []
        unsent: list[int] = []
        for ev, result in zip(sendable, results, strict=True):
            if result is None:
                published.append(ev)
            elif isinstance(result, Unsent):
                unsent.append(ev.id)
            elif isinstance(result, BrokerUnavailable):
                away.append((ev, result))
            else:
                logger.warning("outbox event %s (%s) not published: %r", ev.id, ev.topic, result)
                failures.append((ev, _error_text(result), False))
        if published:
            _BROKER.up(publisher)
        self._flush(published, outcome)
        self._fail_all(failures, leased_until, outcome)
        if away:
            (first, exc), rest = away[0], [ev.id for ev, _ in away[1:]]
            _BROKER.down(publisher, first, exc)
            self.leases.give_back([first.id], leased_until, _error_text(exc))
            if rest:
                self.leases.give_back(rest, leased_until, None)
            outcome.unavailable = True
        if unsent:
            self.leases.give_back(unsent, leased_until, None)
            outcome.released += len(unsent)
        return bool(away or unsent)

    def _fail_all(
        self,
        failures: list[tuple[OutboxEvent, str, bool]],
        leased_until: dt.datetime,
        outcome: _Outcome,
    ) -> None:
        """:meth:`_fail` for each of ``failures``, in one transaction."""
        if not failures:
            return
        steps = []
        for ev, error, at_once in failures:
            attempts = ev.attempts + 1
            park = at_once or attempts >= self.max_attempts
            steps.append((ev.id, attempts, error, backoff(attempts), park))
        written = self.leases.fail_many(steps, leased_until)
        for (ev, error, _), step, done in zip(failures, steps, written, strict=True):
            outcome.failed += 1
            if step[-1] and done:
                outcome.parked.append((ev, error))

    def _flush(self, unmarked: list[OutboxEvent], outcome: _Outcome) -> None:
        """Mark ``unmarked`` published (one short transaction), and empty it."""
        if unmarked:
            self.leases.mark_published([ev.id for ev in unmarked])
            outcome.published.extend(unmarked)
            unmarked.clear()

    def _unopened(
        self, ev: OutboxEvent, broken: SealBroken, leased_until: dt.datetime, outcome: _Outcome
    ) -> None:
        """An event that does not open: failed without a publish (see the class)."""
        error = _error_text(broken)
        logger.error("outbox event %s (%s) not published: %s", ev.id, ev.topic, broken)
        at_once = self.ring is not None and self.ring.has(broken.key_id)
        if self._fail(ev, leased_until, error, park=at_once):
            outcome.parked.append((ev, error))
        outcome.failed += 1

    def _fail(
        self, ev: OutboxEvent, leased_until: dt.datetime, error: str, *, park: bool = False
    ) -> bool:
        """Back the event off, or park it (after the most attempts, or when
        ``park``); whether it was parked here."""
        attempts = ev.attempts + 1
        parks = park or attempts >= self.max_attempts
        written = self.leases.fail(
            ev.id,
            leased_until,
            attempts=attempts,
            error=error,
            delay=backoff(attempts),
            park=parks,
        )
        return parks and written
