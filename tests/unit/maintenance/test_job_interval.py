"""One run of a scheduled job per interval across processes, on every engine.

Several :class:`JobScheduler` instances on one app stand for several processes
(each is its own lock holder); the test clock stands for time, so each tick is
placed exactly where the test wants it.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
import typing as t

import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance.scheduler import JobScheduler
from flask_idempotency._storage.locks import MAX_SLACK, interval_slack
from flask_idempotency._storage.schema import as_utc
from flask_idempotency._storage.store import database_now
from tests.conftest import Clock, reset_tables
from tests.support import testapp
from tests.support.records import cli, keys, make_records

EVERY = dt.timedelta(seconds=10)
SLACK = interval_slack(EVERY)


def recorder(ran: list[str], label: str) -> t.Callable[[Flask, t.Callable[[], bool]], None]:
    def job(app: Flask, keep_going: t.Callable[[], bool]) -> None:
        ran.append(label)

    return job


def lock_row(app: Flask, name: str) -> dict[str, t.Any]:
    with app.app_context(), testapp.db.engine.connect() as conn:
        table = testapp.db.metadata.tables["idempotency_job_locks"]
        row = conn.execute(sa.select(table).where(table.c.name == name)).one()
    return {k: as_utc(v) if isinstance(v, dt.datetime) else v for k, v in row._mapping.items()}


def test_the_slack_is_a_tenth_of_the_interval_at_most_a_second() -> None:
    assert interval_slack(dt.timedelta(seconds=1)) == dt.timedelta(milliseconds=100)
    assert interval_slack(dt.timedelta(seconds=5)) == dt.timedelta(milliseconds=500)
    assert interval_slack(dt.timedelta(minutes=5)) == MAX_SLACK == dt.timedelta(seconds=1)


def test_a_tick_within_the_interval_of_another_holders_run_is_skipped(
    app: Flask, clock: Clock
) -> None:
    first, second = JobScheduler(app), JobScheduler(app)
    ran: list[str] = []
    started = clock()
    assert first.run_job("demo", recorder(ran, "first"), EVERY) is True
    row = lock_row(app, "demo")
    assert row["last_started_at"] == started
    assert row["holder"] is None  # released, yet its start is remembered
    assert row["locked_until"] is None
    # The lock is free, but the job ran a moment ago: the other process skips.
    assert second.run_job("demo", recorder(ran, "second"), EVERY) is False
    clock.now = started + EVERY - SLACK - dt.timedelta(milliseconds=1)
    assert second.run_job("demo", recorder(ran, "second"), EVERY) is False
    assert first.run_job("demo", recorder(ran, "first"), EVERY) is False  # its own too
    assert ran == ["first"]
    # A tick that comes a little early (within the slack) runs.
    clock.now = started + EVERY - SLACK
    assert second.run_job("demo", recorder(ran, "second"), EVERY) is True
    assert ran == ["first", "second"]
    assert lock_row(app, "demo")["last_started_at"] == clock()
    # Now the interval counts from the second holder's run.
    clock.advance(seconds=5)
    assert first.run_job("demo", recorder(ran, "first"), EVERY) is False
    clock.advance(seconds=5)
    assert first.run_job("demo", recorder(ran, "first"), EVERY) is True
    assert ran == ["first", "second", "first"]


def test_each_job_has_its_own_interval(app: Flask, clock: Clock) -> None:
    scheduler = JobScheduler(app)
    ran: list[str] = []
    assert scheduler.run_job("purge", recorder(ran, "purge"), EVERY) is True
    assert scheduler.run_job("recover", recorder(ran, "recover"), EVERY) is True
    assert scheduler.run_job("purge", recorder(ran, "purge"), EVERY) is False
    assert ran == ["purge", "recover"]


def test_ticks_of_many_processes_run_the_job_once_per_interval(app: Flask, clock: Clock) -> None:
    """Three processes tick every second, each at its own phase (the third just
    inside the slack, so it takes the job over), with a few
    milliseconds of jitter, for 60 s of test time: about 60 runs, not 180, never
    two closer than the interval minus the slack."""
    every = dt.timedelta(seconds=1)
    schedulers = [JobScheduler(app) for _ in range(3)]
    rng = random.Random(8)
    base = clock()
    ticks = sorted(
        (
            base
            + every * k
            + dt.timedelta(seconds=phase)
            + dt.timedelta(milliseconds=rng.uniform(-20, 20)),
            i,
        )
        for i, phase in enumerate([0.0, 0.37, 0.93])
        for k in range(60)
    )
    starts: list[dt.datetime] = []
    for when, i in ticks:
        clock.now = when
        if schedulers[i].run_job("demo", lambda app, keep: None, every):
            starts.append(when)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    assert 55 <= len(starts) <= 67, len(starts)
    assert min(gaps) >= (every - interval_slack(every)).total_seconds()
    assert max(gaps) <= 1.05  # the last runner's own next tick is never skipped


def test_one_process_runs_every_tick_despite_jitter(app: Flask, clock: Clock) -> None:
    """A lone scheduler whose ticks come a little early or late still runs each
    one: the rate is once per interval, not once per two."""
    every = dt.timedelta(seconds=1)
    scheduler = JobScheduler(app)
    rng = random.Random(8)
    base = clock()
    ran = 0
    for k in range(40):
        clock.now = base + every * k + dt.timedelta(milliseconds=rng.uniform(-30, 30))
        ran += scheduler.run_job("demo", lambda app, keep: None, every)
    assert ran == 40


def test_a_run_by_hand_is_not_skipped_by_the_interval(app: Flask, clock: Clock) -> None:
    scheduled, by_hand = JobScheduler(app), JobScheduler(app)
    ran: list[str] = []
    assert scheduled.run_job("demo", recorder(ran, "tick"), EVERY) is True
    assert by_hand.run_job("demo", recorder(ran, "hand")) is True  # no interval: it runs
    assert ran == ["tick", "hand"]
    # The CLI commands run the jobs themselves, not through the lock: a scheduled
    # purge a moment ago does not stop the operator's.
    make_records(app, clock, 4, expired=True)
    assert scheduled.run_job("purge", recorder(ran, "purge"), EVERY) is True
    result = cli(app, "purge")
    assert result.exit_code == 0, result.output
    assert "deleted 4 expired record(s)" in result.output
    assert keys(app) == set()


def test_a_run_by_hand_still_waits_for_a_run_in_progress(app: Flask, clock: Clock) -> None:
    state = app.extensions["idempotency"]
    by_hand = JobScheduler(app)
    with app.app_context():
        held = by_hand.locks.acquire(
            state.db.engine, "demo", "busy-host:1", state.settings.job_lock, clock(), every=EVERY
        )
    assert held
    clock.advance(seconds=1)
    assert by_hand.run_job("demo", lambda app, keep: None) is False


def test_a_dead_holders_lock_frees_after_the_ttl(app: Flask, clock: Clock) -> None:
    """A process that died in a run never releases: past the interval the job
    still waits for the lock to expire (IDEMPOTENCY_JOB_LOCK, 2 minutes), then
    runs elsewhere."""
    state = app.extensions["idempotency"]
    ttl = state.settings.job_lock
    survivor = JobScheduler(app)
    with app.app_context():
        engine = state.db.engine
        assert survivor.locks.acquire(engine, "demo", "dead-host:1", ttl, clock(), every=EVERY)
    clock.advance(seconds=30)  # three intervals
    assert survivor.run_job("demo", lambda app, keep: None, EVERY) is False
    clock.advance(seconds=90, microseconds=1)  # 2 minutes since it took the lock
    assert survivor.run_job("demo", lambda app, keep: None, EVERY) is True
    row = lock_row(app, "demo")
    assert row["holder"] is None
    assert row["last_started_at"] == clock()


def test_a_start_from_a_clock_far_ahead_does_not_stop_the_job(app: Flask, clock: Clock) -> None:
    """The lock's clock (the database's; the test clock here) stepped back, as
    after a failover to a server whose clock is behind: a start in its future.
    Less than an interval ahead, the job waits that much longer; more, and the
    start is ignored rather than stop the job for as long as the step."""
    scheduler = JobScheduler(app)

    def run_ahead(by: dt.timedelta) -> None:
        clock.advance(seconds=by.total_seconds())
        assert scheduler.run_job("demo", lambda app, keep: None) is True
        clock.advance(seconds=-by.total_seconds())

    run_ahead(dt.timedelta(seconds=5))
    clock.advance(seconds=10)
    assert scheduler.run_job("demo", lambda app, keep: None, EVERY) is False
    clock.advance(seconds=5)
    assert scheduler.run_job("demo", lambda app, keep: None, EVERY) is True
    run_ahead(dt.timedelta(hours=1))
    assert scheduler.run_job("demo", lambda app, keep: None, EVERY) is True


def test_the_job_lock_reads_the_databases_clock_not_the_hosts(database_url: str) -> None:
    """Each host passes its own clock; the lock compares the database's. A host
    3 minutes ahead cannot start a run while another holds the lock (it would
    see the lock's expiry passed), and one 70 s behind cannot run again right
    after another host's run (it would see that start in its future and ignore
    it): with host clocks, both happened, and a job ran twice as often."""
    app = testapp.create_app(database_url)  # no clock of its own: the database's
    reset_tables(database_url)
    ttl, every = dt.timedelta(minutes=2), dt.timedelta(seconds=30)
    with app.app_context():
        engine = testapp.db.engine
        locks = JobScheduler(app).locks
        with engine.connect() as conn:
            db_now = database_now(conn)
        host = dt.datetime.now(dt.timezone.utc)
        assert locks.acquire(engine, "demo", "host-a", ttl, host, every=every)
        # B's clock 3 minutes ahead, while A's run holds the lock.
        assert not locks.acquire(engine, "demo", "host-b", ttl, host + dt.timedelta(minutes=3))
        locks.release(engine, "demo", "host-a", host)
        # B's clock 70 s behind, right after A's run: within the interval.
        behind = host - dt.timedelta(seconds=70)
        assert not locks.acquire(engine, "demo", "host-b", ttl, behind, every=every)
        assert locks.acquire(engine, "demo", "host-b", ttl, behind)  # by hand: free now
    row = lock_row(app, "demo")
    assert row["holder"] == "host-b"
    # The times written are the database's, whatever B's clock said.
    assert abs(row["last_started_at"] - db_now) < dt.timedelta(seconds=30)
    assert row["locked_until"] - row["last_started_at"] == ttl
