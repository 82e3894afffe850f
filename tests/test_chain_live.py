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
import sqlalchemy as sa
from flask import Flask

from example_app import broker as example_broker
from example_app import orders, shipping
from flask_idempotency.client import IdempotentSession
from flask_idempotency.relay import relay_batch
from tests.live import start_ready

AMQP_ENV = "IDEMPOTENCY_TEST_AMQP_URL"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
ORDER = {"customer_id": "cus_chain", "amount": 4200, "currency": "EUR"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Service:
    """``python -m tests.chain_server`` in a child process; ``supervise`` starts
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
        self.proc, self.port = start_ready(
            "tests.chain_server", self.name, str(self.port), json.dumps(self.config)
        )
        return self

    def supervise(self) -> None:
        def watch() -> None:
            while not self._stop.wait(0.05):
                if self.proc is not None and self.proc.poll() is not None:
                    if self.proc.stdout is not None:
                        self.proc.stdout.close()
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

    def config(self) -> dict[str, str]:
        return {"EXAMPLE_BROKER_URL": self.url, "EXAMPLE_BROKER_FOLDER": self.folder}

    def purge(self) -> None:
        """Empty the shipping queue: a shared RabbitMQ may hold another run's events."""
        holder = Flask(__name__)
        holder.config.update(self.config())
        with example_broker.connection(holder) as conn:
            queue = example_broker.shipping_queue()(conn.channel())
            queue.declare()
            queue.purge()


@pytest.fixture(params=["filesystem", "rabbitmq"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> t.Iterator[Broker]:
    if request.param == "rabbitmq":
        url = os.environ.get(AMQP_ENV) or DEFAULT_AMQP_URL
        where = sa.make_url(url.replace("amqp://", "postgresql://", 1))
        try:
            socket.create_connection((where.host or "127.0.0.1", where.port or 5672), 2).close()
        except OSError as exc:
            pytest.skip(f"no RabbitMQ at {where.host}:{where.port or 5672} ({AMQP_ENV}): {exc}")
        found = Broker("rabbitmq", url, str(tmp_path / "unused"))
    else:
        found = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    found.purge()
    yield found
    found.purge()


@pytest.fixture
def dbs(pg_url: str) -> t.Iterator[dict[str, str]]:
    """A database URL per service: a schema of its own on the suite's PostgreSQL."""
    tag = uuid.uuid4().hex[:10]
    schemas = {name: f"chain_{name}_{tag}" for name in ("orders", "payments", "shipping")}
    admin = sa.create_engine(pg_url)
    with admin.begin() as conn:
        for schema in schemas.values():
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = sa.make_url(pg_url)
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
        order_service = Service("orders", config, port=free_port()).start()
    except BaseException:
        payments.stop()
        raise
    order_service.supervise()
    return payments, order_service


def in_process(app_factory: t.Callable[..., Flask], url: str, broker: Broker) -> Flask:
    return app_factory({"SQLALCHEMY_DATABASE_URI": url, **broker.config()})


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
        response = client().post(
            order_service.url + "/orders",
            json=ORDER,
            headers={"X-Tenant": "acme"},
            idempotency_key=key,
            timeout=10,
        )
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

    orders_app = in_process(orders.create_app, dbs["orders"], broker)
    shipping_app = in_process(shipping.create_app, dbs["shipping"], broker)
    try:
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
    finally:
        orders_app.config["IDEMPOTENCY_PUBLISHER"].close()
        for app, db in ((orders_app, orders.db), (shipping_app, shipping.db)):
            with app.app_context():
                db.engine.dispose()
    assert rows(dbs["shipping"], "SELECT order_id, event_id FROM shipments") == [
        (body["order_id"], body["event_id"])
    ]
    assert rows(dbs["shipping"], "SELECT consumer, event_id FROM idempotency_inbox") == [
        ("shipping", body["event_id"])
    ]


@pytest.mark.parametrize("keys", ["derived", "random"])
def test_a_crash_after_the_charge_charges_once_only_with_derived_keys(
    dbs: dict[str, str], tmp_path: Path, keys: str
) -> None:
    """The order service dies after the payments service charged and before the
    order or the step's result committed. The retry resumes the operation once
    the lease ends and calls the payments service again. With the derived key
    the payments service recognises the call and replays its charge; with a key
    minted afresh per attempt (the mistake derived keys exist for) it charges a
    second time."""
    crash = tmp_path / "crash"
    crash.touch()
    broker = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    payments, order_service = start_chain(
        dbs,
        broker,
        crash_at="after-charge",
        crash_file=str(crash),
        broken_keys=keys == "random",
        IDEMPOTENCY_LEASE=2,
    )
    try:
        response = client().post(
            order_service.url + "/orders",
            json=ORDER,
            headers={"X-Tenant": "acme"},
            idempotency_key=str(uuid.uuid4()),
            timeout=10,
        )
    finally:
        order_service.stop()
        payments.stop()
    assert order_service.restarts == 1
    assert not crash.exists()
    assert response.status_code == 201, response.text
    assert count(dbs["orders"], "orders") == 1
    assert count(dbs["orders"], "idempotency_outbox") == 1
    charges = rows(dbs["payments"], "SELECT id FROM ledger ORDER BY id")
    payment_keys = {k for (k,) in rows(dbs["payments"], "SELECT key FROM idempotency_keys")}
    if keys == "derived":
        assert charges == [(response.json()["charge_id"],)]
        assert len(payment_keys) == 1
    else:
        assert len(charges) == 2, "a fresh key per attempt should have charged twice"
        assert len(payment_keys) == 2


def test_two_tenants_with_one_key_are_two_charges(dbs: dict[str, str], tmp_path: Path) -> None:
    """Two tenants that chose the same key are two operations at every hop: the
    derived keys carry the scope, so the payments service charges twice."""
    broker = Broker("filesystem", "filesystem://", str(tmp_path / "broker"))
    payments, order_service = start_chain(dbs, broker)
    key = "order-1"
    http = client()
    try:
        replies = {
            tenant: http.post(
                order_service.url + "/orders",
                json=ORDER,
                headers={"X-Tenant": tenant},
                idempotency_key=key,
                timeout=10,
            )
            for tenant in ("acme", "globex")
        }
        again = http.post(
            order_service.url + "/orders",
            json=ORDER,
            headers={"X-Tenant": "globex"},
            idempotency_key=key,
            timeout=10,
        )
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
