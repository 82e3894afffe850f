"""Behind PgBouncer in transaction pooling mode (Debian's 1.18, started by the suite).

* A load run through gunicorn (4 workers x 4 threads, psycopg 3): many distinct
  keys, each sent several times at once, through the pooler, ends with no 5xx
  and exactly one ledger row per key. With ``IDEMPOTENCY_TEST_POOLER_UNSAFE=1``
  the app's engine keeps psycopg's automatic prepared statements, and the same
  run fails (``DuplicatePreparedStatement "_pg3_0"``, a few requests in a
  thousand: run it longer with ``IDEMPOTENCY_TEST_POOLER_KEYS=2000``): the proof
  that it can.
* A psycopg 3 engine that would prepare statements behind a declared
  transaction pooler is logged, naming the setting; one with
  ``prepare_threshold=None`` is not.
* The relay LISTENs on ``IDEMPOTENCY_RELAY_LISTEN_URL`` (a direct connection),
  and a commit through the pooler wakes it; without that URL it polls and says so.
"""

from __future__ import annotations

import collections
import concurrent.futures
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa

from flask_idempotency._messaging.listener import Listener
from flask_idempotency.testing._server import free_port
from tests.conftest import (
    direct_postgres_url,
    pgbouncer_mode,
    postgres_url,
    reset_tables,
    run_sql,
)
from tests.support import testapp
from tests.support.live import ROOT

pytestmark = pytest.mark.slow

#: Keys (``IDEMPOTENCY_TEST_POOLER_KEYS`` for a longer run), and how many times
#: each is sent (all at once, by different threads).
KEYS = int(os.environ.get("IDEMPOTENCY_TEST_POOLER_KEYS", "300"))
COPIES = 3
#: Requests in flight from the client at a time.
CLIENTS = 32
UNSAFE_ENV = "IDEMPOTENCY_TEST_POOLER_UNSAFE"


def _post(port: int, key: str) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = json.dumps({"amount": 100, "currency": "EUR"})
        conn.request(
            "POST",
            "/charges",
            body=body,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        conn.close()


def test_a_gunicorn_load_through_pgbouncer_has_no_5xx_and_one_row_per_key() -> None:
    url = postgres_url("psycopg-pgbouncer")
    reset_tables(url)
    config: dict[str, t.Any] = {}
    if os.environ.get(UNSAFE_ENV) == "1":
        # As a new user would: psycopg's default prepare_threshold (5), and no
        # pooler declared. Expected to fail.
        config = {
            "SQLALCHEMY_ENGINE_OPTIONS": {"pool_size": 40, "max_overflow": 10},
            "IDEMPOTENCY_DATABASE_POOLER": None,
        }
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "TEST_DATABASE_URL": url,
        "TEST_APP_CONFIG": json.dumps(config),
    }
    command = [
        sys.executable,
        "-m",
        "gunicorn",
        "--workers=4",
        "--threads=4",
        "--worker-class=gthread",
        f"--bind=127.0.0.1:{port}",
        "tests.support.gunicorn_app:app",
    ]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "gunicorn did not start"
                assert proc.poll() is None, "gunicorn exited"
                time.sleep(0.1)
        keys = [f"pooled-{uuid.uuid4()}" for _ in range(KEYS)]
        # Each key's copies next to each other: they meet at the same time.
        requests = [key for key in keys for _ in range(COPIES)]
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(lambda key: (key, *_post(port, key)), requests))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    statuses = collections.Counter(status for _, status, _, _ in replies)
    errors = [(status, body[:300]) for _, status, _, body in replies if status >= 500]
    if errors:
        # The server's own words (psycopg's errors), not only the HTML page.
        causes = collections.Counter(
            line.strip()[:160]
            for line in output.splitlines()
            if ("psycopg" in line and "Error" in line) or line.startswith("[SQL:")
        )
        pytest.fail(f"{len(errors)} answers 5xx of {len(replies)} ({dict(statuses)}): {causes}")
    assert set(statuses) <= {201, 409}, statuses
    for _, status, content_type, _ in replies:
        if status != 201:
            assert content_type == "application/problem+json"
    rows = run_sql(url, "SELECT key, count(*) AS n FROM ledger GROUP BY key")
    per_key = {row.key: row.n for row in rows}
    assert per_key == dict.fromkeys(keys, 1)
    assert "prepared statement" not in output


@pytest.fixture
def pooled_app_url() -> str:
    url = postgres_url("psycopg-pgbouncer")
    reset_tables(url)
    return url


def _checkout(app: t.Any) -> None:
    with app.app_context(), testapp.db.engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))


def test_a_psycopg3_engine_that_prepares_behind_a_transaction_pooler_is_logged(
    pooled_app_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    if pgbouncer_mode() == "all":
        pytest.skip("IDEMPOTENCY_TEST_PGBOUNCER=all turns psycopg's prepared statements off")
    app = testapp.create_app(
        pooled_app_url,
        SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 2},
        IDEMPOTENCY_DATABASE_POOLER="transaction",
    )
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        _checkout(app)
        _checkout(app)  # once per engine
    told = [r.getMessage() for r in caplog.records if "prepare" in r.getMessage()]
    assert len(told) == 1, told
    assert "IDEMPOTENCY_DATABASE_POOLER" in told[0]
    assert "'prepare_threshold': None" in told[0]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param({}, id="prepare_threshold=None"),
        pytest.param(
            {
                "SQLALCHEMY_ENGINE_OPTIONS": {"pool_size": 2},
                "IDEMPOTENCY_DATABASE_POOLER": "transaction+prepared",
            },
            id="pooler-tracks-prepared",
        ),
        pytest.param(
            {"SQLALCHEMY_ENGINE_OPTIONS": {"pool_size": 2}, "IDEMPOTENCY_DATABASE_POOLER": None},
            id="no-pooler-declared",
        ),
    ],
)
def test_an_engine_fit_for_its_declared_pooler_is_not_logged(
    pooled_app_url: str, caplog: pytest.LogCaptureFixture, config: dict[str, t.Any]
) -> None:
    app = testapp.create_app(pooled_app_url, **config)
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        _checkout(app)
    assert not [r for r in caplog.records if "prepare" in r.getMessage()]


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_the_relay_listens_on_its_direct_url_and_a_commit_through_the_pooler_wakes_it(
    driver: str,
) -> None:
    pooled = postgres_url(f"{driver}-pgbouncer")
    app = testapp.create_app(pooled, IDEMPOTENCY_RELAY_LISTEN_URL=direct_postgres_url(driver))
    listener = Listener(app)
    try:
        assert listener.listening
        run_sql(pooled, "SELECT pg_notify('idempotency_outbox', '')")
        assert listener.wait(30)  # woken, not timed out
    finally:
        listener.close()


def test_behind_a_transaction_pooler_without_a_listen_url_the_relay_polls_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = testapp.create_app(postgres_url("psycopg-pgbouncer"), IDEMPOTENCY_RELAY_LISTEN_URL=None)
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        first, second = Listener(app), Listener(app)
    try:
        assert not first.listening
        assert not second.listening
        assert not first.can_listen  # nothing to retry: it is meant to poll
    finally:
        first.close()
        second.close()
    told = [r.getMessage() for r in caplog.records if "LISTEN" in r.getMessage()]
    assert len(told) == 1, told  # once per app
    assert "IDEMPOTENCY_RELAY_LISTEN_URL" in told[0]
