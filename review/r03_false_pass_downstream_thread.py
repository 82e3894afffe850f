"""Repro: assert_exactly_one passes while the downstream made 2 effects for the
operation, because the calls were made outside the request's thread (no
Idempotency-Kit-Origin header), so they are not counted at all."""
import uuid

import pytest

from flask_idempotency.testing import assert_exactly_one
from notes_app import notes


def test_crash_before_commit_then_retry(api, db, fault, downstream):
    key = str(uuid.uuid4())
    fault.kill_before_commit()
    with pytest.raises(ConnectionError):
        api.post("/notes-parallel", json={"body": "x"}, key=key, headers={"X-Tenant": "t1"})
    api.restart()
    assert api.post("/notes-parallel", json={"body": "x"}, key=key, headers={"X-Tenant": "t1"}).status_code == 201
    print("\ndownstream effects:", [(e.number, e.key) for e in downstream.effects()])
    print("calls with origin=key:", len(downstream.calls(origin=key)))
    assert_exactly_one(db, downstream, key, rows={notes: {}})  # PASSES
    assert len(downstream.effects()) == 2  # ... and yet: charged twice
