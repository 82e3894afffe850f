"""Work that spans transactions: leases, fencing, recovery points, lease recovery.

Real PostgreSQL, a live server in a subprocess killed with SIGKILL, and a fake
downstream that records every call per key. Each test asserts on ledger rows
and downstream calls, not only on status codes.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import threading
import time
import typing as t
import uuid

import pytest

from tests.conftest import reset_tables, run_sql
from tests.support import testapp
from tests.support.downstream import Downstream
from tests.support.live import LiveServer, Reply, concurrently

pytestmark = pytest.mark.slow

LEASE = 1.5  # seconds: short, so the tests can outlive it
ORDER = {"amount": 4200, "card": "tok_visa"}


@pytest.fixture
def downstream() -> t.Iterator[Downstream]:
    service = Downstream().start()
    yield service
    service.stop()


@pytest.fixture
def config(downstream: Downstream) -> dict[str, t.Any]:
    return {"DOWNSTREAM_URL": downstream.url, "IDEMPOTENCY_LEASE": LEASE}


@pytest.fixture
def servers(pg_url: str, config: dict[str, t.Any]) -> t.Iterator[list[LiveServer]]:
    """Start servers with ``servers.append(...)``-style helper; all are killed after."""
    testapp.create_app(pg_url)
    reset_tables(pg_url)
    started: list[LiveServer] = []
    yield started
    for server in started:
        server.stop()


def start(servers: list[LiveServer], pg_url: str, config: dict[str, t.Any]) -> LiveServer:
    server = LiveServer("tests", pg_url, config).start()
    servers.append(server)
    return server


def query(url: str, sql: str) -> list[dict[str, t.Any]]:
    return [dict(r._mapping) for r in run_sql(url, sql)]


def ledger_rows(url: str) -> int:
    return int(query(url, "SELECT count(*) AS n FROM ledger")[0]["n"])


def the_record(url: str) -> dict[str, t.Any]:
    [record] = query(
        url,
        "SELECT status, fencing_token, locked_until, recovery_points, response_code"
        " FROM idempotency_keys",
    )
    return record


def wait_for_lease_end(url: str) -> None:
    """Sleep until the record's lease has ended (reads it; no timing assertion)."""
    locked_until = the_record(url)["locked_until"]
    assert locked_until is not None
    remaining = (locked_until - dt.datetime.now(dt.timezone.utc)).total_seconds()
    time.sleep(max(0.0, remaining) + 0.2)


def crash(server: LiveServer, point: str, key: str) -> None:
    with pytest.raises((ConnectionError, OSError)):
        server.post("/checkout", ORDER, key, headers={"X-Test-Crash": point})
    assert server.wait_dead() != 0


# -- crashes and resumption ---------------------------------------------------------


def test_crash_after_external_calls_before_completion(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    crash(start(servers, pg_url, config), "before-complete", key)
    record = the_record(pg_url)
    assert record["status"] == "in_progress"
    assert set(json.loads(record["recovery_points"])) == {"charge", "email"}
    assert ledger_rows(pg_url) == 0

    server = start(servers, pg_url, config)
    # While the dead attempt's lease runs, the key answers 409. (On a loaded
    # machine the new server may start after the short lease ended: then the
    # request below resumes the operation at once, which the rest checks.)
    left = (record["locked_until"] - dt.datetime.now(dt.timezone.utc)).total_seconds()
    if left > 0.5:
        during = server.post("/checkout", ORDER, key)
        assert during.status == 409
        assert 1 <= int(during.headers["retry-after"]) <= 2
        assert during.headers["content-type"] == "application/problem+json"

    wait_for_lease_end(pg_url)
    retry = server.post("/checkout", ORDER, key)
    assert retry.status == 201, retry.body
    assert not retry.replayed
    assert retry.json()["charge"] == "charge_1"
    assert downstream.calls_for("charge") == 1  # the resumed attempt skipped the step
    assert downstream.effects_for("charge") == 1
    assert ledger_rows(pg_url) == 1
    assert the_record(pg_url)["fencing_token"] != record["fencing_token"]  # reclaimed
    assert server.post("/checkout", ORDER, key).replayed


def test_crash_inside_the_call_is_deduplicated_downstream_by_the_derived_key(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    # The charge went through, the process died before its recovery point was saved.
    crash(start(servers, pg_url, config), "in-charge", key)
    assert json.loads(the_record(pg_url)["recovery_points"] or "{}") == {}
    wait_for_lease_end(pg_url)
    retry = start(servers, pg_url, config).post("/checkout", ORDER, key)
    assert retry.status == 201
    # Called twice with the same derived key, charged once.
    [(operation, derived)] = [k for k in downstream.calls if k[0] == "charge"]
    assert downstream.calls[(operation, derived)] == 2
    assert downstream.effects_for("charge") == 1
    assert ledger_rows(pg_url) == 1


def test_crash_between_recovery_points_resumes_after_the_finished_one(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    crash(start(servers, pg_url, config), "between-steps", key)
    assert set(json.loads(the_record(pg_url)["recovery_points"])) == {"charge"}
    assert downstream.calls_for("email") == 0
    wait_for_lease_end(pg_url)
    retry = start(servers, pg_url, config).post("/checkout", ORDER, key)
    assert retry.status == 201
    assert downstream.calls_for("charge") == 1
    assert downstream.calls_for("email") == 1
    assert ledger_rows(pg_url) == 1


# -- fencing ----------------------------------------------------------------------------


def test_slow_worker_that_lost_its_lease_cannot_complete(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    """Lease too short: a slow but healthy worker is overtaken; its completion is
    refused by the fencing token and its ledger row rolled back."""
    server = start(servers, pg_url, config)
    key = str(uuid.uuid4())
    slow: list[Reply] = []
    worker = threading.Thread(
        target=lambda: slow.append(
            server.post("/checkout", ORDER, key, headers={"X-Test-Slow": str(LEASE * 2.5)})
        )
    )
    worker.start()
    # Wait until the slow worker has saved both steps, then until its lease ends.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        points = query(pg_url, "SELECT recovery_points FROM idempotency_keys")
        if points and points[0]["recovery_points"] and "email" in points[0]["recovery_points"]:
            break
        time.sleep(0.05)
    overtaken_token = the_record(pg_url)["fencing_token"]
    wait_for_lease_end(pg_url)
    # The new holder is still running when the slow worker wakes up, so only the
    # fencing token (not the record's status) can tell the two apart.
    takeover = server.post("/checkout", ORDER, key, headers={"X-Test-Slow": str(LEASE * 2.5)})
    assert takeover.status == 201
    assert not takeover.replayed
    worker.join(60)
    [refused] = slow
    assert refused.status == 409
    assert refused.json()["type"].endswith("lease-lost")
    assert takeover.json() == json.loads(
        bytes(query(pg_url, "SELECT response_body FROM idempotency_keys")[0]["response_body"])
    )
    record = the_record(pg_url)
    assert record["status"] == "completed"
    assert record["fencing_token"] != overtaken_token
    assert ledger_rows(pg_url) == 1
    assert downstream.effects_for("charge") == 1


def test_two_retries_race_to_reclaim_one_wins(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    crash(start(servers, pg_url, config), "before-complete", key)
    crashed_token = the_record(pg_url)["fencing_token"]
    server = start(servers, pg_url, config)
    wait_for_lease_end(pg_url)
    replies = concurrently(
        6, lambda: server.post("/checkout", ORDER, key, headers={"X-Test-Slow": "0.5"})
    )
    statuses = collections.Counter(r.status for r in replies)
    winners = [r for r in replies if r.status == 201 and not r.replayed]
    assert len(winners) == 1, statuses
    # The losers lost the reclaim itself: they never ran the view (which would
    # end in lease-lost), they were told the key is in progress; one that a
    # loaded machine sent after the winner's 0.5 s view ended gets its answer.
    late = [r for r in replies if r.status == 201 and r.replayed]
    assert statuses[409] + len(late) == 5, statuses
    assert statuses[409] >= 1, statuses
    for reply in replies:
        if reply.status == 409:
            assert reply.json()["type"].endswith("request-in-progress"), reply.body
    assert the_record(pg_url)["fencing_token"] != crashed_token
    assert ledger_rows(pg_url) == 1
    assert downstream.effects_for("charge") == 1


# -- release and recovery --------------------------------------------------------------


def test_release_on_5xx_lets_the_retry_run_at_once(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    server = start(servers, pg_url, config)
    key = str(uuid.uuid4())
    downstream.fail_next("email")
    first = server.post("/checkout", ORDER, key)
    assert first.status == 502
    record = the_record(pg_url)
    assert record["status"] == "in_progress"
    assert record["locked_until"] is None  # released: no waiting for the lease
    assert set(json.loads(record["recovery_points"])) == {"charge"}
    retry = server.post("/checkout", ORDER, key)
    assert retry.status == 201
    assert ledger_rows(pg_url) == 1
    assert downstream.calls_for("charge") == 1
    assert downstream.effects_for("email") == 1


def test_recovery_job_completes_an_abandoned_request(
    servers: list[LiveServer], pg_url: str, config: dict[str, t.Any], downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    crash(start(servers, pg_url, config), "between-steps", key)
    app = testapp.create_app(pg_url, **config)
    runner = app.test_cli_runner()
    left = (the_record(pg_url)["locked_until"] - dt.datetime.now(dt.timezone.utc)).total_seconds()
    if left > 0.5:  # a loaded machine may start the app after the short lease ended
        early = runner.invoke(args=["idempotency", "recover"])
        assert early.exit_code == 0
        assert "completed 0" in early.output  # the lease is still live: not abandoned yet
    wait_for_lease_end(pg_url)
    result = runner.invoke(args=["idempotency", "recover"])
    assert result.exit_code == 0, result.output
    assert "completed 1" in result.output
    record = the_record(pg_url)
    assert record["status"] == "completed"
    assert record["response_code"] == 201
    assert ledger_rows(pg_url) == 1
    assert downstream.calls_for("charge") == 1
    assert downstream.calls_for("email") == 1
    # The client comes back later and gets what the job stored.
    late = start(servers, pg_url, config).post("/checkout", ORDER, key)
    assert late.status == 201
    assert late.replayed
    assert late.json() == {"charge": "charge_1", "receipt": "email_2"}
    assert ledger_rows(pg_url) == 1
    with app.app_context():
        testapp.db.engine.dispose()
