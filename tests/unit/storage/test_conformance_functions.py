"""The storage contract an idempotent function (``idem.function``) relies on,
on every implementation of the storage layer (see test_conformance.py): its
record has no stored request, holds its return value as a 200 JSON answer
(sealed under a keyring, opened back), its failure after a commit of its own
as the answer its commit stored; the recovery job's queries never take it
for a request to re-run, release it when abandoned without steps and leave
it to its caller's next call when it holds some.

Against the real database, read back on a connection of its own.
"""

from __future__ import annotations

import datetime as dt
import json

from sqlalchemy.orm import Session

from flask_idempotency._storage import COMPLETED, IN_PROGRESS, answer_values, seal
from tests.support.storage import HOUR, SCOPE, Impl, claimed, new_key, now_ms, record_values

VALUE = json.dumps({"charged": 500, "card": "4242-MARK"}).encode()
JSON = [("Content-Type", "application/json")]


def test_a_function_record_stores_its_value_and_is_never_a_request_to_rerun(impl: Impl) -> None:
    impl.store.keyring = seal.Keyring(keys=(("a", bytes(range(32))),))
    now, key = now_ms(), new_key()
    # No request: the function's name as its path, without a method (a function's claim).
    values = {**record_values(key, now), "request_path": "@idem.function billing.charge"}
    claimed(impl, values)
    with Session(impl.engine) as session:
        assert impl.store.complete(
            session,
            SCOPE,
            key,
            values["fencing_token"],
            response_code=200,
            response_headers=JSON,
            response_body=VALUE,
            body_omitted=False,
            now=now,
            expires_at=now + 24 * HOUR,
        )
        session.commit()
    row = impl.rows()[key]
    assert (row["status"], row["response_code"], row["request_method"]) == (COMPLETED, 200, None)
    assert b"4242-MARK" not in bytes(row["response_body"])  # sealed at rest
    with impl.engine.connect() as conn:
        record = impl.store.load(conn, SCOPE, key)
    assert record is not None
    assert (record.response_body, record.recoverable) == (VALUE, False)
    assert (record.request_path, record.function_call) == ("@idem.function billing.charge", True)
    assert "billing.charge" not in str(row["request_path"])  # sealed as a request's path
    with impl.engine.connect() as conn:  # and so found by the operator's queries
        found = impl.store.failed_after_commit(conn, scope=SCOPE, key=None, limit=10)
    assert key not in {r.key for r in found}  # its 200 is no failure


def test_an_abandoned_function_record_is_released_or_kept_for_its_steps(impl: Impl) -> None:
    now = now_ms()
    bare, stepped, committed = new_key(), new_key(), new_key()
    for key in (bare, stepped, committed):
        values = record_values(key, now - 2 * HOUR, lease=HOUR)
        claimed(impl, {**values, "request_path": "@idem.function jobs.book"})
    rows = impl.rows()
    with impl.engine.begin() as conn:
        # A step saved on one; the other's function committed work of its own.
        assert impl.store.save_recovery_points(
            conn, SCOPE, stepped, rows[stepped]["fencing_token"], {"charge": 1}, now - HOUR
        )
        failure = answer_values(500, [], b"{}", False)
        renewed, _ = impl.store.renew_lease_before_commit(
            conn, SCOPE, committed, rows[committed]["fencing_token"], now - HOUR, failure
        )
        assert renewed
    with impl.engine.connect() as conn:
        found = {r.key: r for r in impl.store.find_abandoned(conn, now, 10)}
    # The one with steps waits for its caller; none is a request to re-run.
    assert set(found) == {bare, committed}
    assert not any(r.recoverable for r in found.values())
    assert all(r.function_call for r in found.values())  # its name read back
    assert found[committed].view_committed
    with impl.engine.begin() as conn:
        assert impl.store.delete_releasable(conn, found[bare], now)
        assert not impl.store.delete_releasable(conn, found[committed], now)
        assert impl.store.settle_committed(
            conn,
            SCOPE,
            committed,
            found[committed].fencing_token,
            now,
            retention=dt.timedelta(hours=24),
        )
    rows = impl.rows()
    assert bare not in rows
    assert (rows[stepped]["status"], rows[committed]["status"]) == (IN_PROGRESS, COMPLETED)
    assert rows[committed]["response_code"] == 500
