"""The pipelined relay under faults found in review (issue 29): a publish
interrupted by KeyboardInterrupt/SystemExit mid-write, and a round cut short
whose one-at-a-time fallback would run past the batch's lease.

Against the real RabbitMQ at 127.0.0.1:5672 (skipped without one) and the test
PostgreSQL.
"""

from __future__ import annotations

import datetime as dt
import typing as t
import uuid

import pytest
from flask import Flask

from flask_idempotency._messaging import relay
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency.publishers import KombuPublisher
from tests.conftest import Clock
from tests.live.test_relay_pipelined import add_events, rabbitmq
from tests.support import outbox_app
from tests.support.broker import delete_queue, drain, text
from tests.support.outbox import fresh_app
from tests.support.outbox import rows as stored


@pytest.fixture
def app(pg_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(pg_url, clock) as app:
        yield app


@pytest.fixture
def names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    return f"relay-pipe-faults-{tag}", f"relay-pipe-faults-{tag}"


def event(event_id: str) -> OutboxEvent:
    now = dt.datetime.now(dt.timezone.utc)
    return OutboxEvent(1, event_id, "order.created", {"id": event_id}, {"pad": "x" * 300}, now, 0)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("path", ["publish", "fallback"])
def test_an_interrupt_mid_write_drops_the_connection(
    names: tuple[str, str], interrupt: type[BaseException], path: str
) -> None:
    """An interrupt lands in the middle of a message's write (half its frames
    on the wire), through ``publish`` and through the one-at-a-time fallback of
    ``publish_many``. The next event on the same publisher is published at
    once on a new connection: not sent after the half frame on the old one
    (which the broker would wait out, or close as a frame error counted as
    that innocent event's failure)."""
    broker = rabbitmq()
    exchange, queue = names
    publisher = KombuPublisher(broker.url, exchange=exchange, queues=[queue], timeout=2)

    def go(ev: OutboxEvent) -> None:
        if path == "publish":
            publisher.publish(ev)
        else:
            (outcome,) = publisher._one_by_one([ev], [None], [0])
            if outcome is not None:
                raise outcome

    try:
        go(event("first"))
        transport = publisher._connection.connection.transport
        write = transport._write

        def half(data: bytes) -> None:
            transport._write = write
            write(data[: len(data) // 2])
            raise interrupt

        transport._write = half
        with pytest.raises(interrupt):
            go(event("interrupted"))
        go(event("next"))  # raised BrokerUnavailable (timed out) on the half-written connection
        assert publisher._connection.connection.transport is not transport
        got = [m["event_id"] for m in drain(broker, exchange, queue, 2)]
        assert got == ["first", "next"]
    finally:
        publisher.close()
        delete_queue(broker, exchange, queue)


class SlowBroker(KombuPublisher):
    """Each publish one at a time takes 20 s on the relay's batch clock."""

    def __init__(self, *args: t.Any, now: list[float], **kw: t.Any) -> None:
        super().__init__(*args, **kw)
        self.now = now

    def _publish_one(self, event: OutboxEvent) -> None:
        try:
            super()._publish_one(event)
        finally:
            self.now[0] += 20


def test_a_cut_short_round_falls_back_only_within_half_the_lease(
    app: Flask, names: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round's first message has headers larger than a frame: the broker
    closes the connection, and the round's events are published again one at
    a time. Each takes 20 s on the batch's clock and the lease is 60 s: the
    fallback stops once half the lease has passed (as the per-event relay
    does), so the batch never publishes past its lease; the events it did not
    try are given back, due at once, no attempt counted, and the next batch
    publishes them."""
    broker = rabbitmq()
    exchange, queue = names
    now = [0.0]
    monkeypatch.setattr(relay, "_elapsed_clock", lambda: now[0])
    monkeypatch.setattr(relay, "PIPELINE", 3)  # a later run of the batch is given back too
    with app.app_context():
        headers = {"pad": "h" * 200_000}
        add_event(outbox_app.db.session, "order.created", {}, headers=headers, event_id="big")
        outbox_app.db.session.commit()
    add_events(app, *(f"e{i}" for i in range(5)))
    publisher = SlowBroker(broker.url, exchange=exchange, queues=[queue], timeout=5, now=now)
    try:
        run = relay.relay_batch(app, publisher, batch=10)
        # big fails at 0 s, e0 goes out at 20 s, at 40 s half the lease (30 s) has passed
        assert (run.taken, run.published, run.failed, run.released) == (6, 1, 1, 4)
        assert not run.broker_unavailable
        assert run.more
        rows = {text(r["event_id"]): r for r in stored(app)}
        assert rows["big"]["last_error"].startswith("FrameError")
        assert rows["e0"]["published_at"] is not None
        given_back = [rows[f"e{i}"] for i in range(1, 5)]
        assert all(r["published_at"] is None for r in given_back)
        assert all((r["attempts"], r["next_attempt_at"]) == (0, None) for r in given_back)
        run = relay.relay_batch(app, publisher, batch=10)
        assert run.published == 4
        got = drain(broker, exchange, queue, 5)
        assert sorted(m["event_id"] for m in got) == [f"e{i}" for i in range(5)]
    finally:
        publisher.close()
        delete_queue(broker, exchange, queue)
