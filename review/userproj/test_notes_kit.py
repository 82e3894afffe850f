"""The proof every payments team should run against its own app and database,
written with Flask-Idempotency's testing kit (docs/testing-kit.md).

Copy this file into your tests, point the kit at your app and database in your
pytest configuration, and change ``post()`` to one of your keyed routes::

    # pyproject.toml
    [tool.pytest.ini_options]
    idempotency_app = "myshop.app:create_app"      # called with a config dict
    idempotency_database = "postgresql+psycopg2://postgres@127.0.0.1/postgres"

Each test gets a database of its own on that server and your app served by
gunicorn in a subprocess; the assertions count rows, outbox events and calls
at the fake downstream, never status codes alone.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

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

from notes_app import notes

PAYMENT = {"body": "hello"}
HEADERS = {"X-Tenant": "t1"}


@pytest.fixture
def idempotency_config(idempotency_config: KitConfig) -> KitConfig:
    # Duplicates wait 1 s (not 10) for a first request that is still running
    # before they get 409: the held-request test below runs in seconds.
    return idempotency_config.replace(
        app_config={**idempotency_config.app_config, "IDEMPOTENCY_WAIT": 1}
    )


def post(api: ServedApp, key: str, amount: int = 1250) -> Response:
    return api.post("/notes", json={**PAYMENT, "amount": amount}, key=key, headers=HEADERS)


def test_crash_after_commit_then_retry(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_after_commit()  # the process dies after COMMIT, before the response is written
    with pytest.raises(ConnectionError):
        post(api, key)
    assert fault.fired("kill_after_commit")
    api.restart()
    retry = post(api, key)
    assert retry.status_code == 201  # replayed from the stored response
    assert_exactly_one(db, downstream, key, rows={notes: {}})  # one charge, one record: counted
    assert retry.replayed


def test_crash_before_commit_then_retry(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    fault.kill_before_commit()  # the view ran; its transaction never commits
    with pytest.raises(ConnectionError):
        post(api, key)
    api.restart()
    retry = post(api, key)
    assert retry.status_code == 201
    assert not retry.replayed  # nothing was stored: the view ran again, once
    assert_exactly_one(db, downstream, key, rows={notes: {}})


def test_concurrent_duplicates(api: ServedApp, db: Database, downstream: Downstream) -> None:
    key = str(uuid.uuid4())
    answers = concurrent_duplicates(
        api, 20, "POST", "/notes", json=PAYMENT, key=key, headers=HEADERS
    )
    for answer in answers:
        assert not isinstance(answer, BaseException), answer
        # The winner's 201, its replay, or 409 problem+json while it still ran.
        assert answer.status_code in (201, 409), answer
        if answer.status_code == 409:
            assert answer.is_problem
    assert sum(1 for a in answers if a.status_code == 201 and not a.replayed) == 1
    assert_exactly_one(db, downstream, key, rows={notes: {}})


def test_reused_key_with_another_payload(
    api: ServedApp, db: Database, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    first, second = reuse_key(
        api, "/notes", key, PAYMENT, {**PAYMENT, "body": "other"}, headers=HEADERS
    )
    assert first.status_code == 201
    assert second.status_code == 422
    assert second.is_problem
    assert_exactly_one(db, downstream, key, rows={notes: {}})


def test_database_down_then_retry(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    if fault.proxy is None:
        pytest.skip("SQLite is a local file: it cannot go down")
    key = str(uuid.uuid4())
    fault.database_down(60, mode="refuse")
    down = post(api, key)
    assert down.status_code == 503  # never an HTML 500
    assert down.is_problem
    fault.database_up()
    retry = post(api, key)
    assert retry.status_code == 201
    assert_exactly_one(db, downstream, key, rows={notes: {}})


def test_duplicate_while_the_first_is_held(
    api: ServedApp, db: Database, fault: Fault, downstream: Downstream
) -> None:
    key = str(uuid.uuid4())
    with fault.hold_first() as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, api, key)
        assert held.wait_reached(timeout=30)  # it claimed the key and waits
        duplicate = post(api, key)
        assert duplicate.status_code == 409  # in progress: retry later
        assert duplicate.is_problem
        held.release()
        assert first.result(timeout=60).status_code == 201
    assert post(api, key).replayed
    assert_exactly_one(db, downstream, key, rows={notes: {}})
