"""The chain of README "Keys across services", with its services as live processes.

    client retry (key K)
      order svc .... dedupes on (tenant, K), returns the stored response
        payment .... dedupes on idem.derived_key("charge")
        outbox ..... event id derived from K, relayed to the broker
          shipping . dedupes on the event id (inbox)

The order and payments services (example_app) run as processes of their own on
a real PostgreSQL, each in a schema of its own as if in its own database; the
order service is killed with SIGKILL at the point a test names and started
again on the same port, as a supervisor would, while the client
(``IdempotentSession``) retries with its one key. Every test counts rows in
each service's tables. The broker is kombu's filesystem transport, and
RabbitMQ too when one answers (``IDEMPOTENCY_TEST_AMQP_URL``, default
guest@127.0.0.1:5672; the test id says which, and it is skipped, saying why,
when none answers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import subprocess
import threading
import typing as t
import uuid
from pathlib import Path

import pytest
import requests
import sqlalchemy as sa
from flask import Flask

from example_app import broker as example_broker
from example_app import orders, shipping
from flask_idempotency._messaging.relay import relay_batch
from flask_idempotency.client import IdempotentSession
from tests.support import pgbouncer
from tests.support.live import start_ready

AMQP_ENV = "IDEMPOTENCY_TEST_AMQP_URL"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
ORDER = {"customer_id": "cus_chain", "amount": 4200, "currency": "EUR"}


class Service:
    """``python -m tests.support.chain_server`` in a child process; ``supervise`` starts
    it again, on the same port, each time it dies."""

    def __init__(self, name: str, config: dict[str, t.Any], port: int = 0) -> None:
        self.name, self.config, self.port = name, config, port
        self.proc: subprocess.Popen[str] | None = None
        self.restarts = 0
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Service:
        """Start the service (again, on the same port, after it died)."""
        if self.proc is not None:
            self.proc.wait(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        self.proc, self.port = start_ready(
            "tests.support.chain_server", self.name, str(self.port), json.dumps(self.config)
        )
        return self

    def supervise(self) -> None:
        def watch() -> None:
            while not self._stop.wait(0.05):
                if self.proc is not None and self.proc.poll() is not None:
                    self.restarts += 1
                    self.start()

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(30)
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@dataclasses.dataclass
class Broker:
    name: str
    url: str
    folder: str
    tag: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:10])

    def config(self) -> dict[str, str]:
        """The services' broker settings: an exchange and a queue of this test's
        own, so runs sharing a RabbitMQ never meet, and nothing declares the queue
        before the relay's publisher does."""
        return {
            "EXAMPLE_BROKER_URL": self.url,
            "EXAMPLE_BROKER_FOLDER": self.folder,
            "EXAMPLE_EXCHANGE": f"chain-test-{self.tag}",
            "EXAMPLE_SHIPPING_QUEUE": f"chain-test-{self.tag}",
        }

    def delete(self) -> None:
        holder = Flask(__name__)
        holder.config.update(self.config())
        example_broker.delete_queue(holder)


def rabbitmq_or_skip() -> str:
    url = os.environ.get(AMQP_ENV) or DEFAULT_AMQP_URL
    where = sa.make_url(url.replace("amqp://", "postgresql://", 1))
    try:
        socket.create_connection((where.host or "127.0.0.1", where.port or 5672), 2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at {where.host}:{where.port or 5672} ({AMQP_ENV}): {exc}")
    return url


@pytest.fixture(params=["filesystem", "rabbitmq"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> t.Iterator[Broker]:
    if request.param == "rabbitmq":
        found = Broker("rabbitmq", rabbitmq_or_skip(), str(tmp_path / "unused"))
    else:
        found = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    yield found
    found.delete()


@pytest.fixture
def dbs(pg_url: str, pooled_role: t.Callable[..., str]) -> t.Iterator[dict[str, str]]:
    """A database URL per service: a schema of its own on the suite's PostgreSQL
    (behind the pooler, a role per service whose search_path it is)."""
    tag = uuid.uuid4().hex[:10]
    schemas = {name: f"chain_{name}_{tag}" for name in ("orders", "payments", "shipping")}
    admin = sa.create_engine(pg_url)
    with admin.begin() as conn:
        for schema in schemas.values():
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = sa.make_url(pg_url)
    if pgbouncer.is_pooled(pg_url):
        yield {name: pooled_role(pg_url, search_path=schema) for name, schema in schemas.items()}
    else:
        yield {
            name: url.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
                hide_password=False
            )
            for name, schema in schemas.items()
        }
    with admin.begin() as conn:
        for schema in schemas.values():
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


def rows(url: str, sql: str) -> list[tuple[t.Any, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def count(url: str, table: str) -> int:
    return int(rows(url, f"SELECT count(*) FROM {table}")[0][0])


def client() -> IdempotentSession:
    return IdempotentSession(total=10, backoff_factor=0.3, backoff_max=2, deadline=90)


def place_order(
    service: Service,
    key: str,
    *,
    tenant: str = "acme",
    http: IdempotentSession | None = None,
    timeout: float = 10,
) -> requests.Response:
    """POST the order to the order service, the way its client would: one key,
    retried (by default) through the crashes and restarts a test arranges."""
    return (http or client()).post(
        service.url + "/orders",
        json=ORDER,
        headers={"X-Tenant": tenant},
        idempotency_key=key,
        timeout=timeout,
    )


def start_chain(
    dbs: dict[str, str], broker: Broker, **orders_config: t.Any
) -> tuple[Service, Service]:
    payments = Service("payments", {"SQLALCHEMY_DATABASE_URI": dbs["payments"]}).start()
    try:
        config = {
            "SQLALCHEMY_DATABASE_URI": dbs["orders"],
            "PAYMENTS_URL": payments.url,
            **broker.config(),
            **orders_config,
        }
        # Port 0: the server binds a free one and says which (a port chosen here
        # and bound there could be taken in between); restarts reuse it.
        order_service = Service("orders", config).start()
    except BaseException:
        payments.stop()
        raise
    order_service.supervise()
    return payments, order_service


@contextlib.contextmanager
def relay_and_consumer(dbs: dict[str, str], broker: Broker) -> t.Iterator[tuple[Flask, Flask]]:
    """The order service's app (to run its relay) and the shipping service's app
    (to consume), in this process; their connections closed afterwards."""
    # Behind the suite's PgBouncer: the pooler declared, as the example's docs say.
    orders_app = orders.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": dbs["orders"],
            **broker.config(),
            **pgbouncer.declared(dbs["orders"]),
        }
    )
    shipping_app = shipping.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": dbs["shipping"],
            **broker.config(),
            **pgbouncer.declared(dbs["shipping"]),
        }
    )
    try:
        yield orders_app, shipping_app
    finally:
        orders_app.config["IDEMPOTENCY_PUBLISHER"].close()
        for app, db in ((orders_app, orders.db), (shipping_app, shipping.db)):
            with app.app_context():
                db.engine.dispose()


def test_a_response_lost_after_commit_is_replayed_and_every_hop_acts_once(
    dbs: dict[str, str], broker: Broker, tmp_path: Path
) -> None:
    """The order service commits the order, the charge's record and the event,
    then dies before answering. The client retries with the same key against
    the restarted service: the stored response, one order, one charge (under a
    key derived from K, not K), one event, and after the relay one shipment,
    even when the relay publishes the event a second time."""
    crash = tmp_path / "crash"
    crash.touch()
    payments, order_service = start_chain(
        dbs, broker, crash_at="after-commit", crash_file=str(crash)
    )
    key = str(uuid.uuid4())
    try:
        response = place_order(order_service, key)
    finally:
        order_service.stop()
        payments.stop()
    assert order_service.restarts == 1  # it did die after the commit
    assert not crash.exists()
    assert response.status_code == 201, response.text
    assert response.headers["Idempotent-Replayed"] == "true"
    body = response.json()
    assert count(dbs["orders"], "orders") == 1
    assert rows(dbs["orders"], "SELECT event_id, topic FROM idempotency_outbox") == [
        (body["event_id"], "order-created")
    ]
    assert rows(dbs["payments"], "SELECT id, amount FROM ledger") == [(body["charge_id"], 4200)]
    [(payment_key,)] = rows(dbs["payments"], "SELECT key FROM idempotency_keys")
    assert payment_key != key
    assert re.fullmatch("[0-9a-f]{64}", payment_key)

    with relay_and_consumer(dbs, broker) as (orders_app, shipping_app):
        assert relay_batch(orders_app).published == 1
        assert shipping.consume(shipping_app, idle=1.0) == shipping.Consumed(shipped=1)
        # A relay that died after publishing, before marking, publishes it again.
        with orders_app.app_context():
            orders.db.session.execute(
                sa.text("UPDATE idempotency_outbox SET published_at = NULL, next_attempt_at = NULL")
            )
            orders.db.session.commit()
        assert relay_batch(orders_app).published == 1
        assert shipping.consume(shipping_app, idle=1.0) == shipping.Consumed(skipped=1)
    assert rows(dbs["shipping"], "SELECT order_id, event_id FROM shipments") == [
        (body["order_id"], body["event_id"])
    ]
    assert rows(dbs["shipping"], "SELECT consumer, event_id FROM idempotency_inbox") == [
        ("shipping", body["event_id"])
    ]


@pytest.mark.parametrize(
    ("crash_at", "keys", "charges"),
    [
        ("before-charge", "derived", 1),
        ("after-charge", "derived", 1),
        ("after-charge", "random", 2),
        ("before-commit", "random", 1),
    ],
    ids=["before-charge", "after-charge", "after-charge-random-keys", "after-the-step"],
)
def test_a_crash_inside_the_order_is_resumed_and_charges_once_with_derived_keys(
    dbs: dict[str, str], tmp_path: Path, crash_at: str, keys: str, charges: int
) -> None:
    """The order service dies inside the view, its claim committed (leased). The
    retry waits out the lease (409 with Retry-After), reclaims the operation and
    resumes it:

    * before the charge: it charges, once;
    * after the payments service charged, before the step's result was saved:
      it calls again with the same derived key and the payments service replays
      its charge; with a key minted afresh per attempt (the mistake derived keys
      exist for) it charges a second time;
    * after the step's result was saved, before the order committed: it does not
      call the payments service again at all (with random keys, to show that the
      recovery point, not the payments service's dedupe, saved the charge).
    """
    crash = tmp_path / "crash"
    crash.touch()
    broker = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    payments, order_service = start_chain(
        dbs,
        broker,
        crash_at=crash_at,
        crash_file=str(crash),
        broken_keys=keys == "random",
        IDEMPOTENCY_LEASE=2,
    )
    try:
        response = place_order(order_service, str(uuid.uuid4()))
    finally:
        order_service.stop()
        payments.stop()
    assert order_service.restarts == 1
    assert not crash.exists()
    assert response.status_code == 201, response.text
    assert count(dbs["orders"], "orders") == 1
    assert count(dbs["orders"], "idempotency_outbox") == 1
    ledger = [c for (c,) in rows(dbs["payments"], "SELECT id FROM ledger ORDER BY id")]
    assert len(ledger) == charges
    assert response.json()["charge_id"] == ledger[-1]
    assert count(dbs["payments"], "idempotency_keys") == charges


def test_a_charge_whose_answer_is_lost_is_a_502_and_the_retry_charges_once(
    dbs: dict[str, str], tmp_path: Path
) -> None:
    """The payments service charges and dies before answering. The order service
    cannot know whether the charge happened: it answers 502, which is not
    stored, and keeps the operation (its derived key went out). The client's
    retry, once the payments service is back, resumes the operation with the
    same derived key: the payments service replays its charge, and the order is
    placed on it. A 4xx stored here would have left the customer charged with no
    order and a key that replays the failure."""
    crash = tmp_path / "crash"
    crash.touch()
    broker = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    payments = Service(
        "payments",
        {"SQLALCHEMY_DATABASE_URI": dbs["payments"], "crash_at": "after-commit"}
        | {"crash_file": str(crash)},
    ).start()
    config = {"SQLALCHEMY_DATABASE_URI": dbs["orders"], "PAYMENTS_URL": payments.url}
    order_service = Service("orders", {**config, **broker.config()}).start()
    key = str(uuid.uuid4())
    try:
        failed = place_order(order_service, key, http=IdempotentSession(total=0), timeout=30)
        assert failed.status_code == 502, failed.text
        assert failed.headers["Content-Type"] == "application/problem+json"
        assert payments.proc is not None
        payments.proc.wait(10)  # it died after charging
        assert count(dbs["payments"], "ledger") == 1
        assert count(dbs["orders"], "orders") == 0
        assert count(dbs["orders"], "idempotency_outbox") == 0
        assert rows(dbs["orders"], "SELECT status FROM idempotency_keys") == [("in_progress",)]
        payments.start()  # back, on the same port
        placed = place_order(order_service, key)
    finally:
        order_service.stop()
        payments.stop()
    assert placed.status_code == 201, placed.text
    assert rows(dbs["payments"], "SELECT id FROM ledger") == [(placed.json()["charge_id"],)]
    assert count(dbs["payments"], "idempotency_keys") == 1
    assert count(dbs["orders"], "orders") == 1
    assert count(dbs["orders"], "idempotency_outbox") == 1


def test_a_consumer_killed_before_it_commits_gets_the_event_again(
    dbs: dict[str, str], tmp_path: Path
) -> None:
    """The shipping consumer is SIGKILLed inside its transaction (the shipment and
    the event id written, not committed, the message not acked): the broker
    delivers the event again and the next consumer ships it, once. Only on a
    broker that redelivers: kombu's filesystem transport deletes a message as
    it is read (README, example_app/broker.py)."""
    broker = Broker("rabbitmq", rabbitmq_or_skip(), str(tmp_path / "unused"))
    payments, order_service = start_chain(dbs, broker)
    try:
        placed = place_order(order_service, str(uuid.uuid4()))
    finally:
        order_service.stop()
        payments.stop()
    assert placed.status_code == 201
    crash = tmp_path / "crash"
    crash.touch()
    try:
        with relay_and_consumer(dbs, broker) as (orders_app, shipping_app):
            assert relay_batch(orders_app).published == 1
            consumer = Service(
                "shipping",
                {"SQLALCHEMY_DATABASE_URI": dbs["shipping"], **broker.config()}
                | {"crash_at": "in-consumer", "crash_file": str(crash)},
            ).start()
            assert consumer.proc is not None
            assert consumer.proc.wait(30) == -9  # SIGKILLed inside its transaction
            consumer.stop()
            assert not crash.exists()
            assert count(dbs["shipping"], "shipments") == 0
            assert shipping.consume(shipping_app, idle=2.0) == shipping.Consumed(shipped=1)
    finally:
        broker.delete()
    assert rows(dbs["shipping"], "SELECT event_id FROM shipments") == [(placed.json()["event_id"],)]


def test_two_tenants_with_one_key_are_two_charges(dbs: dict[str, str], tmp_path: Path) -> None:
    """Two tenants that chose the same key are two operations at every hop: the
    derived keys carry the scope, so the payments service charges twice."""
    broker = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    payments, order_service = start_chain(dbs, broker)
    key = "order-1"
    http = client()
    try:
        replies = {
            tenant: place_order(order_service, key, tenant=tenant, http=http)
            for tenant in ("acme", "globex")
        }
        again = place_order(order_service, key, tenant="globex", http=http)
    finally:
        order_service.stop()
        payments.stop()
    assert [r.status_code for r in replies.values()] == [201, 201]
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == replies["globex"].json()
    charge_ids = {r.json()["charge_id"] for r in replies.values()}
    assert {c for (c,) in rows(dbs["payments"], "SELECT id FROM ledger")} == charge_ids
    assert len(charge_ids) == 2
    assert sorted(t for (t,) in rows(dbs["orders"], "SELECT tenant FROM orders")) == [
        "acme",
        "globex",
    ]
    assert count(dbs["payments"], "idempotency_keys") == 2
    assert len({r.json()["event_id"] for r in replies.values()}) == 2
    assert count(dbs["orders"], "idempotency_outbox") == 2
