"""DESIGN.md "Proof", with a live server in a subprocess and a real PostgreSQL:
concurrent duplicates, a crash after commit before the response is sent, and a
reused key with a different payload. Each asserts exactly one ledger row.
"""

from __future__ import annotations

import collections
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import POSTGRES_ENV, direct_postgres_url, reset_tables, run_sql
from tests.support import pgbouncer
from tests.support.live import MERCHANT, LiveServer, concurrently

pytestmark = pytest.mark.slow

CHARGE = {"customer_id": "cus_1", "amount": 1250, "currency": "EUR"}


def ledger_rows(url: str) -> int:
    return int(run_sql(url, "SELECT count(*) FROM ledger")[0][0])


def records(url: str) -> list[dict[str, t.Any]]:
    rows = run_sql(url, "SELECT scope, key, status, fencing_token FROM idempotency_keys")
    return [dict(r._mapping) for r in rows]


@pytest.fixture
def example_server(pg_url: str) -> t.Iterator[LiveServer]:
    from flask import Flask

    from example_app import app as example_module

    # The example app's tables: create them fresh for each test.
    scratch = Flask("scratch")
    scratch.config["SQLALCHEMY_DATABASE_URI"] = pg_url
    example_module.db.init_app(scratch)
    example_module.idem.init_app(scratch, example_module.db)
    with scratch.app_context():
        example_module.db.drop_all()
        example_module.db.create_all()
        example_module.db.engine.dispose()
    server = LiveServer("example", pg_url).start()
    yield server
    server.stop()


@pytest.fixture
def test_server(pg_url: str) -> t.Iterator[LiveServer]:
    from tests.support import testapp

    testapp.create_app(pg_url)  # registers the record table on the metadata
    reset_tables(pg_url)
    server = LiveServer("tests", pg_url).start()
    yield server
    server.stop()


def test_postgres_is_real(pg_url: str) -> None:
    engine = sa.create_engine(pg_url)
    with engine.connect() as conn:
        assert "PostgreSQL" in conn.execute(sa.text("SELECT version()")).scalar_one()
    engine.dispose()


def test_concurrent_duplicates_run_the_view_once(test_server: LiveServer, pg_url: str) -> None:
    key = str(uuid.uuid4())
    replies = concurrently(25, lambda: test_server.post("/slow", {"delay": 0.5}, key))
    statuses = collections.Counter(r.status for r in replies)
    assert statuses == {201: 25}, statuses
    originals = [r for r in replies if not r.replayed]
    assert len(originals) == 1
    assert {r.body for r in replies} == {originals[0].body}
    assert ledger_rows(pg_url) == 1
    [record] = records(pg_url)
    assert record["status"] == "completed"


def test_concurrent_duplicates_on_the_example_app(example_server: LiveServer, pg_url: str) -> None:
    key = str(uuid.uuid4())
    replies = concurrently(
        20, lambda: example_server.post("/payments", CHARGE, key, headers=MERCHANT)
    )
    assert {r.status for r in replies} == {201}
    assert sum(not r.replayed for r in replies) == 1
    assert len({r.body for r in replies}) == 1
    assert ledger_rows(pg_url) == 1


def test_many_keys_at_once_each_run_once(test_server: LiveServer, pg_url: str) -> None:
    keys = [str(uuid.uuid4()) for _ in range(5)]
    counter = iter(range(1000))

    def call() -> t.Any:
        key = keys[next(counter) % len(keys)]
        return test_server.post("/slow", {"delay": 0.2}, key)

    replies = concurrently(25, call)
    assert {r.status for r in replies} == {201}
    assert sum(not r.replayed for r in replies) == 5
    assert ledger_rows(pg_url) == 5


def test_crash_after_commit_before_response_then_retry_replays(
    example_server: LiveServer, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    with pytest.raises((ConnectionError, OSError)):
        example_server.post(
            "/payments", CHARGE, key, headers={**MERCHANT, "X-Test-Crash": "after-commit"}
        )
    assert example_server.wait_dead() != 0  # really killed
    # The commit happened: the charge and the completed record are durable.
    assert ledger_rows(pg_url) == 1
    assert [r["status"] for r in records(pg_url)] == ["completed"]

    restarted = LiveServer("example", pg_url).start()
    try:
        retry = restarted.post("/payments", CHARGE, key, headers=MERCHANT)
        assert retry.status == 201
        assert retry.replayed
        assert retry.json()["amount"] == 1250
        assert retry.headers["location"].startswith("/payments/")
    finally:
        restarted.stop()
    assert ledger_rows(pg_url) == 1


def test_crash_before_commit_leaves_nothing_and_retry_runs(
    example_server: LiveServer, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    with pytest.raises((ConnectionError, OSError)):
        example_server.post(
            "/payments", CHARGE, key, headers={**MERCHANT, "X-Test-Crash": "before-commit"}
        )
    assert example_server.wait_dead() != 0
    # PostgreSQL rolled the dead connection's transaction back: no claim, no charge.
    assert ledger_rows(pg_url) == 0
    assert records(pg_url) == []

    restarted = LiveServer("example", pg_url).start()
    try:
        retry = restarted.post("/payments", CHARGE, key, headers=MERCHANT)
        assert retry.status == 201
        assert not retry.replayed
        assert restarted.post("/payments", CHARGE, key, headers=MERCHANT).replayed
    finally:
        restarted.stop()
    assert ledger_rows(pg_url) == 1


def test_reused_key_with_different_payload_is_422(example_server: LiveServer, pg_url: str) -> None:
    key = str(uuid.uuid4())
    assert example_server.post("/payments", CHARGE, key, headers=MERCHANT).status == 201
    other = example_server.post("/payments", {**CHARGE, "amount": 9999}, key, headers=MERCHANT)
    assert other.status == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert ledger_rows(pg_url) == 1
    # The original is still what a correct retry gets.
    assert example_server.post("/payments", CHARGE, key, headers=MERCHANT).json()["amount"] == 1250


def test_view_that_commits_itself_under_concurrency(test_server: LiveServer, pg_url: str) -> None:
    """The view commits mid-way: the in-progress record is then durable under its
    lease, duplicates get 409 (or the replay once it completes), the view ran once."""
    key = str(uuid.uuid4())
    replies = concurrently(20, lambda: test_server.post("/commits-itself", {"delay": 0.5}, key))
    statuses = collections.Counter(r.status for r in replies)
    assert set(statuses) <= {201, 409}, statuses
    assert sum(r.status == 201 and not r.replayed for r in replies) == 1
    for reply in replies:
        if reply.status == 409:
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.headers["content-type"] == "application/problem+json"
    assert ledger_rows(pg_url) == 1
    late = test_server.post("/commits-itself", {"delay": 0.5}, key)
    assert late.status == 201
    assert late.replayed
    assert ledger_rows(pg_url) == 1


def test_sqlite_concurrent_duplicates_run_once(tmp_path: Path) -> None:
    """SQLite has one writer at a time; duplicates wait for it and replay."""
    from tests.support import testapp

    url = f"sqlite:///{tmp_path / 'live.sqlite3'}"
    testapp.create_app(url)
    reset_tables(url)
    server = LiveServer("tests", url).start()
    try:
        key = str(uuid.uuid4())
        replies = concurrently(8, lambda: server.post("/slow", {"delay": 0.3}, key))
    finally:
        server.stop()
    assert {r.status for r in replies} <= {201, 409}
    assert sum(r.status == 201 and not r.replayed for r in replies) == 1
    assert ledger_rows(url) == 1


def test_configured_postgres_is_used_when_named(pg_url: str) -> None:
    import os

    if pgbouncer.is_pooled(pg_url):
        # Through the suite's PgBouncer: its upstream is the server named (or the
        # embedded one), the very cluster the pooled URL reaches.
        direct = direct_postgres_url(sa.make_url(pg_url).get_driver_name())
        cluster = "SELECT system_identifier FROM pg_control_system()"
        assert run_sql(pg_url, cluster) == run_sql(direct, cluster)
        pg_url = direct
    if os.environ.get(POSTGRES_ENV):
        configured, used = sa.make_url(os.environ[POSTGRES_ENV]), sa.make_url(pg_url)
        assert (used.host, used.port, used.database) == (
            configured.host,
            configured.port,
            configured.database,
        )
        assert "search_path=idempotency_test_" in used.query["options"]  # a schema of its own
    else:
        assert "host=" in pg_url  # the embedded server's socket directory


def test_duplicate_past_the_configured_wait_gets_409(pg_url: str) -> None:
    from tests.support import testapp

    testapp.create_app(pg_url)
    reset_tables(pg_url)
    server = LiveServer("tests", pg_url, {"IDEMPOTENCY_WAIT": 0.3}).start()
    try:
        key = str(uuid.uuid4())
        replies = concurrently(6, lambda: server.post("/slow", {"delay": 2.0}, key))
        conflicts = [r for r in replies if r.status == 409]
        assert len(conflicts) == 5
        for reply in conflicts:
            assert reply.headers["content-type"] == "application/problem+json"
            assert int(reply.headers["retry-after"]) >= 1
        assert sum(r.status == 201 for r in replies) == 1
        # Once the first is done, a retry replays it.
        assert server.post("/slow", {"delay": 2.0}, key).replayed
    finally:
        server.stop()
    assert ledger_rows(pg_url) == 1
