"""The example's chain across services under faults: orders, payments, outbox, broker, shipping."""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

from reliability import _harness as h
from reliability._context import Context

NAME = "chain"
TITLE = "The chain across services: orders, payments, outbox, broker, shipping"
DESCRIPTION = """\
The example's chain (`example_app`): clients place orders at the order service with a key each
and retry until settled; the order service (gunicorn, 2 workers x 4 threads, leased route, 15 s
lease) charges at the payments service (gunicorn, 2 sync workers) over HTTP with the key derived
from the client's (`idem.derived_key("charge")`), then commits the order with its
`order-created` event in the outbox; the relay (`flask idempotency relay --batch 2`, a process
of its own) publishes the outbox to the broker; the shipping consumer (a process looping over
`example_app.shipping.consume`) ships each event once through the inbox. Each service has a
database of its own on the run's PostgreSQL. The broker is RabbitMQ at 127.0.0.1:5672 when it
answers, reached by the relay and the consumer through a TCP proxy the scenario controls (an
exchange and a queue of the run's own); otherwise kombu's filesystem transport, without the
broker-down fault. Faults: every COMMIT of the order and payments services' sessions during a
POST may SIGKILL the worker right before or right after it (orders 2%, payments 3% each), the
broker cut off (every connection closed, new ones refused) for a while, and the relay killed
(SIGKILL) and restarted, then killed again while it drains the backlog that built up, and
restarted. After the clients are done, the relay and the consumer drain. Counted: orders (one
per key), charges (one per order), outbox events and how many are published, deliveries to the
consumer (a delivery the inbox skips is a duplicate publish or redelivery: at-least-once),
shipments (one per order); duplicates of orders, charges and shipments, lost operations (the
client saw 2xx and an order, its charge or its shipment is missing), stuck records in both
services, HTML 500s.
"""

RABBITMQ = ("127.0.0.1", 5672)
TENANT = {"X-Tenant": "reliability"}
ORDERS_FAULTS = {"before_commit": 0.02, "after_commit": 0.02}
PAYMENTS_FAULTS = {"before_commit": 0.03, "after_commit": 0.03}
#: Events left pending while the relay is away, before it starts again to drain them.
BACKLOG = 20


class Process:
    """A child process in its own group; ``supervise`` starts it again whenever it
    exits while not stopping (counted in ``restarts``)."""

    def __init__(self, name: str, command: list[str], env: t.Mapping[str, str]) -> None:
        self.name, self.command = name, command
        self.env = {
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(h.ROOT), os.environ.get("PYTHONPATH")])
            ),
        }
        self.log = Path(tempfile.mkstemp(prefix=f"reliability-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        #: The supervisor starts the process again no sooner (time.monotonic()).
        self.hold_until = 0.0
        self.exits: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> Process:
        with self._lock, self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                cwd=h.ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        return self

    def supervise(self) -> Process:
        def watch() -> None:
            while not self._stopping.wait(0.2):
                with self._lock:
                    proc = self.proc
                if proc is None or proc.poll() is None or self._stopping.is_set():
                    continue
                if time.monotonic() < self.hold_until:
                    continue
                self.exits[proc.returncode] += 1
                self.restarts += 1
                time.sleep(0.5)
                self.start()

        self._watcher = threading.Thread(target=watch, daemon=True)
        self._watcher.start()
        return self

    def kill(self, hold: float = 0.0) -> None:
        """SIGKILL the process; the supervisor, when on, starts it again after
        ``hold`` seconds (and its own half second)."""
        self.hold_until = time.monotonic() + hold
        with self._lock:
            proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

    def stop(self) -> None:
        self._stopping.set()
        if self._watcher is not None:
            self._watcher.join(10)
        with self._lock:
            proc, self.proc = self.proc, None
        if proc is not None:
            h.stop_group(proc)

    def tail(self, chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _rabbitmq() -> bool:
    try:
        socket.create_connection(RABBITMQ, timeout=2).close()
    except OSError:
        return False
    return True


def _scalar(url: str, sql: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(sql)).scalar_one())
    finally:
        engine.dispose()


def _rows(url: str, sql: str) -> list[tuple[t.Any, ...]]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql))]
    finally:
        engine.dispose()


def _create_tables(urls: dict[str, str], broker_env: dict[str, str]) -> None:
    """Every service's tables, once, before any worker starts (workers creating
    them at once would race)."""
    from example_app import app as payments
    from example_app import orders, shipping

    made = [
        (payments.create_app({"SQLALCHEMY_DATABASE_URI": urls["payments"]}), payments.db),
        (
            orders.create_app({"SQLALCHEMY_DATABASE_URI": urls["orders"], **broker_env}),
            orders.db,
        ),
        (
            shipping.create_app({"SQLALCHEMY_DATABASE_URI": urls["shipping"], **broker_env}),
            shipping.db,
        ),
    ]
    for app, db in made:
        with app.app_context():
            db.engine.dispose()
        publisher = app.config.get("IDEMPOTENCY_PUBLISHER")
        if publisher is not None:
            publisher.close()


def _delete_queue(broker_env: dict[str, str]) -> None:
    from flask import Flask

    from example_app import broker

    holder = Flask(__name__)
    holder.config.update(broker_env)
    with contextlib.suppress(Exception):
        broker.delete_queue(holder)


class Faults:
    """The broker cut off and the relay killed, on a timeline over ``seconds``."""

    def __init__(
        self,
        seconds: float,
        relay: Process,
        proxy: t.Any,
        orders_url: str,
        result: h.Result,
    ) -> None:
        self.seconds, self.relay, self.proxy = seconds, relay, proxy
        self.orders_url, self.result = orders_url, result
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Faults:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(self.seconds + 120)
        if self.error is not None:
            raise self.error

    def _pending(self) -> int:
        return _scalar(
            self.orders_url,
            "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NULL",
        )

    def _run(self) -> None:
        try:
            time.sleep(self.seconds * 0.15)
            if self.proxy is not None:
                down = self.seconds * 0.2
                self.proxy.cut()
                self.result.faults["broker down"] += 1
                time.sleep(down)
                self.proxy.heal()
                self.result.extra["broker down"] = f"{down:.0f} s, from {self.seconds * 0.15:.0f} s"
            time.sleep(self.seconds * 0.1)
            self._kill_mid_drain()
        except BaseException as exc:  # re-raised by join()
            self.error = exc
            if self.proxy is not None:
                self.proxy.heal()

    def _kill_mid_drain(self) -> None:
        # The relay dies and stays away until a backlog has built up (at most
        # 20 s); started again, it drains it two events a batch; once it has
        # published part of it, it is killed again, mid-drain.
        self.relay.kill(hold=3600)
        self.result.faults["relay killed"] += 1
        deadline = time.monotonic() + 20
        while self._pending() < BACKLOG and time.monotonic() < deadline:
            time.sleep(0.2)
        backlog = self._pending()
        self.relay.hold_until = 0.0  # the supervisor starts it now
        deadline = time.monotonic() + 30
        while (pending := self._pending()) >= backlog and time.monotonic() < deadline:
            time.sleep(0.01)
        self.relay.kill()
        self.result.faults["relay killed mid-drain"] += 1
        self.result.extra["relay killed mid-drain"] = (
            f"backlog {backlog} events, {pending} still pending at the kill"
        )


def run(ctx: Context) -> list[h.Result]:
    from tests.support.tcp_proxy import TcpProxy

    result = h.Result(f"{NAME}: orders, payments, relay, broker, shipping", "the chain")
    seconds = ctx.scale.pick(180.0, 30.0)
    concurrency = ctx.scale.pick(6, 4)
    urls = {name: ctx.database(f"chain_{name}") for name in ("orders", "payments", "shipping")}
    tag = uuid.uuid4().hex[:10]
    folder = tempfile.mkdtemp(prefix="reliability-chain-")
    proxy: TcpProxy | None = None
    if _rabbitmq():
        proxy = TcpProxy(RABBITMQ)
        broker_url = f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
        result.notes.append("broker: RabbitMQ at 127.0.0.1:5672, through the scenario's proxy")
    else:
        broker_url = "filesystem://"
        result.notes.append(
            "broker: kombu's filesystem transport (no RabbitMQ answered at 127.0.0.1:5672); "
            "the broker-down fault needs RabbitMQ and was not injected"
        )
    broker_env = {
        "EXAMPLE_BROKER_URL": broker_url,
        "EXAMPLE_BROKER_FOLDER": os.path.join(folder, "broker"),
        "EXAMPLE_EXCHANGE": f"reliability-chain-{tag}",
        "EXAMPLE_SHIPPING_QUEUE": f"reliability-chain-{tag}",
    }
    direct_env = {**broker_env, "EXAMPLE_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"}
    fault_log = Path(folder) / "faults.jsonl"
    skipped_log = Path(folder) / "skipped.jsonl"
    _create_tables(urls, broker_env)
    payments = h.Gunicorn(
        "reliability.chain_apps:payments_app()",
        {
            "EXAMPLE_DATABASE_URL": urls["payments"],
            "RELIABILITY_FAULTS": json.dumps(PAYMENTS_FAULTS),
            "RELIABILITY_FAULT_LOG": str(fault_log),
        },
        workers=2,
    )
    orders_env = {
        "EXAMPLE_ORDERS_DATABASE_URL": urls["orders"],
        "EXAMPLE_PAYMENTS_URL": f"http://{payments.host}:{payments.port}",
        "RELIABILITY_LEASE": "15",
        **broker_env,
    }
    orders = h.Gunicorn(
        "reliability.chain_apps:orders_app()",
        {
            **orders_env,
            "RELIABILITY_FAULTS": json.dumps(ORDERS_FAULTS),
            "RELIABILITY_FAULT_LOG": str(fault_log),
        },
        workers=2,
        threads=4,
    )
    relay = Process(
        "relay",
        [
            sys.executable,
            "-m",
            "flask",
            "--app",
            "reliability.chain_apps:orders_app",
            "idempotency",
            "relay",
            "--batch",
            "2",
            "--poll",
            "0.5",
        ],
        orders_env,
    )
    consumer = Process(
        "consumer",
        [
            sys.executable,
            "-m",
            "reliability.chain_apps",
            "consume",
            str(seconds + 300),
            str(skipped_log),
        ],
        {"EXAMPLE_SHIPPING_DATABASE_URL": urls["shipping"], **broker_env},
    )
    amounts = itertools.count(1000)
    lock = threading.Lock()

    def make() -> h.Operation:
        with lock:
            amount = next(amounts)
        payload = {"customer_id": "cus_reliability", "amount": amount, "currency": "EUR"}
        return h.Operation(str(uuid.uuid4()), "/orders", payload, dict(TENANT))

    try:
        with h.timed(result):
            payments.start()
            orders.start()
            relay.start().supervise()
            consumer.start().supervise()
            client = h.Client([(orders.host, orders.port)], timeout=20, budget=150, attempts=80)
            faults = Faults(seconds, relay, proxy, urls["orders"], result).start()
            ops = h.drive(client, make, count=100_000, concurrency=concurrency, seconds=seconds)
            faults.join()
            result.extra["drain: seconds after the clients finished"] = _drain(urls)
        _count(result, ops, urls, skipped_log)
        h.count_faults(fault_log, result)
        result.extra["relay: restarts (exit codes)"] = f"{relay.restarts} ({dict(relay.exits)})"
        result.extra["consumer: restarts (exit codes)"] = (
            f"{consumer.restarts} ({dict(consumer.exits)})"
        )
    finally:
        for process in (relay, consumer):
            process.stop()
        orders.stop()
        payments.stop()
        if proxy is not None:
            proxy.close()
            _delete_queue(direct_env)
        for path in (relay.log, consumer.log, orders.log, payments.log):
            if os.environ.get("RELIABILITY_KEEP_LOGS"):
                ctx.say(f"log kept: {path}")
            else:
                path.unlink(missing_ok=True)
    ctx.show(result)
    return [result]


def _drain(urls: dict[str, str], within: float = 120) -> str:
    """Wait until every outbox event is published and every order shipped."""
    start = time.monotonic()
    published_at: float | None = None
    while time.monotonic() - start < within:
        pending = _scalar(
            urls["orders"], "SELECT count(*) FROM idempotency_outbox WHERE published_at IS NULL"
        )
        orders = _scalar(urls["orders"], "SELECT count(*) FROM orders")
        shipped = _scalar(urls["shipping"], "SELECT count(DISTINCT order_id) FROM shipments")
        if pending == 0 and published_at is None:
            published_at = time.monotonic() - start
        if pending == 0 and shipped >= orders:
            done = time.monotonic() - start
            return f"all published after {published_at:.1f} s, all shipped after {done:.1f} s"
        time.sleep(0.5)
    return f"not drained within {within:.0f} s ({pending} pending, {orders - shipped} not shipped)"


def _count(result: h.Result, ops: list[h.Operation], urls: dict[str, str], skipped: Path) -> None:
    result.add_operations(ops)
    orders = _rows(urls["orders"], "SELECT id, amount, charge_id FROM orders")
    charges = _rows(urls["payments"], "SELECT id, amount FROM ledger")
    shipments = _rows(urls["shipping"], "SELECT order_id, event_id FROM shipments")
    outbox = _rows(
        urls["orders"], "SELECT event_id, published_at IS NOT NULL, failed_at IS NOT NULL "
        "FROM idempotency_outbox"
    )  # fmt: skip
    inbox = _scalar(urls["shipping"], "SELECT count(*) FROM idempotency_inbox")
    duplicates = (
        sum(1 for line in skipped.read_text().splitlines() if line.strip())
        if skipped.exists()
        else 0
    )
    orders_by_amount = collections.Counter(amount for _, amount, _ in orders)
    charges_by_amount = collections.Counter(amount for _, amount in charges)
    shipments_by_order = collections.Counter(order_id for order_id, _ in shipments)
    charge_amount = {charge_id: amount for charge_id, amount in charges}
    order_of_amount = {amount: order_id for order_id, amount, _ in orders}
    result.ledger_rows = len(orders)
    result.duplicates = (
        sum(n - 1 for n in orders_by_amount.values())
        + sum(n - 1 for n in charges_by_amount.values())
        + sum(n - 1 for n in shipments_by_order.values())
    )
    missing: collections.Counter[str] = collections.Counter()
    for op in ops:
        if not op.succeeded:
            continue
        amount = op.payload["amount"]
        order_id = order_of_amount.get(amount)
        gaps = {
            "order": order_id is None,
            "charge": charges_by_amount[amount] == 0,
            "shipment": order_id is not None and shipments_by_order[order_id] == 0,
        }
        missing.update(k for k, gone in gaps.items() if gone)
        result.lost += any(gaps.values())
    if missing:
        result.notes.append(
            "lost: " + ", ".join(f"{n} without {what}" for what, n in sorted(missing.items()))
        )
    wrong_charge = sum(
        1 for _, amount, charge_id in orders if charge_amount.get(charge_id) != amount
    )
    if wrong_charge:
        result.failures.append(f"{wrong_charge} orders point at another order's charge")
    orphans = sum(1 for amount in charges_by_amount if amount not in orders_by_amount)
    published = sum(1 for _, done, _ in outbox if done)
    parked = sum(1 for _, _, failed in outbox if failed)
    if parked:
        result.failures.append(f"{parked} outbox events parked")
    if published < len(outbox):
        result.failures.append(f"{len(outbox) - published} outbox events never published")
    result.extra["orders (one per key)"] = (
        f"{len(orders)} rows for {len(orders_by_amount)} keys; {len(ops)} operations"
    )
    result.extra["charges at payments (one per order)"] = (
        f"{len(charges)} rows for {len(charges_by_amount)} orders"
        + (f"; {orphans} charges of orders never placed" if orphans else "")
    )
    result.extra["outbox events (one per order)"] = (
        f"{len(outbox)} written, {published} published, {parked} parked"
    )
    result.extra["deliveries to the consumer"] = (
        f"{len(shipments) + duplicates}: {len(shipments)} shipped, {duplicates} skipped by the"
        " inbox as duplicates (published again after a relay kill, or redelivered after a"
        " broker cut)"
    )
    result.extra["shipments (one per order)"] = (
        f"{len(shipments)} rows for {len(shipments_by_order)} orders; inbox ids {inbox}"
    )
    stuck = h.Result("stuck", "stuck")
    h.count_stuck(urls["orders"], stuck)
    h.count_stuck(urls["payments"], stuck)
    result.stuck = stuck.stuck
