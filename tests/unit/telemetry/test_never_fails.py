"""Telemetry never fails what it observes: a span processor that raises (when a
span starts, or ends), a meter provider or instruments that raise, and the
request, the relay, the inbox, the client, the jobs and ``init_app`` all do
their work exactly once, as without telemetry."""

from __future__ import annotations

import datetime as dt
import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from opentelemetry import metrics
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from flask_idempotency import _telemetry
from flask_idempotency._context import app_state
from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._maintenance.scheduler import JobScheduler
from flask_idempotency._messaging import inbox
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._telemetry import figures
from flask_idempotency.client import IdempotentSession
from flask_idempotency.publishers import ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import fresh_app, post, reset, rows
from tests.support.tracing import sdk_tracing

TRACEPARENT = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"


class RaisingProcessor(SpanProcessor):
    """A vendor's span processor with a bug, when a span starts or when it ends."""

    def __init__(self, where: str) -> None:
        self.where = where

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        if self.where == "start":
            raise RuntimeError("span processor bug")

    def on_end(self, span: ReadableSpan) -> None:
        if self.where == "end":
            raise RuntimeError("span processor bug")


@pytest.fixture(params=["start", "end"])
def broken_tracing(request: pytest.FixtureRequest) -> t.Iterator[str]:
    """Every span (the request flow's, the relay's, the inbox's, the client's)
    goes through a processor that raises."""
    processor = RaisingProcessor(request.param)
    provider = TracerProvider()
    provider.add_span_processor(processor)
    figures.forget_all()
    _telemetry._use_providers(None, provider)
    try:
        with sdk_tracing(processor):
            yield request.param
    finally:
        _telemetry._use_providers(None, None)
        provider.shutdown()
        figures.forget_all()


class _RaisingCounter(metrics.NoOpCounter):
    def add(self, *args: t.Any, **kwargs: t.Any) -> None:
        raise RuntimeError("instrument bug")


class _RaisingHistogram(metrics.NoOpHistogram):
    def record(self, *args: t.Any, **kwargs: t.Any) -> None:
        raise RuntimeError("instrument bug")


class _RaisingMeter(metrics.NoOpMeter):
    def create_counter(self, name: str, *args: t.Any, **kwargs: t.Any) -> metrics.Counter:
        return _RaisingCounter(name)

    def create_histogram(self, name: str, *args: t.Any, **kwargs: t.Any) -> metrics.Histogram:
        return _RaisingHistogram(name)


class RaisingMeterProvider(metrics.NoOpMeterProvider):
    """A meter provider with a bug: in ``get_meter``, or in its instruments' recording."""

    def __init__(self, where: str) -> None:
        self.where = where

    def get_meter(self, name: str, *args: t.Any, **kwargs: t.Any) -> metrics.Meter:
        if self.where == "get_meter":
            raise RuntimeError("meter provider bug")
        return _RaisingMeter(name)


@pytest.fixture(params=["get_meter", "record"])
def broken_metrics(request: pytest.FixtureRequest) -> t.Iterator[str]:
    figures.forget_all()
    _telemetry._use_providers(RaisingMeterProvider(request.param), None)
    try:
        yield request.param
    finally:
        _telemetry._use_providers(None, None)
        figures.forget_all()


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3) as app:
        yield app


def emit_publish_and_deliver(app: Flask) -> None:
    """A request that emits an event, the relay's publish of it (twice run), and
    its delivery to a consumer (twice, as a broker redelivers): each done once."""
    assert post(app, key="k1").status_code == 201
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 1
    assert relay_once(app, publisher) == 0
    assert len(publisher.events) == 1
    [row] = rows(app)
    assert row["published_at"] is not None
    assert (row["attempts"], row["last_error"]) == (0, None)

    ran: list[bool] = []
    with app.app_context():
        for _ in range(2):
            with inbox.process(
                outbox_app.db.session,
                consumer="shipping",
                event_id=publisher.events[0].event_id,
                headers={**publisher.events[0].headers, "traceparent": TRACEPARENT},
                commit=True,
            ) as fresh:
                ran.append(fresh)
        # A failing delivery still fails with its own error, and is rolled back.
        with pytest.raises(ValueError, match="the consumer's own error"):
            fail_delivery(ran)
        with inbox.process(
            outbox_app.db.session, consumer="billing", event_id="e-2", commit=True
        ) as fresh:
            ran.append(fresh)
    assert ran == [True, False, True, True]


def fail_delivery(ran: list[bool]) -> None:
    with inbox.process(
        outbox_app.db.session, consumer="billing", event_id="e-2", commit=True
    ) as fresh:
        ran.append(fresh)
        raise ValueError("the consumer's own error")


def test_a_raising_span_processor_fails_no_request_publish_or_delivery(
    broken_tracing: str, app: Flask
) -> None:
    emit_publish_and_deliver(app)


def test_raising_metrics_fail_no_init_app_request_publish_delivery_or_job(
    broken_metrics: str, database_url: str, clock: Clock
) -> None:
    app = outbox_app.create_app(database_url, clock=clock)  # init_app: the gauges' instruments
    reset(database_url)
    try:
        emit_publish_and_deliver(app)
        clock.advance(days=2)
        jobs = JobScheduler(app)
        assert jobs.run_job("purge", lambda app, keep_going: purge_expired(app))
        assert not jobs.run_job("purge", lambda app, keep_going: None, dt.timedelta(minutes=5))
        with app.app_context():
            records = app_state(app).store.table
            count = sa.select(sa.func.count()).select_from(records)
            assert outbox_app.db.session.execute(count).scalar_one() == 0  # purged
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()


class Downstream:
    """A server that answers 201 and keeps each request's Idempotency-Key."""

    def __init__(self) -> None:
        self.keys: list[str | None] = []

    def __call__(self, environ: t.Any, start_response: t.Any) -> t.Any:
        self.keys.append(Request(environ).headers.get("Idempotency-Key"))
        return Response("{}", status=201)(environ, start_response)


def test_a_raising_span_processor_fails_no_client_call(broken_tracing: str) -> None:
    downstream = Downstream()
    server = make_server("127.0.0.1", 0, downstream, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        answer = IdempotentSession(total=0).post(
            f"http://127.0.0.1:{server.server_port}/charges", json={}, timeout=5
        )
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert answer.status_code == 201
    assert len(downstream.keys) == 1
    assert downstream.keys[0]
