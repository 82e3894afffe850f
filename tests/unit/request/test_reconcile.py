"""reconcile=: the answer of an operation whose view committed and whose request
never answered, rebuilt by the app's hook from the committed state.

A shop marks each order with its scope and idempotency key; its hook finds the
order and answers what the view would have. Counted in order rows, on every
engine: a retry after the view's commit and a failure gets 201 with the real
order id, once, and every later retry replays it without asking again.
"""

import datetime as dt
import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._storage import seal
from flask_idempotency.scope import ReconcileAttempt
from tests.conftest import Clock
from tests.support.flow import assert_problem, post
from tests.support.reconcile_shop import (
    FAILURES,
    LEASE,
    Hook,
    Order,
    assert_rebuilt,
    db,
    fail_after_commit,
    idem,
    make_app,
    orders,
    raw_record,
    refuse_completions,
)
from tests.support.sealing import sealed_config


@pytest.fixture
def hook() -> Hook:
    return Hook()


@pytest.fixture
def shop(database_url: str, clock: Clock, hook: Hook) -> t.Iterator[Flask]:
    app = make_app(database_url, clock, hook)
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.mark.parametrize("route", ["/orders", "/leased-orders"])
@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failure_after_the_views_commit_is_rebuilt_into_the_real_answer(
    shop: Flask, hook: Hook, route: str, failure: str
) -> None:
    fail_after_commit(shop, route, failure)
    [order_id] = orders(shop)
    assert raw_record(shop)["response_code"] == 500  # what was stored at first
    client = shop.test_client()
    assert_rebuilt(post(client, route, {}), order_id)
    [attempt] = hook.calls
    assert (attempt.scope, attempt.key, attempt.why) == ("tenant-1", "k1", "failed-after-commit")
    assert attempt.status == 500
    assert attempt.from_client
    assert attempt.endpoint == ("shop.place" if route == "/orders" else "shop.place_leased")
    # Stored: later retries replay it without asking again.
    for _ in range(2):
        assert_rebuilt(post(client, route, {}), order_id)
    assert len(hook.calls) == 1
    record = raw_record(shop)
    assert (record["status"], record["response_code"]) == ("completed", 201)
    assert orders(shop) == [order_id]


@pytest.mark.parametrize("mode", ["none", "raise", "500", "409"])
def test_no_answer_rebuilt_leaves_the_stored_failure(shop: Flask, hook: Hook, mode: str) -> None:
    fail_after_commit(shop, "/orders", "exception")
    before = raw_record(shop)
    hook.mode = mode
    client = shop.test_client()
    for calls in (1, 2):  # asked again on each retry, until it can tell
        doc = assert_problem(post(client, "/orders", {}), 500)
        assert doc["type"].endswith("failed-after-commit")
        assert doc["reconciled"] is False
        assert "could not rebuild" in doc["detail"]
        assert len(hook.calls) == calls
    assert raw_record(shop) == before
    assert len(orders(shop)) == 1
    hook.mode = "find"  # the orders service is back: the next retry rebuilds
    assert_rebuilt(post(client, "/orders", {}), orders(shop)[0])


def test_without_a_hook_the_failure_says_nothing_of_reconciling(
    database_url: str, clock: Clock
) -> None:
    app = make_app(database_url, clock, Hook(), IDEMPOTENCY_RECONCILE=None)
    fail_after_commit(app, "/orders", "exception")
    doc = assert_problem(post(app.test_client(), "/orders", {}), 500)
    assert "reconciled" not in doc
    with app.app_context():
        db.engine.dispose()


def test_a_route_hook_wins_over_the_apps(shop: Flask, hook: Hook) -> None:
    fail_after_commit(shop, "/gift-orders", "exception")
    answer = post(shop.test_client(), "/gift-orders", {})
    assert (answer.status_code, answer.get_json()) == (200, {"own": "tenant-1"})
    assert hook.calls == []


def test_a_hook_that_is_not_callable_is_refused_when_declared(
    database_url: str, clock: Clock
) -> None:
    with pytest.raises(TypeError, match="reconcile must be a callable"):
        idem.idempotent(reconcile="find_order")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="IDEMPOTENCY_RECONCILE must be a callable"):
        make_app(database_url, clock, t.cast(Hook, "find_order"))


@pytest.mark.parametrize("route", ["/orders", "/leased-orders"])
def test_an_operation_left_in_progress_is_rebuilt_after_its_lease(
    shop: Flask, hook: Hook, clock: Clock, route: str
) -> None:
    undo = refuse_completions(shop)
    try:
        assert post(shop.test_client(), route, {}).status_code == 500
    finally:
        undo()
    [order_id] = orders(shop)
    assert raw_record(shop)["status"] == "in_progress"
    client = shop.test_client()
    assert_problem(post(client, route, {}), 409)  # under its lease: nobody asked
    assert hook.calls == []
    clock.advance(seconds=LEASE + 1)
    assert_rebuilt(post(client, route, {}), order_id)
    [attempt] = hook.calls
    # A plain route's commit stored the failure; a leased route's stores none
    # (its view may or may not have committed).
    expected = "failed-after-commit" if route == "/orders" else "lease-ended"
    assert attempt.why == expected
    assert_rebuilt(post(client, route, {}), order_id)
    assert len(hook.calls) == 1
    assert orders(shop) == [order_id]


def test_a_leased_operation_the_hook_cannot_tell_resumes(
    shop: Flask, hook: Hook, clock: Clock
) -> None:
    undo = refuse_completions(shop)
    try:
        post(shop.test_client(), "/leased-orders", {})
    finally:
        undo()
    hook.mode = "none"
    clock.advance(seconds=LEASE + 1)
    # None: the record is reclaimed and the view runs again, as without a hook.
    again = post(shop.test_client(), "/leased-orders", {})
    assert again.status_code == 201
    assert "Idempotent-Replayed" not in again.headers
    assert len(orders(shop)) == 2
    assert len(hook.calls) == 1


def test_two_retries_at_once_store_one_answer(database_url: str, clock: Clock) -> None:
    # SQLite has one writer: the second retry's claim waits for the first to
    # end, and finds the rebuilt answer. Elsewhere both rebuild, one stores.
    serial = database_url.startswith("sqlite")
    gate = threading.Barrier(2, timeout=30)

    class Meeting(Hook):
        def __call__(self, attempt: ReconcileAttempt) -> t.Any:
            answer = super().__call__(attempt)
            if not serial:
                gate.wait()  # both have read the record and rebuilt an answer
            return answer

    hook = Meeting()
    app = make_app(database_url, clock, hook)
    fail_after_commit(app, "/orders", "exception")
    [order_id] = orders(app)
    answers: list[t.Any] = []

    def retry() -> None:
        answers.append(post(app.test_client(), "/orders", {}))

    threads = [threading.Thread(target=retry) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(hook.calls) == (1 if serial else 2)
    for answer in answers:
        assert_rebuilt(answer, order_id)
    record = raw_record(app)
    assert (record["status"], record["response_code"]) == ("completed", 201)
    assert orders(app) == [order_id]
    with app.app_context():
        db.engine.dispose()


def test_a_rebuilt_answer_is_sealed_at_rest(database_url: str, clock: Clock) -> None:
    app = make_app(database_url, clock, Hook(), **sealed_config())
    fail_after_commit(app, "/orders", "exception")
    [order_id] = orders(app)
    assert_rebuilt(post(app.test_client(), "/orders", {}), order_id)
    record = raw_record(app)
    assert record["response_code"] == 201
    assert seal.is_sealed(bytes(record["response_body"]))
    assert seal.is_sealed(record["response_headers"])
    assert b"/orders/" not in bytes(record["response_body"])
    assert_rebuilt(post(app.test_client(), "/orders", {}), order_id)
    with app.app_context():
        db.engine.dispose()


def test_an_erased_record_is_never_reconciled(shop: Flask, hook: Hook, clock: Clock) -> None:
    fail_after_commit(shop, "/orders", "exception")
    with shop.app_context():
        idem.erase("tenant-1")
    assert raw_record(shop)["status"] == "erased"
    assert_problem(post(shop.test_client(), "/orders", {}), 410)
    assert hook.calls == []
    assert len(orders(shop)) == 1


async def _async_hook(attempt: ReconcileAttempt) -> t.Any:
    order = db.session.execute(
        sa.select(Order).where(Order.idempotency_key == attempt.key)
    ).scalar_one()
    return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


def test_an_async_hook_is_awaited(database_url: str, clock: Clock) -> None:
    pytest.importorskip("asgiref")
    app = make_app(database_url, clock, t.cast(Hook, _async_hook))
    fail_after_commit(app, "/orders", "exception")
    [order_id] = orders(app)
    assert_rebuilt(post(app.test_client(), "/orders", {}), order_id)
    with app.app_context():
        db.engine.dispose()


def test_the_retention_counts_from_the_rebuild(shop: Flask, clock: Clock) -> None:
    fail_after_commit(shop, "/orders", "exception")
    clock.advance(hours=2)
    assert post(shop.test_client(), "/orders", {}).status_code == 201
    record = raw_record(shop)
    expires = record["expires_at"]
    if isinstance(expires, str):  # SQLite
        expires = dt.datetime.fromisoformat(expires)
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.timezone.utc)
    assert expires >= clock.now + dt.timedelta(hours=24) - dt.timedelta(seconds=1)


def test_an_interrupted_hook_changes_nothing(shop: Flask, hook: Hook) -> None:
    fail_after_commit(shop, "/orders", "exception")
    before = raw_record(shop)
    hook.mode = "interrupt"
    with pytest.raises(KeyboardInterrupt):
        post(shop.test_client(), "/orders", {})
    assert raw_record(shop) == before
    hook.mode = "find"
    assert_rebuilt(post(shop.test_client(), "/orders", {}), orders(shop)[0])
    assert len(orders(shop)) == 1
