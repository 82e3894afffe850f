"""Relay wake-ups: the scheduler's relay job runs right after a commit that
carried events, not at its next poll.

Every scheduler here polls every 60 s, and nothing runs a relay at start, so an
event published within :data:`SOON` seconds was published by a wake-up: in
this process after the commit, or, on PostgreSQL, through LISTEN/NOTIFY from
another process. (:data:`SOON` is generous: these are not timing assertions.)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
from flask import Flask

from flask_idempotency import signals
from flask_idempotency._maintenance.scheduler import JobScheduler
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency.publishers import ListPublisher
from tests.conftest import run_sql
from tests.support import outbox_app, pgbouncer
from tests.support.live import ROOT
from tests.support.outbox import post, relay_command, reset, rows

POLL = 60.0
SOON = 10.0


def wait_until(condition: t.Callable[[], object], timeout: float = SOON) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(params=["postgresql", "sqlite"])
def url(request: pytest.FixtureRequest, pg_url: str, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return pg_url
    return f"sqlite:///{tmp_path / 'wake.sqlite3'}"


def named(url: str) -> tuple[str, str]:
    """``url`` with an application_name of its own (PostgreSQL), and the name:
    its connections, the LISTEN one among them, can be told apart in
    pg_stat_activity from those of other tests sharing the server."""
    name = f"wake-{uuid.uuid4().hex[:10]}"
    return pgbouncer.named(url, name), name


def listening(pg_url: str, name: str) -> int:
    return int(
        run_sql(
            pg_url,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = :name AND query = 'LISTEN idempotency_outbox'",
            name=name,
        )[0][0]
    )


def make_app(url: str, publisher: t.Any, **config: t.Any) -> Flask:
    app = outbox_app.create_app(
        url, IDEMPOTENCY_PUBLISHER=publisher, IDEMPOTENCY_RELAY_EVERY=POLL, **config
    )
    reset(url)
    return app


def dispose(app: Flask) -> None:
    with app.app_context():
        outbox_app.db.engine.dispose()


@contextlib.contextmanager
def relay_runs(app: Flask) -> t.Iterator[list[str]]:
    """The holder of each relay run started for ``app`` meanwhile."""
    runs: list[str] = []

    def on_start(sender: Flask, **kw: t.Any) -> None:
        if sender is app and kw["name"] == "relay":
            runs.append(kw["holder"])

    signals.job_started.connect(on_start, weak=False)
    try:
        yield runs
    finally:
        signals.job_started.disconnect(on_start)


def test_an_in_process_commit_wakes_the_in_process_scheduler(url: str) -> None:
    """IDEMPOTENCY_SCHEDULER=True: the request that starts the scheduler emits,
    and the relay publishes it long before its 60 s poll."""
    publisher = ListPublisher()
    app = make_app(url, publisher, IDEMPOTENCY_SCHEDULER=True)
    slot = app.extensions["idempotency"].in_process
    try:
        assert post(app, key="k1").status_code == 201
        assert slot.scheduler is not None
        assert wait_until(lambda: publisher.events), "not published before the poll"
        assert post(app, key="k2", twice=True).status_code == 201
        assert wait_until(lambda: len(publisher.events) == 3), publisher.events
        assert [e.event_id for e in publisher.events] == [r["event_id"] for r in rows(app)]
        # The relay publishes, then marks the batch published in its own
        # transaction: a loaded machine can see the events before the mark.
        assert wait_until(lambda: all(r["published_at"] is not None for r in rows(app)))
    finally:
        slot.shutdown()
        dispose(app)


def test_an_emit_that_rolls_back_wakes_nothing_harmful(url: str) -> None:
    """A failed request's event rolls back: nothing is published, no row is
    left, on SQLite no relay run even starts (on PostgreSQL the NOTIFY is
    dropped with the rollback, but other tests may notify the same channel);
    and the next committed emit still wakes the relay."""
    publisher = ListPublisher()
    app = make_app(url, publisher)
    jobs = JobScheduler(app)
    jobs.start()
    try:
        with relay_runs(app) as runs:
            assert post(app, key="bad", fail=True).status_code == 500
            time.sleep(0.5)
            assert rows(app) == []
            assert publisher.events == []
            if url.startswith("sqlite"):
                assert runs == []
            assert post(app, key="good").status_code == 201
            assert wait_until(lambda: publisher.events)
            assert [e.event_id for e in publisher.events] == [r["event_id"] for r in rows(app)]
    finally:
        jobs.shutdown()
        dispose(app)


class GatedPublisher:
    """Holds its first publish until ``gate`` is set; counts publishes in
    progress at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.events: list[OutboxEvent] = []
        self.busy = self.most_busy = 0
        self._lock = threading.Lock()

    def publish(self, event: OutboxEvent) -> None:
        with self._lock:
            self.busy += 1
            self.most_busy = max(self.most_busy, self.busy)
        try:
            self.entered.set()
            self.gate.wait(SOON)
            self.events.append(event)
        finally:
            with self._lock:
                self.busy -= 1


def test_a_commit_during_a_poll_run_is_published_by_that_run_going_round_again(
    pg_url: str,
) -> None:
    """One relay run at a time per scheduler: a wake-up while the poll's run is
    publishing (it read the outbox before the commit) makes that run go round
    again rather than start a second run, and the event is not left to the
    next poll; no two publishes ever overlap. (PostgreSQL: on SQLite the emit
    would wait for the relay's write lock.)"""
    publisher = GatedPublisher()
    app = make_app(pg_url, publisher)
    with app.app_context():  # before the scheduler listens: no wake-up
        add_event(outbox_app.db.session, "t", {}, event_id="first")
        outbox_app.db.session.commit()
    jobs = JobScheduler(app)
    jobs.start()
    poll = threading.Thread(target=jobs.relay_now, args=(dt.timedelta(seconds=POLL),))
    try:
        poll.start()  # what the poll's tick runs
        assert publisher.entered.wait(SOON)
        assert post(app, key="second").status_code == 201  # while "first" is held
        time.sleep(0.3)  # its wake-up arrives during the run
        publisher.gate.set()
        assert wait_until(lambda: len(publisher.events) == 2), publisher.events
        assert publisher.most_busy == 1
        assert [e.event_id for e in publisher.events] == [r["event_id"] for r in rows(app)]
    finally:
        publisher.gate.set()
        poll.join(SOON)
        jobs.shutdown()
        dispose(app)


def test_a_commit_in_another_process_wakes_the_scheduler_and_shutdown_unlistens(
    pg_url: str,
) -> None:
    """PostgreSQL: the scheduler LISTENs, so an event committed by another
    process is published at once; shutdown closes the LISTEN connection."""
    listen_url, name = named(pg_url)
    publisher = ListPublisher()
    app = make_app(listen_url, publisher)
    jobs = JobScheduler(app)
    jobs.start()
    try:
        assert jobs.waker is not None
        assert jobs.waker.listening
        assert listening(pg_url, name) == 1
        script = (
            "import os\n"
            "from tests.support import outbox_app\n"
            "from flask_idempotency._messaging.outbox import add_event\n"
            "app = outbox_app.create_app(os.environ['OUTBOX_TEST_DB'])\n"
            "with app.app_context():\n"
            "    add_event(outbox_app.db.session, 't', {'n': 1}, event_id='elsewhere')\n"
            "    outbox_app.db.session.commit()\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OUTBOX_TEST_DB": pg_url}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert wait_until(lambda: publisher.events), "not published before the poll"
        assert [e.event_id for e in publisher.events] == ["elsewhere"]
    finally:
        jobs.shutdown()
        dispose(app)
    assert jobs.waker is None
    assert listening(pg_url, name) == 0


def test_without_wake_ups_the_scheduler_only_polls(tmp_path: Path) -> None:
    """IDEMPOTENCY_RELAY_WAKE=False: no wake-up thread; the event waits for the
    poll (here it is never due, so it stays unpublished)."""
    publisher = ListPublisher()
    url = f"sqlite:///{tmp_path / 'poll.sqlite3'}"
    app = make_app(url, publisher, IDEMPOTENCY_RELAY_WAKE=False)
    jobs = JobScheduler(app)
    jobs.start()
    try:
        assert jobs.waker is None
        assert post(app, key="k1").status_code == 201
        time.sleep(0.5)
        assert publisher.events == []
        assert rows(app)[0]["published_at"] is None
    finally:
        jobs.shutdown()
        dispose(app)


def test_a_scheduler_process_wakes_on_notify_and_sigterm_stops_its_listener(
    pg_url: str, tmp_path: Path
) -> None:
    """``flask idempotency scheduler`` on PostgreSQL: an event committed here is
    published by that process before its 60 s poll; SIGTERM stops it promptly
    (the wake-up thread blocked in select() does not hold it up), exit 0, and
    its LISTEN connection is gone."""
    listen_url, name = named(pg_url)
    app = outbox_app.create_app(pg_url)
    reset(pg_url)
    out = tmp_path / "published.jsonl"
    env, cmd = relay_command(listen_url, out)
    cmd[-1] = "scheduler"
    env["OUTBOX_TEST_CONFIG"] = json.dumps({"IDEMPOTENCY_RELAY_EVERY": POLL})
    process = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        assert "scheduler running" in banner, banner
        assert "LISTEN" in banner, banner
        assert listening(pg_url, name) == 1
        with app.app_context():
            add_event(outbox_app.db.session, "t", {}, event_id="woken")
            outbox_app.db.session.commit()
        assert wait_until(lambda: out.exists() and out.read_text()), "not published"
        assert json.loads(out.read_text())["event_id"] == "woken"
        process.send_signal(signal.SIGTERM)
        assert process.wait(SOON) == 0
        assert "stopped" in process.stdout.read()
        assert listening(pg_url, name) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
        dispose(app)


def test_a_wake_up_skipped_behind_another_process_run_is_tried_again(tmp_path: Path) -> None:
    """SQLite (no LISTEN): while another process's relay run holds the job lock,
    a wake-up here is skipped; it is tried again until it runs, not left to the
    poll (that run may have read the outbox before this commit)."""
    publisher = ListPublisher()
    app = make_app(f"sqlite:///{tmp_path / 'held.sqlite3'}", publisher)
    jobs = JobScheduler(app)
    with app.app_context():
        engine, now = outbox_app.db.engine, jobs.state.clock()
        assert jobs.locks.acquire(engine, "relay", "elsewhere:1", dt.timedelta(minutes=1), now)
    jobs.start()
    try:
        with relay_runs(app) as runs:
            assert post(app, key="k1").status_code == 201
            time.sleep(0.6)
            assert publisher.events == []  # skipped: the lock is held elsewhere
            with app.app_context():
                jobs.locks.release(engine, "relay", "elsewhere:1", jobs.state.clock())
            assert wait_until(lambda: publisher.events), "left to the poll"
            assert runs == [jobs.holder]
    finally:
        jobs.shutdown()
        dispose(app)


def test_while_the_broker_is_away_commits_do_not_each_make_a_connection_attempt(
    url: str,
) -> None:
    """The broker is unavailable and the app commits an event every 50 ms for
    1.5 s: the first wake-up's run finds the broker away, and the wake-ups
    after it wait out BROKER_PAUSE (5 s) instead of each making a run and a
    connection attempt (it used to be one per commit). The wake-up that
    waited is not lost: when the pause ends it runs, the broker is back, and
    every event goes out, long before the 60 s poll."""
    from flask_idempotency.errors import BrokerUnavailable
    from flask_idempotency.publishers import CallablePublisher

    attempts: list[float] = []
    published: list[str] = []
    away = threading.Event()
    away.set()

    def publish(event: OutboxEvent) -> None:
        attempts.append(time.monotonic())
        if away.is_set():
            raise BrokerUnavailable("connection refused")
        published.append(event.event_id)

    app = make_app(url, CallablePublisher(publish))
    jobs = JobScheduler(app)
    jobs.start()
    try:
        for i in range(30):
            with app.app_context():
                add_event(outbox_app.db.session, "t", {"i": i}, event_id=f"e{i}")
                outbox_app.db.session.commit()
            time.sleep(0.05)
        assert wait_until(lambda: len(attempts) >= 1)  # a wake-up ran (a slow machine's late)
        assert len(attempts) <= 2, len(attempts)  # not one per commit
        away.clear()
        assert wait_until(lambda: len(published) == 30), (len(attempts), len(published))
        assert published == [f"e{i}" for i in range(30)]
    finally:
        jobs.shutdown()
        dispose(app)
