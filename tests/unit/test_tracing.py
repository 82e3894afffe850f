"""One trace across the chain, piece by piece: the client's attempts, the
outbox row, the relay's message and the inbox's delivery, with OpenTelemetry's
SDK (an in-memory exporter), with the API alone, and without OpenTelemetry.

The whole chain (order, payment, broker, shipping) is
``tests/unit/test_example_trace.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, StatusCode
from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response

from flask_idempotency import inbox
from flask_idempotency._messaging.outbox import add_event
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._storage.schema import outbox_table
from flask_idempotency.client import IdempotentSession
from flask_idempotency.publishers import KombuPublisher, ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.live import ROOT
from tests.support.outbox import fresh_app, post, relay_command, reset, rows
from tests.support.tracing import (
    named,
    parent_id,
    parse_traceparent,
    sdk_tracing,
    stored_context,
    traceparent,
    without_sdk,
)

# -- the client: one CLIENT span per attempt, its context in the attempt's headers -------------


class Recorder:
    """A downstream that answers ``statuses`` in turn (then 201) and keeps each
    request's headers; with ``drop`` set, it first drops that many connections
    without an answer (their traceparents in ``dropped``)."""

    def __init__(self, statuses: t.Sequence[int] = ()) -> None:
        self.statuses = list(statuses)
        self.seen: list[dict[str, str]] = []
        self.drop = 0
        self.dropped: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, environ: t.Any, start_response: t.Any) -> t.Any:
        request = Request(environ)
        with self._lock:
            if len(self.dropped) < self.drop:
                self.dropped.append(request.headers["traceparent"])
                environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
                raise ConnectionAbortedError("the response is lost")
            self.seen.append({k.lower(): v for k, v in request.headers.items()})
            status = self.statuses.pop(0) if self.statuses else 201
        headers = {"Retry-After": "0"} if status in (409, 429, 503) else {}
        return Response("{}", status=status, headers=headers)(environ, start_response)


@pytest.fixture
def downstream() -> t.Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    server = make_server("127.0.0.1", 0, recorder, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", recorder
    server.shutdown()
    thread.join(10)


def test_each_attempt_is_a_span_of_its_own_under_the_callers_with_its_traceparent(
    downstream: tuple[str, Recorder],
) -> None:
    url, recorder = downstream
    recorder.statuses = [503, 503]
    http = IdempotentSession(total=3, backoff_factor=0, backoff_jitter=0)
    with sdk_tracing() as (provider, exporter):
        with provider.get_tracer("test").start_as_current_span("checkout") as caller:
            response = http.post(url + "/charges", json={"amount": 1}, idempotency_key="k-secret")
        spans = exporter.get_finished_spans()
    assert response.status_code == 201
    attempts = named(spans, "idempotency.client attempt")
    assert len(attempts) == len(recorder.seen) == 3
    caller_context = caller.get_span_context()
    for n, (span, seen) in enumerate(zip(attempts, recorder.seen, strict=True), start=1):
        assert span.kind is SpanKind.CLIENT
        assert span.parent is not None
        assert span.parent.span_id == caller_context.span_id
        assert span.context.trace_id == caller_context.trace_id
        assert span.attributes is not None
        assert span.attributes["idempotency.attempt"] == n
        assert span.attributes["http.request.method"] == "POST"
        assert span.attributes["http.response.status_code"] == (201 if n == 3 else 503)
        # The attempt's own context went out with it: the server's parent is this span.
        assert parse_traceparent(seen["traceparent"]) == (
            caller_context.trace_id,
            span.context.span_id,
        )
        assert seen["idempotency-key"] == '"k-secret"'  # one key for every attempt
        assert "k-secret" not in json.dumps(dict(span.attributes))
    assert [s.status.status_code for s in attempts] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    assert len({seen["traceparent"] for seen in recorder.seen}) == 3


def test_an_attempt_that_got_no_answer_is_an_error_span_and_the_resend_another(
    downstream: tuple[str, Recorder],
) -> None:
    """The first attempt's connection is dropped by the server without an answer
    (the response lost): its span ends with the error, and the resend that
    urllib3 makes is the second attempt, with a traceparent of its own."""
    url, recorder = downstream
    recorder.drop = 1
    http = IdempotentSession(total=3, backoff_factor=0, backoff_jitter=0)
    with sdk_tracing() as (provider, exporter):
        with provider.get_tracer("test").start_as_current_span("checkout"):
            response = http.post(url + "/charges", json={}, idempotency_key="k-1")
        attempts = named(exporter.get_finished_spans(), "idempotency.client attempt")
    assert response.status_code == 201
    assert [a.attributes["idempotency.attempt"] for a in attempts if a.attributes] == [1, 2]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert "http.response.status_code" not in (attempts[0].attributes or {})
    assert parse_traceparent(recorder.dropped[0])[1] == attempts[0].context.span_id
    assert parse_traceparent(recorder.seen[0]["traceparent"])[1] == attempts[1].context.span_id


def test_without_an_sdk_no_traceparent_is_sent(downstream: tuple[str, Recorder]) -> None:
    url, recorder = downstream
    with without_sdk():
        recorder.statuses = [503]
        http = IdempotentSession(total=2, backoff_factor=0, backoff_jitter=0)
        response = http.post(url + "/charges", json={})
        assert response.status_code == 201
        assert len(recorder.seen) == 2
        assert [("traceparent" in s, "tracestate" in s) for s in recorder.seen] == [
            (False, False)
        ] * 2
        assert recorder.seen[0]["idempotency-key"] == recorder.seen[1]["idempotency-key"]


def test_a_callers_traceparent_is_replaced_by_the_attempts_under_a_current_span(
    downstream: tuple[str, Recorder],
) -> None:
    """With a current span, a header the caller set by hand (or another
    instrumentation) names a span that is not the attempt's: the attempt, a
    child of the current span, sends its own context instead."""
    url, recorder = downstream
    stale = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    http = IdempotentSession(total=0)
    with sdk_tracing() as (provider, exporter):
        with provider.get_tracer("test").start_as_current_span("caller") as caller:
            http.post(url, json={}, headers={"TraceParent": stale})
        [attempt] = named(exporter.get_finished_spans(), "idempotency.client attempt")
    [seen] = recorder.seen
    assert attempt.context.trace_id == caller.get_span_context().trace_id != int("1" * 32, 16)
    assert parse_traceparent(seen["traceparent"]) == (
        attempt.context.trace_id,
        attempt.context.span_id,
    )


def test_with_no_current_span_the_attempts_continue_the_callers_own_traceparent(
    downstream: tuple[str, Recorder],
) -> None:
    """A caller that propagates its trace by hand (a worker continuing a job's
    trace from a message, no span current): every attempt is a child of the
    context its ``traceparent`` names, in the one trace, with the one key."""
    url, recorder = downstream
    recorder.statuses = [503, 503]
    caller_trace, caller_span = int("12" * 16, 16), int("34" * 8, 16)
    caller = traceparent(caller_trace, caller_span)
    http = IdempotentSession(total=3, backoff_factor=0, backoff_jitter=0)
    with sdk_tracing() as (_, exporter):
        response = http.post(url, json={}, headers={"traceparent": caller})
        attempts = named(exporter.get_finished_spans(), "idempotency.client attempt")
    assert response.status_code == 201
    assert len(attempts) == len(recorder.seen) == 3
    assert {s.context.trace_id for s in attempts} == {caller_trace}
    assert {parent_id(s) for s in attempts} == {caller_span}
    assert [parse_traceparent(seen["traceparent"]) for seen in recorder.seen] == [
        (caller_trace, s.context.span_id) for s in attempts
    ]
    assert len({seen["idempotency-key"] for seen in recorder.seen}) == 1


# -- the outbox, the relay and the inbox -------------------------------------------------------


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock) as app:
        yield app


def test_an_event_stores_the_context_of_the_request_that_emitted_it(app: Flask) -> None:
    with sdk_tracing() as (provider, _exporter):
        with provider.get_tracer("test").start_as_current_span("POST /orders") as request_span:
            assert post(app, key="k1", twice=True).status_code == 201
        # Emitted outside any span: nothing to store.
        assert post(app, key="k2").status_code == 201
    stored = [stored_context(r["trace_context"]) for r in rows(app)]
    context = request_span.get_span_context()
    assert stored[2] is None
    for carrier in stored[:2]:
        assert carrier is not None
        assert parse_traceparent(carrier["traceparent"]) == (context.trace_id, context.span_id)
    # Compact JSON (no spaces), and the event's own headers column untouched.
    [raw] = {r["trace_context"] for r in rows(app)[:2]}
    assert " " not in raw
    assert [r["headers"] for r in rows(app)] == [None, None, None]


def test_without_an_sdk_nothing_is_stored(app: Flask) -> None:
    with without_sdk():
        assert post(app, key="k1").status_code == 201
        assert [r["trace_context"] for r in rows(app)] == [None]


def test_a_resumed_emit_keeps_the_first_context(app: Flask) -> None:
    """The same event emitted again (a resumed operation) adds no row and keeps
    the context of the request that wrote it."""
    with sdk_tracing() as (provider, _):
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("first") as first, app.app_context():
            add_event(outbox_app.db.session, "t", {"a": 1}, event_id="e1")
            outbox_app.db.session.commit()
        with tracer.start_as_current_span("second"), app.app_context():
            add_event(outbox_app.db.session, "t", {"a": 1}, event_id="e1")
            outbox_app.db.session.commit()
    [row] = rows(app)
    carrier = stored_context(row["trace_context"])
    assert carrier is not None
    assert parse_traceparent(carrier["traceparent"])[1] == first.get_span_context().span_id


def test_the_relay_publishes_under_the_stored_context_and_the_message_carries_it(
    app: Flask,
) -> None:
    """The relay runs later, outside the request: its PRODUCER span's parent is
    the emitting request's span, and the message's traceparent names the
    PRODUCER span. The event's own headers are kept."""
    with sdk_tracing() as (provider, exporter):
        tracer = provider.get_tracer("test")
        with tracer.start_as_current_span("request") as request_span, app.app_context():
            add_event(
                outbox_app.db.session,
                "order.created",
                {"n": 1},
                event_id="e1",
                headers={"x-tenant": "acme"},
            )
            outbox_app.db.session.commit()
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
        [producer] = named(exporter.get_finished_spans(), "idempotency.outbox publish")
    [event] = publisher.events
    context = request_span.get_span_context()
    assert producer.kind is SpanKind.PRODUCER
    assert producer.context.trace_id == context.trace_id
    assert producer.parent is not None
    assert producer.parent.span_id == context.span_id
    assert producer.attributes is not None
    assert producer.attributes["messaging.operation.name"] == "publish"
    assert producer.attributes["messaging.destination.name"] == "order.created"
    assert "e1" not in json.dumps(dict(producer.attributes))
    assert event.headers["x-tenant"] == "acme"
    assert parse_traceparent(event.headers["traceparent"]) == (
        context.trace_id,
        producer.context.span_id,
    )


def test_an_untraced_event_is_published_with_its_own_headers_only(app: Flask) -> None:
    with app.app_context():
        add_event(outbox_app.db.session, "t", {}, event_id="e1", headers={"x": "y"})
        outbox_app.db.session.commit()
    with without_sdk():
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
        assert publisher.events[0].headers == {"x": "y"}


def test_an_outbox_from_before_traces_works_without_its_column_until_it_is_added(
    app: Flask, database_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``idempotency_outbox`` created by the release before traces (no
    ``trace_context``): a traced emit answers 201 and stores its event without
    the context, the relay publishes it, one WARNING per engine names the
    ALTER TABLE to run, and ``create-tables``, which adds no columns, exits 78
    with that statement. Once it has run, a new process stores the context."""
    from flask_idempotency._storage.outbox import add_trace_context_sql

    with app.app_context():
        engine = outbox_app.db.engine
        table = outbox_table(outbox_app.db.metadata)
        alter = add_trace_context_sql(engine.dialect, table)
    # The statement docs/tracing.md tells an operator to run is the one run here.
    assert f"{alter};" in (ROOT / "docs" / "tracing.md").read_text(encoding="utf-8")
    with app.app_context(), engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE idempotency_outbox DROP COLUMN trace_context"))
    with sdk_tracing() as (provider, _), caplog.at_level("WARNING", "flask_idempotency"):
        with provider.get_tracer("test").start_as_current_span("request"):
            assert post(app, key="k1").status_code == 201
            assert post(app, key="k2").status_code == 201
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 2
        assert len(publisher.events) == 2
    warnings = [r.getMessage() for r in caplog.records if "trace_context" in r.getMessage()]
    assert len(warnings) == 1
    assert alter in warnings[0]
    result = app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
    assert result.exit_code == 78
    assert alter in result.output
    with app.app_context():
        with outbox_app.db.engine.connect() as conn:
            assert "trace_context" not in {
                c["name"] for c in sa.inspect(conn).get_columns("idempotency_outbox")
            }
        with outbox_app.db.engine.begin() as conn:
            conn.execute(sa.text(alter))
        outbox_app.db.engine.dispose()
    assert app.test_cli_runner().invoke(args=["idempotency", "create-tables"]).exit_code == 0
    upgraded = outbox_app.create_app(database_url, clock=clock)  # a process started after
    try:
        with (
            sdk_tracing() as (provider, _),
            provider.get_tracer("test").start_as_current_span("request") as span,
        ):
            assert post(upgraded, key="k3").status_code == 201
        stored = stored_context(rows(upgraded)[-1]["trace_context"])
        assert stored is not None
        assert parse_traceparent(stored["traceparent"])[1] == span.get_span_context().span_id
    finally:
        with upgraded.app_context():
            outbox_app.db.engine.dispose()


def test_a_stored_context_is_carried_by_a_relay_without_an_sdk(app: Flask) -> None:
    """The relay's process has no SDK (or no OpenTelemetry): the message still
    carries the request's context as stored, so the consumer continues it."""
    with (
        sdk_tracing() as (provider, _),
        provider.get_tracer("test").start_as_current_span("request") as request_span,
    ):
        assert post(app, key="k1").status_code == 201
    with without_sdk():
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
        context = request_span.get_span_context()
        assert parse_traceparent(publisher.events[0].headers["traceparent"]) == (
            context.trace_id,
            context.span_id,
        )


def test_a_relay_without_an_sdk_publishes_under_the_stored_context(app: Flask) -> None:
    """No SDK in the relay's process: no span is made, but the publisher still
    runs under the context the event was emitted in (a broker instrumentation
    or the app's own publisher reads or injects the current context), not the
    relay's, even where the relay itself runs under another (a request's)."""
    with (
        sdk_tracing() as (provider, _),
        provider.get_tracer("test").start_as_current_span("request") as request_span,
    ):
        assert post(app, key="k1").status_code == 201
    seen: list[tuple[int, dict[str, str]]] = []

    class Reading(ListPublisher):
        def publish(self, event: t.Any) -> None:
            injected: dict[str, str] = {}
            propagate.inject(injected)
            seen.append((trace.get_current_span().get_span_context().trace_id, injected))
            super().publish(event)

    caller = trace.NonRecordingSpan(
        trace.SpanContext(0x1111, 0x2222, is_remote=True, trace_flags=trace.TraceFlags(1))
    )
    with without_sdk(), trace.use_span(caller):
        assert relay_once(app, Reading()) == 1
    [(trace_id, injected)] = seen
    stored = request_span.get_span_context()
    assert trace_id == stored.trace_id
    assert parse_traceparent(injected["traceparent"]) == (stored.trace_id, stored.span_id)


def test_the_broker_message_carries_the_context_and_the_inbox_continues_it(
    app: Flask, tmp_path: t.Any
) -> None:
    """Through kombu (its in-memory transport): the message's headers hold the
    PRODUCER span's context; the consumer's delivery, through the inbox, runs
    under a CONSUMER span whose parent is that span; a redelivery is a second
    CONSUMER span, marked a duplicate."""
    import kombu

    tag = uuid.uuid4().hex[:8]
    queue = kombu.Queue(f"q-{tag}", kombu.Exchange(f"x-{tag}", type="topic"), routing_key="#")
    publisher = KombuPublisher("memory://", exchange=f"x-{tag}", queues=[queue])
    processed: list[str] = []
    with sdk_tracing() as (provider, exporter):
        with provider.get_tracer("test").start_as_current_span("request") as request_span:
            assert post(app, key="k1").status_code == 201
        assert relay_once(app, publisher) == 1
        with app.app_context():  # published again: a relay that died before its mark
            outbox_app.db.session.execute(
                sa.text("UPDATE idempotency_outbox SET published_at = NULL, next_attempt_at = NULL")
            )
            outbox_app.db.session.commit()
        assert relay_once(app, publisher) == 1

        def on_message(body: t.Any, message: t.Any) -> None:
            with (
                app.app_context(),
                inbox.process(
                    outbox_app.db.session,
                    consumer="shipping",
                    event_id=message.properties["message_id"],
                    headers=message.headers,
                    commit=True,
                ) as fresh,
            ):
                if fresh:
                    processed.append(message.properties["message_id"])
            message.ack()

        with (
            kombu.Connection("memory://") as conn,
            conn.Consumer(queue, callbacks=[on_message], accept=["json"]),
        ):
            for _ in range(2):
                conn.drain_events(timeout=5)
        spans = exporter.get_finished_spans()
    publisher.close()
    producers = named(spans, "idempotency.outbox publish")
    consumers = named(spans, "idempotency.inbox process")
    assert len(processed) == 1
    assert len(producers) == len(consumers) == 2
    trace_id = request_span.get_span_context().trace_id
    for producer, consumer in zip(producers, consumers, strict=True):
        assert consumer.kind is SpanKind.CONSUMER
        assert consumer.context.trace_id == trace_id
        assert consumer.parent is not None
        assert consumer.parent.span_id == producer.context.span_id
        assert consumer.attributes is not None
        assert consumer.attributes["idempotency.consumer"] == "shipping"
    assert [c.attributes["idempotency.inbox.duplicate"] for c in consumers if c.attributes] == [
        False,
        True,
    ]


def test_a_failed_delivery_is_an_error_span_and_still_rolls_back(app: Flask) -> None:
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}
    with sdk_tracing() as (_, exporter):
        with (
            pytest.raises(RuntimeError, match="boom"),
            app.app_context(),
            inbox.process(
                outbox_app.db.session, consumer="c", event_id="e1", headers=headers, commit=True
            ),
        ):
            raise RuntimeError("boom")
        [span] = named(exporter.get_finished_spans(), "idempotency.inbox process")
    assert span.status.status_code is StatusCode.ERROR
    assert span.context.trace_id == int("a" * 32, 16)
    assert span.parent is not None
    assert span.parent.span_id == int("b" * 16, 16)
    # Rolled back: the redelivery does the work.
    with app.app_context(), inbox.process(outbox_app.db.session, consumer="c", event_id="e1") as f:
        assert f


def test_a_decorated_consumer_continues_the_trace_of_its_headers(app: Flask) -> None:
    @inbox.consumer(
        "billing",
        session=lambda: outbox_app.db.session,
        event_id=lambda event_id, headers: event_id,
        headers=lambda event_id, headers: headers,
    )
    def bill(event_id: str, headers: dict[str, str]) -> str:
        return trace.format_trace_id(trace.get_current_span().get_span_context().trace_id)

    with sdk_tracing(), app.app_context():
        carried = bill("e1", {"traceparent": "00-" + "c" * 32 + "-" + "d" * 16 + "-01"})
    assert carried == "c" * 32


def test_unreadable_headers_and_a_stored_context_never_stop_the_chain(
    app: Flask, clock: Clock
) -> None:
    """A malformed traceparent in a message, or a trace_context column written
    by other means: the delivery runs (a new trace), the relay publishes."""
    with sdk_tracing() as (_, exporter), app.app_context():
        with inbox.process(
            outbox_app.db.session,
            consumer="c",
            event_id="e1",
            headers={"traceparent": "garbage", "other": b"\xff", 3: None},
            commit=True,
        ) as fresh:
            assert fresh
        outbox_app.db.session.execute(
            sa.text(
                "INSERT INTO idempotency_outbox (event_id, topic, payload, trace_context, "
                "created_at, attempts) VALUES ('e9', 't', '{}', 'not json', :now, 0)"
            ),
            {"now": clock()},
        )
        outbox_app.db.session.commit()
        assert named(exporter.get_finished_spans(), "idempotency.inbox process")
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 1


# -- without OpenTelemetry at all ------------------------------------------------------------

WITHOUT_OTEL = textwrap.dedent(
    """
    import sys
    sys.modules["opentelemetry"] = None  # as if opentelemetry-api were not installed

    import json, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from flask_idempotency import inbox
    from flask_idempotency._messaging.relay import relay_once
    from flask_idempotency.client import IdempotentSession
    from flask_idempotency.publishers import ListPublisher
    from tests.support import outbox_app
    from tests.support.outbox import post, relay_command, reset, rows

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append({k.lower() for k in self.headers.keys()})
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(503 if len(seen) == 1 else 201)
            self.send_header("Retry-After", "0")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    http = IdempotentSession(total=2, backoff_factor=0, backoff_jitter=0)
    status = http.post(f"http://127.0.0.1:{server.server_port}/", json={}).status_code
    server.shutdown()

    url = sys.argv[1]
    app = outbox_app.create_app(url)
    reset(url)
    assert post(app, key="k1").status_code == 201
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 1
    with app.app_context():
        with inbox.process(
            outbox_app.db.session, consumer="c", event_id="e1",
            headers={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"}, commit=True,
        ) as fresh:
            assert fresh
        outbox_app.db.engine.dispose()
    print(json.dumps({
        "status": status,
        "attempts": len(seen),
        "traceparent_sent": any("traceparent" in s for s in seen),
        "stored": [r["trace_context"] for r in rows(app)],
        "headers": publisher.events[0].headers,
        "loaded": sorted(
            m for m in sys.modules if m.startswith("opentelemetry") and sys.modules[m]
        ),
    }))
    """
)


def test_without_opentelemetry_nothing_of_it_is_imported_and_nothing_is_written(
    tmp_path: t.Any,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_OTEL, f"sqlite:///{tmp_path / 'db.sqlite'}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {
        "status": 201,
        "attempts": 2,
        "traceparent_sent": False,
        "stored": [None],
        "headers": {},
        "loaded": [],
    }


def test_http_https_and_proxy_pools_open_traced_connections() -> None:
    """Every pool the session's adapter opens sends through a traced connection:
    plain, TLS, and through an HTTP proxy (SOCKS proxies are urllib3's own)."""
    from flask_idempotency._client.tracing import TracedHTTPConnection, TracedHTTPSConnection

    http = IdempotentSession()
    adapter = http.get_adapter("https://example.invalid")
    assert adapter is http.get_adapter("http://example.invalid")
    manager = adapter.poolmanager  # type: ignore[attr-defined]
    plain = manager.connection_from_url("http://example.invalid")
    tls = manager.connection_from_url("https://example.invalid")
    assert plain.ConnectionCls is TracedHTTPConnection
    assert tls.ConnectionCls is TracedHTTPSConnection
    proxy = adapter.proxy_manager_for("http://proxy.invalid:3128")  # type: ignore[attr-defined]
    assert proxy.connection_from_url("https://example.invalid").ConnectionCls is (
        TracedHTTPSConnection
    )
    http.close()


@pytest.mark.parametrize("opted_in", [True, False], ids=["trace_baggage", "default"])
def test_baggage_travels_with_the_event_only_when_the_app_opts_in(
    database_url: str, clock: Clock, opted_in: bool
) -> None:
    """With ``IDEMPOTENCY_TRACE_BAGGAGE``, W3C baggage set in the request
    reaches the consumer's handler through the outbox and the message; by
    default the event keeps and sends only its trace context."""
    from opentelemetry import baggage, context

    app = outbox_app.create_app(database_url, clock=clock, IDEMPOTENCY_TRACE_BAGGAGE=opted_in)
    reset(database_url)
    seen: list[object] = []
    with sdk_tracing() as (provider, _):
        token = context.attach(baggage.set_baggage("tenant.tier", "gold"))
        try:
            with provider.get_tracer("test").start_as_current_span("request"):
                assert post(app, key="k1").status_code == 201
        finally:
            context.detach(token)
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
        [event] = publisher.events
        assert event.headers.get("baggage") == ("tenant.tier=gold" if opted_in else None)
        assert "traceparent" in event.headers
        with (
            app.app_context(),
            inbox.process(
                outbox_app.db.session, consumer="c", event_id=event.event_id, headers=event.headers
            ),
        ):
            seen.append(baggage.get_baggage("tenant.tier"))
        with app.app_context():
            outbox_app.db.engine.dispose()
    [row] = rows(app)
    stored = stored_context(row["trace_context"])
    assert stored is not None
    assert stored.get("baggage") == ("tenant.tier=gold" if opted_in else None)
    assert seen == (["gold"] if opted_in else [None])


def test_a_clients_context_is_bounded_and_its_baggage_kept_back(app: Flask) -> None:
    """Through Flask's instrumentation, the documented set-up: a client sends a
    ``traceparent`` of its own, a 32-member ``tracestate`` of 6 KB and 7 KB of
    baggage. The event stores, and its message carries, the request's
    ``traceparent`` (the client's trace, which the app's instrumentation chose
    to continue) and the ``tracestate`` cut to 512 characters (the long
    members first, then from the end); never the client's baggage."""
    from opentelemetry.instrumentation.flask import FlaskInstrumentor

    client_trace = int("ab" * 16, 16)
    long = [f"l{i}=" + "v" * 200 for i in range(16)]
    short = [f"s{i:02d}=" + "w" * 29 for i in range(16)]  # 33 characters each
    state = ",".join(m for pair in zip(long, short, strict=True) for m in pair)
    baggage = "tenant=admin,user.role=superuser," + ",".join(
        f"role{i}=" + "A" * 40 for i in range(150)
    )
    headers = {
        "Idempotency-Key": "k1",
        "traceparent": traceparent(client_trace, int("cd" * 8, 16)),
        "tracestate": state,
        "baggage": baggage,
    }
    with sdk_tracing() as (provider, _):
        FlaskInstrumentor().instrument_app(app, tracer_provider=provider)
        try:
            response = app.test_client().post("/orders", json={"amount": 5}, headers=headers)
        finally:
            FlaskInstrumentor().uninstrument_app(app)
        assert response.status_code == 201
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
    kept = ",".join(short[:15])  # 509 characters: a 16th member would pass 512
    [row] = rows(app)
    stored = stored_context(row["trace_context"])
    assert stored is not None
    assert sorted(stored) == ["traceparent", "tracestate"]
    assert parse_traceparent(stored["traceparent"])[0] == client_trace
    assert stored["tracestate"] == kept
    [event] = publisher.events
    assert sorted(event.headers) == ["traceparent", "tracestate"]
    assert event.headers["tracestate"] == kept
    assert parse_traceparent(event.headers["traceparent"])[0] == client_trace


def test_only_the_telemetry_package_imports_opentelemetry() -> None:
    import ast

    package = ROOT / "flask_idempotency"
    importers = set()
    for path in package.rglob("*.py"):
        if "_telemetry" in path.relative_to(package).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n.split(".")[0] == "opentelemetry" for n in names):
                importers.add(str(path.relative_to(ROOT)))
    assert importers == set()


def test_threads_sharing_a_session_number_their_own_attempts() -> None:
    """Eight threads call through one session at once, each call answered 503
    then 201: every call's attempts are 1 and 2, under that thread's span."""
    first_seen: set[str] = set()
    lock = threading.Lock()
    traceparents: dict[str, list[str]] = {}

    def app(environ: t.Any, start_response: t.Any) -> t.Any:
        request = Request(environ)
        key = request.headers["Idempotency-Key"].strip('"')
        with lock:
            traceparents.setdefault(key, []).append(request.headers["traceparent"])
            status = 201 if key in first_seen else 503
            first_seen.add(key)
        return Response("{}", status=status, headers={"Retry-After": "0"})(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    http = IdempotentSession(total=2, backoff_factor=0, backoff_jitter=0)
    callers: dict[str, int] = {}
    try:
        with sdk_tracing() as (provider, exporter):
            tracer = provider.get_tracer("test")

            def call(n: int) -> None:
                with tracer.start_as_current_span(f"caller-{n}") as span:
                    key = f"key-{n}"
                    callers[key] = span.get_span_context().span_id
                    url = f"http://127.0.0.1:{server.server_port}/"
                    assert http.post(url, json={}, idempotency_key=key).status_code == 201

            threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            attempts = named(exporter.get_finished_spans(), "idempotency.client attempt")
    finally:
        server.shutdown()
        serving.join(10)
    assert len(attempts) == 16
    by_span = {a.context.span_id: a for a in attempts}
    for key, sent in traceparents.items():
        spans = [by_span[parse_traceparent(tp)[1]] for tp in sent]
        assert [(s.attributes or {}).get("idempotency.attempt") for s in spans] == [1, 2], key
        assert {s.parent.span_id for s in spans if s.parent} == {callers[key]}, key


def test_a_relay_in_a_process_of_its_own_continues_the_requests_trace(
    app: Flask, database_url: str, tmp_path: t.Any
) -> None:
    """``flask idempotency relay --once`` in another process, later, with the
    API but no SDK: the message carries the emitting request's context, read
    from the outbox row."""
    with (
        sdk_tracing() as (provider, _),
        provider.get_tracer("test").start_as_current_span("request") as request_span,
    ):
        assert post(app, key="k1").status_code == 201
    with app.app_context():
        outbox_app.db.engine.dispose()
    out = tmp_path / "published.jsonl"
    env, cmd = relay_command(database_url, out, "--once")
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(line) for line in out.read_text().splitlines()]
    context = request_span.get_span_context()
    assert parse_traceparent(line["headers"]["traceparent"]) == (
        context.trace_id,
        context.span_id,
    )
    assert [r["published_at"] is not None for r in rows(app)] == [True]
