"""The example's payments service (example_app/app.py) under the testing kit: the
three proof tests and the faults, served by gunicorn, on the suite's PostgreSQL
through psycopg2 and psycopg 3, and on SQLite. Every test counts ledger rows,
records and downstream effects (assert_exactly_one), not only status codes."""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from example_app.app import LedgerEntry
from flask_idempotency.testing import (
    Database,
    Downstream,
    Fault,
    KitConfig,
    Response,
    ServedApp,
    assert_exactly_one,
    concurrent_duplicates,
    reuse_key,
)
from tests.conftest import postgres_url
from tests.support import pgbouncer

pytestmark = pytest.mark.slow

PAYMENT = {"customer_id": "c1", "amount": 1250, "currency": "EUR"}
HEADERS = {"X-Merchant": "shop-1"}


@pytest.fixture(params=["psycopg2", "psycopg", "sqlite"])
def idempotency_config(request: pytest.FixtureRequest, tmp_path: Path) -> KitConfig:
    database = "sqlite://" if request.param == "sqlite" else postgres_url(request.param)
    return KitConfig(
        app="example_app.app:create_app",
        database=database,
        # A duplicate waits 1 s for a running first request before its 409.
        # Behind the suite's PgBouncer: declared, as the example's docs say.
        app_config={"IDEMPOTENCY_WAIT": 1, **pgbouncer.declared(database)},
    )


def post(api: ServedApp, key: str, amount: int = 1250) -> Response:
    return api.post("/payments", json={**PAYMENT, "amount": amount}, key=key, headers=HEADERS)


def test_crash_after_commit_then_retry_replays(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_commit()
    with pytest.raises(ConnectionError):
        post(api, key)
    assert fault.fired("kill_after_commit")
    # The charge and its record committed before the crash.
    assert db.count(LedgerEntry, merchant="shop-1") == 1
    api.restart()
    retry = post(api, key)
    assert retry.status_code == 201
    assert retry.replayed
    assert retry.json()["charge_id"] == db.scalar("SELECT id FROM ledger")
    assert_exactly_one(db, downstream, key, rows={LedgerEntry: {"merchant": "shop-1"}})


def test_crash_before_commit_then_retry_runs_once(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_before_commit()
    with pytest.raises(ConnectionError):
        post(api, key)
    assert fault.fired("kill_before_commit")
    assert db.count(LedgerEntry) == 0
    assert db.records(key) == []  # the claim rolled back with the view
    api.restart()
    retry = post(api, key)
    assert retry.status_code == 201
    assert not retry.replayed
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry) == 1


def test_twenty_concurrent_duplicates_charge_once(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    answers = concurrent_duplicates(
        api, 20, "POST", "/payments", json=PAYMENT, key=key, headers=HEADERS
    )
    statuses = []
    for answer in answers:
        assert isinstance(answer, Response), answer
        statuses.append(answer.status_code)
        assert answer.status_code in (201, 409), answer
        assert answer.status_code == 201 or answer.is_problem
    assert sum(1 for a in answers if isinstance(a, Response) and a.status_code == 201) >= 1
    originals = [a for a in answers if isinstance(a, Response) and a.status_code == 201]
    assert sum(1 for a in originals if not a.replayed) == 1, statuses
    assert {a.json()["charge_id"] for a in originals} == {db.scalar("SELECT id FROM ledger")}
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry) == 1


def test_reused_key_with_another_amount_is_refused(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    first, second = reuse_key(
        api, "/payments", key, PAYMENT, {**PAYMENT, "amount": 9999}, headers=HEADERS
    )
    assert first.status_code == 201
    assert second.status_code == 422
    assert second.is_problem
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry, amount=9999) == 0


def test_database_refused_is_503_then_the_retry_runs_once(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    if fault.proxy is None:
        pytest.skip("SQLite is a local file: no network between the app and it")
    key = str(uuid.uuid4())
    fault.database_down(60, mode="refuse")
    down = post(api, key)
    assert down.status_code == 503, down
    assert down.is_problem
    assert down.headers.get("Retry-After")
    assert db.records(key) == []
    fault.database_up()
    retry = post(api, key)
    assert retry.status_code == 201, retry
    assert not retry.replayed
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry) == 1


def test_a_request_caught_in_a_partition_and_its_retry_take_effect_once(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    """Through a userland proxy a partition hangs the request (the proxy's kernel
    acknowledges what the app sends, so no TCP timeout fires): the client gives
    up; when the network heals the hung request goes on, and the retries get
    409 until it is done, then its replay."""
    if fault.proxy is None:
        pytest.skip("SQLite is a local file: no network between the app and it")
    key = str(uuid.uuid4())
    fault.database_down(60, mode="blackhole")
    with pytest.raises(TimeoutError):
        api.post("/payments", json=PAYMENT, key=key, headers=HEADERS, timeout=3)
    fault.database_up()
    for _ in range(60):  # bounded: 409 while the first attempt still runs
        retry = post(api, key)
        if retry.status_code != 409:
            break
        assert retry.is_problem
        time.sleep(0.5)
    assert retry.status_code == 201, retry
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry) == 1


def test_a_duplicate_of_a_held_request_is_409_then_replays(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    with fault.hold_first() as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, api, key)
        assert held.wait_reached(timeout=30)
        duplicate = post(api, key)
        assert duplicate.status_code == 409, duplicate
        assert duplicate.is_problem
        assert db.count(LedgerEntry) == 0  # the first has not committed
        held.release()
        assert first.result(timeout=60).status_code == 201
    assert fault.fired("hold_first")
    later = post(api, key)
    assert later.replayed
    assert_exactly_one(db, downstream, key)


def test_a_request_held_past_the_claim_idle_timeout_still_commits(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    """The example ends a claim's transaction left idle 5 s on PostgreSQL
    (IDEMPOTENCY_CLAIM_IDLE_TIMEOUT). A request the kit holds is at work, not cut
    off: held longer than that (a slow test machine), it still commits once."""
    if fault.proxy is None:
        pytest.skip("SQLite has no idle-in-transaction timeout")
    key = str(uuid.uuid4())
    with fault.hold_first() as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, api, key)
        assert held.wait_reached(timeout=30)
        time.sleep(6.5)
        held.release()
        assert first.result(timeout=60).status_code == 201
    assert_exactly_one(db, downstream, key)
    assert db.count(LedgerEntry) == 1
