"""reconcile=: the answer of an operation whose view committed and whose request
never answered, rebuilt by the app's hook from the committed state.

A shop marks each order with its scope and idempotency key; its hook finds the
order and answers what the view would have. Counted in order rows, on every
engine: a retry after the view's commit and a failure gets 201 with the real
order id, once, and every later retry replays it without asking again.
"""

from __future__ import annotations

import datetime as dt
import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Blueprint, Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import event, orm

from flask_idempotency import Idempotency
from flask_idempotency._storage import seal
from flask_idempotency.scope import ReconcileAttempt
from tests.conftest import Clock
from tests.support.flow import assert_problem, post
from tests.support.sealing import sealed_config
from tests.support.tables import recreate_tables

db = SQLAlchemy()
idem = Idempotency()
bp = Blueprint("shop", __name__)

LEASE = 5  # seconds: the clock is moved past it, nobody waits


class Order(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "reconcile_orders"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    scope: orm.Mapped[str] = orm.mapped_column(db.String(512))
    idempotency_key: orm.Mapped[str] = orm.mapped_column(db.String(255))


FAILURES: dict[str, type[BaseException]] = {
    "exception": RuntimeError,
    "systemexit": SystemExit,
    "keyboard": KeyboardInterrupt,
}


def _place() -> t.Any:
    order = Order(scope=idem.scope, idempotency_key=idem.key)
    db.session.add(order)
    db.session.commit()  # the order is durable now, whatever comes next
    failure = request.headers.get("X-Fail")  # not in the fingerprint
    if failure:
        raise FAILURES[failure]("after the view's commit")
    return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


@bp.post("/orders")
@idem.idempotent
def place() -> t.Any:
    return _place()


@bp.post("/leased-orders")
@idem.idempotent(lease=LEASE, ttl=3600)
def place_leased() -> t.Any:
    return _place()


@bp.post("/gift-orders")
@idem.idempotent(reconcile=lambda attempt: ({"own": attempt.scope}, 200))
def place_gift() -> t.Any:
    return _place()


class Hook:
    """The shop's hook: finds the order by (scope, key); or misbehaves as told."""

    def __init__(self) -> None:
        self.mode = "find"
        self.calls: list[ReconcileAttempt] = []

    def __call__(self, attempt: ReconcileAttempt) -> t.Any:
        self.calls.append(attempt)
        if self.mode == "none":
            return None
        if self.mode == "raise":
            raise LookupError("the orders service is down")
        if self.mode == "500":
            return {"error": "x"}, 500
        if self.mode == "409":  # not a stored status
            return {"error": "x"}, 409
        order = db.session.execute(
            sa.select(Order).where(
                Order.scope == attempt.scope, Order.idempotency_key == attempt.key
            )
        ).scalar_one_or_none()
        if order is None:
            return None
        return {"id": order.id}, 201, {"Location": f"/orders/{order.id}"}


def make_app(url: str, clock: Clock, hook: Hook, **config: t.Any) -> Flask:
    app = Flask(__name__)
    defaults = {
        "SQLALCHEMY_DATABASE_URI": url,
        "IDEMPOTENCY_SCOPE": lambda: "tenant-1",
        "IDEMPOTENCY_RECONCILE": hook,
        "IDEMPOTENCY_LEASE": LEASE,
    }
    app.config.update({**defaults, **config})
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.register_blueprint(bp)
    recreate_tables(db.metadata, url)
    return app


@pytest.fixture
def hook() -> Hook:
    return Hook()


@pytest.fixture
def shop(database_url: str, clock: Clock, hook: Hook) -> t.Iterator[Flask]:
    app = make_app(database_url, clock, hook)
    yield app
    with app.app_context():
        db.engine.dispose()


def orders(app: Flask) -> list[int]:
    with app.app_context():
        return list(db.session.execute(sa.select(Order.id)).scalars())


def raw_record(app: Flask) -> dict[str, t.Any]:
    with app.app_context(), db.engine.connect() as conn:
        [row] = conn.execute(sa.text("SELECT * FROM idempotency_keys")).mappings()
        return dict(row)


def fail_after_commit(app: Flask, route: str, failure: str, key: str = "k1") -> None:
    client = app.test_client()
    fail = {"X-Fail": failure}
    if failure == "exception":
        # The app's own error: Flask's 500 (the record holds failed-after-commit).
        assert post(client, route, {}, key=key, headers=fail).status_code == 500
    else:
        with pytest.raises(FAILURES[failure]):
            post(client, route, {}, key=key, headers=fail)


def assert_rebuilt(answer: t.Any, order_id: int) -> None:
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json() == {"id": order_id}
    assert answer.headers["Location"] == f"/orders/{order_id}"
    assert answer.headers["Idempotent-Replayed"] == "true"


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


def _refuse_completions(app: Flask) -> t.Callable[[], None]:
    """Every completion of a record fails at the statement, as a database gone
    after the view's commit: the record stays in progress, as after a SIGKILL."""
    with app.app_context():
        engine = db.engine

    def refuse(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        head = " ".join(statement.split()).lower()
        if head.startswith("update idempotency_keys set status"):
            raise ConnectionError("the database went away")

    event.listen(engine, "before_cursor_execute", refuse)
    return lambda: event.remove(engine, "before_cursor_execute", refuse)


@pytest.mark.parametrize("route", ["/orders", "/leased-orders"])
def test_an_operation_left_in_progress_is_rebuilt_after_its_lease(
    shop: Flask, hook: Hook, clock: Clock, route: str
) -> None:
    undo = _refuse_completions(shop)
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
    undo = _refuse_completions(shop)
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
