"""The relay holds no transaction while it talks to the broker, and counts only
real failures toward parking.

Issue 15, items 4 and 6: on PostgreSQL and MySQL/MariaDB the relay used to keep
one transaction open while it published a whole batch; a server-side timeout
or a slow broker ended it after the broker had every event, nothing was
marked, and the batch went out again on every run. Now each batch leases its
rows in a short transaction and marks each event as its publish returns. And a
broker outage used to count toward parking (one ordinary error after it parked
the event), while a nack never did.

Brokers here are real (RabbitMQ at 127.0.0.1:5672, skipped without one) or a
recording publisher; databases are real; servers' own timeouts are set through
the connection (``idle_in_transaction_session_timeout``, ``idle_session_timeout``,
MySQL's ``wait_timeout``).
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import logging
import socket
import threading
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import signals
from flask_idempotency._messaging import relay as relay_module
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import backoff, relay_batch, relay_once
from flask_idempotency._storage.schema import as_utc, outbox_table
from flask_idempotency.errors import BrokerUnavailable
from flask_idempotency.publishers import CallablePublisher, KombuPublisher
from tests.conftest import Clock, mysql_url, postgres_url
from tests.support import outbox_app, pgbouncer
from tests.support.broker import RABBITMQ, Broker, collect, delete_queue, drain, text, waiting
from tests.support.outbox import reset
from tests.support.tcp_proxy import TcpProxy, upstream_of


def rabbitmq() -> Broker:
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at {RABBITMQ[0]}:{RABBITMQ[1]}: {exc}")
    return Broker("rabbitmq", "amqp://guest:guest@127.0.0.1:5672//", RABBITMQ)


def stored(url: str) -> list[dict[str, t.Any]]:
    """The outbox rows, read on a connection of their own (the app's pooled
    ones may have been closed by the server's idle timeouts)."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        table = outbox_table(outbox_app.db.metadata)
        with engine.connect() as conn:
            return [
                {k: as_utc(v) if isinstance(v, dt.datetime) else v for k, v in r._mapping.items()}
                for r in conn.execute(sa.select(table).order_by(table.c.id))
            ]
    finally:
        engine.dispose()


def add_events(app: Flask, *event_ids: str, topic: str = "t") -> None:
    with app.app_context():
        for event_id in event_ids:
            add_event(outbox_app.db.session, topic, {"id": event_id}, event_id=event_id)
        outbox_app.db.session.commit()


def dispose(app: Flask) -> None:
    with app.app_context():
        outbox_app.db.engine.dispose()


def with_pg_options(url: str, options: str, driver: str) -> str:
    parsed = sa.make_url(url).set(drivername=f"postgresql+{driver}")
    existing = parsed.query.get("options", "")
    assert isinstance(existing, str)
    return parsed.update_query_dict({"options": f"{existing} {options}".strip()}).render_as_string(
        hide_password=False
    )


@pytest.fixture(params=["psycopg2", "psycopg", "mysql"])
def timing_out(
    request: pytest.FixtureRequest, pooled_role: t.Callable[..., str]
) -> tuple[str, str, dict[str, t.Any]]:
    """(plain URL, app URL, engine options) of a database whose server ends an
    idle transaction, or an idle connection, after 1 s: PostgreSQL (psycopg2
    and psycopg 3) with ``idle_in_transaction_session_timeout`` and
    ``idle_session_timeout``, MariaDB/MySQL with ``wait_timeout``."""
    if request.param == "mysql":
        url = mysql_url()
        if url is None:
            pytest.skip("no MariaDB/MySQL reachable (see the report header)")
        options = {"connect_args": {"init_command": "SET SESSION wait_timeout = 1"}}
        return url, url, options
    url = postgres_url()
    if pgbouncer.is_pooled(url):  # behind the pooler: the role's settings
        driven = sa.make_url(url).set(drivername=f"postgresql+{request.param}")
        role = pooled_role(
            driven.render_as_string(hide_password=False),
            idle_in_transaction_session_timeout="1000",
            idle_session_timeout="1000",
        )
        return url, role, {}
    timeouts = "-cidle_in_transaction_session_timeout=1000 -cidle_session_timeout=1000"
    return url, with_pg_options(url, timeouts, request.param), {}


class StallingPublisher:
    """Publishes through ``inner``; before publishing ``at`` it blackholes the
    broker's proxy (connections stay open, nothing comes back) for ``stall``
    seconds, so that publish waits for its confirm that long."""

    def __init__(self, inner: KombuPublisher, proxy: TcpProxy, at: str, stall: float) -> None:
        self.inner, self.proxy, self.at, self.stall = inner, proxy, at, stall
        self.timer: threading.Timer | None = None

    def publish(self, event: OutboxEvent) -> None:
        if text(event.event_id) == self.at and self.timer is None:
            self.proxy.blackhole()
            self.timer = threading.Timer(self.stall, self.proxy.heal)
            self.timer.start()
        self.inner.publish(event)


def test_a_broker_stalling_mid_batch_past_the_servers_idle_timeouts_loses_no_mark(
    timing_out: tuple[str, str, dict[str, t.Any]], clock: Clock
) -> None:
    """The broker stalls for 2.5 s on the third of ten events, past the server's
    1 s idle timeouts: the batch publishes all ten, each once, and marks all
    ten. (It used to lose its transaction in the stall: nothing marked, and
    every run sent the whole batch again.)"""
    plain, url, options = timing_out
    broker = rabbitmq()
    tag = uuid.uuid4().hex[:10]
    exchange = queue = f"relay-stall-{tag}"
    app = outbox_app.create_app(url, clock=clock, SQLALCHEMY_ENGINE_OPTIONS=options)
    reset(plain)
    ids = [f"e{i}" for i in range(10)]
    add_events(app, *ids)
    proxy = TcpProxy(broker.upstream)
    inner = KombuPublisher(
        f"amqp://guest:guest@127.0.0.1:{proxy.port}//", exchange=exchange, queues=[queue]
    )
    publisher = StallingPublisher(inner, proxy, at="e2", stall=2.5)
    try:
        run = relay_batch(app, publisher, batch=10)
        assert publisher.timer is not None
        assert (run.taken, run.published, run.failed) == (10, 10, 0)
        rows = stored(plain)
        assert all(r["published_at"] is not None for r in rows)
        assert [r["attempts"] for r in rows] == [0] * 10
        assert relay_once(app, publisher) == 0
        messages = drain(broker, exchange, queue, 10)  # and none left behind
        assert sorted(m["event_id"] for m in messages) == sorted(ids)
    finally:
        if publisher.timer is not None:
            publisher.timer.join()
        proxy.close()
        inner.close()
        delete_queue(broker, exchange, queue)
        dispose(app)


class Gate:
    """A publisher that records what it publishes and, on ``hold``, waits until
    :meth:`open` (a broker that stopped answering, for as long as a test likes)."""

    def __init__(self, hold: str | None = None) -> None:
        self.hold = hold
        self.published: list[str] = []
        self.reached = threading.Event()
        self._open = threading.Event()

    def publish(self, event: OutboxEvent) -> None:
        if text(event.event_id) == self.hold:
            self.reached.set()
            assert self._open.wait(60)
        self.published.append(text(event.event_id))

    def open(self) -> None:
        self._open.set()


def lock_every_row(url: str) -> None:
    """Update every outbox row, waiting at most about a second for any lock
    (raises if a relay holds one)."""
    engine = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(sa.text("SET LOCAL lock_timeout = '1s'"))
            elif engine.dialect.name == "sqlite":
                conn.execute(sa.text("PRAGMA busy_timeout = 1000"))
            else:
                conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 1"))
            conn.execute(sa.text("UPDATE idempotency_outbox SET attempts = attempts"))
    finally:
        engine.dispose()


def test_a_relay_waiting_on_the_broker_holds_no_lock_and_its_rows_stay_its_own(
    database_url: str, clock: Clock
) -> None:
    """While relay A waits on a broker that does not answer, it holds no
    transaction and no row lock (anything may update the rows), yet relay B,
    running meanwhile, takes only the rows A did not take. Each event is
    published once. (A used to hold its batch's rows locked in an open
    transaction for as long as the broker took.)"""
    app = outbox_app.create_app(database_url, clock=clock)
    reset(database_url)
    ids = [f"e{i}" for i in range(6)]
    add_events(app, *ids)
    a, b = Gate(hold="e0"), Gate()
    errors: list[BaseException] = []

    def relay_a() -> None:
        try:
            relay_once(app, a, batch=3)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=relay_a)
    thread.start()
    try:
        assert a.reached.wait(30)
        lock_every_row(database_url)  # no lock held: this does not wait
        assert relay_once(app, b, batch=10) == 3
        assert b.published == ["e3", "e4", "e5"]
    finally:
        a.open()
        thread.join(60)
    assert not errors
    assert a.published == ["e0", "e1", "e2"]
    assert all(r["published_at"] is not None for r in stored(database_url))
    dispose(app)


def test_a_batch_stops_at_half_its_lease_and_gives_the_rest_back(
    database_url: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch publishes for at most half of IDEMPOTENCY_OUTBOX_LEASE (on the
    relay's own clock), so it never publishes past its lease; what it did not
    try is due again at once, and ``more`` says to go on."""
    elapsed = [0.0]
    monkeypatch.setattr(relay_module, "_elapsed_clock", lambda: elapsed[0])
    app = outbox_app.create_app(database_url, clock=clock, IDEMPOTENCY_OUTBOX_LEASE=60)
    reset(database_url)
    add_events(app, *(f"e{i}" for i in range(5)))
    published: list[str] = []

    def slow(event: OutboxEvent) -> None:
        published.append(text(event.event_id))
        elapsed[0] += 20  # the second publish ends 40 s into the lease

    run = relay_batch(app, CallablePublisher(slow), batch=5)
    assert (run.taken, run.published, run.released, run.more) == (5, 2, 3, True)
    assert published == ["e0", "e1"]
    rows = stored(database_url)
    assert [r["published_at"] is not None for r in rows] == [True, True, False, False, False]
    assert [r["next_attempt_at"] for r in rows[2:]] == [None] * 3  # due, not leased
    assert [r["attempts"] for r in rows] == [0] * 5
    assert relay_batch(app, CallablePublisher(slow), batch=5).published == 2
    assert relay_batch(app, CallablePublisher(slow), batch=5).published == 1
    assert published == [f"e{i}" for i in range(5)]
    dispose(app)


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_relay_interrupted_mid_batch_keeps_its_marks_and_gives_the_rest_back(
    database_url: str, clock: Clock, interrupt: type[BaseException]
) -> None:
    """A BaseException in the middle of a batch (Ctrl-C, gunicorn's SystemExit
    at a worker timeout, in a scheduler thread): what was published is marked,
    the rest (the interrupted event included: it may have reached the broker)
    is due again at once, and the next run sends it. (It used to roll the
    batch's marks back on PostgreSQL and MySQL, and leave SQLite's rows leased
    for five minutes.)"""
    app = outbox_app.create_app(database_url, clock=clock)
    reset(database_url)
    add_events(app, "e0", "e1", "e2")
    sent: list[str] = []

    def publish(event: OutboxEvent) -> None:
        sent.append(text(event.event_id))
        if text(event.event_id) == "e1" and sent.count("e1") == 1:
            raise interrupt()

    with pytest.raises(interrupt):
        relay_once(app, CallablePublisher(publish))
    rows = stored(database_url)
    assert [r["published_at"] is not None for r in rows] == [True, False, False]
    assert [r["next_attempt_at"] for r in rows[1:]] == [None, None]
    assert [r["attempts"] for r in rows] == [0, 0, 0]
    assert relay_once(app, CallablePublisher(publish)) == 2
    assert sent == ["e0", "e1", "e1", "e2"]
    dispose(app)


def test_a_relay_cut_off_from_its_database_leaves_each_event_marked_or_re_sendable(
    pg_url: str, clock: Clock
) -> None:
    """The database goes away (a cut on the relay's connections) just after the
    broker took the second event: the relay fails, and each event is either
    marked published (sent once) or still leased, so no other relay sends it
    while the lease holds and the next relay sends it once the lease has run
    out. Nothing the broker took is lost or marked without being sent."""
    proxy = TcpProxy(upstream_of(pg_url))
    app = outbox_app.create_app(proxy.url(pg_url), clock=clock)
    reset(pg_url)
    add_events(app, "e0", "e1", "e2")
    sent: list[str] = []

    def publish(event: OutboxEvent) -> None:
        sent.append(text(event.event_id))
        if sent == ["e0", "e1"]:
            proxy.cut()  # after the broker has e1, before its mark

    try:
        with pytest.raises(sa.exc.OperationalError):
            relay_once(app, CallablePublisher(publish))
        proxy.heal()
        rows = stored(pg_url)
        marked = [text(r["event_id"]) for r in rows if r["published_at"] is not None]
        left = [r for r in rows if r["published_at"] is None]
        assert left  # the marks after the cut were lost with it
        assert all(sent.count(event_id) == 1 for event_id in marked)
        assert all(r["next_attempt_at"] > clock() for r in left)  # still leased
        assert relay_once(app, CallablePublisher(publish)) == 0
        clock.advance(minutes=2)  # past the lease
        assert relay_once(app, CallablePublisher(publish)) == len(left)
        assert all(r["published_at"] is not None for r in stored(pg_url))
        assert sorted(set(sent)) == ["e0", "e1", "e2"]
        assert all(sent.count(event_id) == 1 for event_id in marked)
    finally:
        proxy.close()
        dispose(app)


# -- item 6: only real failures count toward parking --------------------------


def test_an_outage_does_not_count_toward_parking(
    database_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Fifty runs against an unreachable broker (past MAX_ATTEMPTS=3 many times):
    the event keeps 0 attempts, stays due and first in line (one try per run).
    Then one ordinary error is one failure: backed off 1 s, not parked, and
    published after it. Parking still comes at the third real failure, outages
    between them or not. (One error after an outage used to park it.)"""
    app = outbox_app.create_app(database_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3)
    reset(database_url)
    add_events(app, "e1", "e2")
    tried: list[str] = []
    script: collections.deque[str] = collections.deque(["down"] * 50 + ["error"])

    def publish(event: OutboxEvent) -> None:
        tried.append(text(event.event_id))
        step = script.popleft() if script else "up"
        if step == "down":
            raise BrokerUnavailable("connection refused")
        if step == "error":
            raise RuntimeError("channel closed once")

    publisher = CallablePublisher(publish)
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")
    for _ in range(50):
        assert relay_once(app, publisher) == 0
        clock.advance(seconds=1)
    assert tried == ["e1"] * 50
    # One WARNING for the outage, not one per run; the other 49 runs at DEBUG.
    unreachable = [r for r in caplog.records if "the broker is unreachable" in r.getMessage()]
    assert [r.levelno for r in unreachable] == [logging.WARNING] + [logging.DEBUG] * 49
    e1 = stored(database_url)[0]
    assert (e1["attempts"], e1["failed_at"], e1["next_attempt_at"]) == (0, None, None)
    assert e1["last_error"] == "BrokerUnavailable: connection refused"
    assert relay_once(app, publisher) == 1  # e1 fails once, e2 passes it
    back = [r for r in caplog.records if "the broker answers again" in r.getMessage()]
    assert [(r.levelno, "50 relay runs" in r.getMessage()) for r in back] == [(logging.INFO, True)]
    e1 = stored(database_url)[0]
    assert (e1["attempts"], e1["failed_at"]) == (1, None)
    assert e1["next_attempt_at"] == clock() + backoff(1)
    clock.advance(seconds=1)
    assert relay_once(app, publisher) == 1
    assert tried[-3:] == ["e1", "e2", "e1"]
    assert all(r["published_at"] is not None for r in stored(database_url))

    parked: list[str] = []

    def on_parked(sender: Flask, event: OutboxEvent, error: str) -> None:
        parked.append(text(event.event_id))

    signals.event_parked.connect(on_parked, app)
    add_events(app, "bad")
    script.extend(["error", "down", "down", "error", "down", "error"])
    for _ in range(6):
        relay_once(app, publisher)
        clock.advance(minutes=1)
    bad = stored(database_url)[-1]
    assert (bad["attempts"], bad["failed_at"] is not None) == (3, True)
    assert parked == ["bad"]
    dispose(app)


def test_a_nacked_message_counts_toward_parking_and_the_batch_goes_on(
    pg_url: str, clock: Clock
) -> None:
    """RabbitMQ refuses a message (a queue full with ``x-overflow:
    reject-publish`` nacks it): a real failure of that event. The events after
    it go out in the same batch, and it is parked after MAX_ATTEMPTS=2. (A nack
    used to be taken for "broker unavailable": never parked, and every batch
    ended at it.)"""
    import kombu

    broker = rabbitmq()
    tag = uuid.uuid4().hex[:10]
    exchange_name, full_name, ok_name = (f"relay-nack-{x}-{tag}" for x in ("ex", "full", "ok"))
    exchange = kombu.Exchange(exchange_name, type="topic", durable=True)
    full = kombu.Queue(
        full_name,
        exchange,
        routing_key="audit.#",
        durable=True,
        queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    ok = kombu.Queue(ok_name, exchange, routing_key="order.#", durable=True)
    app = outbox_app.create_app(pg_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2)
    reset(pg_url)
    add_events(app, "audit-0", topic="audit.x")
    add_events(app, "order-0", "order-1", "order-2", topic="order.created")
    publisher = KombuPublisher(broker.url, exchange=exchange_name, queues=[full, ok], timeout=5)
    try:
        run = relay_batch(app, publisher)
        assert (run.published, run.failed, run.broker_unavailable) == (3, 1, False)
        audit = stored(pg_url)[0]
        assert (audit["attempts"], audit["failed_at"]) == (1, None)
        assert audit["last_error"].startswith("MessageNacked")
        clock.advance(seconds=backoff(1).total_seconds())
        assert relay_batch(app, publisher).failed == 1
        audit = stored(pg_url)[0]
        assert (audit["attempts"], audit["failed_at"] is not None) == (2, True)
        assert waiting(broker, exchange_name, ok_name) == 3
        got = drain(broker, exchange_name, ok_name, 3)
        assert sorted(m["event_id"] for m in got) == ["order-0", "order-1", "order-2"]
        assert [json.loads(r["payload"]) for r in stored(pg_url)[1:]] == [
            {"id": f"order-{i}"} for i in range(3)
        ]
    finally:
        publisher.close()
        with kombu.Connection(broker.url) as conn:
            channel = conn.channel()
            for queue in (full, ok):
                queue(channel).delete()
            exchange(channel).delete()
        dispose(app)


def test_a_message_the_broker_closes_the_connection_over_is_its_own_failure(
    pg_url: str, clock: Clock
) -> None:
    """An event whose headers (200 kB) exceed an AMQP frame: RabbitMQ answers
    its publish by closing the connection (501 FRAME_ERROR). That is the
    event's failure: attempts 1, backed off, parked at MAX_ATTEMPTS=2, and the
    events behind it go out in the same batch. (It used to be taken for
    "broker unavailable": never counted, first in every run, and nothing
    behind it was ever published.)"""
    broker = rabbitmq()
    tag = uuid.uuid4().hex[:10]
    exchange = queue = f"relay-frame-{tag}"
    app = outbox_app.create_app(pg_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2)
    reset(pg_url)
    with app.app_context():
        add_event(
            outbox_app.db.session,
            "t",
            {"id": "big"},
            event_id="big",
            headers={"trace": "x" * 200_000},
        )
        outbox_app.db.session.commit()
    add_events(app, "after-0", "after-1", "after-2")
    publisher = KombuPublisher(broker.url, exchange=exchange, queues=[queue], timeout=5)
    try:
        run = relay_batch(app, publisher)
        assert (run.published, run.failed, run.broker_unavailable) == (3, 1, False)
        big = stored(pg_url)[0]
        assert (big["attempts"], big["failed_at"], big["published_at"]) == (1, None, None)
        assert big["last_error"].startswith("FrameError")
        assert big["next_attempt_at"] == clock() + backoff(1)
        assert all(r["published_at"] is not None for r in stored(pg_url)[1:])
        clock.advance(seconds=backoff(1).total_seconds())
        run = relay_batch(app, publisher)
        assert (run.taken, run.failed, run.broker_unavailable) == (1, 1, False)
        assert stored(pg_url)[0]["failed_at"] is not None  # parked
        got = drain(broker, exchange, queue, 3)
        assert sorted(m["event_id"] for m in got) == ["after-0", "after-1", "after-2"]
    finally:
        publisher.close()
        delete_queue(broker, exchange, queue)
        dispose(app)


class CountingPublisher(KombuPublisher):
    """A :class:`KombuPublisher` that counts the connections it opens."""

    connects = 0

    def _ensure(self) -> t.Any:
        if self._producer is None:
            self.connects += 1
        return super()._ensure()


@pytest.mark.parametrize(
    ("credentials", "vhost"),
    [("guest:wrong-password", ""), ("guest:guest", "no-such-vhost-relay-tests")],
    ids=["wrong-password", "unknown-vhost"],
)
def test_a_refused_login_is_the_broker_being_unavailable(
    pg_url: str, clock: Clock, credentials: str, vhost: str
) -> None:
    """The broker refuses the relay's login (a rotated password: 403
    ACCESS_REFUSED; a vhost that is not there): no event is at fault. Each run
    tries one connection, ends at the first event with its attempts unchanged,
    and none is ever parked, however many runs pass MAX_ATTEMPTS=2. (Every
    event used to count it as its own failure, one connection each, and all
    were parked after two runs.)"""
    rabbitmq()
    app = outbox_app.create_app(pg_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=2)
    reset(pg_url)
    add_events(app, "e0", "e1", "e2")
    publisher = CountingPublisher(
        f"amqp://{credentials}@127.0.0.1:{RABBITMQ[1]}/{vhost}", exchange="relay-login", timeout=5
    )
    try:
        for _ in range(4):
            run = relay_batch(app, publisher)
            assert (run.taken, run.published, run.failed, run.broker_unavailable) == (
                3,
                0,
                0,
                True,
            )
            clock.advance(minutes=1)
        assert publisher.connects == 4  # one per run
        rows = stored(pg_url)
        assert [(r["attempts"], r["failed_at"], r["published_at"]) for r in rows] == [
            (0, None, None)
        ] * 3
        assert rows[0]["last_error"].startswith("BrokerUnavailable: cannot connect to the broker")
        assert all(r["next_attempt_at"] is None for r in rows)  # due at once
    finally:
        publisher.close()
        dispose(app)


class ConfirmOutlastsTimeout(KombuPublisher):
    """A :class:`KombuPublisher` through ``proxy`` whose connection goes quiet
    (a blackhole) right after connecting whenever ``slow`` is the event being
    published: the broker accepts connections and every other event, but this
    one's confirm never comes within the timeout, as with a message too large
    to be confirmed in time."""

    def __init__(self, proxy: TcpProxy, slow: str, **kw: t.Any) -> None:
        super().__init__(f"amqp://guest:guest@127.0.0.1:{proxy.port}//", **kw)
        self.proxy, self.slow, self.current = proxy, slow, ""

    def _ensure(self) -> t.Any:
        producer = super()._ensure()
        if self.current == self.slow:
            self.proxy.blackhole()
        return producer

    def publish(self, event: OutboxEvent) -> None:
        self.current = text(event.event_id)
        try:
            super().publish(event)
        finally:
            self.proxy.heal()


def test_an_event_whose_confirm_always_times_out_stops_heading_every_run(
    pg_url: str, clock: Clock
) -> None:
    """The same event's publish times out run after run while the broker keeps
    accepting connections: the first STALLS=3 count as the broker's (an outage
    looks the same at first), the next is the event's failure
    (``StalledMessage``, attempts 1, backed off), and the events behind it go
    out in that run. (It used to head every run for ever, nothing behind it
    published.)"""
    broker = rabbitmq()
    exchange = queue = f"relay-slow-{uuid.uuid4().hex[:10]}"
    app = outbox_app.create_app(pg_url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=5)
    reset(pg_url)
    add_events(app, "slow", "e1", "e2")
    proxy = TcpProxy(broker.upstream)
    publisher = ConfirmOutlastsTimeout(proxy, "slow", exchange=exchange, queues=[queue], timeout=1)
    try:
        for _ in range(KombuPublisher.STALLS):
            run = relay_batch(app, publisher)
            assert (run.published, run.failed, run.broker_unavailable) == (0, 0, True)
            assert stored(pg_url)[0]["attempts"] == 0
        run = relay_batch(app, publisher)
        assert (run.published, run.failed, run.broker_unavailable) == (2, 1, False)
        slow, *rest = stored(pg_url)
        assert (slow["attempts"], slow["failed_at"], slow["published_at"]) == (1, None, None)
        assert slow["last_error"].startswith("StalledMessage")
        assert slow["next_attempt_at"] == clock() + backoff(1)
        assert all(r["published_at"] is not None for r in rest)
        # The next try after its backoff is a failure at once (no free runs
        # again): the other events confirmed that the broker is up.
        clock.advance(seconds=backoff(1).total_seconds())
        run = relay_batch(app, publisher)
        assert (run.taken, run.failed, run.broker_unavailable) == (1, 1, False)
        assert stored(pg_url)[0]["attempts"] == 2
        # At least once: a timed-out publish may reach the broker late.
        assert collect(broker, exchange, queue, {"e1", "e2"})
    finally:
        proxy.close()
        publisher.close()
        delete_queue(broker, exchange, queue)
        dispose(app)
