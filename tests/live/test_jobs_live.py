"""Cleanup and the scheduler across processes, against a real PostgreSQL.

Bulk rows are made with ``generate_series``; cleaners and schedulers run as
separate ``flask`` processes, stopped with real signals.
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa

from tests.conftest import reset_tables, run_sql
from tests.support import cli_app, testapp
from tests.support.commands import flask_cmd, wait_running
from tests.support.live import LiveServer, Reply

pytestmark = pytest.mark.slow


def seed_expired(url: str, n: int, prefix: str = "old") -> None:
    """``n`` completed records that expired an hour ago."""
    run_sql(
        url,
        """
        INSERT INTO idempotency_keys
            (scope, key, request_hash, status, fencing_token, response_code,
             response_body, body_omitted, created_at, expires_at)
        SELECT 'bulk', :prefix || i, 'h', 'completed', 1, 201, 'x', false,
               now() - interval '2 days', now() - interval '1 hour'
        FROM generate_series(1, :n) AS i
        """,
        n=n,
        prefix=prefix,
    )


def count(url: str, where: str = "") -> int:
    return int(run_sql(url, f"SELECT count(*) FROM idempotency_keys {where}")[0][0])


@pytest.fixture
def db(pg_url: str) -> str:
    testapp.create_app(pg_url)
    reset_tables(pg_url)
    return pg_url


def test_100k_expired_purged_while_requests_keep_succeeding(db: str) -> None:
    seed_expired(db, 100_000)
    server = LiveServer("tests", db).start()
    stop = threading.Event()
    replies: list[Reply] = []
    lock_waits: list[t.Any] = []

    def traffic() -> None:
        while not stop.is_set():
            replies.append(server.post("/raw", {"n": 1}, str(uuid.uuid4())))

    def watch_locks() -> None:
        engine = sa.create_engine(db)
        with engine.connect() as conn:
            while not stop.is_set():
                lock_waits.extend(
                    conn.execute(
                        sa.text(
                            "SELECT pid, query FROM pg_stat_activity"
                            " WHERE wait_event_type = 'Lock' AND datname = current_database()"
                        )
                    )
                )
                conn.commit()
                time.sleep(0.02)
        engine.dispose()

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    threads.append(threading.Thread(target=watch_locks))
    for th in threads:
        th.start()
    try:
        time.sleep(0.3)  # traffic is flowing before the cleanup starts
        app = testapp.create_app(db)
        from flask_idempotency._maintenance.jobs import purge_expired

        report = purge_expired(app, batch_size=1000)
        time.sleep(0.3)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
        server.stop()
    assert report.deleted == 100_000
    assert report.batches >= 100
    assert count(db, "WHERE scope = 'bulk'") == 0
    assert len(replies) > 20
    assert {r.status for r in replies} == {200}
    assert count(db) == len(replies)  # every request's record is still there
    assert int(run_sql(db, "SELECT count(*) FROM ledger")[0][0]) == len(replies)
    assert lock_waits == []  # nothing ever waited on a lock


def test_two_cleaners_at_once_delete_everything_once(db: str) -> None:
    seed_expired(db, 20_000)
    cleaners = [flask_cmd(db, "purge", "--batch-size", "250") for _ in range(2)]
    outputs = [c.communicate(timeout=300) for c in cleaners]
    for cleaner, (_out, err) in zip(cleaners, outputs, strict=True):
        assert cleaner.returncode == 0, err
        assert "Traceback" not in err
    deleted = [int(out.split("deleted ")[1].split()[0]) for out, _ in outputs]
    assert sum(deleted) == 20_000, outputs
    assert count(db) == 0


def test_two_scheduler_processes_run_each_job_one_at_a_time(db: str) -> None:
    cli_app.job_runs.create(sa.create_engine(db), checkfirst=True)
    run_sql(db, "DELETE FROM job_runs")
    seed_expired(db, 5_000)
    config = {"IDEMPOTENCY_PURGE_EVERY": 0.2, "IDEMPOTENCY_RECOVER_EVERY": 0.2}
    schedulers = [
        flask_cmd(db, "scheduler", config=config, IDEMPOTENCY_TEST_JOB_RUNS="0.3") for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            runs = run_sql(db, "SELECT count(*) FROM job_runs")[0][0]
            if runs >= 12 and count(db) == 0:
                break
            time.sleep(0.2)
    finally:
        for process in schedulers:
            process.send_signal(signal.SIGTERM)
        outputs = [stopped(p) for p in schedulers]
    for process, (out, err) in zip(schedulers, outputs, strict=True):
        assert process.returncode == 0, err  # a clean stop on SIGTERM
        assert "stopped" in out
        assert "Traceback" not in err
    assert count(db) == 0  # every expired record deleted
    runs = run_sql(db, "SELECT job, pid, started, finished FROM job_runs ORDER BY started")
    assert len(runs) >= 12
    for job in ("purge", "recover"):
        spans = [(r.started, r.finished) for r in runs if r.job == job]
        assert spans, job
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end, f"two {job} runs overlapped"
    run_sql(db, "DROP TABLE job_runs")


def stopped(process: subprocess.Popen[str]) -> tuple[str, str]:
    """The output of a process sent SIGTERM; killed when it has not stopped in
    60 s (it fails the test on its exit code instead of running the jobs of
    the tests after it)."""
    try:
        return process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()


def test_scheduler_processes_run_each_job_about_once_per_interval(db: str) -> None:
    """Three scheduler processes, recover every 0.5 s and purge every 0.7 s: over
    6 s each job runs about 6 s / interval times in all, not three times that,
    and two runs are never closer than the interval minus its slack."""
    every = {"recover": 0.5, "purge": 0.7}
    cli_app.job_runs.create(sa.create_engine(db), checkfirst=True)
    run_sql(db, "DELETE FROM job_runs")
    config = {
        "IDEMPOTENCY_RECOVER_EVERY": every["recover"],
        "IDEMPOTENCY_PURGE_EVERY": every["purge"],
    }
    schedulers = [
        flask_cmd(db, "scheduler", config=config, IDEMPOTENCY_TEST_JOB_RUNS="0") for _ in range(3)
    ]
    try:
        for process in schedulers:
            wait_running(process)
        start = time.time()
        time.sleep(6)
        end = time.time()
    finally:
        for process in schedulers:
            process.send_signal(signal.SIGTERM)
        outputs = [stopped(p) for p in schedulers]
    for process, (_out, err) in zip(schedulers, outputs, strict=True):
        assert process.returncode == 0, err
        assert "Traceback" not in err
    runs = run_sql(db, "SELECT job, pid, started, acquired FROM job_runs ORDER BY acquired")
    run_sql(db, "DROP TABLE job_runs")
    for job, interval in every.items():
        ran = [r for r in runs if r.job == job and start <= r.started <= end]
        expected = (end - start) / interval
        assert 0.5 * expected <= len(ran) <= 1.5 * expected, (job, len(ran), expected)
        # Spaced by the start each run's lock recorded (the time a loaded machine
        # takes from there to job_started is no part of the rule).
        gaps = [b.acquired - a.acquired for a, b in itertools.pairwise(ran)]
        assert min(gaps) >= 0.9 * interval - 1e-3, (job, min(gaps))
