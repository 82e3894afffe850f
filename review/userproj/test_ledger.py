import time
import uuid

import pytest

from flask_idempotency.testing import assert_exactly_one


@pytest.fixture
def idempotency_config(idempotency_config):
    return idempotency_config.replace(
        app=idempotency_config.app.replace("notes_app", "ledger_app"),
        app_config={"IDEMPOTENCY_LEASE": 2, "IDEMPOTENCY_WAIT": 1})


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_kill_after_nth_commit(api, db, fault, downstream, nth):
    key = str(uuid.uuid4())
    fault.kill_after_commit(nth)
    try:
        first = api.post("/transfer", json={"amount": 5}, key=key)
        print(f"\nnth={nth}: first answered {first.status_code}, fired={fault.fired('kill_after_commit')}")
    except ConnectionError as exc:
        print(f"\nnth={nth}: first died ({exc}), fired={fault.fired('kill_after_commit')}")
    api.restart()
    for _ in range(40):
        retry = api.post("/transfer", json={"amount": 5}, key=key)
        if retry.status_code != 409:
            break
        time.sleep(0.25)
    print(f"retry: {retry.status_code} replayed={retry.replayed} {retry.text[:100]}")
    print("moves:", db.rows("select account, amount from moves order by id"))
    assert_exactly_one(db, downstream, key)
