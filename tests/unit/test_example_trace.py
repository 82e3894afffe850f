"""One trace from the client to the last consumer, on the example chain.

    client (a span "checkout")  -- key K, its first answer lost, retried --
      order service ............ Flask server span per attempt (instrumented)
        payments service ....... called through the client, over HTTP
        outbox ................. the order-created event, its request's context kept
      relay (later) ............ PRODUCER span under that context, into the message
        broker ................. kombu's filesystem transport
          shipping ............. CONSUMER span (the inbox) under the message's context

The order and payments services are the example's apps, served over real HTTP
(werkzeug, threads) and instrumented with opentelemetry-instrumentation-flask;
the SDK's in-memory exporter collects every span of this process. The order
service's first answer is lost after its commit (the connection dropped
instead of the response), so the client's retry is answered the stored
response (replayed). Every span of the order carries one trace id, the
retry's included, and each hop's parent is the hop before it.
"""

from __future__ import annotations

import socket
import threading
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from opentelemetry.instrumentation.flask import FlaskInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from werkzeug.serving import make_server

from example_app import app as example
from example_app import orders, shipping
from flask_idempotency._messaging.relay import relay_batch
from flask_idempotency.client import IdempotentSession
from tests.support import pgbouncer
from tests.support.tracing import named, sdk_tracing

ORDER = {"customer_id": "cus_traced", "amount": 1990, "currency": "EUR"}


class LoseFirstAnswer:
    """WSGI middleware: the first POST runs in full (its transaction commits,
    its spans end), then its connection is dropped instead of the answer, as
    when a proxy or the network loses a response after the commit."""

    def __init__(self, app: t.Callable[..., t.Any]) -> None:
        self.app = app
        self.lost = 0

    def __call__(self, environ: dict[str, t.Any], start_response: t.Any) -> t.Any:
        if environ["REQUEST_METHOD"] != "POST" or self.lost:
            return self.app(environ, start_response)
        self.lost += 1
        body = self.app(environ, lambda *args: lambda data: None)
        try:
            b"".join(body)
        finally:
            getattr(body, "close", lambda: None)()
        environ["werkzeug.socket"].shutdown(socket.SHUT_RDWR)
        raise ConnectionAbortedError("the order service's answer is lost")


class Served:
    def __init__(self, app: t.Any) -> None:
        self.server = make_server("127.0.0.1", 0, app, threaded=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def stop(self) -> None:
        self.server.shutdown()
        self.thread.join(10)


def ancestry(span: ReadableSpan, spans: t.Sequence[ReadableSpan]) -> list[ReadableSpan]:
    """``span``'s ancestors, nearest first, as far as ``spans`` hold them."""
    by_id = {s.context.span_id: s for s in spans}
    chain = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span)
    return chain


def server_spans(spans: t.Sequence[ReadableSpan], route: str) -> list[ReadableSpan]:
    return [
        s
        for s in spans
        if s.kind is SpanKind.SERVER and (s.attributes or {}).get("http.route") == route
    ]


@pytest.fixture
def chain(database_url: str, tmp_path: Path) -> t.Iterator[dict[str, t.Any]]:
    """The three services: payments (SQLite), orders (the engine under test),
    shipping (SQLite), one filesystem broker."""
    with sdk_tracing() as (provider, exporter):
        yield from _serve_chain(database_url, tmp_path, provider, exporter)


def _serve_chain(
    database_url: str, tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> t.Iterator[dict[str, t.Any]]:
    tag = uuid.uuid4().hex[:8]
    broker = {
        "EXAMPLE_BROKER_URL": "filesystem://",
        "EXAMPLE_BROKER_FOLDER": str(tmp_path / "broker"),
        "EXAMPLE_EXCHANGE": f"orders-{tag}",
        "EXAMPLE_SHIPPING_QUEUE": f"shipping-{tag}",
    }
    payments = example.create_app({"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 'p.db'}"})
    payments_server = Served(payments)
    order_app = orders.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": database_url,
            "PAYMENTS_URL": payments_server.url,
            **broker,
            # Behind the suite's PgBouncer: the pooler declared, as the example's docs say.
            **pgbouncer.declared(database_url),
        }
    )
    with order_app.app_context():
        orders.db.drop_all()
        orders.db.create_all()
    shipping_app = shipping.create_app(
        {"SQLALCHEMY_DATABASE_URI": f"sqlite:///{tmp_path / 's.db'}", **broker}
    )
    # The server spans go to this test's provider, whatever the process's global one.
    instrumentor = FlaskInstrumentor()
    for app in (payments, order_app):
        instrumentor.instrument_app(app, tracer_provider=provider)
    lose = LoseFirstAnswer(order_app.wsgi_app)
    order_app.wsgi_app = lose  # type: ignore[method-assign]
    order_server = Served(order_app)
    yield {
        "orders": order_app,
        "orders_url": order_server.url,
        "payments": payments,
        "shipping": shipping_app,
        "lost": lose,
        "provider": provider,
        "exporter": exporter,
    }
    order_server.stop()
    payments_server.stop()
    order_app.config["IDEMPOTENCY_PUBLISHER"].close()
    for app, db in ((order_app, orders.db), (payments, example.db), (shipping_app, shipping.db)):
        with app.app_context():
            db.engine.dispose()


def count(app: Flask, db: t.Any, table: str) -> int:
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def test_one_trace_from_the_client_to_the_shipment_the_retry_included(
    chain: dict[str, t.Any],
) -> None:
    http = IdempotentSession(total=3, backoff_factor=0.1, backoff_jitter=0)
    provider, exporter = chain["provider"], chain["exporter"]
    tracer = provider.get_tracer("shop-frontend")
    with tracer.start_as_current_span("checkout") as checkout:
        response = http.post(
            chain["orders_url"] + "/orders",
            json=ORDER,
            headers={"X-Tenant": "acme"},
            idempotency_key=str(uuid.uuid4()),
            timeout=30,
        )
    # Later, elsewhere: the relay, then the shipping service's consumer.
    assert relay_batch(chain["orders"]).published == 1
    assert shipping.consume(chain["shipping"], idle=1.0) == shipping.Consumed(shipped=1)
    spans = exporter.get_finished_spans()

    # The chain acted once at every hop, the answer lost once and replayed.
    assert chain["lost"].lost == 1
    assert response.status_code == 201, response.text
    assert response.headers["Idempotent-Replayed"] == "true"
    assert count(chain["orders"], orders.db, "orders") == 1
    assert count(chain["payments"], example.db, "ledger") == 1
    assert count(chain["shipping"], shipping.db, "shipments") == 1

    # One trace id on every span of the order.
    trace_id = checkout.get_span_context().trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}

    # The client: two attempts under the caller's span, the first lost.
    attempts = [
        s
        for s in named(spans, "idempotency.client attempt")
        if s.parent is not None and s.parent.span_id == checkout.get_span_context().span_id
    ]
    assert [(a.attributes or {}).get("idempotency.attempt") for a in attempts] == [1, 2]
    assert attempts[0].status.status_code is StatusCode.ERROR
    assert (attempts[1].attributes or {}).get("http.response.status_code") == 201

    # The order service: a server span per attempt, each under its attempt.
    placed, replayed = sorted(server_spans(spans, "/orders"), key=lambda s: s.start_time or 0)
    assert placed.parent is not None
    assert placed.parent.span_id == attempts[0].context.span_id
    assert replayed.parent is not None
    assert replayed.parent.span_id == attempts[1].context.span_id

    # The payments service, called by the first attempt only (the retry replayed).
    [charged] = server_spans(spans, "/payments")
    assert placed in ancestry(charged, spans)
    [call] = [s for s in ancestry(charged, spans) if s.name == "idempotency.client attempt"][:1]
    assert call.kind is SpanKind.CLIENT

    # The event: published under the request that emitted it, shipped under its publish.
    [publish] = named(spans, "idempotency.outbox publish")
    [ship] = named(spans, "idempotency.inbox process")
    assert publish.kind is SpanKind.PRODUCER
    assert ship.kind is SpanKind.CONSUMER
    assert ancestry(ship, spans)[:1] == [publish]
    assert placed in ancestry(publish, spans)
    assert ancestry(ship, spans)[-1].name == "checkout"
