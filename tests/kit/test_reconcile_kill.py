"""reconcile= through real HTTP: the serving process is killed (SIGKILL) right
after the view's own commit, so the order exists and no answer was stored.
After the lease, the retry gets 201 with the real order id, and one order
exists; with a hook that cannot tell, the plain route's stored failure."""

from __future__ import annotations

import time
import typing as t
import uuid

import pytest

from flask_idempotency.testing import Database, Fault, KitConfig, ServedApp
from tests.conftest import postgres_url

APP = "tests.kit.reconcile_app:create_app"
LEASE = 2  # seconds (IDEMPOTENCY_LEASE, and the leased route's lease=)


@pytest.fixture
def idempotency_config(request: pytest.FixtureRequest) -> KitConfig:
    """The shop on PostgreSQL (psycopg2 or psycopg 3) or SQLite, one worker."""
    driver, mode = request.param
    database = "sqlite://" if driver == "sqlite" else postgres_url(driver)
    return KitConfig(
        app=APP,
        database=database,
        workers=1,
        threads=4,
        app_config={"IDEMPOTENCY_WAIT": 1, "IDEMPOTENCY_LEASE": LEASE, "RECONCILE_MODE": mode},
    )


def _after_the_lease(api: ServedApp, path: str, key: str) -> t.Any:
    retry = None
    for _ in range(80):  # in progress (409) until the lease ends (bounded)
        retry = api.post(path, json={}, key=key)
        if retry.status_code != 409:
            break
        time.sleep(0.25)
    assert retry is not None
    return retry


@pytest.mark.slow
@pytest.mark.parametrize(
    "idempotency_config",
    [("psycopg2", "find"), ("psycopg", "find"), ("sqlite", "find")],
    indirect=True,
    ids=["psycopg2", "psycopg", "sqlite"],
)
@pytest.mark.parametrize(("path", "nth"), [("/orders", 1), ("/leased-orders", 2)])
def test_a_kill_after_the_views_commit_is_answered_with_the_real_order(
    api: ServedApp, db: Database, fault: Fault, path: str, nth: int
) -> None:
    key = str(uuid.uuid4())
    # The leased route's first commit is its claim's; the view's is the next.
    fault.kill_after_commit(nth)
    with pytest.raises(ConnectionError):
        api.post(path, json={}, key=key)
    assert fault.fired("kill_after_commit")
    api.restart()
    retry = _after_the_lease(api, path, key)
    assert retry.status_code == 201, retry
    [order_id] = [row["id"] for row in db.rows("SELECT id FROM orders")]
    assert retry.json() == {"id": order_id}
    assert retry.headers["Location"] == f"/orders/{order_id}"
    assert retry.replayed
    again = api.post(path, json={}, key=key)
    assert (again.status_code, again.json()) == (201, {"id": order_id})
    assert db.count("SELECT count(*) FROM orders") == 1


@pytest.mark.slow
@pytest.mark.parametrize("idempotency_config", [("psycopg2", "none")], indirect=True)
def test_a_hook_that_cannot_tell_leaves_the_stored_failure(
    api: ServedApp, db: Database, fault: Fault
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_commit()
    with pytest.raises(ConnectionError):
        api.post("/orders", json={}, key=key)
    api.restart()
    retry = _after_the_lease(api, "/orders", key)
    assert retry.status_code == 500, retry
    document = retry.json()
    assert document["type"].endswith("failed-after-commit")
    assert document["reconciled"] is False
    assert db.count("SELECT count(*) FROM orders") == 1
