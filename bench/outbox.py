"""The outbox relay, measured: ``python -m bench.outbox [--quick] ...``.

Two phases, on PostgreSQL (embedded, or ``IDEMPOTENCY_TEST_POSTGRES_URL`` in a
schema of its own, or ``--database-url``):

* **Latency** from commit to a consumer: a writer process commits one event at
  a time at a steady pace; a consumer (a thread of this process) notes when
  each message arrives; latency = arrival - the writer's clock right after its
  commit returned (one machine, one clock). Relays: the foreground ``flask
  idempotency relay`` process (LISTEN/NOTIFY) and the scheduler's relay job in
  the writer process (in-process wake-up after commit), each against the same
  relay with wake-ups off (``IDEMPOTENCY_RELAY_WAKE = False``: polling alone,
  default 1 s). The broker is RabbitMQ when one answers, else kombu's
  filesystem transport (whose consumer polls its folder every 5 ms).
* **Throughput**: a backlog of events drained by one relay (``relay_once``
  batches in this process), events per second, per broker: RabbitMQ with
  publisher confirms (when reachable) waited for one at a time (the relay's
  per-event path) and pipelined (``KombuPublisher.publish_many``: a batch sent,
  its confirms collected together) at batches of 100 and ``--batch``, kombu's
  filesystem and SQLAlchemy (SQLite) transports, and no broker at all (in
  memory, event by event and pipelined: the database's and the relay's share);
  and RabbitMQ alone, the same publisher given events made in memory with no
  database (the broker's ceiling on this machine: a relay cannot beat it).
* **Relays sharing a backlog**: 1, 2 and 4 relay processes started together on
  one backlog (their leases and ``SKIP LOCKED`` keep them apart), RabbitMQ
  pipelined, events per second from the common start to the last one's end.

Variants run interleaved in rounds, in a shuffled order each round; the
figures are the medians over rounds of each round's p50/p99 (or events/s).
Writes section ``bench.outbox`` of ``BENCHMARKS.md`` (kept by ``python -m
bench.run``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from bench import harness
from bench.harness import percentile, say
from flask_idempotency import Idempotency
from flask_idempotency._messaging.outbox import add_event
from flask_idempotency._storage.schema import outbox_table

ROOT = harness.ROOT
RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"
TOPIC = "bench.tick"
NAME = "bench.outbox"

DB_ENV = "BENCH_OUTBOX_DB"
BROKER_ENV = "BENCH_OUTBOX_BROKER"  # JSON: {"url", "exchange", "options"}
CONFIG_ENV = "BENCH_OUTBOX_CONFIG"  # JSON: extra app config

db = SQLAlchemy()
idem = Idempotency()


@dataclasses.dataclass(frozen=True)
class Broker:
    name: str
    url: str
    exchange: str
    options: dict[str, t.Any]

    def env(self) -> str:
        return json.dumps({"url": self.url, "exchange": self.exchange, "options": self.options})


def make_app(database_url: str, publisher: t.Any, **config: t.Any) -> Flask:
    app = Flask("bench_outbox")
    app.config.update(SQLALCHEMY_DATABASE_URI=database_url, IDEMPOTENCY_PUBLISHER=publisher)
    app.config.update(config)
    db.init_app(app)
    idem.init_app(app, db)
    return app


ONE_AT_A_TIME = "RabbitMQ, one confirm at a time"
PIPELINED = "RabbitMQ, pipelined confirms"
#: The publisher alone, no database: what the broker (and the client) take on this machine.
CEILING = "RabbitMQ alone (no database: the ceiling)"
NONE = "none (in-memory list, one event at a time)"
NONE_PIPELINED = "none (in-memory, pipelined)"
RELAYS = (1, 2, 4)
#: The targets of issue 29.
TARGET_RATE = 10_000.0
TARGET_LISTEN_P50_MS = 2.0


def kombu_publisher(broker: Broker, *, one_at_a_time: bool = False) -> t.Any:
    """The relay's publisher; ``one_at_a_time``: one that overrides ``publish``
    alone, so the relay publishes event by event and waits for each confirm
    (the path before pipelining, and any publisher without ``publish_many``)."""
    from flask_idempotency.publishers import KombuPublisher

    class OneAtATime(KombuPublisher):
        def publish(self, event: t.Any) -> None:
            super().publish(event)

    cls = OneAtATime if one_at_a_time else KombuPublisher
    return cls(broker.url, exchange=broker.exchange, transport_options=broker.options)


def create_app() -> Flask:
    """``flask --app bench.outbox:create_app``: the relay and writer processes."""
    spec = json.loads(os.environ[BROKER_ENV])
    broker = Broker("env", spec["url"], spec["exchange"], spec["options"])
    config = json.loads(os.environ.get(CONFIG_ENV, "{}"))
    return make_app(os.environ[DB_ENV], kombu_publisher(broker), **config)


# -- the writer process ------------------------------------------------------


def writer_main(n: int, gap: float, tag: str, scheduler: bool) -> None:
    """Commit ``n`` events, one every ``gap`` seconds; print ``{event_id: commit
    time}`` as JSON. With ``scheduler``, this process runs the relay job (a
    JobScheduler) and waits, after the last commit, until everything is published."""
    from flask_idempotency._maintenance.scheduler import JobScheduler

    app = create_app()
    jobs = JobScheduler(app) if scheduler else None
    if jobs is not None:
        jobs.start()
    committed: dict[str, float] = {}
    try:
        with app.app_context():
            db.session.execute(sa.text("SELECT 1"))  # the pool's first connection
            db.session.commit()
            next_at = time.monotonic() + 0.5
            for i in range(n):
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at += gap
                event_id = f"{tag}-{i}"
                add_event(db.session, TOPIC, {"i": i}, event_id=event_id)
                db.session.commit()
                committed[event_id] = time.time()
            if jobs is not None:
                table = outbox_table(db.metadata)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    pending = db.session.execute(
                        sa.select(sa.func.count()).where(table.c.published_at.is_(None))
                    ).scalar_one()
                    db.session.rollback()
                    if not pending:
                        break
                    time.sleep(0.05)
            db.engine.dispose()
    finally:
        if jobs is not None:
            jobs.shutdown()
    print(json.dumps(committed), flush=True)


def drainer_main(batch: int) -> None:
    """One of several relays sharing a backlog: set up (app, connections), say
    ``ready``, wait for the start time on stdin (this machine's clock), then run
    batches until one takes nothing; print ``{"published", "ended"}`` as JSON."""
    from flask_idempotency._messaging.relay import app_publisher, relay_batch

    app = create_app()
    with app.app_context():
        db.session.execute(sa.text("SELECT 1"))  # the pool's first connection
        db.session.rollback()
        app_publisher(app)._ensure()  # type: ignore[union-attr]  # the broker's connection
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    time.sleep(max(0.0, start_at - time.time()))
    published = 0
    while True:
        run = relay_batch(app, batch=batch)
        published += run.published
        if run.taken == 0:
            break
    ended = time.time()
    with app.app_context():
        db.engine.dispose()
    print(json.dumps({"published": published, "ended": ended}), flush=True)


# -- the benchmark -----------------------------------------------------------


def rabbitmq_reachable() -> str | None:
    """``None`` when RabbitMQ answers on 127.0.0.1:5672, else why not."""
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError as exc:
        return f"no RabbitMQ at 127.0.0.1:5672 ({exc})"
    return None


def filesystem_broker(folder: Path, exchange: str) -> Broker:
    (folder / "data").mkdir(parents=True, exist_ok=True)
    options = {
        "data_folder_in": str(folder / "data"),
        "data_folder_out": str(folder / "data"),
        "control_folder": str(folder / "control"),
        "polling_interval": 0.005,
    }
    return Broker("kombu filesystem", "filesystem://", exchange, options)


def _settled_filesystem() -> type:
    """kombu's filesystem transport, for a consumer that waits while a message
    file is still empty. Its producer creates the file, then writes it; a
    consumer polling in between takes an empty message, fails to decode it and
    the message is lost. This shrinks that window (it cannot close it: the
    check and kombu's own listing are two steps)."""
    from queue import Empty

    from kombu.transport import filesystem

    class SettledChannel(filesystem.Channel):  # type: ignore[misc]
        def _get(self, queue: str) -> t.Any:
            folder = self.data_folder_in
            for name in os.listdir(folder):
                if name.endswith(f".{queue}.msg"):
                    with contextlib.suppress(OSError):
                        if os.path.getsize(os.path.join(folder, name)) == 0:
                            raise Empty()  # being written: the next poll takes it
            return super()._get(queue)

    class Transport(filesystem.Transport):  # type: ignore[misc]
        Channel = SettledChannel

    return Transport


class Consumer:
    """A queue bound to the broker's exchange (``#``), drained by a thread that
    notes the arrival time of each message id. ``broken`` counts messages that
    could not be read (kombu's filesystem race, see :func:`_settled_filesystem`)."""

    def __init__(self, broker: Broker) -> None:
        import kombu

        self.arrived: dict[str, float] = {}
        self.broken = 0
        self._stop = threading.Event()
        transport = _settled_filesystem() if broker.url.startswith("filesystem") else None
        self._conn = kombu.Connection(
            broker.url, transport=transport, transport_options=broker.options
        )
        exchange = kombu.Exchange(broker.exchange, type="topic", durable=True)
        self.queue = kombu.Queue(
            f"bench-{uuid.uuid4().hex[:8]}", exchange, routing_key="#", auto_delete=False
        )
        self._channel = self._conn.channel()
        self.queue(self._channel).declare()
        self._consumer = kombu.Consumer(
            self._channel, [self.queue], callbacks=[self._on_message], accept=["json"]
        )
        self._consumer.consume()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _on_message(self, body: t.Any, message: t.Any) -> None:
        self.arrived[message.properties["message_id"]] = time.time()
        message.ack()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            except ValueError:  # an empty or torn message file: lost
                self.broken += 1

    def wait_for(self, ids: t.Collection[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not all(i in self.arrived for i in ids):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with contextlib.suppress(Exception):
            self.queue(self._channel).delete()
        self._conn.release()


def reset(url: str) -> None:
    """The extension's tables, empty."""
    app = make_app(url, None)
    with app.app_context():
        db.metadata.create_all(db.engine)
        with db.engine.begin() as conn:
            conn.execute(sa.text("TRUNCATE idempotency_outbox, idempotency_job_locks"))
        db.engine.dispose()


@dataclasses.dataclass(frozen=True)
class Latency:
    name: str
    relay: str  # "cli" or "scheduler"
    wake: bool
    what: str


LATENCY = (
    Latency("cli-listen", "cli", True, "`flask idempotency relay`, LISTEN/NOTIFY wake-ups"),
    Latency("cli-poll", "cli", False, "the same, IDEMPOTENCY_RELAY_WAKE=False (polls every 1 s)"),
    Latency(
        "scheduler-wake",
        "scheduler",
        True,
        "scheduler relay job in the writer process, woken after commit (and by LISTEN)",
    ),
    Latency(
        "scheduler-poll",
        "scheduler",
        False,
        "the same, IDEMPOTENCY_RELAY_WAKE=False (polls every IDEMPOTENCY_RELAY_EVERY = 1 s)",
    ),
)


def _env(url: str, broker: Broker, **config: t.Any) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        DB_ENV: url,
        BROKER_ENV: broker.env(),
        CONFIG_ENV: json.dumps(config),
    }


def latency_round(
    url: str, broker: Broker, variant: Latency, n: int, gap: float, lost: list[int]
) -> list[float]:
    """One variant once: the latencies (ms) of ``n`` events (of those that
    arrived: the filesystem transport can lose some, counted in ``lost``)."""
    reset(url)
    env = _env(url, broker, IDEMPOTENCY_RELAY_WAKE=variant.wake)
    consumer = Consumer(broker)
    relay: subprocess.Popen[str] | None = None
    try:
        if variant.relay == "cli":
            cmd = [sys.executable, "-m", "flask", "--app", "bench.outbox:create_app"]
            relay = subprocess.Popen(
                [*cmd, "idempotency", "relay"],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
            )
            assert relay.stdout is not None
            banner = relay.stdout.readline()
            if "relay running" not in banner:
                raise RuntimeError(f"relay did not start: {banner!r}")
            if variant.wake and "LISTEN" not in banner:
                raise RuntimeError(f"relay does not LISTEN: {banner!r}")
        tag = uuid.uuid4().hex[:8]
        args = [str(n), str(gap), tag, "1" if variant.relay == "scheduler" else "0"]
        writer = subprocess.run(
            [sys.executable, "-m", "bench.outbox", "--writer", *args],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=n * gap + 120,
        )
        if writer.returncode != 0:
            raise RuntimeError(f"writer failed:\n{writer.stderr}")
        committed: dict[str, float] = json.loads(writer.stdout.strip().splitlines()[-1])
        if not consumer.wait_for(committed, 30):
            missing = len([i for i in committed if i not in consumer.arrived])
            if missing > consumer.broken:
                raise RuntimeError(f"{variant.name}: {missing} of {n} events never arrived")
            lost.append(missing)  # published, then lost by the transport
        arrived = consumer.arrived
        return [(arrived[i] - at) * 1000 for i, at in committed.items() if i in arrived]
    finally:
        if relay is not None:
            relay.send_signal(signal.SIGTERM)
            try:
                relay.wait(15)
            except subprocess.TimeoutExpired:
                relay.kill()
                relay.wait()
            if relay.stdout is not None:
                relay.stdout.close()
        consumer.close()


def seed_backlog(url: str, n: int) -> None:
    reset(url)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO idempotency_outbox (event_id, topic, payload, created_at,"
                    " attempts) SELECT 'backlog-' || i, :topic, '{\"i\":' || i || '}', now(), 0"
                    " FROM generate_series(1, :n) AS i"
                ),
                {"topic": TOPIC, "n": n},
            )
    finally:
        engine.dispose()


def throughput_round(
    url: str,
    name: str,
    publisher: t.Any,
    n: int,
    count: t.Callable[[], int] | None = None,
    batch: int = 100,
) -> float:
    """Drain a backlog of ``n`` with one relay (batches of ``batch``); events per
    second. ``count()``: the messages in the broker's queue, which must then be ``n``."""
    from flask_idempotency._messaging.relay import relay_once

    seed_backlog(url, n)
    app = make_app(url, publisher)
    total = 0
    started = time.perf_counter()
    while (got := relay_once(app, publisher, batch=batch)) > 0:
        total += got
    elapsed = time.perf_counter() - started
    with app.app_context():
        db.engine.dispose()
    if total != n:
        raise RuntimeError(f"{name}: drained {total} of {n}")
    if count is not None and (queued := count()) != n:
        raise RuntimeError(f"{name}: {queued} of {n} messages in the broker's queue")
    return n / elapsed


def pipelined_list() -> t.Any:
    """The tests' in-memory publisher with ``publish_many`` too: the relay's
    pipelined path with no broker (the database's and the relay's own share)."""
    from flask_idempotency.publishers import ListPublisher

    class PipelinedList(ListPublisher):
        def publish_many(self, events: t.Sequence[t.Any]) -> list[BaseException | None]:
            for event in events:
                self.publish(event)
            return [None] * len(events)

    return PipelinedList()


def ceiling_round(
    name: str, publisher: t.Any, n: int, count: t.Callable[[], int], batch: int
) -> float:
    """``n`` events made in memory, published ``batch`` at a time through
    ``publish_many`` with nothing else: messages per second the broker confirms."""
    import datetime as dt

    from flask_idempotency._messaging.outbox import OutboxEvent

    now = dt.datetime.now(dt.timezone.utc)
    events = [
        OutboxEvent(
            id=i,
            event_id=f"ceiling-{i}",
            topic=TOPIC,
            payload={"i": i},
            headers={},
            created_at=now,
            attempts=0,
        )
        for i in range(1, n + 1)
    ]
    started = time.perf_counter()
    for at in range(0, n, batch):
        if any(outcome is not None for outcome in publisher.publish_many(events[at : at + batch])):
            raise RuntimeError(f"{name}: a publish failed")
    elapsed = time.perf_counter() - started
    if (queued := count()) != n:
        raise RuntimeError(f"{name}: {queued} of {n} messages in the broker's queue")
    return n / elapsed


def relays_batch(args: argparse.Namespace) -> int:
    """The batch of the relays sharing a backlog: small enough that four relays
    take several batches each (``--batch`` at most)."""
    return max(10, min(args.batch, args.backlog // (4 * max(RELAYS))))


def relays_round(url: str, broker: Broker, relays: int, n: int, batch: int) -> float:
    """Drain a backlog of ``n`` with ``relays`` relay processes started together
    once all are set up (pipelined confirms, batches of ``batch``); events per
    second from the common start to the last relay's end. Every event must
    reach the queue."""
    from flask_idempotency.publishers import KombuPublisher

    seed_backlog(url, n)
    declaring = KombuPublisher(broker.url, exchange=broker.exchange)
    procs: list[subprocess.Popen[str]] = []
    try:
        with bound_queue(broker, declaring) as count:
            for _ in range(relays):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "bench.outbox", "--drainer", str(batch)],
                        env=_env(url, broker),
                        cwd=ROOT,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
            for proc in procs:  # each set up: imports, app, connections
                assert proc.stdout is not None
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a relay process did not start")
            start_at = time.time() + 0.1
            results = []
            for proc in procs:
                out, _ = proc.communicate(f"{start_at}\n", timeout=n / 50 + 120)
                if proc.returncode != 0:
                    raise RuntimeError(f"a relay process failed ({proc.returncode})")
                results.append(json.loads(out.strip().splitlines()[-1]))
            published = sum(r["published"] for r in results)
            if published < n or count() < n:
                raise RuntimeError(f"{relays} relays: {published} marked, {count()} queued of {n}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        declaring.close()
    return n / (max(r["ended"] for r in results) - start_at)


@contextlib.contextmanager
def bound_queue(broker: Broker, publisher: t.Any) -> t.Iterator[t.Callable[[], int]]:
    """A queue bound to the exchange, so that messages are routed and kept (as in
    production), deleted afterwards; yields a function counting its messages.

    Declared on the publisher's own channel too: kombu's virtual transports
    other than the filesystem one keep bindings per connection."""
    import kombu

    exchange = kombu.Exchange(broker.exchange, type="topic", durable=True)
    queue = kombu.Queue(f"bench-{uuid.uuid4().hex[:8]}", exchange, routing_key="#")
    queue(publisher._ensure().channel).declare()
    with kombu.Connection(broker.url, transport_options=broker.options) as conn:
        channel = conn.channel()
        queue(channel).declare()
        try:
            yield lambda: int(queue(channel).queue_declare(passive=True).message_count)
        finally:
            with contextlib.suppress(Exception):
                queue(channel).delete()


@dataclasses.dataclass
class Results:
    latency: dict[str, list[list[float]]]
    throughput: dict[str, list[float]]
    latency_broker: str
    notes: list[str]
    relays: dict[int, list[float]] = dataclasses.field(default_factory=dict)


def run(args: argparse.Namespace, url: str, folder: Path) -> Results:
    from flask_idempotency.publishers import ListPublisher

    exchange = f"idem-bench-{uuid.uuid4().hex[:6]}"
    notes: list[str] = []
    why_not = None if args.no_rabbitmq else rabbitmq_reachable()
    if args.no_rabbitmq:
        why_not = "RabbitMQ left out (--no-rabbitmq)"
    rabbit = Broker("RabbitMQ (confirms)", RABBITMQ, exchange, {}) if why_not is None else None
    if why_not is not None:
        notes.append(f"{why_not}: RabbitMQ figures are missing.")
        say(f"note: {why_not}")
    fs = filesystem_broker(folder / "fs", exchange)
    latency_broker = rabbit or fs
    results = Results({v.name: [] for v in LATENCY}, {}, latency_broker.name, notes)
    rng = random.Random(args.seed)
    lost: list[int] = []
    for round_no in range(1, args.rounds + 1):
        for variant in rng.sample(LATENCY, len(LATENCY)):
            ms = latency_round(url, latency_broker, variant, args.events, args.gap, lost)
            results.latency[variant.name].append(ms)
            say(
                f"round {round_no}/{args.rounds} latency {variant.name:15} "
                f"p50 {percentile(ms, 0.5):8.1f} ms  p99 {percentile(ms, 0.99):8.1f} ms"
            )

    if lost:
        notes.append(
            f"kombu's filesystem transport lost {sum(lost)} of the latency events (its consumer"
            " read a message file its producer had created but not yet written): figures are"
            " over the events that arrived."
        )

    def brokers(round_no: int) -> list[tuple[str, Broker | None]]:
        """Fresh folders and files each round: a transport's leftovers would slow the next."""
        here = folder / f"round-{round_no}"
        chosen: list[tuple[str, Broker | None]] = []
        if rabbit is not None:
            chosen.append((ONE_AT_A_TIME, rabbit))
            chosen.append((PIPELINED, rabbit))
            chosen.append((pipelined_big, rabbit))
            chosen.append((CEILING, rabbit))
            chosen.append((ceiling_big, rabbit))
        chosen.append(("kombu filesystem", filesystem_broker(here / "fs", exchange)))
        sqla_url = f"sqla+sqlite:///{here / 'kombu.sqlite3'}"
        chosen.append(("kombu SQLAlchemy (SQLite)", Broker("sqla", sqla_url, exchange, {})))
        chosen.append((NONE, None))
        chosen.append((none_pipelined, None))
        chosen.append((none_big, None))
        return chosen

    pipelined_big = f"{PIPELINED}, batches of {args.batch:,}"
    ceiling_big = f"{CEILING}, batches of {args.batch:,}"
    none_pipelined = f"{NONE_PIPELINED}, batches of 100"
    none_big = f"{NONE_PIPELINED}, batches of {args.batch:,}"
    big = (pipelined_big, ceiling_big, none_big)
    for name, _ in brokers(0):  # the table's order
        results.throughput[name] = []
    for round_no in range(1, args.rounds + 1):
        order = brokers(round_no)
        rng.shuffle(order)
        for name, broker in order:
            batch = args.batch if name in big else 100
            if broker is None:
                listed = ListPublisher() if name == NONE else pipelined_list()
                rate = throughput_round(url, name, listed, args.backlog, batch=batch)
            else:
                publisher = kombu_publisher(broker, one_at_a_time=name == ONE_AT_A_TIME)
                try:
                    with bound_queue(broker, publisher) as count:
                        if name.startswith(CEILING):
                            rate = ceiling_round(name, publisher, args.backlog, count, batch)
                        else:
                            rate = throughput_round(
                                url, name, publisher, args.backlog, count, batch
                            )
                finally:
                    publisher.close()
            results.throughput[name].append(rate)
            say(f"round {round_no}/{args.rounds} throughput {name:40} {rate:8.0f} events/s")
        if rabbit is None:
            continue
        for relays in rng.sample(RELAYS, len(RELAYS)):
            rate = relays_round(url, rabbit, relays, args.backlog, relays_batch(args))
            results.relays.setdefault(relays, []).append(rate)
            shared = f"{relays} relays sharing a backlog"
            say(f"round {round_no}/{args.rounds} {shared:40} {rate:8.0f} events/s")
    return results


def section(results: Results, facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rows = []
    medians: dict[str, tuple[float, float]] = {}
    for variant in LATENCY:
        rounds = results.latency[variant.name]
        p50 = statistics.median(percentile(r, 0.5) for r in rounds)
        p99 = statistics.median(percentile(r, 0.99) for r in rounds)
        medians[variant.name] = (p50, p99)
        rows.append(f"| {variant.name} | {p50:,.1f} | {p99:,.1f} | {variant.what} |")
    ratios = []
    for wake, poll in (("cli-listen", "cli-poll"), ("scheduler-wake", "scheduler-poll")):
        ratios.append(
            f"* p50 {poll} / {wake}: {medians[poll][0] / medians[wake][0]:,.0f}x; "
            f"p99: {medians[poll][1] / medians[wake][1]:,.0f}x"
        )
    throughput = [
        f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f} | {max(rates):,.0f} |"
        for name, rates in results.throughput.items()
    ]
    parts = [
        "## The outbox relay (`python -m bench.outbox`)",
        "",
        *facts.lines(),
        f"* {args.rounds} rounds; latency: {args.events} single-event commits, one every "
        f"{args.gap * 1000:g} ms, per variant per round, through {results.latency_broker}; "
        f"throughput: a backlog of {args.backlog:,} events per broker per round",
        f"* relays sharing a backlog: batches of {relays_batch(args):,}, pipelined confirms",
        "",
        "Publish latency, commit to consumer (median over rounds of each round's p50 and p99):",
        "",
        "| relay | p50 ms | p99 ms | what |",
        "|---|---:|---:|---|",
        *rows,
        "",
        *ratios,
        "",
        "Relay throughput, one relay draining the backlog in batches of 100 (unless said):",
        "",
        "| broker | events/s (median) | min | max |",
        "|---|---:|---:|---:|",
        *throughput,
        "",
    ]
    if results.relays:
        one = statistics.median(results.relays[1])
        parts += [
            "Relays sharing one backlog (RabbitMQ, pipelined confirms), from their common start",
            "to the last one's end:",
            "",
            "| relays | events/s (median) | min | max | / one relay |",
            "|---:|---:|---:|---:|---:|",
            *(
                f"| {n} | {statistics.median(r):,.0f} | {min(r):,.0f} | {max(r):,.0f} | "
                f"{statistics.median(r) / one:.2f}x |"
                for n, r in sorted(results.relays.items())
            ),
            "",
        ]
    parts += targets(results, medians, args)
    if results.notes:
        parts += [f"* {note}" for note in results.notes] + [""]
    parts += [
        "Latency is measured from the writer's clock right after its commit returned to the",
        "consumer's clock on arrival (same machine). Polling alone waits about half the poll",
        "interval, plus the publishing of the events ahead in its batch; a wake-up costs one relay",
        "run (a job-lock update for the scheduler's job, a select, the publish, the marking).",
        "One confirm at a time is bound by the broker's round trip per event; pipelined, the",
        "relay sends a batch (up to 500 messages in one write) and collects its confirms",
        "together, then marks it in one statement, so the database's statements and the",
        "relay's CPU bound it. The embedded transports are bound by their writes; `none` is the",
        "database's and the relay's share. RabbitMQ alone publishes events made in memory",
        "through the same publisher and connection, with no database: the most a relay on this",
        "machine can publish through this broker.",
    ]
    return parts


def targets(
    results: Results, medians: dict[str, tuple[float, float]], args: argparse.Namespace
) -> list[str]:
    """Issue 29's targets, met or not, on this run's figures."""
    lines = ["Targets (issue 29):", ""]

    def best(prefix: str) -> float | None:
        rates = [
            statistics.median(rates)
            for name, rates in results.throughput.items()
            if name.startswith(prefix) and rates
        ]
        return max(rates, default=None)

    rate, ceiling = best(PIPELINED), best(CEILING)
    if rate is not None:
        verdict = "met" if rate >= TARGET_RATE else "not met"
        lines.append(
            f"* one relay, RabbitMQ with confirms >= {TARGET_RATE:,.0f} events/s: {verdict} "
            f"({rate:,.0f})"
        )
        if ceiling is not None:
            lines.append(
                f"* RabbitMQ alone, the same publisher with no database: {ceiling:,.0f} messages/s;"
                f" the relay publishes at {rate / ceiling:.2f} of it"
            )
    else:
        lines.append("* one relay, RabbitMQ with confirms: not measured (no RabbitMQ)")
    p50 = medians["cli-listen"][0]
    verdict = "met" if p50 <= TARGET_LISTEN_P50_MS else "not met"
    lines.append(
        f"* LISTEN publish latency p50 <= {TARGET_LISTEN_P50_MS:g} ms: {verdict} ({p50:.1f} ms)"
    )
    return [*lines, ""]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    parser.add_argument("--events", type=int, help="trickle events per variant (default 300)")
    parser.add_argument("--gap", type=float, default=0.02, help="seconds between commits")
    parser.add_argument("--backlog", type=int, help="backlog per broker (default 10,000)")
    parser.add_argument(
        "--batch", type=int, default=1000, help="the relay's batch for the pipelined figures"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant order")
    parser.add_argument("--no-rabbitmq", action="store_true", help="leave RabbitMQ out")
    parser.add_argument("--database-url", help="a PostgreSQL URL (default: as the tests)")
    return {"rounds": (1, 3), "events": (20, 300), "backlog": (200, 10_000)}


def measure(url: str, args: argparse.Namespace) -> Results:
    with tempfile.TemporaryDirectory(prefix="bench-outbox-") as folder:
        return run(args, url, Path(folder))


def main(argv: t.Sequence[str] | None = None) -> int:
    """The benchmark's command; ``--writer`` and ``--drainer`` are its own
    processes (:func:`writer_main`, :func:`drainer_main`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--writer"]:
        n, gap, tag, scheduler = argv[1:]
        writer_main(int(n), float(gap), tag, scheduler == "1")
        return 0
    if argv[:1] == ["--drainer"]:
        drainer_main(int(argv[1]))
        return 0
    return harness.main(
        NAME, __doc__, argv, options, measure, section, server=harness.shared_server
    )


if __name__ == "__main__":
    sys.exit(main())
