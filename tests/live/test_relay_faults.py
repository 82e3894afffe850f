"""The outbox relay and the inbox under faults, on PostgreSQL with a real broker:
the broker going away (a TCP proxy cut between the relay's publisher and the
broker), a relay killed between publishing and marking, and three relay
processes over 10,000 events.

The broker is RabbitMQ when one answers at 127.0.0.1:5672 (guest/guest), and
always kombu's SQLAlchemy transport on the test PostgreSQL (``sqla+``), which
needs no server of its own and runs in CI.
"""

from __future__ import annotations

import datetime as dt
import gc
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time
import typing as t
import uuid
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy import orm

from flask_idempotency import signals
from flask_idempotency._messaging.outbox import add_event
from flask_idempotency._messaging.relay import backoff, relay_once
from flask_idempotency._storage.schema import outbox_table
from flask_idempotency.errors import BrokerUnavailable
from flask_idempotency.publishers import CallablePublisher, KombuPublisher
from tests.conftest import Clock
from tests.support import inbox_worker, outbox_app
from tests.support.broker import RABBITMQ, Broker, collect, delete_queue, drain, text, waiting
from tests.support.live import ROOT
from tests.support.outbox import post, reset, rows
from tests.support.tcp_proxy import TcpProxy, upstream_of

# kombu's SQLAlchemy transport maps its tables with a loader strategy that
# SQLAlchemy 2.1 deprecates: not ours to fix, and harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


@pytest.fixture(params=["sqla", "rabbitmq"])
def broker(request: pytest.FixtureRequest, pg_url: str) -> t.Iterator[Broker]:
    if request.param == "rabbitmq":
        try:
            socket.create_connection(RABBITMQ, timeout=2).close()
        except OSError as exc:
            pytest.skip(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}: {exc}")
        yield Broker("rabbitmq", "amqp://guest:guest@127.0.0.1:5672//", RABBITMQ)
        return
    yield Broker("sqla", "sqla+" + pg_url, upstream_of(pg_url))
    # kombu's SQLAlchemy transport keeps a session per channel that it never
    # closes, its connection checked out; psycopg 3 warns when the garbage
    # collector takes it, in whichever test runs then. Take them here, quietly:
    # the leak is kombu's, in the tests' own consumers.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


@pytest.fixture
def names() -> tuple[str, str]:
    """An exchange and a queue of this test's own."""
    tag = uuid.uuid4().hex[:10]
    return f"relay-faults-{tag}", f"relay-faults-{tag}"


def test_broker_down_events_wait_and_flow_when_it_returns(
    broker: Broker, pg_url: str, clock: Clock, names: tuple[str, str]
) -> None:
    """While the broker is cut off the relay publishes nothing and loses nothing:
    each run tries one event (one connection attempt, not one per event), the
    first pending one, again and again, and none is parked or counts an attempt,
    however long the outage. Healed, every event arrives once, exactly as
    written, and every row is marked published."""
    exchange, queue = names
    app = outbox_app.create_app(pg_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3)
    reset(pg_url)
    parked: list[str] = []

    def on_parked(sender: Flask, event: t.Any, error: str) -> None:
        parked.append(event.event_id)

    signals.event_parked.connect(on_parked, app)
    proxy = TcpProxy(broker.upstream)
    kombu_publisher = KombuPublisher(
        broker.through(proxy), exchange=exchange, queues=[queue], timeout=5
    )
    tried: list[str] = []

    def publish(event: t.Any) -> None:
        tried.append(text(event.event_id))
        kombu_publisher.publish(event)

    publisher = CallablePublisher(publish)
    try:
        assert post(app, key="before", amount=1).status_code == 201
        assert relay_once(app, publisher) == 1  # up: declares the queue, publishes
        assert waiting(broker, exchange, queue) == 1

        proxy.cut()
        for i in range(4):
            assert post(app, key=f"down-{i}", amount=10 + i).status_code == 201
        del tried[:]
        for _ in range(25):  # runs over a long outage
            assert relay_once(app, publisher) == 0
            clock.advance(seconds=backoff(30).total_seconds())
        down = rows(app)[1:]
        first = text(down[0]["event_id"])
        assert tried == [first] * 25  # one connection attempt per run, in order
        assert waiting(broker, exchange, queue) == 1  # nothing got through
        assert all(r["published_at"] is None for r in down)
        assert all(r["failed_at"] is None for r in down)  # none parked
        assert parked == []
        assert [r["attempts"] for r in down] == [0] * 4  # an outage is not a failure
        assert "BrokerUnavailable" in down[0]["last_error"]
        assert [r["next_attempt_at"] for r in down] == [None] * 4  # all due
        numbers = json.loads(app.test_cli_runner().invoke(args=["idempotency", "stats"]).output)
        assert (numbers["outbox_pending"], numbers["outbox_retrying"]) == (4, 1)
        assert numbers["outbox_parked"] == 0

        proxy.heal()
        for _ in range(5):  # a pooled connection cut earlier may fail once more
            clock.advance(seconds=backoff(30).total_seconds())
            relay_once(app, publisher)
            if all(r["published_at"] is not None for r in rows(app)):
                break
        stored = rows(app)
        assert all(r["published_at"] is not None and r["failed_at"] is None for r in stored)
        got = drain(broker, exchange, queue, len(stored))
        written = [(text(r["event_id"]), json.loads(r["payload"])) for r in stored]
        assert sorted((m["event_id"], m["payload"]) for m in got) == sorted(written)
        assert len({m["event_id"] for m in got}) == 5
    finally:
        proxy.close()  # first: a connection still hanging in it fails at once
        kombu_publisher.close()
        delete_queue(broker, exchange, queue)
        with app.app_context():
            outbox_app.db.engine.dispose()


def test_an_unreachable_broker_ends_the_batch_and_never_parks(
    database_url: str, clock: Clock
) -> None:
    """On every engine: BrokerUnavailable from a publisher ends the batch (the
    events after it are not tried), leaves the event due with its attempts
    unchanged (an outage is not the event's failure), and never parks it; any
    other failure still parks after MAX_ATTEMPTS."""
    app = outbox_app.create_app(database_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2)
    reset(database_url)
    with app.app_context():
        for eid in ("a", "b", "c"):
            add_event(outbox_app.db.session, "t", {"id": eid}, event_id=eid)
        outbox_app.db.session.commit()
    down = {"on": True}
    tried: list[str] = []

    def publish(event: t.Any) -> None:
        tried.append(event.event_id)
        if event.event_id == "c":
            raise ValueError("rejected")  # the event's own fault
        if down["on"]:
            raise BrokerUnavailable("connection refused")

    publisher = CallablePublisher(publish)
    for _ in range(4):  # twice MAX_ATTEMPTS for "a"
        assert relay_once(app, publisher) == 0
        clock.advance(seconds=backoff(30).total_seconds())
    assert tried == ["a"] * 4
    stored = rows(app)
    assert [(r["attempts"], r["failed_at"] is None) for r in stored] == [
        (0, True),
        (0, True),
        (0, True),
    ]
    assert [r["next_attempt_at"] for r in stored] == [None] * 3
    assert stored[0]["last_error"] == "BrokerUnavailable: connection refused"
    down["on"] = False
    assert relay_once(app, publisher) == 2  # a and b; c refused
    clock.advance(seconds=backoff(30).total_seconds())
    assert relay_once(app, publisher) == 0
    assert [r["failed_at"] is not None for r in rows(app)] == [False, False, True]


def test_relay_once_drains_past_a_failing_event(database_url: str, clock: Clock) -> None:
    """``flask idempotency relay --once`` publishes everything pending, though a
    failed publish makes a batch publish fewer than it took (it used to stop
    there, leaving the rest for another run); it stops early only when the
    broker is unreachable."""
    refused = {"e0"}
    published: list[str] = []

    def publish(event: t.Any) -> None:
        if event.event_id in refused:
            raise ValueError("rejected")
        if event.event_id == "unreachable":
            raise BrokerUnavailable("connection refused")
        published.append(event.event_id)

    app = outbox_app.create_app(
        database_url, clock=clock, IDEMPOTENCY_PUBLISHER=CallablePublisher(publish)
    )
    reset(database_url)
    with app.app_context():
        for i in range(7):
            add_event(outbox_app.db.session, "t", {"n": i}, event_id=f"e{i}")
        outbox_app.db.session.commit()
    runner = app.test_cli_runner()
    result = runner.invoke(args=["idempotency", "relay", "--once", "--batch", "2"])
    assert "published 6" in result.output, result.output
    assert published == [f"e{i}" for i in range(1, 7)]
    with app.app_context():
        for name in ("unreachable", "later"):
            add_event(outbox_app.db.session, "t", {}, event_id=name)
        outbox_app.db.session.commit()
    result = runner.invoke(args=["idempotency", "relay", "--once", "--batch", "1"])
    assert "published 0" in result.output  # the broker is away: the rest waits
    assert published[-1] == "e6"
    with app.app_context():
        outbox_app.db.engine.dispose()


def test_a_hung_broker_times_out_instead_of_holding_the_relay(
    pg_url: str, clock: Clock, names: tuple[str, str]
) -> None:
    """A broker that stops answering (a partition: connections open, nothing
    comes back) costs the relay its publisher's timeout, not for ever."""
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}: {exc}")
    broker = Broker("rabbitmq", "amqp://guest:guest@127.0.0.1:5672//", RABBITMQ)
    exchange, queue = names
    app = outbox_app.create_app(pg_url, clock=clock)
    reset(pg_url)
    proxy = TcpProxy(broker.upstream)
    publisher = KombuPublisher(broker.through(proxy), exchange=exchange, queues=[queue], timeout=1)
    try:
        post(app, key="first")
        assert relay_once(app, publisher) == 1
        proxy.blackhole()
        post(app, key="second")
        returned: list[int] = []
        run = threading.Thread(
            target=lambda: returned.append(relay_once(app, publisher)), daemon=True
        )
        run.start()
        run.join(60)  # a bound for the test only: the publisher's timeout is 1 s
        assert returned == [0]  # it returned: the confirm timed out
        second = rows(app)[1]
        assert second["published_at"] is None
        assert second["attempts"] == 0  # the broker's failure, not the event's
        assert "BrokerUnavailable" in second["last_error"]
        proxy.heal()
        clock.advance(seconds=2)
        assert relay_once(app, publisher) == 1
        # At least once: the timed-out publish may reach the broker too, late.
        assert collect(broker, exchange, queue, {text(r["event_id"]) for r in rows(app)})
    finally:
        proxy.close()  # first: a connection still hanging in it fails at once
        publisher.close()
        delete_queue(broker, exchange, queue)
        with app.app_context():
            outbox_app.db.engine.dispose()


def relay_process(
    pg_url: str, app: str, env: dict[str, str], *options: str, kill: bool = False
) -> subprocess.CompletedProcess[str]:
    """``flask idempotency relay`` on ``tests.support.outbox_app:<app>``, to its end."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_TEST_DB": pg_url, **env}
    if kill:
        full["OUTBOX_KILL_AFTER_PUBLISH"] = "1"
    cmd = [sys.executable, "-m", "flask", "--app", f"tests.support.outbox_app:{app}", "idempotency"]
    return subprocess.run(
        [*cmd, "relay", *options], env=full, cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_a_relay_killed_after_publishing_and_the_inbox_does_the_work_once(
    broker: Broker, pg_url: str, names: tuple[str, str]
) -> None:
    """SIGKILL after the broker took the first event and before the relay marked
    it: once the dead relay's lease (1 s here) has run out, the next relay
    publishes it again (at least once), and the inbox consumer reading the
    broker does its work once per event."""
    exchange, queue = names
    app = outbox_app.create_app(pg_url)
    reset(pg_url)
    engine = sa.create_engine(pg_url)
    inbox_worker.reset(engine)
    with app.app_context():
        for i in range(3):
            add_event(outbox_app.db.session, "order.created", {"n": i}, event_id=f"evt-{i}")
        outbox_app.db.session.commit()
    env = {
        "OUTBOX_BROKER_URL": broker.url,
        "OUTBOX_EXCHANGE": exchange,
        "OUTBOX_QUEUE": queue,
        "OUTBOX_TEST_CONFIG": json.dumps({"IDEMPOTENCY_OUTBOX_LEASE": 1}),
    }
    try:
        killed = relay_process(pg_url, "broker_from_env", env, "--once", kill=True)
        assert killed.returncode == -9, killed.stderr
        assert waiting(broker, exchange, queue) == 1  # the broker has evt-0
        assert all(r["published_at"] is None for r in rows(app))  # the mark died with it
        leases = [r["next_attempt_at"] for r in rows(app)]
        while dt.datetime.now(dt.timezone.utc) <= max(leases):  # the lease runs out
            time.sleep(0.1)

        again = relay_process(pg_url, "broker_from_env", env, "--once")
        assert again.returncode == 0, again.stderr
        assert "published 3" in again.stdout
        assert all(r["published_at"] is not None for r in rows(app))

        messages = drain(broker, exchange, queue, 4)
        assert sorted(m["event_id"] for m in messages) == ["evt-0", "evt-0", "evt-1", "evt-2"]
        skipped: list[str] = []

        def on_skip(sender: t.Any, consumer: str, event_id: str) -> None:
            skipped.append(event_id)

        signals.event_skipped_duplicate.connect(on_skip)
        try:
            with orm.Session(engine) as session:
                deliver = inbox_worker.make_consumer(session)
                outcomes = [deliver(m["event_id"], m["payload"]) for m in messages]
        finally:
            signals.event_skipped_duplicate.disconnect(on_skip)
        assert outcomes.count("done") == 3
        assert skipped == ["evt-0"]
        assert inbox_worker.counts(engine) == (3, 3, 3)
        with engine.connect() as conn:
            done = conn.execute(
                sa.select(inbox_worker.work.c.event_id, inbox_worker.work.c.payload)
            )
            assert sorted((e, json.loads(p)) for e, p in done) == [
                (f"evt-{i}", {"n": i}) for i in range(3)
            ]
    finally:
        delete_queue(broker, exchange, queue)
        engine.dispose()
        with app.app_context():
            outbox_app.db.engine.dispose()


EVENTS = 10_000


def test_three_relay_processes_over_ten_thousand_events(pg_url: str, tmp_path: Path) -> None:
    """Three ``flask idempotency relay --once`` processes at once over 10,000
    events: every event published, by one relay, never by two at the same time
    (publish intervals per event id do not overlap), and processed exactly once
    by inbox consumers reading what the relays published."""
    app = outbox_app.create_app(pg_url)
    reset(pg_url)
    engine = sa.create_engine(pg_url)
    inbox_worker.reset(engine)
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
        now = dt.datetime.now(dt.timezone.utc)
        with outbox_app.db.engine.begin() as conn:
            conn.execute(
                sa.insert(table).values(event_id=sa.bindparam("eid", type_=sa.String())),
                [
                    {
                        "eid": f"e{i:05d}",
                        "topic": "t",
                        "payload": json.dumps({"n": i}),
                        "created_at": now,
                        "attempts": 0,
                    }
                    for i in range(EVENTS)
                ],
            )
        outbox_app.db.engine.dispose()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_TEST_DB": pg_url,
        "OUTBOX_TEST_DIR": str(tmp_path),
    }
    cmd = [sys.executable, "-m", "flask", "--app", "tests.support.outbox_app:intervals_from_env"]
    relays = [
        subprocess.Popen(
            [*cmd, "idempotency", "relay", "--once", "--batch", "250"],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp_path / "go").touch()  # all three start their runs together
    for relay in relays:
        _, err = relay.communicate(timeout=120)
        assert relay.returncode == 0, err
    queues = sorted(tmp_path.glob("relay-*.jsonl"))
    consumers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.support.inbox_worker", pg_url, str(path)],
            env=env,
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in queues
    ]
    for consumer in consumers:
        _, err = consumer.communicate(timeout=120)
        assert consumer.returncode == 0, err

    by_event: dict[str, list[tuple[int, int, int]]] = {}
    for path in tmp_path.glob("intervals-*.jsonl"):
        for line in path.read_text().splitlines():
            event_id, start, end, pid = json.loads(line)
            by_event.setdefault(event_id, []).append((start, end, pid))
    assert len(by_event) == EVENTS  # each published at least once
    for event_id, spans in by_event.items():
        spans.sort()
        for (_, end, _), (start, _, _) in itertools.pairwise(spans):
            assert end <= start, f"{event_id} published twice at once: {spans}"
    # No relay died, so none was published twice at all; the three shared them.
    assert sum(len(s) for s in by_event.values()) == EVENTS
    assert len({pid for spans in by_event.values() for _, _, pid in spans}) >= 2
    assert inbox_worker.counts(engine) == (EVENTS, EVENTS, EVENTS)
    with engine.connect() as conn:
        pending = conn.execute(
            sa.select(sa.func.count()).where(table.c.published_at.is_(None))
        ).scalar_one()
    assert pending == 0
    engine.dispose()
