"""Readiness: ``idem.readiness()`` and ``idem.readiness_view`` tell a load balancer
whether this host can use the record's database, in time, even in a partition.

The database is made unreachable for real with tests/support/tcp_proxy.py: "cut" closes
connections and refuses new ones; "blackhole" accepts connections and forwards
nothing, so queries hang instead of failing, as in a network partition. Timing
bounds are generous on purpose (shared, noisy machines): they separate
"answers within its timeout" from "hangs", nothing finer.
"""

from __future__ import annotations

import threading
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from tests.support.live import MERCHANT, LiveServer
from tests.support.tcp_proxy import TcpProxy

db = SQLAlchemy()
idem = Idempotency()

TIMEOUT = 1.0  # IDEMPOTENCY_READY_TIMEOUT where a test times the answer
#: Where the answer must be found (ready, a missing table), not timed: a loaded
#: machine may take longer than TIMEOUT for a query that does not hang.
PATIENT = 10.0
MARGIN = 4.0  # what a loaded machine may add to an answer that does not hang
PROBE_THREAD = "flask-idempotency-readiness"


def create_app(url: str, **config: t.Any) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        SQLALCHEMY_ENGINE_OPTIONS={"pool_pre_ping": True},
        **{"IDEMPOTENCY_READY_TIMEOUT": TIMEOUT, **config},
    )
    db.init_app(app)
    idem.init_app(app, db)
    app.add_url_rule("/readyz", view_func=idem.readiness_view)
    with app.app_context():
        db.create_all()
        db.session.remove()
    return app


def timed_get(app: Flask, path: str = "/readyz") -> tuple[t.Any, float]:
    started = time.monotonic()
    response = app.test_client().get(path)
    return response, time.monotonic() - started


def wait_ready(get: t.Callable[[], int], within: float = 20) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if get() == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"not ready again within {within} s of healing")


def probe_threads() -> int:
    return sum(th.name == PROBE_THREAD and th.is_alive() for th in threading.enumerate())


def test_ready_when_the_record_table_answers(database_url: str) -> None:
    app = create_app(database_url, IDEMPOTENCY_READY_TIMEOUT=PATIENT)
    try:
        with app.app_context():
            ready, details = idem.readiness()
        assert ready is True
        assert details["database"] == "ok"
        assert details["table"] == "idempotency_keys"
        assert details["timeout_ms"] == PATIENT * 1000
        response = app.test_client().get("/readyz")
        assert response.status_code == 200
        assert response.content_type == "application/json"
        assert response.headers["Cache-Control"] == "no-store"
        assert response.get_json()["ready"] is True
    finally:
        with app.app_context():
            db.engine.dispose()


def test_not_ready_without_the_record_table(database_url: str) -> None:
    """The probe queries the record's table, not just the connection."""
    app = create_app(database_url, IDEMPOTENCY_READY_TIMEOUT=PATIENT)
    try:
        with app.app_context():
            db.session.execute(sa.text("DROP TABLE idempotency_keys"))
            db.session.commit()
        response = app.test_client().get("/readyz")
        assert response.status_code == 503
        assert response.content_type == "application/problem+json"
        problem = response.get_json()
        assert problem["type"].endswith("/database-unavailable")
        assert problem["status"] == 503
        assert problem["ready"] is False
        assert problem["database"] == "missing_table"
        assert "flask idempotency create-tables" in problem["detail"]
        assert problem["error"] in ("ProgrammingError", "OperationalError")  # PG, SQLite
        assert int(response.headers["Retry-After"]) >= 1
        assert response.headers["Cache-Control"] == "no-store"
    finally:
        with app.app_context():
            db.metadata.create_all(db.engine)
            db.engine.dispose()


def test_timeout_must_be_positive(database_url: str) -> None:
    app = create_app(database_url)
    try:
        with app.app_context(), pytest.raises(ValueError, match="longer than zero"):
            idem.readiness(timeout=0)
    finally:
        with app.app_context():
            db.engine.dispose()
    other = Flask("other")
    other.config["SQLALCHEMY_DATABASE_URI"] = database_url
    other_db = SQLAlchemy()
    other_db.init_app(other)
    with pytest.raises(ValueError, match="IDEMPOTENCY_READY_TIMEOUT"):
        Idempotency(other, other_db, ready_timeout=0)


@pytest.fixture
def proxied_app(pg_url: str, proxy: TcpProxy) -> t.Iterator[Flask]:
    app = create_app(proxy.url(pg_url))
    wait_ready(lambda: app.test_client().get("/readyz").status_code)  # a warm pool
    yield app
    proxy.heal()
    with app.app_context():
        db.engine.dispose()


def test_cut_off_database_is_not_ready_at_once_and_recovers(
    proxied_app: Flask, proxy: TcpProxy
) -> None:
    proxy.cut()
    response, took = timed_get(proxied_app)
    assert response.status_code == 503
    assert response.get_json()["database"] == "unavailable"
    assert took < TIMEOUT + MARGIN
    proxy.heal()
    wait_ready(lambda: proxied_app.test_client().get("/readyz").status_code)


def test_partitioned_database_is_not_ready_within_the_timeout(
    proxied_app: Flask, proxy: TcpProxy
) -> None:
    """In a blackhole the probe's query hangs; readiness still answers in time,
    keeps one probe in flight however many checks arrive, and recovers when
    the network heals."""
    proxy.blackhole()
    first, took = timed_get(proxied_app)
    assert first.status_code == 503, first.data
    assert took < TIMEOUT + MARGIN
    hung = first.get_json()
    assert hung["database"] == "timeout"

    answers: list[tuple[t.Any, float]] = []
    lock = threading.Lock()

    def check() -> None:
        answer = timed_get(proxied_app)
        with lock:
            answers.append(answer)

    checkers = [threading.Thread(target=check) for _ in range(8)]
    for th in checkers:
        th.start()
    for th in checkers:
        th.join(30)
    assert len(answers) == 8
    for response, took in answers:
        assert response.status_code == 503
        assert took < TIMEOUT + MARGIN
        # The same hung probe answers for everyone: none started another.
        assert response.get_json()["probe_id"] == hung["probe_id"]
    assert probe_threads() == 1

    proxy.heal()
    wait_ready(lambda: proxied_app.test_client().get("/readyz").status_code)
    assert timed_get(proxied_app)[0].get_json()["probe_id"] > hung["probe_id"]


# -- the example app, live, behind the proxy ----------------------------------------------


def timed(call: t.Callable[[], t.Any]) -> tuple[t.Any, float]:
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


@pytest.mark.slow
def test_live_partition_takes_the_host_out_and_back(
    example_behind_proxy: LiveServer, proxy: TcpProxy
) -> None:
    """Liveness keeps answering 200 in a partition; readiness answers 503 within
    its timeout (2 s by default) and 200 again once the network heals."""
    server = example_behind_proxy
    wait_ready(lambda: server.get("/readyz").status)
    proxy.blackhole()
    alive, took = timed(lambda: server.get("/healthz"))
    assert alive.status == 200
    assert took < MARGIN
    for _ in range(3):
        ready, took = timed(lambda: server.get("/readyz"))
        assert ready.status == 503
        assert ready.headers["content-type"] == "application/problem+json"
        assert ready.json()["database"] == "timeout"
        assert took < 2 + MARGIN

    proxy.cut()  # the hung probe's connection dies; new ones are refused
    wait_not_ready = time.monotonic() + 20
    while True:
        ready = server.get("/readyz")
        if ready.json().get("database") == "unavailable" or time.monotonic() > wait_not_ready:
            break
        time.sleep(0.2)
    assert ready.status == 503
    assert ready.json()["database"] == "unavailable"

    proxy.heal()
    wait_ready(lambda: server.get("/readyz").status)


@pytest.mark.slow
def test_live_partition_fails_a_request_within_the_connect_timeout(
    example_behind_proxy: LiveServer, proxy: TcpProxy, pg_url: str
) -> None:
    """With the example's fail-fast engine settings, a request that needs a new
    connection during a partition answers 503 after ``connect_timeout`` (3 s)
    instead of hanging until the WSGI server kills the worker (gunicorn: 30 s)."""
    server = example_behind_proxy
    charge = {"customer_id": "cus_1", "amount": 1250, "currency": "EUR"}
    assert server.post("/payments", charge, str(uuid.uuid4()), headers=MERCHANT).status == 201
    proxy.cut()  # pooled connections die ...
    proxy.blackhole()  # ... and new ones connect into a partition
    key = str(uuid.uuid4())
    reply, took = timed(lambda: server.post("/payments", charge, key, headers=MERCHANT, timeout=60))
    assert reply.status == 503, reply.body[:300]
    assert reply.headers["content-type"] == "application/problem+json"
    assert took < 20  # 3 s connect_timeout, plus a loaded machine; never 30 s
    proxy.heal()
    retry = server.post("/payments", charge, key, headers=MERCHANT)
    assert retry.status == 201
    assert not retry.replayed
