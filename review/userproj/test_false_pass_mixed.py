"""Repro: assert_exactly_one passes although the charge was made twice: the
charge is a Core insert (not traced), an ORM row of the same view is traced
only for the execution that got past the crash point."""
import time
import uuid

import pytest

from flask_idempotency.testing import assert_exactly_one


@pytest.fixture
def idempotency_config(idempotency_config):
    return idempotency_config.replace(app="ledger_app:create_app",
                                      app_config={"IDEMPOTENCY_LEASE": 2, "IDEMPOTENCY_WAIT": 1})


def test_crash_after_commit_then_retry(api, db, fault, downstream):
    key = str(uuid.uuid4())
    fault.kill_after_commit()
    with pytest.raises(ConnectionError):
        api.post("/pay", json={"amount": 5}, key=key)
    api.restart()
    for _ in range(40):  # in progress (409) until the lease ends
        retry = api.post("/pay", json={"amount": 5}, key=key)
        if retry.status_code != 409:
            break
        time.sleep(0.25)
    print("\nretry:", retry.status_code, "charges:", db.count("SELECT count(*) FROM charges"))
    assert_exactly_one(db, downstream, key)       # PASSES
    assert db.count("SELECT count(*) FROM charges") == 2   # charged twice
