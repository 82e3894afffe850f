"""reconcile= when something goes wrong around the hook: the database goes away
at the rebuilt answer's write, the database refuses the hook's own writes, a
route option that could never take effect. The client always gets a
problem+json answer, the record stays as it was, and the next retry rebuilds.
"""

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from sqlalchemy import event

from flask_idempotency import Idempotency
from flask_idempotency.scope import ReconcileAttempt
from tests.conftest import Clock
from tests.support.flow import assert_problem, post
from tests.support.reconcile_shop import (
    Hook,
    Order,
    assert_rebuilt,
    db,
    fail_after_commit,
    make_app,
    orders,
    raw_record,
)


@pytest.fixture
def shop_of(database_url: str, clock: Clock) -> t.Iterator[t.Callable[[Hook], Flask]]:
    made: list[Flask] = []

    def make(hook: Hook) -> Flask:
        made.append(make_app(database_url, clock, hook))
        return made[-1]

    yield make
    for app in made:
        with app.app_context():
            db.engine.dispose()


def _kill_server_side(url: str, dbapi_connection: t.Any) -> None:
    """End ``dbapi_connection``'s session from another connection, as a server
    restart or a proxy that drops it would."""
    killer = sa.create_engine(url, poolclass=sa.NullPool)
    try:
        with killer.begin() as conn:
            if killer.dialect.name == "postgresql":
                pid = (
                    dbapi_connection.get_backend_pid()
                    if hasattr(dbapi_connection, "get_backend_pid")
                    else dbapi_connection.info.backend_pid
                )
                conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
            else:
                conn.execute(sa.text(f"KILL {int(dbapi_connection.thread_id())}"))
    finally:
        killer.dispose()


def test_the_database_gone_at_the_rebuilt_answers_write_answers_503(
    request: pytest.FixtureRequest, database_url: str, shop_of: t.Callable[[Hook], Flask]
) -> None:
    engine_id = request.node.callspec.params["database_url"]
    if engine_id == "sqlite" or "pgbouncer" in engine_id:
        pytest.skip("a server-side session to end: PostgreSQL and MariaDB, unpooled")
    app = shop_of(Hook())
    fail_after_commit(app, "/orders", "exception")
    before = raw_record(app)
    with app.app_context():
        engine = db.engine

    def end_session(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        head = " ".join(statement.split()).lower()
        if head.startswith("update idempotency_keys set") and "response_code" in head:
            _kill_server_side(database_url, conn.connection.dbapi_connection)

    event.listen(engine, "before_cursor_execute", end_session)
    try:
        answer = post(app.test_client(), "/orders", {})
    finally:
        event.remove(engine, "before_cursor_execute", end_session)
    assert_problem(answer, 503)  # not Flask's HTML 500: MariaDB's lost session says so too
    assert raw_record(app) == before
    [order_id] = orders(app)
    assert_rebuilt(post(app.test_client(), "/orders", {}), order_id)
    assert orders(app) == [order_id]


class RefusedWriteHook(Hook):
    """Finds the order, and leaves a write the database refuses (NOT NULL)."""

    def __call__(self, attempt: ReconcileAttempt) -> t.Any:
        answer = super().__call__(attempt)
        if self.mode == "bad-write":
            db.session.add(Order(scope=None, idempotency_key="reconciled-marker"))
        return answer


@pytest.mark.parametrize("route", ["/orders", "/leased-orders"])
def test_hook_writes_the_database_refuses_leave_the_stored_failure(
    shop_of: t.Callable[[Hook], Flask], route: str
) -> None:
    hook = RefusedWriteHook()
    app = shop_of(hook)
    fail_after_commit(app, route, "exception")
    before = raw_record(app)
    hook.mode = "bad-write"
    doc = assert_problem(post(app.test_client(), route, {}), 500)
    assert doc["reconciled"] is False
    assert raw_record(app) == before
    hook.mode = "find"
    [order_id] = orders(app)
    assert_rebuilt(post(app.test_client(), route, {}), order_id)
    assert orders(app) == [order_id]  # the refused marker row is gone with its transaction


@pytest.mark.parametrize("mode", ["manual", "optimistic"])
def test_a_route_hook_that_would_never_be_asked_is_refused_when_declared(mode: str) -> None:
    with pytest.raises(ValueError, match=f"never asked on a route with {mode}=True"):

        @Idempotency().idempotent(**{mode: True}, reconcile=lambda attempt: None)
        def view() -> str:
            return "x"
