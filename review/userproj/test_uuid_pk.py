"""Repro: a correct app with a UUID primary key. assert_exactly_one crashes on
psycopg 3 (plain postgresql://) and fails falsely on SQLite."""
import uuid

import pytest

from flask_idempotency.testing import assert_exactly_one


@pytest.fixture
def idempotency_config(idempotency_config):
    return idempotency_config.replace(app="uuid_app:create_app")


def test_crash_after_commit_then_retry(api, db, fault, downstream):
    key = str(uuid.uuid4())
    fault.kill_after_commit()
    with pytest.raises(ConnectionError):
        api.post("/invoices", json={"total": 10}, key=key)
    api.restart()
    retry = api.post("/invoices", json={"total": 10}, key=key)
    assert retry.status_code == 201 and retry.replayed
    assert db.count("SELECT count(*) FROM invoices") == 1
    assert_exactly_one(db, downstream, key)
