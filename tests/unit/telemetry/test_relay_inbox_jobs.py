"""The relay's publishes (OpenTelemetry's messaging conventions), the inbox's
duplicates and the maintenance jobs' runs, rows and durations, on every engine."""

from __future__ import annotations

import datetime as dt
import os
import signal
import typing as t

import pytest
from flask import Flask

from flask_idempotency._confirms import Unsent
from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._maintenance.runner import run_relay
from flask_idempotency._maintenance.scheduler import JobScheduler
from flask_idempotency._messaging import inbox
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import error_type, relay_batch, relay_once
from flask_idempotency.errors import BrokerUnavailable, StalledMessage
from flask_idempotency.publishers import CallablePublisher, KombuPublisher, ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import fresh_app, post, reset

from .conftest import Otel

PUBLISH = {"messaging.system": "other", "messaging.operation.name": "publish"}


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3) as app:
        yield app


def add(app: Flask, *event_ids: str) -> None:
    with app.app_context():
        for eid in event_ids:
            add_event(outbox_app.db.session, "t", {"id": eid}, event_id=eid)
        outbox_app.db.session.commit()


def test_each_publish_is_counted_and_timed_with_its_failure_reason(otel: Otel, app: Flask) -> None:
    add(app, "a", "b", "c", "bad", "d")

    def publish(event: OutboxEvent) -> None:
        if event.event_id == "bad":
            raise RuntimeError("the broker said no")

    assert relay_once(app, CallablePublisher(publish)) == 4
    add(app, "e")

    def away(event: OutboxEvent) -> None:
        raise BrokerUnavailable("connection refused")

    assert relay_once(app, CallablePublisher(away)) == 0
    points = otel.collect()
    sent = {
        p.attributes.get("error.type"): p.value
        for p in otel.series("messaging.client.sent.messages", points)
    }
    assert sent == {None: 4, "other": 1, "broker_unavailable": 1}
    for p in otel.series("messaging.client.sent.messages", points):
        assert {k: v for k, v in p.attributes.items() if k != "error.type"} == PUBLISH
    timed = {
        p.attributes.get("error.type"): p.value
        for p in otel.series("messaging.client.operation.duration", points)
    }
    assert timed == sent
    [batches] = otel.series("idempotency.relay.batch.size", points)
    assert (batches.value, batches.total) == (2, 5 + 1)  # "bad" backs off: "e" alone


def test_events_a_batch_gave_back_untried_are_not_counted_as_publishes(
    otel: Otel, app: Flask
) -> None:
    """A pipelined batch that ran out of time gives back the events it did not
    try (``Unsent``): no publish to count, and not an outage."""
    add(app, "a", "b", "c")

    class Late:
        def publish(self, event: OutboxEvent) -> None:
            raise AssertionError("published together")

        def publish_many(self, events: t.Sequence[OutboxEvent]) -> list[BaseException | None]:
            return [None] + [Unsent("out of time")] * (len(events) - 1)

    run = relay_batch(app, Late())
    assert (run.published, run.released, run.broker_unavailable) == (1, 2, False)
    sent = [
        (p.attributes.get("error.type"), p.value)
        for p in otel.series("messaging.client.sent.messages")
    ]
    assert sent == [(None, 1)]


def test_an_empty_batch_is_not_a_batch_size(otel: Otel, app: Flask) -> None:
    assert relay_once(app, ListPublisher()) == 0
    assert otel.series("idempotency.relay.batch.size") == []


def test_failure_reasons_are_a_few_fixed_words() -> None:
    class MessageNacked(Exception):
        pass

    class EncodeError(Exception):
        pass

    assert error_type(BrokerUnavailable("x")) == "broker_unavailable"
    assert error_type(StalledMessage("x")) == "timeout"
    assert error_type(TimeoutError()) == "timeout"
    assert error_type(MessageNacked()) == "rejected"
    assert error_type(EncodeError()) == "serialization"
    assert error_type(TypeError("not JSON serializable")) == "serialization"
    assert error_type(OSError("x")) == "other"


def test_kombu_publishers_name_their_broker() -> None:
    pytest.importorskip("kombu")
    assert KombuPublisher("amqp://guest@localhost//").messaging_system == "rabbitmq"
    assert KombuPublisher("memory://").messaging_system == "memory"


def test_the_inbox_counts_the_duplicates_it_skips(otel: Otel, app: Flask) -> None:
    with app.app_context():
        for _ in range(3):
            with inbox.process(
                outbox_app.db.session, consumer="billing", event_id="e-1", commit=True
            ):
                pass
        with inbox.process(outbox_app.db.session, consumer="mail", event_id="e-1", commit=True):
            pass
    [duplicates] = otel.series("idempotency.inbox.duplicates")
    assert duplicates.attributes == {"idempotency.consumer": "billing"}
    assert duplicates.value == 2


def test_job_runs_by_result_with_their_rows_and_duration(
    otel: Otel, app: Flask, clock: Clock
) -> None:
    for key in ("k1", "k2", "k3"):
        assert post(app, key=key).status_code == 201
    clock.advance(days=2)
    jobs = JobScheduler(app)
    every = dt.timedelta(minutes=5)

    def purge(app: Flask, keep_going: t.Callable[[], bool]) -> object:
        return purge_expired(app, keep_going=keep_going)

    def broken(app: Flask, keep_going: t.Callable[[], bool]) -> object:
        raise RuntimeError("the job failed")

    assert jobs.run_job("purge", purge, every)
    assert not jobs.run_job("purge", purge, every)  # ran less than `every` ago: skipped
    assert jobs.run_job("mine", broken)
    points = otel.collect()
    runs = {
        (p.attributes["idempotency.job"], p.attributes["idempotency.job.result"]): p.value
        for p in otel.series("idempotency.job.runs", points)
    }
    assert runs == {("cleanup", "ok"): 1, ("cleanup", "skipped"): 1, ("mine", "error"): 1}
    durations = {
        (p.attributes["idempotency.job"], p.attributes["idempotency.job.result"]): p.value
        for p in otel.series("idempotency.job.duration", points)
    }
    assert durations == {("cleanup", "ok"): 1, ("mine", "error"): 1}
    [rows] = otel.series("idempotency.job.rows", points)
    assert rows.attributes == {"idempotency.job": "cleanup"}
    assert rows.value == 3


def test_the_dedicated_relay_counts_its_runs(otel: Otel, database_url: str, clock: Clock) -> None:
    """``flask idempotency relay`` (run_relay) counts each batch as a run of
    outbox_relay, as the scheduler's relay job does."""
    published: list[str] = []

    def publish(event: OutboxEvent) -> None:
        published.append(event.event_id)
        os.kill(os.getpid(), signal.SIGTERM)  # run_relay's own handler: it stops

    app = outbox_app.create_app(
        database_url, clock=clock, IDEMPOTENCY_PUBLISHER=CallablePublisher(publish)
    )
    reset(database_url)
    add(app, "a")
    run_relay(app, batch=10, poll=0.05, wake=False, report=lambda line: None)
    assert published == ["a"]
    [runs] = otel.series("idempotency.job.runs")
    assert runs.attributes == {"idempotency.job": "outbox_relay", "idempotency.job.result": "ok"}
    assert runs.value >= 1
    with app.app_context():
        outbox_app.db.engine.dispose()
