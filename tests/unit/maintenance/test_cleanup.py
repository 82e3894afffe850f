"""Retention, cleanup, the CLI and the in-process scheduler, on PostgreSQL and SQLite."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import signals
from flask_idempotency._maintenance import jobs as jobs_module
from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._maintenance.scheduler import JobScheduler
from tests.conftest import Clock, insert_records, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import abandon, post
from tests.support.records import cli, keys, make_records


def test_expired_record_is_absent_and_cleanup_removes_only_expired(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    post(client, "/short-ttl", {}, key="old")  # TTL 5 minutes
    clock.advance(minutes=3)
    post(client, "/short-ttl", {}, key="young")
    clock.advance(minutes=3)  # "old" is past its TTL, "young" is not
    assert post(client, "/short-ttl", {}, key="young").headers["Idempotent-Replayed"] == "true"
    report = purge_expired(app)
    assert report.deleted == 1
    assert keys(app) == {"young"}
    # Once gone, the key is new again: the retry runs the view.
    again = post(client, "/short-ttl", {}, key="old")
    assert again.headers.get("Idempotent-Replayed") is None
    assert ledger_count(app) == 3


def test_purge_works_in_batches_and_keeps_live_records(app: Flask, clock: Clock) -> None:
    make_records(app, clock, 25, expired=True, prefix="e")
    make_records(app, clock, 5, expired=False, prefix="l")
    abandon(app, clock, key="stuck")
    clock.advance(hours=25)  # the abandoned in-progress record has expired too
    make_records(app, clock, 3, expired=False, prefix="new")
    report = purge_expired(app, batch_size=10)
    assert report.deleted == 31  # 25 + 5 + the stuck one: all past expiry now
    assert report.batches == 4
    assert keys(app) == {"new0", "new1", "new2"}


def test_purge_pauses_after_each_full_batch_as_long_as_it_took_times_pause(
    app: Flask, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writers meanwhile wait on the cores and the WAL the batches keep
    busy, not on a lock (BENCHMARKS.md): the cleanup yields after each full
    batch, the longer the longer the batch took; none after the last, short
    one; ``pause=0`` never waits, and the CLI passes ``--pause`` on."""
    slept: list[float] = []
    monkeypatch.setattr(jobs_module, "sleep", slept.append)
    took = iter(range(100))  # each batch "takes" 1 s of the monotonic clock
    monkeypatch.setattr(jobs_module, "monotonic", lambda: float(next(took)))
    make_records(app, clock, 25, expired=True, prefix="e")
    clock.advance(hours=25)
    report = purge_expired(app, batch_size=10)
    assert (report.deleted, report.batches) == (25, 3)
    assert slept == [jobs_module.PURGE_PAUSE, jobs_module.PURGE_PAUSE]
    slept.clear()
    make_records(app, clock, 25, expired=True, prefix="f")
    clock.advance(hours=25)
    assert purge_expired(app, batch_size=10, pause=2.5).deleted == 25
    assert slept == [2.5, 2.5]
    slept.clear()
    make_records(app, clock, 25, expired=True, prefix="g")
    clock.advance(hours=25)
    assert purge_expired(app, batch_size=10, pause=0).deleted == 25
    assert slept == []
    make_records(app, clock, 25, expired=True, prefix="h")
    clock.advance(hours=25)
    result = cli(app, "purge", "--batch-size", "10", "--pause", "0.5")
    assert "deleted 25 expired record(s) in 3 batch(es)" in result.output, result.output
    assert slept == [0.5, 0.5]


def test_each_cleanup_batch_commits_without_waiting_for_its_flush_on_postgresql(
    app: Flask, clock: Clock
) -> None:
    """Records', inbox ids' and published events' batches alike: their own
    transactions only (``SET LOCAL``), the pooled connections keep the
    server's setting."""
    if not app.config["SQLALCHEMY_DATABASE_URI"].startswith("postgresql"):
        pytest.skip("only PostgreSQL sets it per transaction")
    make_records(app, clock, 25, expired=True, prefix="e")
    clock.advance(hours=25)
    seen: list[str] = []

    def before_delete(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            cursor.execute("SHOW synchronous_commit")
            seen.append(cursor.fetchone()[0])

    with app.app_context():
        engine = testapp.db.engine
        sa.event.listen(engine, "before_cursor_execute", before_delete)
        try:
            assert purge_expired(app, batch_size=10, pause=0).deleted == 25
        finally:
            sa.event.remove(engine, "before_cursor_execute", before_delete)
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SHOW synchronous_commit").scalar_one() == "on"
    assert len(seen) >= 3
    assert set(seen) == {"off"}


def test_purge_resumes_where_each_batch_ended_and_misses_no_tie(app: Flask, clock: Clock) -> None:
    """Each batch starts at the previous one's latest ``expires_at`` (``>=``):
    records sharing an expiry across a batch boundary are all deleted, a record
    past its retention whose lease still runs and a live one are kept, and the
    next run starts from the oldest again (the bound lasts one run)."""
    early, tied = clock.now - dt.timedelta(hours=3), clock.now - dt.timedelta(hours=2)

    def row(key: str, expires: dt.datetime, **columns: t.Any) -> dict[str, t.Any]:
        values = {
            "scope": "bulk",
            "key": key,
            "request_hash": "h",
            "status": "completed",
            "fencing_token": 1,
            "response_code": 201,
            "body_omitted": False,
            "created_at": clock.now - dt.timedelta(days=1),
            "expires_at": expires,
            "locked_until": None,
        }
        return {**values, **columns}  # the same columns in every row (one executemany)

    leased = row(
        "leased",
        tied,
        status="in_progress",
        response_code=None,
        locked_until=clock.now + dt.timedelta(minutes=10),
    )
    rows = [
        *(row(f"early{i}", early) for i in range(3)),
        *(row(f"tied{i}", tied) for i in range(7)),
        leased,
        row("live", clock.now + dt.timedelta(hours=1)),
    ]
    with app.app_context(), testapp.db.engine.begin() as conn:
        insert_records(conn, rows)
    report = purge_expired(app, batch_size=4)
    # Batches of 4: three early and a tie, four ties, the last two ties.
    assert (report.deleted, report.batches) == (10, 3)
    assert keys(app) == {"leased", "live"}
    clock.advance(minutes=11)  # the lease ended: the next run, from the oldest, finds it
    assert purge_expired(app, batch_size=4).deleted == 1
    assert keys(app) == {"live"}


def test_purge_dry_run_counts_and_deletes_nothing(app: Flask, clock: Clock) -> None:
    make_records(app, clock, 7, expired=True)
    assert purge_expired(app, dry_run=True).deleted == 7
    assert len(record_rows(app)) == 7


# -- CLI ----------------------------------------------------------------------------------


def test_cli_purge(app: Flask, clock: Clock) -> None:
    make_records(app, clock, 12, expired=True)
    make_records(app, clock, 2, expired=False, prefix="live")
    dry = cli(app, "purge", "--dry-run")
    assert dry.exit_code == 0
    assert "12 expired record(s) would be deleted" in dry.output
    assert len(record_rows(app)) == 14
    result = cli(app, "purge", "--batch-size", "5")
    assert result.exit_code == 0, result.output
    assert "deleted 12 expired record(s) in 3 batch(es)" in result.output
    assert keys(app) == {"live0", "live1"}


@pytest.mark.parametrize(
    "args",
    [
        ["purge", "--batch-size", "0"],
        ["purge", "--batch-size", "lots"],
        ["purge", "--nope"],
        ["show", "only-scope"],
        ["release"],
        ["stats", "extra"],
    ],
)
def test_cli_bad_arguments_change_nothing(app: Flask, clock: Clock, args: list[str]) -> None:
    make_records(app, clock, 3, expired=True)
    result = cli(app, *args)
    assert result.exit_code == 2
    assert "Error" in result.output
    assert len(record_rows(app)) == 3


def test_cli_stats(app: Flask, client: t.Any, clock: Clock) -> None:
    post(client, "/charges", {"amount": 1, "currency": "EUR"})
    abandon(app, clock, key="running")
    make_records(app, clock, 4, expired=True)
    result = cli(app, "stats")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["by_status"] == {"completed": 1, "in_progress": 1}
    assert stats["expired_awaiting_cleanup"] == 4
    assert stats["oldest_in_progress"] == clock.now.isoformat()
    dialect = app.config["SQLALCHEMY_DATABASE_URI"].split(":")[0]
    if dialect.startswith("postgresql"):
        assert stats["table_bytes"] > 0
    else:
        assert stats["table_bytes"] is None


def test_cli_show(app: Flask, client: t.Any) -> None:
    post(client, "/charges", {"amount": 1, "currency": "EUR"}, key="shown")
    [record] = record_rows(app)
    result = cli(app, "show", record["scope"], "shown")
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["status"] == "completed"
    assert shown["response_code"] == 201
    assert "response_body" not in shown  # contents only with --reveal
    revealed = json.loads(cli(app, "show", record["scope"], "shown", "--reveal").output)
    assert json.loads(revealed["response_body"])["amount"] == 1
    missing = cli(app, "show", record["scope"], "nope")
    assert missing.exit_code == 1
    assert "no record" in missing.output


def test_cli_release_asks_and_unsticks(app: Flask, client: t.Any, clock: Clock) -> None:
    abandon(app, clock, key="stuck")  # its worker died; its lease runs another minute
    refused = cli(app, "release", "t.status", "stuck", "--yes")
    assert refused.exit_code == 1
    assert "its lease is live" in refused.output
    override = ("--override", "live-lease")
    declined = cli(app, "release", "t.status", "stuck", *override, input="n\n")
    assert declined.exit_code == 1
    assert "overriding live-lease" in declined.output  # the prompt says what it overrides
    assert len(record_rows(app)) == 1
    accepted = cli(app, "release", "t.status", "stuck", *override, input="y\n")
    assert accepted.exit_code == 0, accepted.output
    assert "released, overriding live-lease" in accepted.output
    assert record_rows(app) == []
    # The stuck key now runs at once instead of answering 409 until the lease ends.
    assert post(client, "/status/201", {}, key="stuck").status_code == 201


def test_cli_release_never_releases_a_completed_record(app: Flask, client: t.Any) -> None:
    post(client, "/status/201", {}, key="done")
    refused = cli(app, "release", "t.status", "done", "--yes")
    assert refused.exit_code == 1
    assert "it is completed (201)" in refused.output
    assert "sends a new key" in refused.output
    assert len(record_rows(app)) == 1
    forced = cli(app, "release", "t.status", "done", "--yes", "--force")
    assert forced.exit_code == 2
    assert len(record_rows(app)) == 1
    assert post(client, "/status/201", {}, key="done").headers["Idempotent-Replayed"] == "true"


def test_cli_create_tables_creates_both(database_url: str) -> None:
    app = testapp.create_app(database_url)
    engine = sa.create_engine(database_url)
    testapp.db.metadata.drop_all(engine)
    result = cli(app, "create-tables")
    assert result.exit_code == 0, result.output
    names = set(sa.inspect(engine).get_table_names())
    engine.dispose()
    assert {"idempotency_keys", "idempotency_job_locks"} <= names
    assert "ledger" not in names


# -- the scheduler ------------------------------------------------------------------


def scheduler_threads() -> list[threading.Thread]:
    return [th for th in threading.enumerate() if "APScheduler" in th.name]


def wait_until(condition: t.Callable[[], bool], timeout: float = 20) -> bool:
    """Poll ``condition`` (bounded): the job is judged on what it did, not on when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_scheduler_is_off_unless_enabled(app: Flask, client: t.Any) -> None:
    before = len(scheduler_threads())
    post(client, "/charges", {"amount": 1, "currency": "EUR"})
    assert len(scheduler_threads()) == before
    assert app.extensions["idempotency"].in_process.scheduler is None


def test_in_process_scheduler_starts_on_first_request_and_runs_jobs(
    database_url: str, clock: Clock
) -> None:
    app = testapp.create_app(
        database_url,
        clock=clock,
        IDEMPOTENCY_SCHEDULER=True,
        IDEMPOTENCY_PURGE_EVERY=0.2,
        IDEMPOTENCY_RECOVER_EVERY=0.2,
    )
    reset_tables(database_url)
    slot = app.extensions["idempotency"].in_process
    assert slot.scheduler is None  # not at app creation
    make_records(app, clock, 30, expired=True)
    abandon(app, clock, key="stuck")
    clock.advance(seconds=61)  # the lease ended: recovery releases it
    runs: list[str] = []
    on_finish = lambda sender, **kw: runs.append(kw["name"])  # noqa: E731
    signals.job_finished.connect(on_finish)
    try:
        client = app.test_client()
        post(client, "/status/200", {}, key="first")
        assert slot.scheduler is not None
        assert slot.scheduler.running
        post(client, "/status/200", {}, key="second")  # the same scheduler, not a second one
        assert wait_until(lambda: keys(app) == {"first", "second"}), keys(app)
        assert wait_until(lambda: {"purge", "recover"} <= set(runs)), runs
    finally:
        slot.shutdown()
        signals.job_finished.disconnect(on_finish)
    assert slot.scheduler is None
    assert wait_until(lambda: not scheduler_threads(), timeout=5)
    with app.app_context():
        testapp.db.engine.dispose()


def test_a_job_whose_lock_is_held_elsewhere_skips_the_tick(app: Flask, clock: Clock) -> None:
    first, second = JobScheduler(app), JobScheduler(app)
    ran: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def slow_job(app: Flask, keep_going: t.Callable[[], bool]) -> None:
        ran.append("slow")
        started.set()
        release.wait(10)

    worker = threading.Thread(target=first.run_job, args=("demo", slow_job))
    worker.start()
    assert started.wait(10)
    assert second.run_job("demo", lambda app, keep: ran.append("other")) is False
    release.set()
    worker.join(10)
    assert ran == ["slow"]
    # Freed after the run: the next tick anywhere takes it.
    assert second.run_job("demo", lambda app, keep: ran.append("other")) is True
    assert ran == ["slow", "other"]


def test_a_dead_runners_lock_frees_after_its_ttl(app: Flask, clock: Clock) -> None:
    state = app.extensions["idempotency"]
    with app.app_context():
        engine = state.db.engine
        locks = JobScheduler(app).locks
        assert locks.acquire(engine, "demo", "dead-host:1", dt.timedelta(minutes=2), clock())
        assert not locks.acquire(engine, "demo", "live-host:2", dt.timedelta(minutes=2), clock())
        clock.advance(minutes=2, seconds=1)
        assert locks.acquire(engine, "demo", "live-host:2", dt.timedelta(minutes=2), clock())
        # The dead holder cannot renew what it lost.
        assert not locks.renew(engine, "demo", "dead-host:1", dt.timedelta(minutes=2), clock())


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_worker_starts_its_own_scheduler(pg_url: str, clock: Clock) -> None:
    """As under gunicorn: the parent served (and started a scheduler) before the
    fork; the child's first request must start one in the child, since the
    parent's thread does not exist there."""
    import os

    app = testapp.create_app(pg_url, clock=clock, IDEMPOTENCY_SCHEDULER=True)
    reset_tables(pg_url)
    slot = app.extensions["idempotency"].in_process
    post(app.test_client(), "/status/200", {}, key="parent")
    parent_scheduler = slot.scheduler
    assert parent_scheduler is not None
    with app.app_context():
        testapp.db.engine.dispose()  # no pooled connection crosses the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into pytest
        ok = False
        try:
            post(app.test_client(), "/status/200", {}, key="child")
            ok = (
                slot.scheduler is not None
                and slot.scheduler is not parent_scheduler
                and slot.scheduler.running
            )
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
    finally:
        os.close(read)
        slot.shutdown()
    assert answer == b"1"
    assert keys(testapp.create_app(pg_url)) == {"parent", "child"}


def test_cli_scheduler_runs_jobs_and_stops_on_sigterm(database_url: str, clock: Clock) -> None:
    import os
    import signal as os_signal

    app = testapp.create_app(
        database_url, clock=clock, IDEMPOTENCY_PURGE_EVERY=0.1, IDEMPOTENCY_RECOVER_EVERY=0.1
    )
    reset_tables(database_url)
    make_records(app, clock, 20, expired=True)
    done: list[str] = []

    guard = threading.Lock()

    def on_finish(sender: t.Any, **kw: t.Any) -> None:
        # Each job runs once: the test clock stands still, so the interval
        # since the last run never passes. Stop when both have run.
        with guard:
            done.append(kw["name"])
            if {"purge", "recover"} <= set(done) and "stop" not in done:
                done.append("stop")
                # The command's own handler catches this; without it pytest would die.
                os.kill(os.getpid(), os_signal.SIGTERM)

    signals.job_finished.connect(on_finish)
    try:
        result = cli(app, "scheduler")
    finally:
        signals.job_finished.disconnect(on_finish)
    assert result.exit_code == 0, result.output
    assert "stopped" in result.output
    assert record_rows(app) == []
    assert not scheduler_threads()
    assert os_signal.getsignal(os_signal.SIGTERM) is os_signal.SIG_DFL  # handler restored
    bad = cli(app, "scheduler", "--bogus")
    assert bad.exit_code == 2
