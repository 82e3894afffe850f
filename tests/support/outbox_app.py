"""A small app for the outbox tests: one order row per request, events emitted
with it. Also the ``flask --app`` target of the killed-relay test
(``tests.support.outbox_app:from_env``)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
import typing as t

from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency._messaging.outbox import OutboxEvent
from tests.support import pgbouncer

db = SQLAlchemy()
idem = Idempotency()


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "outbox_orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    amount: orm.Mapped[int]


def _order() -> t.Any:
    body = request.get_json()
    order = Order(amount=body["amount"])
    db.session.add(order)
    db.session.flush()
    ids = [idem.emit("order.created", {"order": order.id, "amount": body["amount"]})]
    if body.get("twice"):
        ids.append(idem.emit("order.created", {"order": order.id, "again": True}))
    if body.get("same_twice"):  # the very same event again: a second event
        ids.append(idem.emit("order.created", {"order": order.id, "amount": body["amount"]}))
    if body.get("fail"):
        return jsonify(error="boom", events=ids), 500
    return jsonify(order=order.id, events=ids), 201


def _emit_all(plan: list[dict[str, t.Any]]) -> list[str]:
    return [idem.emit(e["topic"], e["payload"], name=e.get("name")) for e in plan]


def _resumable() -> t.Any:
    """A leased view whose events the body lists, for crash-and-resume tests.

    With ``OUTBOX_CRASH_AFTER_COMMIT`` set (the first attempt, in a process of
    its own) it emits ``body["crashing"]``, commits, and the process kills
    itself (SIGKILL) before answering. Otherwise (the resumed attempt) it emits
    ``body["resumed"]["first"]``, commits, then ``body["resumed"]["then"]``.
    Both attempts send the same body, so the retry resumes the same operation.
    """
    body = request.get_json()
    if os.environ.get("OUTBOX_CRASH_AFTER_COMMIT"):
        _emit_all(body["crashing"])
        db.session.commit()
        os.kill(os.getpid(), signal.SIGKILL)
    ids = _emit_all(body["resumed"].get("first", []))
    db.session.commit()
    ids += _emit_all(body["resumed"].get("then", []))
    return jsonify(events=ids), 201


def create_app(
    database_url: str, *, clock: t.Callable[[], dt.datetime] | None = None, **config: t.Any
) -> Flask:
    app = Flask(__name__)
    pooled = pgbouncer.user_config(database_url)
    if "SQLALCHEMY_ENGINE_OPTIONS" in pooled and "SQLALCHEMY_ENGINE_OPTIONS" in config:
        # A test's pool settings, on top of the pooler's (psycopg 3 prepares nothing).
        config["SQLALCHEMY_ENGINE_OPTIONS"] = {
            **pooled["SQLALCHEMY_ENGINE_OPTIONS"],
            **config["SQLALCHEMY_ENGINE_OPTIONS"],
        }
    app.config.update(SQLALCHEMY_DATABASE_URI=database_url, **{**pooled, **config})
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.add_url_rule("/orders", "orders", idem.idempotent()(_order), methods=["POST"])
    app.add_url_rule(
        "/resumable", "resumable", idem.idempotent(lease=5)(_resumable), methods=["POST"]
    )
    app.add_url_rule(
        "/fast-orders", "fast_orders", idem.idempotent(optimistic=True)(_order), methods=["POST"]
    )
    return app


class FilePublisher:
    """Appends each event id to a file; with OUTBOX_KILL_AFTER_PUBLISH set, the
    process kills itself (SIGKILL) right after the first publish, before the
    relay marks anything."""

    def __init__(self, path: str) -> None:
        self.path = path

    def publish(self, event: OutboxEvent) -> None:
        if os.path.exists(self.path + ".away"):  # the broker is down: count the attempt
            with open(self.path + ".attempts", "a") as f:
                f.write(f"{event.event_id}\n")
            from flask_idempotency.errors import BrokerUnavailable

            raise BrokerUnavailable("connection refused (the test's broker is away)")
        with open(self.path, "a") as f:
            line = {"event_id": event.event_id, "id": event.id, "headers": event.headers}
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if os.environ.get("OUTBOX_KILL_AFTER_PUBLISH"):
            os.kill(os.getpid(), signal.SIGKILL)


def from_env() -> Flask:
    """Extra config (JSON) from ``OUTBOX_TEST_CONFIG``, e.g. ``IDEMPOTENCY_RELAY_EVERY``;
    with ``OUTBOX_TEST_LOGGING`` (a format), the app configures logging itself."""
    if os.environ.get("OUTBOX_TEST_LOGGING"):
        import logging
        import sys

        logging.basicConfig(
            stream=sys.stderr, level=logging.INFO, format=os.environ["OUTBOX_TEST_LOGGING"]
        )
    return create_app(
        os.environ["OUTBOX_TEST_DB"],
        IDEMPOTENCY_PUBLISHER=FilePublisher(os.environ["OUTBOX_TEST_FILE"]),
        **json.loads(os.environ.get("OUTBOX_TEST_CONFIG", "{}")),
    )


class KillingPublisher:
    """Publishes through ``inner``; with OUTBOX_KILL_AFTER_PUBLISH set, the
    process kills itself (SIGKILL) right after the first publish returned (the
    broker has the event), before the relay marks anything."""

    def __init__(self, inner: t.Any) -> None:
        self.inner = inner

    def publish(self, event: OutboxEvent) -> None:
        self.inner.publish(event)
        if os.environ.get("OUTBOX_KILL_AFTER_PUBLISH"):
            os.kill(os.getpid(), signal.SIGKILL)


def broker_from_env() -> Flask:
    """The relay's app publishing to a real broker (kombu): OUTBOX_BROKER_URL,
    OUTBOX_EXCHANGE, and OUTBOX_QUEUE declared and bound on connect; extra
    config (JSON) from ``OUTBOX_TEST_CONFIG``."""
    from flask_idempotency.publishers import KombuPublisher

    publisher = KombuPublisher(
        os.environ["OUTBOX_BROKER_URL"],
        exchange=os.environ["OUTBOX_EXCHANGE"],
        queues=[os.environ["OUTBOX_QUEUE"]],
    )
    return create_app(
        os.environ["OUTBOX_TEST_DB"],
        IDEMPOTENCY_PUBLISHER=KillingPublisher(publisher),
        **json.loads(os.environ.get("OUTBOX_TEST_CONFIG", "{}")),
    )


class IntervalPublisher:
    """A fast "broker" in files of this process's own, under ``directory``:
    each publish appends the message (event id, payload) to ``relay-<pid>.jsonl``
    (the queue a consumer reads), then the publish's start and end on the
    machine's monotonic clock (comparable across processes) to
    ``intervals-<pid>.jsonl``."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: t.Any = None

    def publish(self, event: OutboxEvent) -> None:
        start = time.monotonic_ns()
        if self._files is None:
            pid = os.getpid()
            self._files = tuple(
                open(os.path.join(self.directory, f"{name}-{pid}.jsonl"), "a")  # noqa: SIM115
                for name in ("relay", "intervals")
            )
        queue, intervals = self._files
        queue.write(json.dumps({"event_id": event.event_id, "payload": event.payload}) + "\n")
        queue.flush()
        end = time.monotonic_ns()
        intervals.write(json.dumps([event.event_id, start, end, os.getpid()]) + "\n")
        intervals.flush()


def intervals_from_env() -> Flask:
    """The relay's app publishing through :class:`IntervalPublisher`. It starts
    when the test says so (the file ``go``), after saying it is ready, so that
    relays started as several processes really run at once."""
    directory = os.environ["OUTBOX_TEST_DIR"]
    app = create_app(
        os.environ["OUTBOX_TEST_DB"],
        IDEMPOTENCY_PUBLISHER=IntervalPublisher(directory),
        SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 2},
    )
    with open(os.path.join(directory, f"ready-{os.getpid()}"), "w"):
        pass
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(directory, "go")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return app
