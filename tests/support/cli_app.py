"""An app factory for ``flask --app tests.support.cli_app`` in subprocesses.

Reads the database from ``IDEMPOTENCY_TEST_APP_DB`` and extra config (JSON,
durations in seconds) from ``IDEMPOTENCY_TEST_APP_CONFIG``. With
``IDEMPOTENCY_TEST_JOB_RUNS`` set, every scheduled job run is written to the
``job_runs`` table (pid, job, start, end, and the ``last_started_at`` its lock
was acquired with), and each run is stretched by that many seconds so that runs
in two processes would overlap if the lock let them.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import time
import typing as t

import sqlalchemy as sa
from flask import Flask

from flask_idempotency import signals
from flask_idempotency._storage.schema import as_utc
from flask_idempotency.models import job_lock_table
from tests.support import testapp

job_runs = sa.Table(
    "job_runs",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("pid", sa.Integer),
    sa.Column("job", sa.String(50)),
    sa.Column("started", sa.Float),
    sa.Column("finished", sa.Float),
    #: The lock's ``last_started_at`` as this run set it on acquiring: what
    #: spaces the runs, free of the delay before ``job_started`` is sent.
    sa.Column("acquired", sa.Float),
)

_started: dict[tuple[int, str], tuple[float, float]] = {}
_lock = threading.Lock()


def create_app() -> Flask:
    url = os.environ["IDEMPOTENCY_TEST_APP_DB"]
    extra = json.loads(os.environ.get("IDEMPOTENCY_TEST_APP_CONFIG", "{}"))
    app = testapp.create_app(url, **extra)
    stretch = os.environ.get("IDEMPOTENCY_TEST_JOB_RUNS")
    if stretch is not None:
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)

        locks = job_lock_table(sa.MetaData())

        def on_start(sender: t.Any, **kw: t.Any) -> None:
            now = time.time()
            with engine.connect() as conn:
                acquired = conn.execute(
                    sa.select(locks.c.last_started_at).where(
                        locks.c.name == kw["name"], locks.c.holder == kw["holder"]
                    )
                ).scalar_one()
            with _lock:
                _started[(os.getpid(), kw["name"])] = (
                    now,
                    t.cast(dt.datetime, as_utc(acquired)).timestamp(),
                )
            time.sleep(float(stretch))

        def on_finish(sender: t.Any, **kw: t.Any) -> None:
            with _lock:
                started, acquired = _started.pop((os.getpid(), kw["name"]))
            with engine.begin() as conn:
                conn.execute(
                    sa.insert(job_runs).values(
                        pid=os.getpid(),
                        job=kw["name"],
                        started=started,
                        finished=time.time(),
                        acquired=acquired,
                    )
                )

        signals.job_started.connect(on_start, weak=False)
        signals.job_finished.connect(on_finish, weak=False)
    return app
