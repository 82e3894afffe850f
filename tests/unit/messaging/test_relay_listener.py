"""The relay's LISTEN wait: past 1,024 open files, on psycopg 3, and when its
connection keeps failing (issue 15, item 8).

``Listener.wait`` used ``select()``, which refuses a file descriptor of 1,024
or more: in a busy process every wait failed, and the scheduler's waker opened
a new LISTEN connection at once, in a loop. It waits with :mod:`selectors`
now, LISTENs on psycopg 3 as on psycopg2, and both the waker and the
foreground relay pause, longer each time, after a failed wait.

Wake-ups here come from ``pg_notify`` on a connection outside the app (not a
commit in this process, which wakes a listener through its pipe anyway), so
only the LISTEN connection can deliver them.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance import scheduler as scheduler_module
from flask_idempotency._maintenance.scheduler import JobScheduler, RelayWaker
from flask_idempotency._messaging.listener import Listener
from flask_idempotency.publishers import ListPublisher
from tests.conftest import direct_postgres_url, run_sql
from tests.support import outbox_app, pgbouncer
from tests.support.live import ROOT
from tests.support.outbox import relay_command, reset
from tests.support.tcp_proxy import TcpProxy, upstream_of

SOON = 10.0  # generous: a bound for the test, not a timing assertion


def on_driver(pg_url: str, driver: str, name: str) -> str:
    """``pg_url`` through ``driver``, its connections named ``name`` in
    pg_stat_activity (behind the suite's PgBouncer: its relay's LISTEN
    connection, on IDEMPOTENCY_RELAY_LISTEN_URL, :func:`pgbouncer.named`)."""
    url = sa.make_url(pg_url).set(drivername=f"postgresql+{driver}")
    return pgbouncer.named(url.render_as_string(hide_password=False), name)


@pytest.fixture(params=["psycopg2", "psycopg"])
def driver(request: pytest.FixtureRequest) -> str:
    return t.cast(str, request.param)


def notify(pg_url: str) -> None:
    run_sql(pg_url, "SELECT pg_notify('idempotency_outbox', '')")


def assert_an_event_from_elsewhere_is_relayed(pg_url: str, publisher: ListPublisher) -> None:
    """An event written and NOTIFYed by a connection outside the app reaches
    ``publisher`` within :data:`SOON` seconds, long before a 60 s poll."""
    run_sql(
        pg_url,
        "INSERT INTO idempotency_outbox (event_id, topic, payload, created_at, attempts)"
        " VALUES ('from-elsewhere', 't', '{}', now(), 0)",
    )
    notify(pg_url)
    deadline = time.monotonic() + SOON
    while not publisher.events and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [e.event_id for e in publisher.events] == ["from-elsewhere"]


@contextlib.contextmanager
def started_scheduler(app: Flask) -> t.Iterator[JobScheduler]:
    """A scheduler started on ``app``; after, shut down and the app's
    connections closed."""
    jobs = JobScheduler(app)
    jobs.start()
    try:
        yield jobs
    finally:
        jobs.shutdown()
        with app.app_context():
            outbox_app.db.engine.dispose()


def listen_backends(pg_url: str, name: str) -> list[int]:
    rows = run_sql(
        pg_url,
        "SELECT pid FROM pg_stat_activity WHERE application_name = :name"
        " AND query = 'LISTEN idempotency_outbox'",
        name=name,
    )
    return [row[0] for row in rows]


def test_the_listener_wakes_on_notify_past_1024_open_files(pg_url: str, driver: str) -> None:
    """With 1,100 files open, the listener's pipe and LISTEN socket get numbers
    past select()'s limit of 1,024: a wait still sleeps until a notification
    and wakes on it (on psycopg2 it raised ValueError; psycopg 3 did not LISTEN
    at all)."""
    name = f"fds-{uuid.uuid4().hex[:10]}"
    app = outbox_app.create_app(on_driver(pg_url, driver, name))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler: list[int] = []
    listener: Listener | None = None
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        listener = Listener(app)
        assert listener.listening
        assert listen_backends(pg_url, name)
        assert listener.wait(0.1) is False  # nothing yet: it sleeps, it does not fail
        notify(pg_url)
        assert listener.wait(SOON) is True
        assert listener.wait(0.1) is False  # the notification was consumed
    finally:
        if listener is not None:
            listener.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        with app.app_context():
            outbox_app.db.engine.dispose()


def test_a_lost_listen_connection_makes_the_wait_fail(pg_url: str, driver: str) -> None:
    """The server ends the LISTEN connection: the next wait raises (the caller
    listens again) instead of reporting a wake-up on every call for ever."""
    name = f"lost-{uuid.uuid4().hex[:10]}"
    app = outbox_app.create_app(on_driver(pg_url, driver, name))
    listener = Listener(app)
    try:
        [pid] = listen_backends(pg_url, name)
        run_sql(pg_url, "SELECT pg_terminate_backend(:pid)", pid=pid)
        with pytest.raises(Exception, match=r"(?i)terminat|closed|connection"):  # noqa: PT012
            for _ in range(3):
                listener.wait(SOON)
    finally:
        listener.close()
        with app.app_context():
            outbox_app.db.engine.dispose()


def test_the_scheduler_wakes_on_notify_from_another_connection(pg_url: str, driver: str) -> None:
    """The scheduler's relay job runs on a NOTIFY, long before its 60 s poll, on
    psycopg 3 too (it only polled there)."""
    name = f"sched-{uuid.uuid4().hex[:10]}"
    publisher = ListPublisher()
    app = outbox_app.create_app(
        on_driver(pg_url, driver, name), IDEMPOTENCY_PUBLISHER=publisher, IDEMPOTENCY_RELAY_EVERY=60
    )
    reset(pg_url)
    with started_scheduler(app) as jobs:
        assert jobs.waker is not None
        assert jobs.waker.listening
        assert_an_event_from_elsewhere_is_relayed(pg_url, publisher)


def test_a_scheduler_whose_first_listen_failed_listens_once_the_database_is_back(
    pg_url: str, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The database is away as the scheduler starts: its first LISTEN fails. It
    tries again every RELISTEN seconds, and once the database is back it
    LISTENs, and a NOTIFY from another connection wakes the relay long before
    its 60 s poll. (A first LISTEN that failed was taken for a driver that
    cannot LISTEN: never tried again, the poll alone for the process's life.)"""
    monkeypatch.setattr(RelayWaker, "RELISTEN", 0.3)
    reset(pg_url)
    publisher = ListPublisher()
    name = f"relisten-{uuid.uuid4().hex[:10]}"
    pooled = pgbouncer.is_pooled(pg_url)
    # Behind the pooler, the database that is away is the LISTEN's, the direct one.
    server = direct_postgres_url(driver) if pooled else pg_url
    with TcpProxy(upstream_of(server)) as proxy:
        if pooled:
            app = outbox_app.create_app(
                on_driver(pg_url, driver, name),
                IDEMPOTENCY_RELAY_LISTEN_URL=proxy.url(on_driver(server, driver, name)),
                IDEMPOTENCY_PUBLISHER=publisher,
                IDEMPOTENCY_RELAY_EVERY=60,
            )
        else:
            app = outbox_app.create_app(
                proxy.url(on_driver(pg_url, driver, name)),
                IDEMPOTENCY_PUBLISHER=publisher,
                IDEMPOTENCY_RELAY_EVERY=60,
            )
        proxy.cut()
        with started_scheduler(app) as jobs:
            assert jobs.waker is not None
            assert not jobs.waker.listening  # the database is away
            time.sleep(1)  # a few RELISTEN intervals with the database still away
            assert not jobs.waker.listening
            proxy.heal()
            deadline = time.monotonic() + SOON
            while not jobs.waker.listening and time.monotonic() < deadline:
                time.sleep(0.02)
            assert jobs.waker.listening
            assert_an_event_from_elsewhere_is_relayed(pg_url, publisher)


class Terminator:
    """Ends every LISTEN connection named ``name`` as soon as it appears (a
    proxy or a server that keeps dropping it), counting the ones it ended."""

    def __init__(self, pg_url: str, name: str) -> None:
        self.pg_url, self.name = pg_url, name
        self.ended: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        engine = sa.create_engine(self.pg_url)
        try:
            while not self._stop.wait(0.02):
                with engine.begin() as conn:
                    pids = conn.execute(
                        sa.text(
                            "SELECT pid FROM pg_stat_activity WHERE application_name = :name"
                            " AND query = 'LISTEN idempotency_outbox'"
                        ),
                        {"name": self.name},
                    ).scalars()
                    for pid in pids:
                        conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
                        self.ended.add(pid)
        finally:
            engine.dispose()

    def __enter__(self) -> Terminator:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def test_a_waker_whose_listen_connection_keeps_failing_backs_off(
    pg_url: str, driver: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every LISTEN connection is ended as soon as it is up: over 3 s the waker
    listens again a handful of times (0.25 s, 0.5 s, 1 s, 2 s apart), not in a
    loop of connections (it opened one every few milliseconds)."""
    name = f"backoff-{uuid.uuid4().hex[:10]}"
    app = outbox_app.create_app(
        on_driver(pg_url, driver, name),
        IDEMPOTENCY_PUBLISHER=ListPublisher(),
        IDEMPOTENCY_RELAY_EVERY=60,
    )
    reset(pg_url)
    made: list[Listener] = []

    class Counted(Listener):
        def __init__(self, *args: t.Any, **kwargs: t.Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(scheduler_module, "Listener", Counted)
    waker = RelayWaker(JobScheduler(app))
    assert waker.listening
    with Terminator(pg_url, name) as terminator:
        waker.start()
        time.sleep(3)  # a window to count in, not a timing assertion
        waker.stop()
    assert 2 <= len(made) <= 6, len(made)
    assert len(terminator.ended) <= 6
    assert not listen_backends(pg_url, name)  # stop() closed the last one
    with app.app_context():
        outbox_app.db.engine.dispose()


def test_the_foreground_relay_backs_off_when_its_listen_connection_keeps_failing(
    pg_url: str, tmp_path: Path
) -> None:
    """``flask idempotency relay --poll 0.05`` whose LISTEN connection is ended as
    soon as it is up: a few new connections in 3 s, not one per poll."""
    name = f"cli-{uuid.uuid4().hex[:10]}"
    url = on_driver(pg_url, "psycopg2", name)
    reset(pg_url)
    env, cmd = relay_command(url, tmp_path / "published.jsonl", "--poll", "0.05")
    relay = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert relay.stdout is not None
        assert "LISTEN" in relay.stdout.readline()
        with Terminator(pg_url, name) as terminator:
            time.sleep(3)  # a window to count in, not a timing assertion
        relay.send_signal(signal.SIGTERM)
        _, err = relay.communicate(timeout=30)
        assert relay.returncode == 0, err
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate()
    # Each LISTEN connection it made was ended: a few, after growing pauses.
    assert 2 <= len(terminator.ended) <= 6, err[-2000:]
    assert "outbox relay LISTEN" in err  # and it said so (once per failure, not per poll)
