"""The in-process scheduler says that it started, under ``flask run`` with no
logging configured, and ``flask idempotency stats`` shows when each job last ran,
in whichever process (here: a ``flask run`` child; the stats read in the test's
own process). On every engine, against the real database."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import re
import subprocess
import sys
import textwrap
import threading
import time
import typing as t
import urllib.request
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency._maintenance.scheduler import JobScheduler

ROOT = Path(__file__).resolve().parents[3]

APP = """
import os
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_idempotency import Idempotency
from flask_idempotency._maintenance.scheduler import JobScheduler

db = SQLAlchemy()
idem = Idempotency()
app = Flask("shop")
app.config.update(
    SQLALCHEMY_DATABASE_URI=os.environ["URL"],
    IDEMPOTENCY_SCHEDULER=True,
    IDEMPOTENCY_PURGE_EVERY=0.5,
    IDEMPOTENCY_RECOVER_EVERY=0.5,
)
idem.init_app(app, db)
db.init_app(app)


@app.post("/orders")
@idem.idempotent(scope=lambda: "tenant")
def orders():
    return {"ok": True}, 201


with app.app_context():
    db.create_all()
"""


def make_app(url: str) -> Flask:
    app = Flask("reader")
    app.config.update(SQLALCHEMY_DATABASE_URI=url)
    db = SQLAlchemy()
    Idempotency().init_app(app, db)
    db.init_app(app)
    return app


def stats(app: Flask) -> dict[str, t.Any]:
    done = app.test_cli_runner().invoke(args=["idempotency", "stats"])
    assert done.exit_code == 0, done.output
    return t.cast(dict[str, t.Any], json.loads(done.output))


def lines_of(stream: t.IO[str]) -> tuple[queue.Queue[str], threading.Thread]:
    found: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            found.put(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    return found, reader


def wait_for(lines: queue.Queue[str], pattern: str, seen: list[str]) -> re.Match[str]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r} in {seen!r}")


def test_flask_run_says_the_jobs_started_and_stats_shows_their_last_runs(
    fresh_database: str, tmp_path: Path
) -> None:
    (tmp_path / "shop.py").write_text(textwrap.dedent(APP))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
        "URL": fresh_database,
    }
    env.pop("FLASK_DEBUG", None)
    child = subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "shop", "run", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen: list[str] = []
    try:
        assert child.stderr is not None
        lines, pump = lines_of(child.stderr)
        port = wait_for(lines, r"Running on http://127\.0\.0\.1:(\d+)", seen).group(1)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/orders",
            data=b"{}",
            headers={"Content-Type": "application/json", "Idempotency-Key": "k1"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            assert answer.status == 201
        started = wait_for(lines, r"started the maintenance jobs", seen).string
        assert "IDEMPOTENCY_SCHEDULER" in started
        assert "cleanup every 0:00:00.500000" in started
        assert "lease_recovery every 0:00:00.500000" in started
        assert "flask idempotency stats" in started

        reader = make_app(fresh_database)
        deadline = time.monotonic() + 60
        while True:
            jobs = stats(reader)["jobs"]
            if all(jobs[name]["last_finished_at"] for name in ("purge", "recover")):
                break
            assert time.monotonic() < deadline, jobs
            time.sleep(0.2)
    finally:
        child.terminate()
        child.wait(30)
        assert child.stderr is not None
        pump.join(10)
        child.stderr.close()
    assert set(jobs) == {"purge", "recover"}
    assert jobs["purge"]["job"] == "cleanup"
    assert jobs["recover"]["job"] == "lease_recovery"
    # This reader's own intervals (the defaults): the runs were another process's.
    assert (jobs["purge"]["every_s"], jobs["recover"]["every_s"]) == (300.0, 30.0)
    for name in ("purge", "recover"):
        last = dt.datetime.fromisoformat(jobs[name]["last_started_at"])
        assert abs(dt.datetime.now(dt.timezone.utc) - last) < dt.timedelta(minutes=5)
    with reader.app_context():
        reader.extensions["sqlalchemy"].engine.dispose()


def test_stats_shows_jobs_that_never_ran_and_none_without_the_table(fresh_database: str) -> None:
    app = make_app(fresh_database)
    with app.app_context():
        db = app.extensions["sqlalchemy"]
        db.metadata.tables["idempotency_keys"].create(db.engine)
    assert stats(app)["jobs"] is None  # no idempotency_job_locks: nothing to show
    with app.app_context():
        db.metadata.tables["idempotency_job_locks"].create(db.engine)
    jobs = stats(app)["jobs"]
    assert jobs == {
        "purge": {
            "job": "cleanup",
            "every_s": 300.0,
            "last_started_at": None,
            "last_finished_at": None,
            "running": False,
        },
        "recover": {
            "job": "lease_recovery",
            "every_s": 30.0,
            "last_started_at": None,
            "last_finished_at": None,
            "running": False,
        },
    }
    # A run through the job's lock, as every scheduler's (in-process or not).
    assert JobScheduler(app).run_job("purge", lambda app, keep: None) is True
    ran = stats(app)["jobs"]
    assert ran["purge"]["last_started_at"] is not None
    assert ran["purge"]["last_finished_at"] is not None
    assert ran["purge"]["running"] is False
    assert ran["recover"]["last_started_at"] is None
    with app.app_context():
        (started,) = db.session.execute(
            sa.text("SELECT last_started_at FROM idempotency_job_locks WHERE name = 'purge'")
        ).one()
    with app.app_context():
        db.engine.dispose()
    assert started is not None  # the row the stats read


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLASK_DEBUG", raising=False)


def test_stats_prints_the_figures_for_a_role_that_may_not_read_the_job_locks(
    fresh_database: str,
) -> None:
    """An operator's role with SELECT on the records but none on
    ``idempotency_job_locks``: ``stats`` printed nothing (exit 69) since it shows
    the jobs; now ``jobs`` is null, ``errors`` says why, and the record figures
    are the table's. PostgreSQL and MariaDB (SQLite has no roles)."""
    url = sa.make_url(fresh_database)
    if url.get_backend_name() == "sqlite":
        pytest.skip("SQLite has no roles")
    writer = Flask("writer")
    writer.config.update(SQLALCHEMY_DATABASE_URI=fresh_database)
    db = SQLAlchemy(writer)
    idem = Idempotency(writer, db)

    @writer.post("/orders")
    @idem.idempotent
    def orders() -> tuple[dict[str, bool], int]:
        return {"ok": True}, 201

    with writer.app_context():
        db.create_all()
    made = writer.test_client().post("/orders", json={}, headers={"Idempotency-Key": "k1"})
    assert made.status_code == 201
    with writer.app_context():
        db.engine.dispose()
    user = f"ro_{uuid.uuid4().hex[:8]}"
    mysql = url.get_backend_name() != "postgresql"
    admin = sa.create_engine(url)
    with admin.begin() as conn:
        # SELECT on every table of the extension's (the records, the inbox) but
        # the job locks'.
        tables = [n for n in sa.inspect(conn).get_table_names() if n != "idempotency_job_locks"]
        if mysql:
            conn.execute(sa.text(f"CREATE USER '{user}'@'%'"))
            for table in tables:
                conn.execute(sa.text(f"GRANT SELECT ON `{url.database}`.{table} TO '{user}'@'%'"))
        else:
            conn.execute(sa.text(f"CREATE ROLE {user} LOGIN"))
            conn.execute(sa.text(f"GRANT SELECT ON {', '.join(tables)} TO {user}"))
    reader = make_app(url.set(username=user, password=None).render_as_string(False))
    try:
        done = reader.test_cli_runner().invoke(args=["idempotency", "stats"])
        assert done.exit_code == 0, done.output
        figures = json.loads(done.output)
        with admin.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT status, count(*) FROM idempotency_keys GROUP BY status")
            )
            by_status = {status: count for status, count in rows}
        assert figures["by_status"]["completed"] == by_status["completed"] == 1
        assert figures["jobs"] is None
        assert "idempotency_job_locks" in figures["errors"]["jobs"]
    finally:
        with reader.app_context():
            reader.extensions["sqlalchemy"].engine.dispose()
        with admin.begin() as conn:
            if mysql:
                conn.execute(sa.text(f"DROP USER IF EXISTS '{user}'@'%'"))
            else:
                conn.execute(sa.text(f"DROP OWNED BY {user}"))
                conn.execute(sa.text(f"DROP ROLE IF EXISTS {user}"))
        admin.dispose()


def test_a_missing_job_locks_table_is_one_error_line_with_the_hint(
    fresh_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The migration that makes ``idempotency_job_locks`` forgotten: each tick of
    the in-process scheduler logged APScheduler's traceback of the database's
    error. Now the first tick logs one ERROR line naming the table and the
    command, the next ones DEBUG; once the table is back a job runs (its row
    written), and a second outage is reported again."""
    app = make_app(fresh_database)
    db = app.extensions["sqlalchemy"]
    with app.app_context():
        db.metadata.tables["idempotency_keys"].create(db.engine)
    scheduler = JobScheduler(app)
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")

    def missing_lines() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "idempotency_job_locks is missing" in r.getMessage()]

    for _ in range(3):
        assert scheduler.run_job("purge", lambda app, keep: None) is False
    lines = missing_lines()
    assert [r.levelno for r in lines] == [logging.ERROR, logging.DEBUG, logging.DEBUG]
    assert "flask idempotency create-tables" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.exc_info]
    with app.app_context():
        db.metadata.tables["idempotency_job_locks"].create(db.engine)
    assert scheduler.run_job("purge", lambda app, keep: None) is True
    with app.app_context():
        ran = db.session.scalar(
            sa.text("SELECT count(*) FROM idempotency_job_locks WHERE last_finished_at IS NOT NULL")
        )
        db.session.remove()
        db.metadata.tables["idempotency_job_locks"].drop(db.engine)
    assert ran == 1
    caplog.clear()
    assert scheduler.run_job("purge", lambda app, keep: None) is False
    assert [r.levelno for r in missing_lines()] == [logging.ERROR]
    with app.app_context():
        db.engine.dispose()
