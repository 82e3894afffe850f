"""``idem.function`` with real processes: the billing example's command run as
``flask --app billing.app ...``, calls killed with SIGKILL before and after
their commit and between recovery points, and a kombu consumer on RabbitMQ
(skipped, saying why, where none answers at 127.0.0.1:5672).

Every test counts what happened: the ``charges`` rows committed, and the calls
the fake payment processor (tests/support/downstream.py) recorded.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from flask_idempotency import errors
from flask_idempotency._storage.schema import as_utc, record_table
from tests.conftest import run_sql
from tests.support import billing, sealing
from tests.support.downstream import Downstream
from tests.support.live import ROOT

pytestmark = pytest.mark.slow

LEASE = 3  # seconds: short, so that a test outlives it
CHARGE = {"invoice_id": "inv-1", "amount": 500, "payment_id": None}


@pytest.fixture
def url(database_url: str) -> t.Iterator[str]:
    app = billing.fresh_app(database_url)
    yield database_url
    with app.app_context():
        billing.example().db.engine.dispose()


def python_path(*first: Path) -> str:
    """``PYTHONPATH`` with ``first`` before what the environment has."""
    given = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([*map(str, first), *given])


def call(
    url: str,
    function: str,
    crash: str = "none",
    *,
    config: dict[str, t.Any] | None = None,
    args: tuple[str, str] = ("inv-1", "500"),
) -> tuple[int, dict[str, t.Any]]:
    """``billing.app.<function>("inv-1", 500)`` in a process of its own, killed at
    ``crash`` (tests/support/billing.py); its exit code and what it printed
    (``{}`` for a killed one)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.support.billing",
            url,
            function,
            crash,
            *args,
            json.dumps(config or {}),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": python_path(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}


# -- A flask command, as a real process ---------------------------------------------


def flask(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flask", "--app", "billing.app", *args],
        cwd=billing.EXAMPLES,
        env={
            **os.environ,
            "PYTHONPATH": python_path(ROOT, billing.EXAMPLES),
            "FLASK_SQLALCHEMY_DATABASE_URI": url,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_command_run_twice_by_an_operator_charges_once(url: str) -> None:
    first = flask(url, "charge-invoice", "inv-1", "500")
    second = flask(url, "charge-invoice", "inv-1", "500")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert first.stdout.startswith("charged {")
    assert second.stdout == first.stdout.replace("charged", "replayed", 1)
    other = flask(url, "charge-invoice", "inv-1", "700")
    assert other.returncode == 1
    assert "inv-1 was charged with other arguments" in other.stderr
    assert "Traceback" not in other.stderr
    assert billing.charges(url) == [CHARGE]


# -- Real kills ------------------------------------------------------------------------


@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
def test_killed_right_after_its_commit_the_rerun_returns_the_stored_charge(
    url: str, sealed: bool
) -> None:
    """Sealed: the value was stored under the app's encryption keys, and the
    rerun, another process, opens it with the same keys."""
    config = sealing.sealed_config() if sealed else {}
    code, _ = call(url, "charge_invoice", "after_commit", config=config)
    assert code == -signal.SIGKILL
    assert billing.charges(url) == [CHARGE]  # the charge and its record committed
    [(stored,)] = run_sql(url, "SELECT response_body FROM idempotency_keys")
    text = stored if isinstance(stored, str) else bytes(stored).decode("latin-1")
    assert ("invoice_id" in text) is not sealed
    code, rerun = call(url, "charge_invoice", config=config)
    assert code == 0
    assert rerun["replayed"] is True
    assert rerun["value"]["invoice_id"] == "inv-1"
    assert billing.charges(url) == [CHARGE]


@pytest.mark.parametrize("crash", ["in_body", "before_commit"])
def test_killed_before_its_commit_the_rerun_charges_once(url: str, crash: str) -> None:
    code, _ = call(url, "charge_invoice", crash)
    assert code == -signal.SIGKILL
    assert billing.charges(url) == []  # nothing of the call committed
    code, rerun = call(url, "charge_invoice")
    assert code == 0
    assert rerun["replayed"] is False
    assert billing.charges(url) == [CHARGE]
    code, again = call(url, "charge_invoice")
    assert again["replayed"] is True
    assert again["value"] == rerun["value"]


def start(url: str, crash: str = "none") -> subprocess.Popen[str]:
    """:func:`call`, started and left running."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.billing",
            url,
            "charge_invoice",
            crash,
            "inv-1",
            "500",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": python_path(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


#: A session of the test's database waiting on a lock, as each server tells it.
LOCK_WAITS = {
    "postgresql": "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    " AND datname = current_database() AND application_name = :name",
    "mysql": "SELECT 1 FROM information_schema.innodb_trx AS trx"
    " JOIN information_schema.processlist AS p ON p.id = trx.trx_mysql_thread_id"
    " WHERE trx.trx_state = 'LOCK WAIT' AND p.db = DATABASE()",
}


def waits_on_a_lock(url: str, name: str, deadline: float) -> bool:
    """Whether the second caller (``application_name`` ``name`` on PostgreSQL; a
    session of the test's own database on MySQL/MariaDB) waits on a lock. SQLite
    cannot tell: after a moment, assume so (a second caller that came after the
    first's commit only makes the test a plain repeat)."""
    sql = LOCK_WAITS.get(sa.make_url(url).get_backend_name())
    if sql is None:
        time.sleep(0.5)
        return True
    while time.monotonic() < deadline:
        if run_sql(url, sql, name=name):
            return True
        time.sleep(0.02)
    return False


def test_two_processes_calling_at_once_charge_once(url: str, tmp_path: Path) -> None:
    """The second caller comes while the first holds its claim, uncommitted: it
    waits on the claim's row, then returns the charge the first committed."""
    gate = tmp_path / "gate"
    first = start(url, f"hold:{gate}")
    deadline = time.monotonic() + 60
    while not gate.with_suffix(".held").exists():
        assert first.poll() is None, first.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    name = f"billing-{uuid.uuid4().hex[:8]}"
    named = url
    if url.startswith("postgresql"):
        named = sa.make_url(url).update_query_dict({"application_name": name})
        named = named.render_as_string(hide_password=False)
    second = start(named)
    try:
        assert waits_on_a_lock(url, name, time.monotonic() + 30)
    finally:
        gate.touch()
    outputs = [each.communicate(timeout=120) for each in (first, second)]
    for each, (_, err) in zip((first, second), outputs, strict=True):
        assert each.returncode == 0, err
    made, again = (json.loads(out) for out, _ in outputs)
    assert made["replayed"] is False
    assert again["replayed"] is True
    assert again["value"] == made["value"]
    assert billing.charges(url) == [CHARGE]


@pytest.fixture
def processor() -> t.Iterator[Downstream]:
    service = Downstream().start()
    yield service
    service.stop()


def locked_until(url: str) -> dt.datetime:
    """The lease of the one record, read through the table's types (SQLite has no
    timestamp of its own)."""
    table = record_table(sa.MetaData())
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            [until] = conn.execute(sa.select(table.c.locked_until)).scalars()
    finally:
        engine.dispose()
    assert until is not None
    return t.cast(dt.datetime, as_utc(until))


def test_a_leased_call_killed_after_its_first_step_resumes_after_the_lease(
    url: str, processor: Downstream
) -> None:
    config = {"BILLING_PROCESSOR_URL": processor.url, "IDEMPOTENCY_LEASE": LEASE}
    code, _ = call(url, "settle_invoice", "after_step:payment", config=config)
    assert code == -signal.SIGKILL
    assert processor.calls_for("payments") == 1
    assert processor.calls_for("receipts") == 0
    assert billing.charges(url) == []
    # Within the lease the record is held by the dead call: refused, with when to
    # retry (asked in this process: a new one may take longer than the lease to start).
    until = locked_until(url)
    app = billing.example().create_app({"SQLALCHEMY_DATABASE_URI": url, **config})
    with app.app_context():
        # With a margin: the lease must not end between this check and the claim.
        if until - dt.datetime.now(dt.timezone.utc) > dt.timedelta(seconds=1):
            with pytest.raises(errors.OperationInProgressError) as held:
                billing.example().settle_invoice("inv-1", 500)
            assert held.value.retry_after
        billing.example().db.engine.dispose()
    assert processor.calls_for("payments") == 1
    # What an operator sees (a real `flask idempotency` process): the call in
    # progress with its first step saved, not to be released (whether or not its
    # lease ended by now: a release would lose the step).
    shown = flask(url, "idempotency", "show", "billing.settle", "inv-1")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["status"] == "in_progress"
    assert record["recovery_point_names"] == ["payment"]
    refused = flask(url, "idempotency", "release", "billing.settle", "inv-1", "--yes")
    assert refused.returncode == 1
    assert "not released" in refused.stderr
    assert "Traceback" not in refused.stderr
    time.sleep(max(0.0, (until - dt.datetime.now(dt.timezone.utc)).total_seconds()) + 0.2)
    code, resumed = call(url, "settle_invoice", config=config)
    assert code == 0, resumed
    assert resumed["replayed"] is False
    # The payment step was not called again; the receipt, after it, was called once.
    assert processor.calls_for("payments") == 1
    assert processor.calls_for("receipts") == 1
    [payment] = [effect["id"] for (op, _), effect in processor.effects.items() if op == "payments"]
    assert resumed["value"]["payment_id"] == payment
    assert billing.charges(url) == [{**CHARGE, "payment_id": payment}]
    shown = flask(url, "idempotency", "show", "billing.settle", "inv-1")
    assert json.loads(shown.stdout)["status"] == "completed"
    code, again = call(url, "settle_invoice", config=config)
    assert again["replayed"] is True
    assert again["value"] == resumed["value"]
    assert processor.calls_for("payments") == 1
    assert processor.calls_for("receipts") == 1


# -- A kombu consumer on RabbitMQ -------------------------------------------------------

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def rabbitmq() -> t.Iterator[t.Any]:
    import kombu

    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError as exc:
        pytest.skip(f"no RabbitMQ at 127.0.0.1:5672: {exc}")
    with kombu.Connection(RABBITMQ) as connection:
        yield connection


@pytest.fixture
def rabbit_queue(rabbitmq: t.Any) -> t.Iterator[t.Any]:
    queue = billing.example("consumer").charge_queue(f"billing.charges.{uuid.uuid4().hex[:8]}")
    yield queue
    queue(rabbitmq.channel()).delete()  # leave nothing behind on a shared server


def test_rabbitmq_redelivers_after_a_lost_ack_and_the_consumer_charges_once(
    url: str, rabbitmq: t.Any, rabbit_queue: t.Any
) -> None:
    import kombu

    consumer = billing.example("consumer")
    app = billing.example().create_app({"SQLALCHEMY_DATABASE_URI": url})
    consumer.request_charge(rabbitmq, rabbit_queue, "inv-1", 500)
    consumer.request_charge(rabbitmq, rabbit_queue, "inv-1", 500)  # a retried publish
    first: list[t.Any] = []
    with kombu.Connection(RABBITMQ) as dying:

        def process_without_ack(body: dict[str, t.Any], message: t.Any) -> None:
            first.append(consumer.process(app, body))

        with kombu.Consumer(
            dying, queues=[rabbit_queue], callbacks=[process_without_ack], prefetch_count=1
        ):
            dying.drain_events(timeout=10)
    # The connection closed with the message unacked: RabbitMQ redelivers it.
    outcomes = consumer.consume(app, rabbitmq, rabbit_queue, count=2)
    assert not first[0].replayed
    assert [o.replayed for o in outcomes] == [True, True]
    assert {json.dumps(o.value) for o in outcomes} == {json.dumps(first[0].value)}
    assert billing.charges(url) == [CHARGE]
    with app.app_context():
        billing.example().db.engine.dispose()


def test_a_consumer_killed_between_its_commit_and_its_ack_is_answered_on_redelivery(
    url: str, rabbitmq: t.Any, rabbit_queue: t.Any
) -> None:
    """A consumer process charges, commits, and is SIGKILLed before its ack:
    RabbitMQ redelivers the message to the next consumer, which gets the charge
    the dead one made."""
    consumer = billing.example("consumer")
    consumer.request_charge(rabbitmq, rabbit_queue, "inv-1", 500)
    code, _ = call(url, "consume", "after_commit", args=(RABBITMQ, rabbit_queue.name))
    assert code == -signal.SIGKILL
    assert billing.charges(url) == [CHARGE]
    code, redelivered = call(url, "consume", args=(RABBITMQ, rabbit_queue.name))
    assert code == 0, redelivered
    assert redelivered["replayed"] is True
    assert redelivered["value"]["invoice_id"] == "inv-1"
    assert billing.charges(url) == [CHARGE]
