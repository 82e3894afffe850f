"""The relay's pipelined publishing (issue 29): KombuPublisher.publish_many sends
a batch to RabbitMQ and collects its confirms together, and the relay marks
exactly the events the broker confirmed.

Against the real RabbitMQ at 127.0.0.1:5672 (guest/guest; skipped, with the
reason, without one) and the test PostgreSQL; the broker is cut off or silenced
by a TCP proxy in the middle of a round, at the first confirm that comes back.
"""

from __future__ import annotations

import json
import socket
import typing as t
import uuid
from unittest import mock

import pytest
from flask import Flask

from flask_idempotency._confirms import ConfirmChannel, amqp_message
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.publishing import publish_many_of
from flask_idempotency._messaging.relay import relay_batch, relay_once
from flask_idempotency.publishers import CallablePublisher, KombuPublisher, ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.broker import RABBITMQ, Broker, delete_queue, drain, text, waiting
from tests.support.outbox import fresh_app
from tests.support.outbox import rows as stored
from tests.support.tcp_proxy import TcpProxy


def rabbitmq() -> Broker:
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}: {exc}")
    return Broker("rabbitmq", "amqp://guest:guest@127.0.0.1:5672//", RABBITMQ)


def add_events(app: Flask, *event_ids: str, topic: str = "order.created") -> None:
    with app.app_context():
        for event_id in event_ids:
            add_event(outbox_app.db.session, topic, {"id": event_id}, event_id=event_id)
        outbox_app.db.session.commit()


class Counting(KombuPublisher):
    """A KombuPublisher that counts its connections and its pipelined rounds,
    and may run ``on_first_confirm`` when a round's first confirm comes back."""

    def __init__(self, *args: t.Any, **kw: t.Any) -> None:
        super().__init__(*args, **kw)
        self.connects = self.rounds = 0
        self.on_first_confirm: t.Callable[[], None] | None = None

    def _ensure(self) -> t.Any:
        if self._producer is None:
            self.connects += 1
        return super()._ensure()

    def _confirming(self) -> ConfirmChannel:
        fresh = self._confirms is None
        confirms = super()._confirming()
        self.rounds += 1
        if fresh and self.on_first_confirm is not None:
            hooks = [self.on_first_confirm]
            self.on_first_confirm = None

            def first(tag: int, multiple: bool) -> None:
                if hooks:
                    hooks.pop()()

            confirms.channel.events["basic_ack"].add(first)
        return confirms


@pytest.fixture
def app(pg_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(pg_url, clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2) as app:
        yield app


@pytest.fixture
def names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"relay-pipe-{tag}", f"relay-pipe-{tag}"


def test_a_nacked_message_mid_round_fails_alone(app: Flask, clock: Clock) -> None:
    """Five events in one pipelined round; the middle one routes to a full
    queue (``x-max-length: 0``, ``x-overflow: reject-publish``), which RabbitMQ
    nacks. Exactly the other four are marked published and reach their queue;
    the nacked one has one attempt and ``MessageNacked`` as its error, is
    parked at MAX_ATTEMPTS=2, and the round kept its connection (no fallback
    to one publish at a time)."""
    import kombu

    broker = rabbitmq()
    tag = uuid.uuid4().hex[:10]
    exchange_name, full_name, ok_name = (f"relay-pipe-{x}-{tag}" for x in ("ex", "full", "ok"))
    exchange = kombu.Exchange(exchange_name, type="topic", durable=True)
    full = kombu.Queue(
        full_name,
        exchange,
        routing_key="audit.#",
        durable=True,
        queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    ok = kombu.Queue(ok_name, exchange, routing_key="order.#", durable=True)
    add_events(app, "order-0", "order-1")
    add_events(app, "audit-0", topic="audit.x")
    add_events(app, "order-2", "order-3")
    publisher = Counting(broker.url, exchange=exchange_name, queues=[full, ok], timeout=5)
    try:
        run = relay_batch(app, publisher, batch=10)
        assert (run.taken, run.published, run.failed, run.broker_unavailable) == (5, 4, 1, False)
        assert (publisher.connects, publisher.rounds) == (1, 1)
        rows = {text(r["event_id"]): r for r in stored(app)}
        audit = rows.pop("audit-0")
        assert (audit["attempts"], audit["published_at"], audit["failed_at"]) == (1, None, None)
        assert audit["last_error"].startswith("MessageNacked")
        assert all(r["published_at"] is not None and r["attempts"] == 0 for r in rows.values())
        assert waiting(broker, exchange_name, ok_name) == 4
        got = drain(broker, exchange_name, ok_name, 4)
        assert [m["event_id"] for m in got] == ["order-0", "order-1", "order-2", "order-3"]
        assert [m["payload"] for m in got] == [{"id": f"order-{i}"} for i in (0, 1, 2, 3)]
        clock.advance(minutes=1)
        run = relay_batch(app, publisher, batch=10)
        assert (run.taken, run.failed) == (1, 1)
        assert stored(app)[2]["failed_at"] is not None  # parked at the second nack
    finally:
        publisher.close()
        with kombu.Connection(broker.url) as conn:
            channel = conn.channel()
            for queue in (full, ok):
                queue(channel).delete()
            exchange(channel).delete()


@pytest.mark.parametrize("fault", ["cut", "blackhole"])
def test_a_broker_lost_mid_round_marks_only_what_it_confirmed(
    app: Flask, names: tuple[str, str], fault: str
) -> None:
    """The broker's connection is cut (or goes silent past ``timeout``) as the
    first confirm of a 2,000-event round comes back. Every event marked
    published is in the queue (none marked without its confirm), every other
    one is due again with no attempt counted, and once the broker is back
    every event reaches the consumer at least once: duplicates allowed, never
    a loss."""
    broker = rabbitmq()
    exchange, queue = names
    ids = [f"e{i}" for i in range(2000)]
    add_events(app, *ids)
    proxy = TcpProxy(broker.upstream)
    publisher = Counting(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}//", exchange=exchange, queues=[queue], timeout=1
    )
    publisher.on_first_confirm = proxy.cut if fault == "cut" else proxy.blackhole
    try:
        run = relay_batch(app, publisher, batch=2000)
        assert run.broker_unavailable
        assert run.failed == 0
        rows = stored(app)
        marked = {text(r["event_id"]) for r in rows if r["published_at"] is not None}
        assert 0 < len(marked) < len(ids)  # the round was cut between its confirms
        left = [r for r in rows if r["published_at"] is None]
        assert all(r["attempts"] == 0 and r["next_attempt_at"] is None for r in left)
        assert "BrokerUnavailable" in left[0]["last_error"]
        reached = waiting(broker, exchange, queue)
        assert reached >= len(marked)

        proxy.heal()
        for _ in range(5):
            if relay_once(app, publisher, batch=2000) == 0 and all(
                r["published_at"] is not None for r in stored(app)
            ):
                break
        assert all(r["published_at"] is not None for r in stored(app))
        total = waiting(broker, exchange, queue)
        got = drain(broker, exchange, queue, total)
        seen = [m["event_id"] for m in got]
        assert set(seen) == set(ids)  # no loss (duplicates allowed: the unconfirmed re-sent)
        assert marked <= set(seen[:reached])  # what was marked had reached the broker
    finally:
        proxy.close()
        publisher.close()
        delete_queue(broker, exchange, queue)


def test_the_message_is_the_one_kombu_publishes() -> None:
    """A pipelined message's body and basic properties are those kombu's
    producer (through py-amqp) gives the same event: consumers see no
    difference between the two paths."""
    import datetime as dt

    import amqp  # type: ignore[import-untyped]
    from kombu import serialization

    event = OutboxEvent(
        id=1,
        event_id="ev-1",
        topic="order.created",
        payload={"id": "é", "n": [1, 2.5, None, True]},
        headers={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        created_at=dt.datetime.now(dt.timezone.utc),
        attempts=0,
    )
    message = amqp_message(event, "ex")
    content_type, encoding, body = serialization.dumps(event.payload, serializer="json")
    reference = amqp.Message(
        body.encode(encoding),
        priority=0,
        content_type=content_type,
        content_encoding=encoding,
        application_headers=event.headers,
        message_id=event.event_id,
        delivery_mode=2,
    )
    assert message.body == reference.body
    assert message.properties == reference._serialize_properties()
    assert (message.exchange, message.routing_key) == ("ex", "order.created")
    assert json.loads(message.body) == event.payload


def test_which_publishers_publish_together() -> None:
    """The relay calls ``publish_many`` when a publisher offers it, and
    ``publish`` per event when it does not, or when a subclass or an instance
    overrides ``publish`` alone (a user's hook around each publish keeps
    running)."""

    class OwnPublish(KombuPublisher):
        def publish(self, event: OutboxEvent) -> None:
            super().publish(event)

    class Both(OwnPublish):
        def publish_many(self, events: t.Sequence[OutboxEvent]) -> list[BaseException | None]:
            return super().publish_many(events)

    kombu_publisher = KombuPublisher("memory://")
    assert publish_many_of(kombu_publisher) == kombu_publisher.publish_many
    assert publish_many_of(OwnPublish("memory://")) is None
    assert publish_many_of(Both("memory://")) is not None
    patched = KombuPublisher("memory://")
    patched.publish = lambda event: None  # type: ignore[method-assign]
    assert publish_many_of(patched) is None
    assert publish_many_of(ListPublisher()) is None
    assert publish_many_of(CallablePublisher(print)) is None
    assert publish_many_of(mock.Mock()) is None  # answers every name, defines none
    assert publish_many_of(mock.Mock(spec=KombuPublisher("memory://"))) is None


def test_each_event_of_a_round_has_its_own_span_and_parent(
    app: Flask, names: tuple[str, str]
) -> None:
    """Three events published in one pipelined round, two emitted under
    requests of two traces and one under none: a PRODUCER span each, whose
    parent is its own request's span (never another event's span, though all
    three are open together), the third a root; each message carries its own
    span's context."""
    from opentelemetry.trace import SpanKind

    from tests.support.outbox import post
    from tests.support.tracing import named, parse_traceparent, sdk_tracing

    broker = rabbitmq()
    exchange, queue = names
    publisher = Counting(broker.url, exchange=exchange, queues=[queue], timeout=5)
    try:
        with sdk_tracing() as (provider, exporter):
            requests = []
            for key in ("k1", "k2"):
                with provider.get_tracer("test").start_as_current_span("request") as span:
                    assert post(app, key=key).status_code == 201
                requests.append(span)
            assert post(app, key="k3").status_code == 201
            assert relay_once(app, publisher) == 3
            producers = named(exporter.get_finished_spans(), "idempotency.outbox publish")
        assert publisher.rounds == 1
        got = drain(broker, exchange, queue, 3)
    finally:
        publisher.close()
        delete_queue(broker, exchange, queue)
    assert len(producers) == 3
    assert all(p.kind is SpanKind.PRODUCER for p in producers)
    by_message = {parse_traceparent(m["headers"]["traceparent"]): m["event_id"] for m in got}
    spans = {(p.context.trace_id, p.context.span_id): p for p in producers}
    assert set(by_message) == set(spans)  # each message carries its own span
    parents = sorted(
        (p.parent.span_id if p.parent else None for p in producers), key=lambda x: x or 0
    )
    expected = [None, *sorted(r.get_span_context().span_id for r in requests)]
    assert parents == expected
    for request in requests:
        child = [
            p
            for p in producers
            if p.parent and p.parent.span_id == request.get_span_context().span_id
        ]
        assert child[0].context.trace_id == request.get_span_context().trace_id


def test_a_round_with_a_body_larger_than_a_frame(app: Flask, names: tuple[str, str]) -> None:
    """A payload of 600 kB (several body frames, and more than one write of
    frames) between small ones, in one pipelined round: each message arrives
    whole and in order, and all are marked published."""
    broker = rabbitmq()
    exchange, queue = names
    big = {"id": "big", "blob": "x" * 600_000}
    add_events(app, "before")
    with app.app_context():
        add_event(outbox_app.db.session, "order.created", big, event_id="big")
        outbox_app.db.session.commit()
    add_events(app, "after")
    publisher = Counting(broker.url, exchange=exchange, queues=[queue], timeout=5)
    try:
        assert relay_once(app, publisher) == 3
        assert (publisher.connects, publisher.rounds) == (1, 1)
        got = drain(broker, exchange, queue, 3)
    finally:
        publisher.close()
        delete_queue(broker, exchange, queue)
    assert [m["event_id"] for m in got] == ["before", "big", "after"]
    assert got[1]["payload"] == big
    assert [m["payload"] for m in (got[0], got[2])] == [{"id": "before"}, {"id": "after"}]
