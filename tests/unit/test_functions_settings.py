"""``idem.function`` where Flask apps work outside HTTP, in one process: an
APScheduler job, a ``flask`` command through the CLI runner, a kombu consumer on
kombu's in-memory transport (real kombu, no server). Each drives the billing
example (docs/examples/billing) as its docs show it, on every engine, and counts
the charges it committed; the live tests (tests/live/test_functions_live.py)
add real processes, real kills and RabbitMQ.
"""

from __future__ import annotations

import datetime as dt
import threading
import typing as t
import uuid

import pytest

from tests.support import billing

CHARGE = {"invoice_id": "inv-1", "amount": 500, "payment_id": None}


@pytest.fixture
def app(database_url: str) -> t.Iterator[t.Any]:
    app = billing.fresh_app(database_url)
    yield app
    with app.app_context():
        billing.example().db.engine.dispose()


# -- APScheduler ----------------------------------------------------------------


class Runs:
    """What a scheduler's job runs returned (or raised), as its listener saw them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.results: list[t.Any] = []
        self.done = threading.Condition(self.lock)

    def listener(self, event: t.Any) -> None:
        with self.lock:
            self.results.append(event.exception if event.exception else event.retval)
            self.done.notify_all()

    def wait(self, count: int) -> list[t.Any]:
        with self.lock:
            assert self.done.wait_for(lambda: len(self.results) >= count, timeout=60)
            return list(self.results)


def scheduler(runs: Runs) -> t.Any:
    from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_EXECUTED
    from apscheduler.schedulers.background import BackgroundScheduler

    started = BackgroundScheduler(timezone=dt.timezone.utc)
    started.add_listener(runs.listener, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    started.start()
    return started


def test_a_job_run_again_after_a_restart_returns_the_first_charge(app: t.Any) -> None:
    job = billing.example("job")
    runs = Runs()
    first = scheduler(runs)
    job.schedule_charge(first, app, "inv-1", 500)
    runs.wait(1)
    first.shutdown()
    # The process restarts and catches up a run it believes missed (misfired ten
    # minutes ago, within the job's grace time): the same invoice again.
    second = scheduler(runs)
    ago = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10)
    job.schedule_charge(second, app, "inv-1", 500, at=ago)
    made, again = runs.wait(2)
    second.shutdown()
    assert not made.replayed
    assert again.replayed
    assert again.value == made.value
    assert made.value["invoice_id"] == "inv-1"
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


def test_two_schedulers_firing_the_same_job_at_once_charge_once(app: t.Any) -> None:
    """Two processes with the same schedule (two schedulers here, each with its
    own threads) run the same job at the same time: one charge, and both runs
    end with it."""
    job = billing.example("job")
    runs = Runs()
    schedulers = [scheduler(runs) for _ in range(2)]
    at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=0.5)
    for each in schedulers:
        job.schedule_charge(each, app, "inv-1", 500, at=at)
    outcomes = runs.wait(2)
    for each in schedulers:
        each.shutdown()
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert sorted(o.replayed for o in outcomes) == [False, True]
    assert outcomes[0].value == outcomes[1].value
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
def test_a_job_run_that_failed_is_run_again_by_the_next_one(
    app: t.Any, failure: type[BaseException]
) -> None:
    """The first run raises inside the function, after its charge row was written
    (flushed, not committed): nothing of it stays, the key is free, and the next
    run (the scheduler's retry) charges."""
    from sqlalchemy import event, orm

    job = billing.example("job")
    failures = [failure("the processor's answer could not be read")]

    def fail_once(session: orm.Session, context: t.Any) -> None:
        if failures and any(isinstance(o, billing.example().Charge) for o in session.new):
            raise failures.pop()

    event.listen(orm.Session, "after_flush", fail_once)
    try:
        runs = Runs()
        each = scheduler(runs)
        job.schedule_charge(each, app, "inv-1", 500)
        runs.wait(1)
        job.schedule_charge(each, app, "inv-1", 500)
        failed, made = runs.wait(2)
        each.shutdown()
    finally:
        event.remove(orm.Session, "after_flush", fail_once)
    assert isinstance(failed, failure)
    assert not made.replayed
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


def test_the_extensions_scheduler_runs_a_billing_job_charging_each_invoice_once(
    app: t.Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job on the extension's own scheduler (JobScheduler): two processes'
    schedulers each run it (the first's run outlived its job lock, or its process
    died after charging); each invoice is charged once, the second run replays."""
    from flask_idempotency.scheduler import JobScheduler

    job = billing.example("job")
    due = [("inv-1", 500), ("inv-2", 700)]
    seen: list[t.Any] = []
    charge_job = job.charge_job

    def recorded(app: t.Any, invoice_id: str, amount: int) -> t.Any:
        seen.append(charge_job(app, invoice_id, amount))
        return seen[-1]

    monkeypatch.setattr(job, "charge_job", recorded)  # (to see each charge's outcome)
    run = job.charge_due(lambda: due)
    assert JobScheduler(app).run_job("billing.charge-due", run)
    assert JobScheduler(app).run_job("billing.charge-due", run)
    assert [o.replayed for o in seen] == [False, False, True, True]
    assert [o.value for o in seen[2:]] == [o.value for o in seen[:2]]
    rows = billing.charges(app.config["SQLALCHEMY_DATABASE_URI"])
    assert rows == [CHARGE, {**CHARGE, "invoice_id": "inv-2", "amount": 700}]


# -- A flask command --------------------------------------------------------------


def test_a_command_run_twice_charges_once_and_prints_the_first_charge(app: t.Any) -> None:
    runner = app.test_cli_runner()
    first = runner.invoke(args=["charge-invoice", "inv-1", "500"])
    second = runner.invoke(args=["charge-invoice", "inv-1", "500"])
    assert first.exit_code == 0, first.output
    assert second.exit_code == 0, second.output
    assert first.output.startswith("charged {")
    assert second.output == first.output.replace("charged", "replayed", 1)
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


def test_a_command_with_another_amount_for_a_charged_invoice_is_refused(app: t.Any) -> None:
    runner = app.test_cli_runner()
    assert runner.invoke(args=["charge-invoice", "inv-1", "500"]).exit_code == 0
    other = runner.invoke(args=["charge-invoice", "inv-1", "700"])
    assert other.exit_code == 1
    assert "inv-1 was charged with other arguments" in other.output
    assert "Traceback" not in other.output
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


# -- A kombu consumer ---------------------------------------------------------------


@pytest.fixture
def memory() -> t.Iterator[t.Any]:
    """kombu's in-memory broker (one per process, shared by its connections)."""
    import kombu

    with kombu.Connection("memory://") as connection:
        yield connection


@pytest.fixture
def queue() -> t.Any:
    return billing.example("consumer").charge_queue(f"billing.charges.{uuid.uuid4().hex[:8]}")


def test_a_message_published_twice_charges_once(app: t.Any, memory: t.Any, queue: t.Any) -> None:
    consumer = billing.example("consumer")
    for _ in range(2):  # the producer retried a publish whose confirm it lost
        consumer.request_charge(memory, queue, "inv-1", 500)
    made, again = consumer.consume(app, memory, queue, count=2)
    assert (made.replayed, again.replayed) == (False, True)
    assert again.value == made.value
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]


def test_a_message_requeued_after_its_charge_charges_once(
    app: t.Any, memory: t.Any, queue: t.Any
) -> None:
    """The first consumer charges, then fails before it is done with the message
    (its reply could not be sent, say) and rejects it with requeue: the broker
    delivers it again, and that delivery gets the first charge."""
    import kombu

    consumer = billing.example("consumer")
    consumer.request_charge(memory, queue, "inv-1", 500)
    first: list[t.Any] = []

    def process_then_requeue(body: dict[str, t.Any], message: t.Any) -> None:
        first.append(consumer.process(app, body))
        message.requeue()

    with kombu.Consumer(memory, queues=[queue], callbacks=[process_then_requeue]):
        memory.drain_events(timeout=10)
    [again] = consumer.consume(app, memory, queue, count=1)
    with pytest.raises(TimeoutError):  # acked now: nothing more to deliver
        consumer.consume(app, memory, queue, count=1, timeout=0.2)
    assert not first[0].replayed
    assert again.replayed
    assert again.value == first[0].value
    assert billing.charges(app.config["SQLALCHEMY_DATABASE_URI"]) == [CHARGE]
