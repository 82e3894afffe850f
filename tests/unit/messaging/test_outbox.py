"""The transactional outbox and its relay, on real databases."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy import orm

from flask_idempotency import EventIdConflictError, signals
from flask_idempotency._messaging.admin import retry_parked
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import backoff, relay_once
from flask_idempotency._storage.schema import (
    as_utc,
    outbox_table,
    record_table,
)
from flask_idempotency.keys import derive_scoped_key
from flask_idempotency.publishers import KombuPublisher, ListPublisher
from tests.conftest import Clock, run_sql
from tests.support import outbox_app, pgbouncer
from tests.support.outbox import fresh_app, post, relay_command, reset, rows

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3) as app:
        yield app


def orders(app: Flask) -> int:
    with app.app_context():
        return int(outbox_app.db.session.query(outbox_app.Order).count())


class FlakyPublisher:
    """Fails the first ``failures`` publishes of each event id listed in ``flaky``."""

    def __init__(self, failures: int = 0, flaky: t.Collection[str] = ()) -> None:
        self.failures, self.flaky = failures, set(flaky)
        self.tries: dict[str, int] = {}
        self.published: list[OutboxEvent] = []

    def publish(self, event: OutboxEvent) -> None:
        n = self.tries[event.event_id] = self.tries.get(event.event_id, 0) + 1
        if event.event_id in self.flaky and n <= self.failures:
            raise ConnectionError(f"broker down ({n})")
        self.published.append(event)


def test_emit_commits_with_the_business_rows(app: Flask) -> None:
    response = post(app, key="k1", twice=True)
    assert response.status_code == 201
    events = response.get_json()["events"]
    assert orders(app) == 1
    stored = rows(app)
    assert [r["topic"] for r in stored] == ["order.created", "order.created"]
    assert [
        r["event_id"] if isinstance(r["event_id"], str) else r["event_id"].decode() for r in stored
    ] == events
    assert json.loads(stored[0]["payload"]) == {"amount": 5, "order": 1}
    assert all(r["published_at"] is None and r["attempts"] == 0 for r in stored)
    assert len(set(events)) == 2
    assert all(len(e) == 64 for e in events)


def test_emit_rolls_back_with_the_business_rows(app: Flask) -> None:
    assert post(app, key="k1", fail=True).status_code == 500
    assert orders(app) == 0
    assert rows(app) == []
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 0
    assert publisher.events == []


def test_a_replayed_request_does_not_emit_again(app: Flask) -> None:
    first = post(app, key="k1")
    again = post(app, key="k1")
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_json() == first.get_json()
    assert len(rows(app)) == 1
    assert orders(app) == 1


def test_an_event_id_conflict_names_sizes_not_payloads(app: Flask) -> None:
    """The conflict's message reaches logs: it names the id and topics, never
    either payload's text (issue 27's review)."""
    with app.app_context():
        session = outbox_app.db.session
        add_event(session, "t", {"card": "SECRET-ONE"}, event_id="e1")
        session.commit()
        with pytest.raises(EventIdConflictError) as conflict:
            add_event(session, "t", {"card": "SECRET-TWO"}, event_id="e1")
    message = str(conflict.value)
    assert "SECRET" not in message
    assert "'e1' already names another event" in message
    assert "topic 't'" in message


def test_an_event_id_names_one_event(app: Flask) -> None:
    """``add_event`` with an id that exists: the same topic and payload (however
    its keys were ordered, whatever its headers) adds nothing and returns the
    id; another topic or payload raises EventIdConflictError, adds nothing, and
    leaves the transaction usable. It used to skip the second event silently."""
    with app.app_context():
        session = outbox_app.db.session
        assert add_event(session, "t", {"a": 1, "b": 2}, event_id="e1") == "e1"
        session.commit()
        again = add_event(session, "t", {"b": 2, "a": 1}, event_id="e1", headers={"x": "y"})
        assert again == "e1"
        with pytest.raises(EventIdConflictError, match="'e1' already names another event"):
            add_event(session, "t", {"a": 2, "b": 2}, event_id="e1")
        with pytest.raises(EventIdConflictError, match="topic 't'"):
            add_event(session, "other", {"a": 1, "b": 2}, event_id="e1")
        add_event(session, "t", {"n": 2}, event_id="e2")  # the transaction goes on
        session.commit()
        # Within one transaction too, before anything committed.
        add_event(session, "t", {"n": 3}, event_id="e3")
        with pytest.raises(EventIdConflictError):
            add_event(session, "t", {"n": 4}, event_id="e3")
        session.commit()
    stored = rows(app)
    assert [(text(r["event_id"]), r["topic"], json.loads(r["payload"])) for r in stored] == [
        ("e1", "t", {"a": 1, "b": 2}),
        ("e2", "t", {"n": 2}),
        ("e3", "t", {"n": 3}),
    ]


def test_an_event_id_added_by_two_transactions_at_once_is_one_event_or_an_error(
    app: Flask,
) -> None:
    """Two transactions add one id with different payloads: the second waits on
    the first's row (its unique index entry, or SQLite's write lock), then
    raises: it never returns the id as if its own event had been written."""
    with app.app_context():
        engine = outbox_app.db.engine
    outcome: list[BaseException | str] = []

    def second() -> None:
        with app.app_context(), orm.Session(engine) as b:
            try:
                outcome.append(add_event(b, "t", {"txn": "B"}, event_id="shared"))
                b.commit()
            except BaseException as exc:
                outcome.append(exc)

    with app.app_context(), orm.Session(engine) as a:
        add_event(a, "t", {"txn": "A"}, event_id="shared")
        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.3)  # let B meet A's uncommitted row (not an assertion)
        a.commit()
    thread.join(30)
    [second_outcome] = outcome
    assert isinstance(second_outcome, EventIdConflictError), second_outcome
    [stored] = rows(app)
    assert json.loads(stored["payload"]) == {"txn": "A"}


def crash_then_resume(app: Flask, url: str, clock: Clock, body: dict[str, t.Any]) -> t.Any:
    """POST ``body`` to the leased ``/resumable`` route in a process that commits
    its first events and is SIGKILLed, then again here once its lease has run
    out (the test's clock moves past it): the resumed attempt's response."""
    child = (
        "import json, sys; from tests.support import outbox_app; "
        "outbox_app.create_app(sys.argv[1]).test_client().post("
        "'/resumable', json=json.loads(sys.argv[2]), headers={'Idempotency-Key': 'resume-1'})"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_CRASH_AFTER_COMMIT": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", child, url, json.dumps(body)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -9, killed.stderr
    clock.advance(seconds=60)  # past the route's 5 s lease
    return app.test_client().post("/resumable", json=body, headers={"Idempotency-Key": "resume-1"})


def ev(topic: str, what: str, name: str | None = None) -> dict[str, t.Any]:
    return {"topic": topic, "payload": {"order": 1, "what": what}, "name": name}


def events(app: Flask) -> list[tuple[str, str, str]]:
    """(event id, topic, what) of every outbox row, in write order."""
    return [(text(r["event_id"]), r["topic"], json.loads(r["payload"])["what"]) for r in rows(app)]


def test_a_resumed_view_that_emits_another_event_first_writes_it(
    app: Flask, database_url: str, clock: Clock
) -> None:
    """The first attempt commits "created" and dies; the resumed one skips that
    phase and emits "confirmed" on the same topic. Ids were positions: it got
    "created"'s id back and "confirmed" was never written."""
    body = {
        "crashing": [ev("orders", "created")],
        "resumed": {"then": [ev("orders", "confirmed")]},
    }
    response = crash_then_resume(app, database_url, clock, body)
    assert response.status_code == 201, response.get_data(as_text=True)
    stored = events(app)
    assert [(topic, what) for _, topic, what in stored] == [
        ("orders", "created"),
        ("orders", "confirmed"),
    ]
    assert response.get_json()["events"] == [stored[1][0]]
    assert stored[0][0] != stored[1][0]


def test_a_resumed_view_that_emits_its_events_in_another_order_writes_each_once(
    app: Flask, database_url: str, clock: Clock
) -> None:
    """The same two events in the other order (iterating a set: the hash seed
    differs per process) keep their ids: two rows, not four."""
    first, second = ev("order.created", "o"), ev("invoice.created", "i")
    body = {"crashing": [first, second], "resumed": {"first": [second, first]}}
    response = crash_then_resume(app, database_url, clock, body)
    assert response.status_code == 201, response.get_data(as_text=True)
    stored = events(app)
    assert [(topic, what) for _, topic, what in stored] == [
        ("order.created", "o"),
        ("invoice.created", "i"),
    ]
    assert response.get_json()["events"] == [stored[1][0], stored[0][0]]


def test_a_resumed_view_re_emits_a_committed_event_once_and_goes_on(
    app: Flask, database_url: str, clock: Clock
) -> None:
    """The resumed attempt emits the committed events again (one named, one
    not), then a new one: no failure, no second row, the same ids."""
    a, b = ev("orders", "created", name="created"), ev("orders", "paid")
    body = {"crashing": [a, b], "resumed": {"first": [a, b], "then": [ev("orders", "shipped")]}}
    response = crash_then_resume(app, database_url, clock, body)
    assert response.status_code == 201, response.get_data(as_text=True)
    stored = events(app)
    assert [what for _, _, what in stored] == ["created", "paid", "shipped"]
    assert response.get_json()["events"] == [e[0] for e in stored]


def test_a_name_reused_for_another_payload_on_resume_raises_and_writes_nothing(
    app: Flask, database_url: str, clock: Clock
) -> None:
    """A named event whose payload changed between attempts is not silently
    taken for the committed one: the resumed attempt fails and adds nothing."""
    body = {
        "crashing": [ev("orders", "created", name="created")],
        "resumed": {"first": [ev("orders", "created-v2", name="created")]},
    }
    app.testing = True  # the view's error reaches the test
    with pytest.raises(EventIdConflictError, match="already names another event"):
        crash_then_resume(app, database_url, clock, body)
    assert [what for _, _, what in events(app)] == ["created"]


def test_event_names_are_checked(app: Flask) -> None:
    with app.test_request_context("/"), pytest.raises(ValueError, match="event name"):
        outbox_app.idem.emit("t", {}, name="")


def test_requests_sharing_an_app_context_each_count_their_emits_from_zero(
    app: Flask, clock: Clock
) -> None:
    """An event without a name is named by its topic, its payload and how many
    identical events the attempt emitted before it, counted within the request,
    also when a test or a script sends several requests in one app context
    (they share ``g``)."""
    with app.app_context():
        ids = {key: post(app, key=key, same_twice=True).get_json()["events"] for key in "ab"}
    with app.app_context(), outbox_app.db.engine.connect() as conn:
        records = record_table(outbox_app.db.metadata)
        scopes = {
            text(k): text(s) for k, s in conn.execute(sa.select(records.c.key, records.c.scope))
        }
    for order, key in enumerate("ab", start=1):
        content = json.dumps({"amount": 5, "order": order}, separators=(",", ":"))
        steps = [
            "event#"
            + hashlib.sha256(json.dumps(["order.created", content, n]).encode()).hexdigest()
            for n in (0, 1)
        ]
        operation = clock().isoformat()
        assert ids[key] == [
            derive_scoped_key(scopes[key], key, step, operation=operation) for step in steps
        ]
    assert len(rows(app)) == 4


def test_with_a_fingerprint_key_an_unnamed_events_id_is_keyed(
    database_url: str, clock: Clock
) -> None:
    """With ``IDEMPOTENCY_FINGERPRINT_KEY`` the content digest in an unnamed
    event's id is an HMAC under it: a reader of the table (scope, key and
    event id in clear) cannot confirm a guess of a payload by recomputing it."""
    secret = "outbox-fingerprint-key-0123456789abcdef"
    app = outbox_app.create_app(database_url, clock=clock, IDEMPOTENCY_FINGERPRINT_KEY=secret)
    reset(database_url)
    try:
        with app.app_context():
            [event_id] = post(app, key="a").get_json()["events"]
            [scope] = [text(s) for s in rows_of(record_table(outbox_app.db.metadata), "scope")]
    finally:
        with app.app_context():
            outbox_app.db.engine.dispose()
    content = json.dumps({"amount": 5, "order": 1}, separators=(",", ":"))
    message = json.dumps(["order.created", content, 0]).encode()
    operation = clock().isoformat()

    def event_id_of(digest: str) -> str:
        return derive_scoped_key(scope, "a", "event#" + digest, operation=operation)

    keyed = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    assert event_id == event_id_of(keyed)
    assert event_id != event_id_of(hashlib.sha256(message).hexdigest())


def rows_of(table: sa.Table, column: str) -> list[t.Any]:
    with outbox_app.db.engine.connect() as conn:
        return list(conn.execute(sa.select(table.c[column])).scalars())


def text(value: str | bytes) -> str:
    """A text column's value: MySQL/MariaDB keep keys and scopes as bytes."""
    return value.decode() if isinstance(value, bytes) else value


def test_a_request_without_a_key_emits_with_a_random_id(app: Flask) -> None:
    first = post(app).get_json()["events"][0]
    second = post(app).get_json()["events"][0]
    assert first != second
    assert len(rows(app)) == 2


def test_optimistic_routes_emit_too(app: Flask) -> None:
    response = post(app, "/fast-orders", key="k1")
    assert response.status_code == 201
    assert post(app, "/fast-orders", key="k1").headers.get("Idempotent-Replayed") == "true"
    assert len(rows(app)) == 1
    assert orders(app) == 1


def test_relay_publishes_in_id_order_and_marks_published(app: Flask) -> None:
    for i in range(5):
        post(app, key=f"k{i}", amount=i)
    sent: list[t.Any] = []

    def on_published(sender: Flask, event: OutboxEvent) -> None:
        sent.append(event.id)

    signals.event_published.connect(on_published, app)
    publisher = ListPublisher()
    assert relay_once(app, publisher, batch=3) == 3
    assert relay_once(app, publisher, batch=3) == 2
    assert relay_once(app, publisher, batch=3) == 0
    assert [e.payload["amount"] for e in publisher.events] == [0, 1, 2, 3, 4]
    assert [e.id for e in publisher.events] == sorted(e.id for e in publisher.events) == sent
    assert all(r["published_at"] is not None for r in rows(app))


def test_failures_back_off_then_park_then_retry(app: Flask, clock: Clock) -> None:
    with app.app_context():
        add_event(outbox_app.db.session, "t", {"n": 1}, event_id="bad")
        add_event(outbox_app.db.session, "t", {"n": 2}, event_id="good")
        outbox_app.db.session.commit()
    parked: list[str] = []

    def on_parked(sender: Flask, event: OutboxEvent, error: str) -> None:
        parked.append(event.event_id)

    signals.event_parked.connect(on_parked, app)
    publisher = FlakyPublisher(failures=10, flaky={"bad"})
    assert relay_once(app, publisher) == 1  # "good" passes the failing one
    bad = rows(app)[0]
    assert bad["attempts"] == 1
    assert "broker down (1)" in bad["last_error"]
    assert bad["failed_at"] is None
    # Not due until its backoff has passed.
    assert relay_once(app, publisher) == 0
    assert publisher.tries["bad"] == 1
    clock.advance(seconds=backoff(1).total_seconds() + 0.01)
    assert relay_once(app, publisher) == 0
    assert publisher.tries["bad"] == 2
    assert rows(app)[0]["attempts"] == 2
    clock.advance(seconds=backoff(1).total_seconds())  # 1 s: backoff(2) is 2 s
    assert relay_once(app, publisher) == 0
    assert publisher.tries["bad"] == 2
    clock.advance(seconds=backoff(2).total_seconds())
    assert relay_once(app, publisher) == 0
    assert publisher.tries["bad"] == 3
    assert rows(app)[0]["failed_at"] is not None  # parked after 3 attempts
    assert parked == ["bad"]
    clock.advance(hours=1)
    assert relay_once(app, publisher) == 0
    assert publisher.tries["bad"] == 3
    publisher.failures = 0
    assert retry_parked(app) == 1
    assert relay_once(app, publisher) == 1
    assert [e.event_id for e in publisher.published] == ["good", "bad"]
    assert backoff(1) == dt.timedelta(seconds=1)
    assert backoff(50) == dt.timedelta(minutes=10)


def test_cli_create_tables_creates_the_outbox(app: Flask, database_url: str) -> None:
    engine = sa.create_engine(database_url)
    outbox_app.db.metadata.drop_all(engine)
    result = app.test_cli_runner().invoke(args=["idempotency", "create-tables"])
    assert "idempotency_outbox: present" in result.output
    assert "idempotency_outbox" in sa.inspect(engine).get_table_names()
    engine.dispose()


def test_cli_stats_and_outbox_retry(app: Flask, clock: Clock) -> None:
    with app.app_context():
        add_event(outbox_app.db.session, "t", {}, event_id="a")
        add_event(outbox_app.db.session, "t", {}, event_id="b")
        outbox_app.db.session.commit()
    publisher = FlakyPublisher(failures=99, flaky={"a"})  # parked after 3 (the app's setting)
    for _ in range(3):
        relay_once(app, publisher)
        clock.advance(minutes=1)
    runner = app.test_cli_runner()
    result = runner.invoke(args=["idempotency", "stats"])
    numbers = json.loads(result.output)
    assert numbers["outbox_pending"] == 0
    assert numbers["outbox_parked"] == 1
    assert numbers["outbox_oldest_age_s"] is None
    result = runner.invoke(args=["idempotency", "outbox-retry"])
    assert "un-parked 1 event(s)" in result.output
    numbers = json.loads(runner.invoke(args=["idempotency", "stats"]).output)
    assert numbers["outbox_pending"] == 1
    assert numbers["outbox_oldest_age_s"] >= 180


def test_an_event_committed_late_with_a_lower_id_is_still_published(
    app: Flask, database_url: str
) -> None:
    """No high-water mark: txn A takes id 1 and commits after id 2 is published."""
    if database_url.startswith("sqlite"):
        pytest.skip("SQLite has one writer: transactions commit in the order of their ids")
    with app.app_context():
        engine = outbox_app.db.engine
    with app.app_context(), orm.Session(engine) as a, orm.Session(engine) as b:
        add_event(a, "t", {"txn": "A"}, event_id="A")
        add_event(b, "t", {"txn": "B"}, event_id="B")
        b.commit()
        publisher = ListPublisher()
        assert relay_once(app, publisher) == 1
        a.commit()
        assert relay_once(app, publisher) == 1
    assert [e.event_id for e in publisher.events] == ["B", "A"]
    assert publisher.events[1].id < publisher.events[0].id


class RecordingPublisher:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.published: list[tuple[str, float, str]] = []

    def publish(self, event: OutboxEvent) -> None:
        with self.lock:
            self.published.append(
                (event.event_id, time.monotonic(), threading.current_thread().name)
            )


def test_concurrent_relays_publish_every_event_exactly_once(database_url: str) -> None:
    """Four relay threads over 2,000 events: SKIP LOCKED (SQLite: its write lock)
    and one commit per batch, so no event is published twice at all."""
    pg_url = database_url
    options = {} if pg_url.startswith("sqlite") else {"pool_size": 10}
    app = outbox_app.create_app(pg_url, SQLALCHEMY_ENGINE_OPTIONS=options)
    reset(pg_url)
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
        with outbox_app.db.engine.begin() as conn:
            now = dt.datetime.now(dt.timezone.utc)
            conn.execute(
                # event_id bound as a string (a VARBINARY column on MySQL)
                sa.insert(table).values(event_id=sa.bindparam("eid", type_=sa.String())),
                [
                    {
                        "eid": f"e{i:05d}",
                        "topic": "t",
                        "payload": "{}",
                        "created_at": now,
                        "attempts": 0,
                    }
                    for i in range(2000)
                ],
            )
    publisher = RecordingPublisher()
    errors: list[BaseException] = []

    def relay() -> None:
        try:
            idle = 0
            while idle < 3:
                idle = idle + 1 if relay_once(app, publisher, batch=50) == 0 else 0
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=relay, name=f"relay-{i}") for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors
    ids = [p[0] for p in publisher.published]
    assert len(ids) == 2000
    assert len(set(ids)) == 2000
    if not database_url.startswith("sqlite"):  # SQLite: whoever gets the write lock drains
        assert len({p[2] for p in publisher.published}) > 1  # the relays shared the work
    with app.app_context():
        with outbox_app.db.engine.connect() as conn:
            pending = conn.execute(
                sa.select(sa.func.count()).where(table.c.published_at.is_(None))
            ).scalar_one()
        outbox_app.db.engine.dispose()
    assert pending == 0


def test_a_relay_killed_after_publishing_publishes_again(
    database_url: str, tmp_path: Path, clock: Clock
) -> None:
    """At least once: SIGKILL between the publish and the commit that marks it.
    The dead relay's rows stay leased (no other relay takes them, though no
    transaction or lock of the dead one is left); once the lease has run out
    the next relay publishes them again."""
    pg_url = database_url
    app = outbox_app.create_app(pg_url, clock=clock)
    reset(pg_url)
    with app.app_context():
        add_event(outbox_app.db.session, "t", {"n": 1}, event_id="only")
        outbox_app.db.session.commit()
        outbox_app.db.engine.dispose()
    out = tmp_path / "published.jsonl"
    env, cmd = relay_command(pg_url, out, "--once")
    killed = subprocess.run(
        cmd,
        env={**env, "OUTBOX_KILL_AFTER_PUBLISH": "1"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -9, killed.stderr
    assert [json.loads(line)["event_id"] for line in out.read_text().splitlines()] == ["only"]
    [row] = rows(app)
    assert row["published_at"] is None
    assert row["attempts"] == 0
    leased_until = as_utc(row["next_attempt_at"])
    assert leased_until is not None
    assert (
        dt.timedelta(0) < leased_until - dt.datetime.now(dt.timezone.utc) <= dt.timedelta(minutes=1)
    )  # IDEMPOTENCY_OUTBOX_LEASE's default
    publisher = outbox_app.FilePublisher(str(out))
    assert relay_once(app, publisher) == 0  # still the dead relay's
    clock.advance(minutes=2)  # its lease runs out
    assert relay_once(app, publisher) == 1
    assert [json.loads(line)["event_id"] for line in out.read_text().splitlines()] == [
        "only",
        "only",
    ]
    assert rows(app)[0]["published_at"] is not None
    with app.app_context():
        outbox_app.db.engine.dispose()


def _consume(url: str, exchange: str, publish: t.Callable[[], None]) -> list[t.Any]:
    import kombu

    with kombu.Connection(url) as conn:
        queue = kombu.Queue(
            f"q-{uuid.uuid4().hex[:8]}",
            kombu.Exchange(exchange, type="topic", durable=True),
            routing_key="order.#",
            auto_delete=True,
        )
        queue(conn.channel()).declare()
        publish()
        simple = conn.SimpleQueue(queue)
        got = []
        for _ in range(2):
            message = simple.get(timeout=5)
            got.append((message.payload, message.properties.get("message_id"), message.headers))
            message.ack()
        simple.close()
        return got


@pytest.mark.parametrize("url", ["memory://", "rabbitmq"])
def test_kombu_publisher_through_the_relay(sqlite_app: Flask, url: str) -> None:
    if url == "rabbitmq":
        url = "amqp://guest:guest@127.0.0.1:5672//"
        try:
            socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
        except OSError as exc:
            pytest.skip(f"no RabbitMQ at 127.0.0.1:5672: {exc}")
    exchange = f"idem-test-{uuid.uuid4().hex[:8]}"
    publisher = KombuPublisher(url, exchange=exchange)
    if url.startswith("amqp"):
        assert publisher.transport_options["confirm_publish"] is True
    post(sqlite_app, key="k1", twice=True)
    try:
        got = _consume(url, exchange, lambda: relay_once(sqlite_app, publisher))
    finally:
        publisher.close()
    ids = [r["event_id"] for r in rows(sqlite_app)]
    assert [g[1] for g in got] == ids
    assert got[0][0] == {"amount": 5, "order": 1}


@pytest.fixture
def sqlite_app(tmp_path: Path) -> Flask:
    url = f"sqlite:///{tmp_path / 'outbox.sqlite3'}"
    app = outbox_app.create_app(url)
    reset(url)
    return app


@pytest.mark.parametrize("engine", ["postgresql", "sqlite"])
def test_the_foreground_relay_wakes_on_notify_and_stops_on_sigterm(
    engine: str, pg_url: str, tmp_path: Path
) -> None:
    """PostgreSQL: LISTEN/NOTIFY wakes the relay long before its 30 s poll. SQLite:
    it polls (short poll here). Both stop at once on SIGTERM."""
    url = pg_url if engine == "postgresql" else f"sqlite:///{tmp_path / 'relay.sqlite3'}"
    poll = "30" if engine == "postgresql" else "0.2"
    app = outbox_app.create_app(url)
    reset(url)
    out = tmp_path / "published.jsonl"
    env, cmd = relay_command(url, out, "--poll", poll)
    relay = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert relay.stdout is not None
        banner = relay.stdout.readline()
        assert ("LISTEN" in banner) == (engine == "postgresql"), banner
        time.sleep(0.3)  # past its first (empty) run, into the wait
        started = time.monotonic()
        with app.app_context():
            add_event(outbox_app.db.session, "t", {}, event_id="woken")
            outbox_app.db.session.commit()
            outbox_app.db.engine.dispose()
        while not (out.exists() and out.read_text()) and time.monotonic() - started < 10:
            time.sleep(0.05)
        assert time.monotonic() - started < 5
        assert json.loads(out.read_text())["event_id"] == "woken"
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(10) == 0
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
        if relay.stdout is not None:
            relay.stdout.close()


def test_the_foreground_relay_survives_losing_its_listen_connection(
    pg_url: str, tmp_path: Path
) -> None:
    """A restart, a failover or an idle-connection killer ends the LISTEN
    connection: the relay keeps running, listens again on a new one, and
    publishes what is committed afterwards (it used to exit with the error)."""
    name = f"relay-{uuid.uuid4().hex[:10]}"
    url = pgbouncer.named(pg_url, name)  # behind the pooler: its LISTEN connection's name
    app = outbox_app.create_app(pg_url)
    reset(pg_url)
    out = tmp_path / "published.jsonl"
    env, cmd = relay_command(url, out, "--poll", "1")
    relay = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    listening = (
        "SELECT pid FROM pg_stat_activity WHERE application_name = :name AND query LIKE 'LISTEN%'"
    )
    try:
        assert relay.stdout is not None
        assert "LISTEN" in relay.stdout.readline()
        [old] = wait_for_rows(pg_url, listening, name=name)
        run_sql(pg_url, "SELECT pg_terminate_backend(:pid)", pid=old[0])
        [_listening_again] = wait_for_rows(
            pg_url, listening + " AND pid <> :old", name=name, old=old[0]
        )
        assert relay.poll() is None
        with app.app_context():
            add_event(outbox_app.db.session, "t", {}, event_id="after-the-blip")
            outbox_app.db.session.commit()
            outbox_app.db.engine.dispose()
        started = time.monotonic()
        while not (out.exists() and out.read_text()) and time.monotonic() - started < 15:
            time.sleep(0.05)
        assert json.loads(out.read_text())["event_id"] == "after-the-blip"
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(10) == 0
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
        if relay.stdout is not None:
            relay.stdout.close()


def wait_for_rows(url: str, sql: str, **params: t.Any) -> list[t.Any]:
    """The rows of ``sql`` once there are any (within 15 s)."""
    deadline = time.monotonic() + 15
    while not (found := run_sql(url, sql, **params)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_the_scheduler_runs_the_relay_job_with_the_configured_publisher(tmp_path: Path) -> None:
    from flask_idempotency._maintenance.scheduler import JobScheduler

    url = f"sqlite:///{tmp_path / 'jobs.sqlite3'}"
    publisher = ListPublisher()
    app = outbox_app.create_app(url, IDEMPOTENCY_PUBLISHER=publisher)
    reset(url)
    post(app, key="k1")
    jobs = JobScheduler(app)
    job = jobs._scheduler.get_job("relay")
    assert job is not None
    assert jobs.run_job("relay", job.args[1])
    assert [e.topic for e in publisher.events] == ["order.created"]
    assert "relay" not in {
        j.id for j in JobScheduler(outbox_app.create_app(url))._scheduler.get_jobs()
    }


def test_the_publisher_setting_takes_an_import_string(tmp_path: Path) -> None:
    from flask_idempotency._messaging.relay import app_publisher

    url = f"sqlite:///{tmp_path / 'p.sqlite3'}"
    app = outbox_app.create_app(
        url, IDEMPOTENCY_PUBLISHER="flask_idempotency.publishers:ListPublisher"
    )
    assert isinstance(app_publisher(app), ListPublisher)
    assert app_publisher(app) is app_publisher(app)  # resolved once
    with pytest.raises(ValueError, match="module:attribute"):
        app_publisher(outbox_app.create_app(url, IDEMPOTENCY_PUBLISHER="nocolon"))


def test_a_relay_publishing_does_not_block_emits(app: Flask, database_url: str) -> None:
    """The relay holds its rows' locks while it publishes; a request emitting
    meanwhile must not wait for it (MySQL: no gap locks, READ COMMITTED; SQLite:
    the relay publishes outside a transaction, since its one lock would stop
    every writer)."""
    with app.app_context():
        add_event(outbox_app.db.session, "t", {}, event_id="first")
        outbox_app.db.session.commit()
        engine = outbox_app.db.engine
    waited: list[float] = []

    def emit_meanwhile(event: OutboxEvent) -> None:
        started = time.monotonic()
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(sa.text("SET lock_timeout = '2s'"))
            elif engine.dialect.name == "sqlite":
                conn.execute(sa.text("PRAGMA busy_timeout = 2000"))
            else:
                conn.execute(sa.text("SET SESSION innodb_lock_wait_timeout = 2"))
            with orm.Session(bind=conn) as session, app.app_context():
                add_event(session, "t", {}, event_id=f"during-{event.event_id}")
                session.commit()
            conn.commit()
        waited.append(time.monotonic() - started)

    from flask_idempotency.publishers import CallablePublisher

    assert relay_once(app, CallablePublisher(emit_meanwhile)) == 1
    assert waited
    assert waited[0] < 1.5
    assert [r["published_at"] is None for r in rows(app)] == [False, True]


def test_outbox_purge_deletes_only_old_published_events(app: Flask, clock: Clock) -> None:
    with app.app_context():
        for name in ("old", "parked"):
            add_event(outbox_app.db.session, "t", {}, event_id=name)
        outbox_app.db.session.commit()
    publisher = FlakyPublisher(failures=99, flaky={"parked"})
    for _ in range(3):  # IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3 in this app
        relay_once(app, publisher)
        clock.advance(minutes=1)
    clock.advance(hours=200)
    with app.app_context():
        add_event(outbox_app.db.session, "t", {}, event_id="pending")
        outbox_app.db.session.commit()
    result = app.test_cli_runner().invoke(args=["idempotency", "outbox-purge"])
    assert "deleted 1 published event(s)" in result.output
    stored = rows(app)
    left = [
        r["event_id"] if isinstance(r["event_id"], str) else r["event_id"].decode() for r in stored
    ]
    assert left == ["parked", "pending"]
    assert stored[0]["failed_at"] is not None


def test_event_ids_hold_64_characters_of_any_script(app: Flask) -> None:
    """The limit is 64 characters on every engine (MySQL/MariaDB store bytes: 4 per
    character fit); a longer id is a ``ValueError`` and nothing is added."""
    longest = "𝄞€" * 32
    with app.app_context():
        add_event(outbox_app.db.session, "t", {"a": 1}, event_id=longest)
        outbox_app.db.session.commit()
        with pytest.raises(ValueError, match="1 to 64"):
            add_event(outbox_app.db.session, "t", {"a": 2}, event_id=longest + "x")
        outbox_app.db.session.rollback()
    [stored] = rows(app)
    event_id = stored["event_id"]
    assert (event_id.decode() if isinstance(event_id, bytes) else event_id) == longest


def test_a_topic_or_id_no_broker_could_take_is_refused_at_emit(app: Flask) -> None:
    """A topic of 100 three-byte characters fits the 255-character column but
    not AMQP's 255-byte routing key; an id of 64 four-byte characters is 256
    bytes of message id. Both are a ``ValueError`` at the emit, in a request
    and in ``add_event``, and nothing is added. (They used to be added and
    then parked with "ubyte format requires 0 <= number <= 255".) 255 bytes
    are fine (85 characters of topic, 63 four-byte characters and one more of id)."""
    with app.test_request_context("/"):
        with pytest.raises(ValueError, match=r"at most 255 bytes in UTF-8.*got 300"):
            outbox_app.idem.emit("注文" * 50, {"a": 1})
        with pytest.raises(ValueError, match="topic must be valid Unicode"):
            outbox_app.idem.emit("t\ud800", {"a": 1})
    with app.app_context():
        session = outbox_app.db.session
        with pytest.raises(ValueError, match="event_id must be at most 255 bytes"):
            add_event(session, "t", {"a": 1}, event_id="𝄞" * 64)
        with pytest.raises(ValueError, match="non-empty string"):
            add_event(session, "", {"a": 1}, event_id="e")
        session.rollback()
        add_event(session, "注" * 85, {"a": 1}, event_id="𝄞" * 63 + "a")
        session.commit()
    [stored] = rows(app)
    assert stored["topic"] == "注" * 85
