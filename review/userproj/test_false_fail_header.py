"""Repro: with a non-default IDEMPOTENCY_HEADER, idem.forward_headers() sends
the key in that header; the fake downstream only knows Idempotency-Key, so a
correct retry (same key downstream) counts as a second effect: false FAIL."""
import uuid

import pytest

from flask_idempotency.testing import assert_exactly_one
from notes_app import notes


def test_crash_after_the_call_then_retry(api, db, fault, downstream):
    key = str(uuid.uuid4())
    fault.kill_after_call()
    with pytest.raises(ConnectionError):
        api.post("/notes", json={"body": "x"}, key=key, headers={"X-Tenant": "t1"})
    api.restart()
    assert api.post("/notes", json={"body": "x"}, key=key, headers={"X-Tenant": "t1"}).status_code == 201
    for c in downstream.calls():
        print("\ncall", c.path, "key:", c.key, "X-Request-Id:", c.headers.get("X-Request-Id"), "effect:", c.effect)
    assert_exactly_one(db, downstream, key, rows={notes: {}})
