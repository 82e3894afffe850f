"""A failed attempt that handed a derived key out keeps its operation for the retry.

The view sent a derived key downstream and then failed (a timeout it cannot
tell from a refusal, a later error). The downstream may have acted under that
key. If the record were freed, the retry would be a new operation with a new
start time, so new derived keys, and the downstream would act a second time.
Kept with its lease ended, the retry reclaims the same operation and sends the
same keys. A failed attempt that handed nothing out is still freed as before, so
a client may correct its payload and retry with the key.

Every case runs on PostgreSQL, SQLite and MariaDB, and reads the record table.
"""

from __future__ import annotations

import typing as t

import pytest
from flask import Flask

from flask_idempotency._maintenance import jobs
from tests.conftest import Clock, ledger_count, record_rows
from tests.support import testapp

idem = testapp.idem


def _add_routes(app: Flask, sent: list[str], fail: list[bool]) -> None:
    """Routes that derive a key (as if calling a payment service), then fail while
    ``fail`` holds ``True`` (one per attempt)."""

    def outcome() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("kept")
        if fail.pop(0) if fail else False:
            return {"error": "the payment service timed out"}, 504
        return {"sent": sent[-1] if sent else None}, 201

    @app.post("/derives")
    @idem.idempotent(required=True, lease=30)
    def derives() -> tuple[dict[str, t.Any], int]:
        sent.append(idem.derived_key("charge"))
        return outcome()

    @app.post("/derives-unleased")
    @idem.idempotent(required=True)
    def derives_unleased() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("kept")
        sent.append(idem.derived_key("charge"))
        return outcome()

    @app.post("/forwards-then-raises")
    @idem.idempotent(required=True, lease=30)
    def forwards_then_raises() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("kept")
        headers = idem.forward_headers(step="charge")
        sent.append(next(iter(headers.values())).strip('"'))
        if fail.pop(0) if fail else False:
            raise RuntimeError("the payment client blew up after sending")
        return {"sent": sent[-1]}, 201

    @app.post("/derives-after-own-rollback")
    @idem.idempotent(required=True, lease=30)
    def derives_after_own_rollback() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("kept")
        testapp.db.session.rollback()  # the view manages its transaction itself
        sent.append(idem.derived_key("charge"))
        return outcome()

    @app.post("/emits-only")
    @idem.idempotent(required=True, lease=30)
    def emits_only() -> tuple[dict[str, t.Any], int]:
        idem.emit("order-created", {"n": 1})
        return outcome()


@pytest.fixture
def routes(app: Flask) -> tuple[list[str], list[bool]]:
    sent: list[str] = []
    fail: list[bool] = []
    _add_routes(app, sent, fail)
    return sent, fail


def _post(app: Flask, path: str, key: str, body: dict[str, t.Any] | None = None) -> t.Any:
    return app.test_client().post(
        path, json=body if body is not None else {"amount": 1}, headers={"Idempotency-Key": key}
    )


@pytest.mark.parametrize(
    "path",
    [
        "/derives",
        "/forwards-then-raises",
        "/derives-after-own-rollback",
    ],
)
def test_the_retry_of_a_failed_attempt_sends_the_same_derived_key(
    app: Flask, routes: tuple[list[str], list[bool]], path: str, clock: Clock
) -> None:
    sent, fail = routes
    fail.extend([True, True, False])
    first = None
    for _ in range(3):
        clock.advance(seconds=5)  # each retry comes later: a new operation would start later
        try:
            first = _post(app, path, "k-kept")
        except RuntimeError:
            first = None
    assert first is not None
    assert first.status_code == 201
    assert len(sent) == 3, sent
    assert len(set(sent)) == 1, sent
    # The failures wrote nothing; the success wrote once and is replayed.
    assert ledger_count(app, "kept") == 1
    again = _post(app, path, "k-kept")
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert len(sent) == 3


def test_a_kept_operation_is_in_progress_with_its_lease_ended(
    app: Flask, routes: tuple[list[str], list[bool]], clock: Clock
) -> None:
    _sent, fail = routes
    fail.append(True)
    assert _post(app, "/derives", "k-state").status_code == 504
    [row] = record_rows(app)
    assert row["status"] == "in_progress"
    assert row["locked_until"] is None
    assert row["recovery_points"] == "{}"
    assert ledger_count(app, "kept") == 0
    # The recovery job leaves it for the client's retry ...
    with app.app_context():
        jobs.recover_abandoned(app)
    assert len(record_rows(app)) == 1
    # ... and it goes when it expires, like any record.
    clock.advance(days=2)
    with app.app_context():
        jobs.purge_expired(app)
    assert record_rows(app) == []


def test_a_kept_operation_refuses_a_different_payload(
    app: Flask, routes: tuple[list[str], list[bool]]
) -> None:
    """The downstream may have acted for the first payload: the key is that operation's."""
    sent, fail = routes
    fail.append(True)
    assert _post(app, "/derives", "k-payload", {"amount": 1}).status_code == 504
    other = _post(app, "/derives", "k-payload", {"amount": 2})
    assert other.status_code == 422
    assert other.mimetype == "application/problem+json"
    assert len(sent) == 1


def test_a_failed_attempt_that_handed_nothing_out_is_freed(
    app: Flask, routes: tuple[list[str], list[bool]]
) -> None:
    """Emitting alone hands nothing out (events roll back with the view): the key is
    freed, and a corrected payload runs."""
    _sent, fail = routes
    fail.append(True)
    assert _post(app, "/emits-only", "k-free", {"amount": 1}).status_code == 504
    assert record_rows(app) == []
    corrected = _post(app, "/emits-only", "k-free", {"amount": 2})
    assert corrected.status_code == 201
    assert ledger_count(app, "kept") == 1


def test_a_new_operation_after_expiry_derives_new_keys(
    app: Flask, routes: tuple[list[str], list[bool]], clock: Clock
) -> None:
    """Keeping an operation does not make its keys outlive it."""
    sent, fail = routes
    fail.append(True)
    assert _post(app, "/derives", "k-expire").status_code == 504
    clock.advance(days=2)
    assert _post(app, "/derives", "k-expire").status_code == 201
    assert len(set(sent)) == 2


def test_a_derived_key_needs_a_committed_claim(
    app: Flask, routes: tuple[list[str], list[bool]]
) -> None:
    """Without a lease the claim is uncommitted while the view runs: a crash or a
    rollback loses it, and the retry would be a new operation with new keys. So
    the key is refused there, before it can leave, and nothing is written."""
    sent, _fail = routes
    app.testing = True  # the app's programming error reaches the test
    with pytest.raises(RuntimeError, match="needs a leased route"):
        _post(app, "/derives-unleased", "k-unleased")
    assert sent == []
    assert record_rows(app) == []
    assert ledger_count(app, "kept") == 0


def test_a_failed_recovery_run_leaves_the_kept_operation_to_the_client(
    app: Flask, clock: Clock
) -> None:
    """On a ``recover=True`` route, the job re-runs an abandoned operation; if the
    re-run hands a derived key out and fails, the job does not re-run it on each
    tick: it waits for the client's retry, which sends the same key."""
    sent: list[str] = []
    fail = [True, True]

    @app.post("/recoverable")
    @idem.idempotent(required=True, lease=30, recover=True)
    def recoverable() -> tuple[dict[str, t.Any], int]:
        sent.append(idem.derived_key("charge"))
        if fail.pop(0) if fail else False:
            return {"error": "the payment service timed out"}, 504
        return {"sent": sent[-1]}, 201

    assert _post(app, "/recoverable", "k-rec").status_code == 504
    [row] = record_rows(app)
    assert row["request_method"] is None  # the job has nothing to re-run
    reports = []
    for _ in range(3):
        clock.advance(minutes=1)
        with app.app_context():
            reports.append(jobs.recover_abandoned(app))
    assert len(sent) == 1
    assert [(r.completed, r.released) for r in reports] == [(0, 0)] * 3
    assert len(record_rows(app)) == 1
    assert _post(app, "/recoverable", "k-rec").status_code == 504
    done = _post(app, "/recoverable", "k-rec")
    assert done.status_code == 201
    assert len(set(sent)) == 1


def test_manual_mode_derives_the_completed_operations_keys(app: Flask) -> None:
    sent: list[str] = []

    @app.post("/manual")
    @idem.idempotent(required=True, lease=30, manual=True)
    def manual() -> tuple[dict[str, t.Any], int]:
        sent.append(idem.derived_key("charge"))
        return {"sent": sent[0]}, 201

    _post(app, "/manual", "k-manual")
    _post(app, "/manual", "k-manual")
    assert len(sent) == 2
    assert sent[0] == sent[1]
