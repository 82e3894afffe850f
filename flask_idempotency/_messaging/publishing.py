"""How the relay hands events to its publisher, one at a time or together, and
what it records of each publish (a span, the metrics, the outage log lines).

A publisher may offer ``publish_many(events)``: the events' outcomes, in order
(``None`` once the event is safely handed over, else the exception
``publish(event)`` would have raised for it; :class:`BrokerUnavailable` for
every event not handed over because the broker went away).
:class:`~flask_idempotency.publishers.KombuPublisher` offers it (pipelined
confirms on AMQP); a publisher with ``publish`` alone is called once per event.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import typing as t

from .. import _telemetry as telemetry
from .._confirms import Unsent
from .._telemetry import propagation
from ..errors import BrokerUnavailable, StalledMessage
from ..publishers import MESSAGE_CODES
from .outbox import OutboxEvent

if t.TYPE_CHECKING:
    from .relay import Publisher

logger = logging.getLogger("flask_idempotency")

PublishMany = t.Callable[[t.Sequence[OutboxEvent]], t.Sequence[BaseException | None]]


def publish_many_of(publisher: Publisher) -> PublishMany | None:
    """The publisher's ``publish_many``, when its class (or the object itself)
    defines one, unless its ``publish`` is the more specific of the two: a
    subclass (or an instance) that overrides ``publish`` alone expects every
    event to go through it. (An object answering any attribute, a test's
    ``Mock``, defines neither: it is called per event, as before.)"""
    own = vars(publisher) if hasattr(publisher, "__dict__") else {}
    mro = type(publisher).__mro__

    def depth(name: str) -> int | None:
        if name in own:
            return -1
        return next((i for i, cls in enumerate(mro) if name in vars(cls)), None)

    many_at, publish_at = depth("publish_many"), depth("publish")
    if many_at is None or (publish_at is not None and publish_at < many_at):
        return None
    many = getattr(publisher, "publish_many", None)
    return t.cast(PublishMany, many) if callable(many) else None


def messaging_system(publisher: Publisher) -> str:
    """The metrics' ``messaging.system``: the publisher's ``messaging_system``
    (:class:`~flask_idempotency.publishers.KombuPublisher` names its broker),
    else ``"other"``."""
    system = getattr(publisher, "messaging_system", None)
    return system if isinstance(system, str) and system else "other"


def error_type(exc: BaseException) -> str:
    """The metrics' ``error.type`` of a failed publish, one of a few reasons."""
    if isinstance(exc, BrokerUnavailable):
        return "broker_unavailable"
    if isinstance(exc, (StalledMessage, TimeoutError)):
        return "timeout"
    names = {cls.__name__ for cls in type(exc).__mro__}
    if "MessageNacked" in names or getattr(exc, "reply_code", None) in MESSAGE_CODES:
        return "rejected"  # the broker refused this message (a nack, a message it closed on)
    if names & {"EncodeError", "SerializerError"} or isinstance(exc, (TypeError, ValueError)):
        return "serialization"
    return "other"


def publish_one(publisher: Publisher, ev: OutboxEvent, system: str) -> None:
    """``publisher.publish(ev)``, timed to its return (the broker's confirm) and
    counted, under a PRODUCER span whose parent is the trace context the event
    was emitted under; that span's context is added to the headers (the app's
    own headers win a name they share). Neither the span nor the recording can
    fail the publish or run it twice: both are guarded in ``_telemetry`` (a
    span that cannot start publishes untraced, one that cannot end is dropped)."""
    with propagation.publishing(ev.trace_context, destination=ev.topic) as carried:
        if carried:
            ev = dataclasses.replace(ev, headers={**carried, **ev.headers})
        started = time.perf_counter()
        try:
            publisher.publish(ev)
        except Exception as exc:
            telemetry.published(system, time.perf_counter() - started, error_type(exc))
            raise
        telemetry.published(system, time.perf_counter() - started, None)


def publish_together(
    many: PublishMany, events: t.Sequence[OutboxEvent], system: str
) -> list[BaseException | None]:
    """``many(events)``: each event's outcome, with a span and the metrics per
    event as :func:`publish_one` records them (each event's duration is the
    whole call's: its confirm is collected with the others'). A publisher
    that raises instead fails every event with that exception."""
    headers, end = propagation.publishing_together(
        [ev.trace_context for ev in events], [ev.topic for ev in events]
    )
    sent = [
        dataclasses.replace(ev, headers={**carried, **ev.headers}) if carried else ev
        for ev, carried in zip(events, headers, strict=True)
    ]
    started = time.perf_counter()
    outcomes: list[BaseException | None]
    try:
        outcomes = list(many(sent))
        if len(outcomes) != len(sent):
            raise ValueError(f"publish_many answered {len(outcomes)} outcomes for {len(sent)}")
    except Exception as exc:
        outcomes = [exc] * len(sent)
    except BaseException as exc:
        end([exc] * len(sent))
        raise
    seconds = time.perf_counter() - started
    for outcome in outcomes:
        if isinstance(outcome, Unsent):
            continue  # never tried (the batch ran out of time): no publish, no outage
        telemetry.published(system, seconds, None if outcome is None else error_type(outcome))
    end(outcomes)
    return outcomes


class BrokerReports:
    """An unreachable broker is logged once per outage at WARNING (a relay runs
    every few seconds: an outage of minutes would log a line per run), the runs
    that find it still away at DEBUG, and its return at INFO with their count."""

    def __init__(self) -> None:
        # By publisher (an app's own): two brokers are two outages.
        self._failed_runs: dict[int, int] = {}

    def down(self, publisher: Publisher, ev: OutboxEvent, exc: BaseException) -> None:
        runs = self._failed_runs[id(publisher)] = self._failed_runs.get(id(publisher), 0) + 1
        level = logging.WARNING if runs == 1 else logging.DEBUG
        logger.log(
            level,
            "outbox event %s (%s) not published: %r (the broker is unreachable; repeats of "
            "this are logged at DEBUG until it answers again)",
            ev.id,
            ev.topic,
            exc,
        )

    def up(self, publisher: Publisher) -> None:
        runs = self._failed_runs.pop(id(publisher), 0)
        if runs:
            logger.info(
                "the broker answers again: outbox events are published (%d relay runs "
                "found it unreachable)",
                runs,
            )
