"""Once the view has committed work of its own, no interruption frees the key.

gunicorn's sync worker raises ``SystemExit`` inside the view when the worker
outlives ``--timeout``; Ctrl-C raises ``KeyboardInterrupt``; gevent raises
``GreenletExit`` (or its ``Timeout``) in a killed green thread. None is an
``Exception``. A view that committed a charge and is then interrupted must have
its operation recorded (retries get the failure, 500 ``failed-after-commit``),
never released for a second charge. A commit interrupted while in flight, its
outcome hidden, counts as committed when it landed and as never run when it
did not. Counted in ledger rows, on every engine, and through a real gunicorn
whose worker times out.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types
import typing as t
import uuid

import pytest
import sqlalchemy as sa

from flask_idempotency.testing._server import free_port
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem
from tests.support.live import ROOT, Reply
from tests.support.tcp_proxy import TcpProxy, upstream_of


class GreenletExit(BaseException):
    """Stands for gevent's GreenletExit (a BaseException, as there)."""


INTERRUPTS = [SystemExit(1), KeyboardInterrupt(), GreenletExit()]
ROUTES = {"plain": "/commits-then-hangs", "leased": "/leased-commits-then-hangs"}


def _interrupt_first_sleep(monkeypatch: pytest.MonkeyPatch, interrupt: BaseException) -> None:
    """The test app's views are interrupted by ``interrupt`` at their first sleep
    (where a worker would hang), right after their commit."""
    calls = {"n": 0}

    def sleep(seconds: float) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise interrupt
        time.sleep(seconds)

    monkeypatch.setattr(testapp, "time", types.SimpleNamespace(sleep=sleep, time=time.time))


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("interrupt", INTERRUPTS, ids=lambda e: type(e).__name__)
def test_an_interruption_after_the_views_commit_records_the_operation(
    database_url: str,
    clock: Clock,
    interrupt: BaseException,
    route: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = testapp.create_app(database_url, clock=clock)
    reset_tables(database_url)
    _interrupt_first_sleep(monkeypatch, interrupt)
    client = app.test_client()
    headers = {"Idempotency-Key": "charge-1"}
    with pytest.raises(type(interrupt)):
        client.post(ROUTES[route], json={"amount": 100}, headers=headers)
    # The charge committed; the operation is recorded, not freed.
    [record] = record_rows(app)
    assert record["status"] == "completed"
    assert record["response_code"] == 500
    for _ in range(2):
        retry = client.post(ROUTES[route], json={"amount": 100}, headers=headers)
        doc = assert_problem(retry, 500)
        assert doc["type"].endswith("failed-after-commit")
        assert retry.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 1


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed", "commit-lost"])
def test_a_commit_interrupted_in_flight(
    database_url: str, route: str, landed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view's COMMIT is sent, then SystemExit hides its outcome. When it
    landed, the charge is there and the retry must not run it again; when it did
    not, nothing happened and the retry runs it: one charge either way. (The
    system clock: the record tells the two apart by the lease end each commit
    wrote, which a frozen test clock would make equal.)"""
    app = testapp.create_app(database_url)
    reset_tables(database_url)
    with app.app_context():
        dialect = testapp.db.engine.dialect
    real_commit = dialect.do_commit
    # The view's own commit is the request's first (the claim commits with it),
    # or, on the leased route, its second (the claim commits before the view).
    trapped = 1 if route == "plain" else 2
    commits = {"n": 0}

    def do_commit(dbapi_connection: t.Any) -> None:
        commits["n"] += 1
        if commits["n"] == trapped:
            if landed:
                real_commit(dbapi_connection)
            raise SystemExit(1)
        real_commit(dbapi_connection)

    monkeypatch.setattr(dialect, "do_commit", do_commit)
    client = app.test_client()
    headers = {"Idempotency-Key": "in-doubt"}
    with pytest.raises(SystemExit):
        client.post(ROUTES[route], json={"amount": 7}, headers=headers)
    retry = client.post(ROUTES[route], json={"amount": 7}, headers=headers)
    assert ledger_count(app) == 1, retry.get_data(as_text=True)
    if landed:
        # Recorded: the charge happened, its answer was lost.
        assert assert_problem(retry, 500)["type"].endswith("failed-after-commit")
    else:
        assert retry.status_code == 201  # nothing had happened: it ran now, once
    assert len(record_rows(app)) == 1


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("where", ["storing", "committing", "after-commit"])
@pytest.mark.parametrize("interrupt", INTERRUPTS[::2], ids=lambda e: type(e).__name__)
def test_an_interruption_while_the_answer_is_stored_after_the_views_commit(
    database_url: str,
    route: str,
    where: str,
    interrupt: BaseException,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The view committed its charge and answered; the interruption (gunicorn's
    worker timeout lands wherever the worker is) comes while the extension
    stores that answer: in the completing statement, in its COMMIT before it
    is sent, or right after the COMMIT landed. The operation stays recorded,
    never freed: retries replay the answer stored (``failed-after-commit``
    when the answer's own commit did not land). One charge."""
    from flask_idempotency._storage import Store

    app = testapp.create_app(database_url)
    reset_tables(database_url)
    with app.app_context():
        dialect = testapp.db.engine.dialect
    fired = {"done": False}
    real_complete, real_commit = Store.complete, dialect.do_commit
    completing = {"now": False}

    def complete(self: Store, *args: t.Any, **kwargs: t.Any) -> bool:
        if not fired["done"] and where == "storing":
            fired["done"] = True
            raise interrupt
        completing["now"] = True
        return real_complete(self, *args, **kwargs)

    def do_commit(dbapi_connection: t.Any) -> None:
        if completing["now"] and not fired["done"] and where != "storing":
            fired["done"] = True
            if where == "after-commit":
                real_commit(dbapi_connection)
            raise interrupt
        real_commit(dbapi_connection)

    monkeypatch.setattr(Store, "complete", complete)
    monkeypatch.setattr(dialect, "do_commit", do_commit)
    client = app.test_client()
    headers = {"Idempotency-Key": "storing"}
    with pytest.raises(type(interrupt)):
        client.post(ROUTES[route], json={"amount": 3}, headers=headers)
    assert fired["done"]
    [record] = record_rows(app)
    assert record["status"] == "completed"
    for _ in range(2):
        retry = client.post(ROUTES[route], json={"amount": 3}, headers=headers)
        assert retry.headers["Idempotent-Replayed"] == "true"
        if where == "after-commit":
            assert retry.status_code == 201  # the answer's commit landed: it is the answer
        else:
            assert assert_problem(retry, 500)["type"].endswith("failed-after-commit")
    assert ledger_count(app) == 1


@pytest.mark.parametrize("rollback", [True, False], ids=["rolls-back", "as-is"])
@pytest.mark.parametrize("landed", [True, False], ids=["commit-landed", "commit-lost"])
def test_a_view_that_catches_the_failure_of_its_own_commit(
    database_url: str, landed: bool, rollback: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The view's COMMIT goes out and the connection is lost before its answer;
    the view catches the error, as views do for an outage, (rolls back,) and
    answers 503. Landed: its charge stays, so that answer is recorded and
    replayed, and nothing runs again (it used to stay in progress, or be taken
    for lost, and run a second time after the lease). Lost: nothing happened,
    and the retry charges, once."""
    app = testapp.create_app(database_url)
    reset_tables(database_url)
    with app.app_context():
        dialect = testapp.db.engine.dialect
    real_commit = dialect.do_commit
    fired = {"done": False}

    def do_commit(dbapi_connection: t.Any) -> None:
        if fired["done"]:
            real_commit(dbapi_connection)
            return
        fired["done"] = True
        if landed:
            real_commit(dbapi_connection)
        raise dialect.loaded_dbapi.OperationalError("connection lost before the answer")

    monkeypatch.setattr(dialect, "do_commit", do_commit)
    client = app.test_client()
    headers = {"Idempotency-Key": "caught", "X-Rollback": "1" if rollback else "0"}
    first = client.post("/catches-commit-failure", json={}, headers=headers)
    assert first.status_code == 503, first.get_data(as_text=True)
    retry = client.post("/catches-commit-failure", json={}, headers=headers)
    assert ledger_count(app) == 1, retry.get_data(as_text=True)
    if landed:
        assert retry.status_code == 503
        assert retry.headers["Idempotent-Replayed"] == "true"
    else:
        assert retry.status_code == 201
    [record] = record_rows(app)
    assert record["status"] == "completed"


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_commit_still_on_the_wire_is_judged_with_a_pool_of_one(driver: str) -> None:
    """A pool of one connection (one per sync worker, a usual setting), the
    view's COMMIT held on the wire 3 s while its client is cut off; the view
    catches the error, rolls back and answers 503. The judgement runs on the
    connection the view's next transaction took (no second one to be had: it
    used to wait out the pool, count the commit as landed, and the COMMIT then
    landed under a record in progress, run again after the lease): PostgreSQL
    ends the transaction still open, so it never lands, and the retry charges
    once."""
    from tests.conftest import postgres_url

    url = postgres_url(driver)
    with TcpProxy(upstream_of(url)) as proxy:
        app = testapp.create_app(
            proxy.url(url),
            IDEMPOTENCY_LEASE=2,
            SQLALCHEMY_ENGINE_OPTIONS={"pool_size": 1, "max_overflow": 0, "pool_timeout": 2},
        )
        reset_tables(url)
        client = app.test_client()
        headers = {"Idempotency-Key": "on-the-wire", "X-Rollback": "1"}
        with app.app_context():
            testapp.db.session.execute(sa.text("SELECT 1"))  # the pool's one connection
            testapp.db.session.remove()
        proxy.hold_commit(3.0)
        first = client.post("/catches-commit-failure", json={}, headers=headers)
        assert first.status_code in (201, 409, 503), first.get_data(as_text=True)
        time.sleep(3.5)  # the held COMMIT has been delivered (or refused) by now
        time.sleep(2.0)  # and any lease is over
        retry = client.post("/catches-commit-failure", json={}, headers=headers)
        assert retry.status_code in (201, 503), retry.get_data(as_text=True)
        assert _sql(url, "SELECT COUNT(*) FROM ledger WHERE route = 'catches-commit-failure'") == 1
        with app.app_context():
            testapp.db.engine.dispose()


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_a_commit_the_database_refuses_frees_a_leased_key_at_once(driver: str) -> None:
    """A leased route whose own COMMIT the database refuses (a deferred unique
    constraint, checked at COMMIT): nothing happened and nothing is in doubt, so
    the key is free at once for the retry (it was kept under its lease, 409 for
    a minute)."""
    from tests.conftest import postgres_url

    url = postgres_url(driver)
    app = testapp.create_app(url)
    reset_tables(url)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS deferred_check"))
            conn.execute(
                sa.text(
                    "CREATE TABLE deferred_check (tag TEXT, "
                    "UNIQUE (tag) DEFERRABLE INITIALLY DEFERRED)"
                )
            )
            conn.execute(sa.text("INSERT INTO deferred_check VALUES ('taken')"))
        app.testing = True
        client = app.test_client()
        key = {"Idempotency-Key": "refused"}
        with pytest.raises(sa.exc.IntegrityError):
            client.post("/leased-deferred-check", json={}, headers={**key, "X-Refuse": "1"})
        app.testing = False
        retry = client.post("/leased-deferred-check", json={}, headers=key)
        assert retry.status_code == 201, retry.get_data(as_text=True)
        assert ledger_count(app) == 1
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("DROP TABLE IF EXISTS deferred_check"))
        engine.dispose()


# -- a real gunicorn worker timeout -------------------------------------------------


def _post(port: int, path: str, key: str, hang: float, timeout: float) -> Reply | None:
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        body = json.dumps({"amount": 100})
        conn.request(
            "POST",
            path,
            body=body,
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "X-Hang": str(hang),
            },
        )
        response = conn.getresponse()
        return Reply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    except (ConnectionError, http.client.RemoteDisconnected):
        return None  # the worker died with the request
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_gunicorn_worker_timeout_after_the_views_commit_charges_once(
    pg_url: str, route: str
) -> None:
    """gunicorn (sync worker, --timeout 2): the view commits a charge, then hangs
    past the timeout; the arbiter aborts the worker, whose SystemExit unwinds the
    view. The retry must get the recorded failure, and the ledger hold one charge."""
    reset_tables(pg_url)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TEST_DATABASE_URL": pg_url}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            "1",
            "--timeout",
            "2",
            "--graceful-timeout",
            "5",
            "--bind",
            f"127.0.0.1:{port}",
            "tests.support.gunicorn_app:app",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "gunicorn did not start"
                assert proc.poll() is None, "gunicorn exited"
                time.sleep(0.1)
        key = f"gunicorn-{uuid.uuid4()}"
        first = _post(port, ROUTES[route], key, hang=30, timeout=60)
        assert first is None or first.status >= 500  # the worker was aborted
        retries: list[Reply] = []
        deadline = time.monotonic() + 30
        while len(retries) < 2 and time.monotonic() < deadline:
            reply = _post(port, ROUTES[route], key, hang=0, timeout=10)
            if reply is not None:
                retries.append(reply)
            else:
                time.sleep(0.2)  # the arbiter is replacing the worker
        assert len(retries) == 2
        for reply in retries:
            assert reply.status == 500, reply.body
            assert reply.headers["content-type"] == "application/problem+json"
            assert reply.json()["type"].endswith("failed-after-commit")
            assert reply.replayed
        rows = _sql(pg_url, "SELECT count(*) FROM ledger")
        assert rows == 1
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert "WORKER TIMEOUT" in output, output


def _sql(url: str, statement: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text(statement)).scalar_one())
    finally:
        engine.dispose()
