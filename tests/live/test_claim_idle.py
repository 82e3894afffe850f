"""``IDEMPOTENCY_CLAIM_IDLE_TIMEOUT``: the server ends a claim's transaction that
its app left idle (PostgreSQL's ``idle_in_transaction_session_timeout``, set with
the claim), so a host that vanished mid-request does not keep the key from its
retry on another host.

On PostgreSQL through psycopg2 and psycopg 3 (each claims in one round trip)
and through the statement-by-statement path (a ``schema_translate_map`` turns
the batch off). The vanished host is a real process, frozen with SIGSTOP in the
middle of its view: no FIN, no reset, the server sees silence, as in a
partition. Counted in ledger rows and records.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import threading
import time
import typing as t
import uuid

import pytest
import sqlalchemy as sa
from flask import Flask, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from flask_idempotency.errors import PROBLEM_JSON
from tests.conftest import postgres_url, reset_tables, run_sql
from tests.support import pgbouncer
from tests.support.live import LiveServer

db = SQLAlchemy()
idem = Idempotency()


class Row(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "claim_idle_rows"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    tag: orm.Mapped[str] = orm.mapped_column(db.String(100))


def _work(tag: str) -> tuple[dict[str, t.Any], int]:
    """A pause inside the transaction (``?pause=`` seconds), right after the claim
    or (``?at=write``) after a business row; then a business row."""
    pause = float(request.args.get("pause", "0"))
    if request.args.get("at") != "write":
        time.sleep(pause)
    row = Row(tag=tag)
    db.session.add(row)
    db.session.flush()
    if request.args.get("at") == "write":
        time.sleep(pause)
    db.session.add(Row(tag=tag))  # a statement after the pause
    db.session.flush()
    return {"id": row.id}, 201


def create_app(url: str, **config: t.Any) -> Flask:
    app = Flask(__name__)
    app.config.update(
        {
            "SQLALCHEMY_DATABASE_URI": url,
            "SQLALCHEMY_ENGINE_OPTIONS": {"pool_pre_ping": True},
            "IDEMPOTENCY_SCOPE": lambda: "tenant",
            **config,
        }
    )
    db.init_app(app)
    idem.init_app(app, db)

    @app.post("/work")
    @idem.idempotent()
    def work() -> tuple[dict[str, t.Any], int]:
        return _work(idem.key or "none")

    @app.post("/leased-work")
    @idem.idempotent(lease=dt.timedelta(seconds=30))
    def leased_work() -> tuple[dict[str, t.Any], int]:
        return _work(idem.key or "none")

    return app


def _driver_url(driver: str) -> str:
    return (
        sa.make_url(postgres_url())
        .set(drivername=f"postgresql+{driver}")
        .render_as_string(hide_password=False)
    )


def _counts(url: str, tag: str) -> tuple[int, int]:
    """(business rows tagged ``tag``, records with key ``tag``)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(sa.func.count()).select_from(Row).where(Row.tag == tag)
            ).scalar_one()
            table = db.metadata.tables["idempotency_keys"]
            records = conn.execute(
                sa.select(sa.func.count()).select_from(table).where(table.c.key == tag)
            ).scalar_one()
            return int(rows), int(records)
    finally:
        engine.dispose()


@pytest.fixture(params=["psycopg2", "psycopg", "psycopg2-statements"])
def claim_app(request: pytest.FixtureRequest) -> t.Iterator[tuple[Flask, str]]:
    """An app with a 2 s bound, on each way the claim reaches PostgreSQL. (Not
    shorter: the requests that must succeed run under it too, on a loaded machine.)"""
    driver = request.param.split("-")[0]
    url = _driver_url(driver)
    options: dict[str, t.Any] = {"pool_pre_ping": True}
    if request.param.endswith("statements"):
        # SQLAlchemy rewrites statements per connection: no one-round-trip batch.
        options["execution_options"] = {"schema_translate_map": {None: None}}
    app = create_app(url, IDEMPOTENCY_CLAIM_IDLE_TIMEOUT=2, SQLALCHEMY_ENGINE_OPTIONS=options)
    engine = sa.create_engine(url)
    db.metadata.drop_all(engine)
    db.metadata.create_all(engine)
    engine.dispose()
    yield app, url
    with app.app_context():
        db.engine.dispose()


@pytest.mark.parametrize("at", ["claim", "write"])
def test_a_view_paused_past_the_bound_answers_503_and_stores_nothing(
    claim_app: tuple[Flask, str], at: str
) -> None:
    """Paused right after the claim (on psycopg 3 the claim's round trip must leave
    the server's timer running, which psycopg's pipeline mode, with its closing
    Flush, does not) or after a write of its own: the server ends the
    transaction, the client gets 503."""
    app, url = claim_app
    client = app.test_client()
    key = f"paused-{uuid.uuid4()}"
    response = client.post(f"/work?pause=4&at={at}", headers={"Idempotency-Key": key})
    assert response.status_code == 503, response.data
    assert response.content_type == PROBLEM_JSON
    assert int(response.headers["Retry-After"]) >= 1
    assert _counts(url, key) == (0, 0)
    retry = client.post("/work", headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert _counts(url, key) == (2, 1)


def test_the_bound_does_not_outlive_the_claims_transaction(claim_app: tuple[Flask, str]) -> None:
    """A leased route commits its claim first: its view's own transaction, paused
    past the bound, completes; so does the next request on the same pooled
    connection (the bound was the claim transaction's only)."""
    app, url = claim_app
    client = app.test_client()
    key = f"leased-{uuid.uuid4()}"
    response = client.post("/leased-work?pause=3", headers={"Idempotency-Key": key})
    assert response.status_code == 201, response.data
    assert _counts(url, key) == (2, 1)
    with app.app_context():
        db.session.execute(sa.text("SELECT 1"))
        time.sleep(3)  # idle in a transaction without a claim: not ours to end
        db.session.execute(sa.text("SELECT 1"))
        db.session.rollback()


def test_a_stricter_server_setting_is_kept(
    claim_app: tuple[Flask, str], pooled_role: t.Callable[..., str]
) -> None:
    """The claim never loosens a shorter idle_in_transaction_session_timeout the
    operator set (here on the connection): it only tightens."""
    _, url = claim_app
    from flask_idempotency._storage.dialects.postgresql import SET_IDLE as _PG_SET_IDLE

    made = sa.make_url(url)
    given = made.query.get("options", "")  # a search_path, when the suite uses a schema
    options = f"{given} -c idle_in_transaction_session_timeout=200".strip()
    if pgbouncer.is_pooled(url):  # behind the pooler: the role's setting (the operator's)
        engine = sa.create_engine(pooled_role(url, idle_in_transaction_session_timeout="200"))
    else:
        engine = sa.create_engine(made.update_query_dict({"options": options}))
    try:
        with engine.connect() as conn:
            conn.execute(_PG_SET_IDLE, {"idle": "500ms"})
            kept = conn.execute(sa.text("SHOW idle_in_transaction_session_timeout")).scalar_one()
            conn.rollback()
            conn.execute(_PG_SET_IDLE, {"idle": "100ms"})
            tightened = conn.execute(
                sa.text("SHOW idle_in_transaction_session_timeout")
            ).scalar_one()
            conn.rollback()
    finally:
        engine.dispose()
    assert kept == "200ms"
    assert tightened == "100ms"


# -- a host that vanished mid-request, and its retry on another host ---------------------


def _idle_claim_pids(url: str, since: float) -> list[int]:
    """Backends of this database idle in a transaction whose last statement wrote
    the test app's ledger (the frozen server's view, paused after its write).
    Behind the pooler the server connection may be older than the test (PgBouncer
    reuses it): its transaction is not."""
    began = "xact_start" if pgbouncer.is_pooled(url) else "backend_start"
    rows = run_sql(
        url,
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'idle in transaction' AND query ILIKE '%ledger%' "
        f"AND {began} >= to_timestamp(:since)",
        since=since,
    )
    return [int(r[0]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize("bounded", [True, False], ids=["bounded", "unbounded"])
def test_a_frozen_hosts_claim_does_not_hold_the_retry_elsewhere(driver: str, bounded: bool) -> None:
    """Host A claims a key and freezes in its view (SIGSTOP: the server sees an
    idle transaction and nothing else, as in a partition). Host B gets the
    client's retry. With the bound, the server ends A's transaction and B runs
    the charge once (201); without it, B waits out IDEMPOTENCY_WAIT behind A's
    claim and answers 409, and A's claim outlives it."""
    url = _driver_url(driver)
    reset_tables(url)
    config: dict[str, t.Any] = {"IDEMPOTENCY_WAIT": 8}
    if bounded:
        config["IDEMPOTENCY_CLAIM_IDLE_TIMEOUT"] = 1
    started = time.time() - 1
    host_a = LiveServer("tests", url, config).start()
    from tests.support import testapp

    host_b = testapp.create_app(url, **config)
    key = f"frozen-{uuid.uuid4()}"
    first: list[t.Any] = []
    try:
        sender = threading.Thread(
            target=lambda: first.append(_post_quietly(host_a, "/slow", {"delay": 120}, key)),
            daemon=True,
        )
        sender.start()
        deadline = time.monotonic() + 20
        while not _idle_claim_pids(url, started):
            assert time.monotonic() < deadline, "host A never reached its view"
            time.sleep(0.1)
        assert host_a.proc is not None
        os.kill(host_a.proc.pid, signal.SIGSTOP)  # frozen: no FIN, no reset

        retry = host_b.test_client().post(
            "/slow", json={"delay": 0}, headers={"Idempotency-Key": key}
        )
        if bounded:
            assert retry.status_code == 201, retry.data
            assert "Idempotent-Replayed" not in retry.headers
            assert not _idle_claim_pids(url, started)  # the server ended A's transaction
        else:
            assert retry.status_code == 409, retry.data
            assert retry.content_type == PROBLEM_JSON
            assert _idle_claim_pids(url, started)  # A's claim is still held
    finally:
        host_a.stop()  # SIGKILL ends a stopped process too
        with host_b.app_context():
            testapp.db.engine.dispose()
    rows = run_sql(url, "SELECT count(*) FROM ledger WHERE key = :k", k=key)
    assert int(rows[0][0]) == (1 if bounded else 0)


def _post_quietly(server: LiveServer, path: str, body: t.Any, key: str) -> t.Any:
    try:
        return server.post(path, body, key, timeout=300)
    except OSError as exc:  # the host was killed under its request
        return exc


@pytest.mark.parametrize("wait", [dt.timedelta(seconds=10), None], ids=["bounded", "unbounded"])
def test_the_bound_rides_in_the_claims_one_round_trip(
    pg_url: str, wait: dt.timedelta | None
) -> None:
    """On psycopg2 and psycopg 3 (one client-bound batch on each) the idle bound adds
    a statement to the claim's round trip, not a round trip: counted on the wire,
    for a new key and a taken one; the bound is in force after the claim."""
    from flask_idempotency._storage import Store
    from tests.support import testapp
    from tests.support.claims import claimed_in_one_round_trip_each

    reset_tables(pg_url)
    store = Store(
        testapp.db.metadata.tables["idempotency_keys"], claim_idle=dt.timedelta(seconds=5)
    )
    with claimed_in_one_round_trip_each(pg_url, store, wait) as session:
        bound = session.execute(sa.text("SHOW idle_in_transaction_session_timeout"))
        assert bound.scalar_one() == "5s"
        session.rollback()
        after = session.execute(sa.text("SHOW idle_in_transaction_session_timeout"))
        assert after.scalar_one() == "0"  # SET LOCAL: gone with the transaction


def test_a_new_keys_request_costs_the_same_exchanges_with_the_bound(pg_url: str) -> None:
    """A whole request, not only the claim: with the bound on, a new key's POST
    exchanges as many messages with PostgreSQL as without it."""
    from bench.wire import CountingProxy
    from tests.support import testapp

    reset_tables(pg_url)
    exchanges = {}
    for bound in (None, 5):
        config = {} if bound is None else {"IDEMPOTENCY_CLAIM_IDLE_TIMEOUT": bound}
        with CountingProxy(pg_url) as proxy:
            app = testapp.create_app(proxy.url(), IDEMPOTENCY_SCOPE=lambda: "s", **config)
            client = app.test_client()
            try:
                counted = []
                for n in range(10):  # the first ones warm the pool and psycopg's prepares
                    proxy.reset()
                    response = client.post(
                        "/charges",
                        json={"amount": 1, "currency": "EUR"},
                        headers={"Idempotency-Key": f"{bound}-{n}-{uuid.uuid4()}"},
                    )
                    assert response.status_code == 201, response.data
                    counted.append(proxy.exchanges)
                exchanges[bound] = counted[-3:]
            finally:
                with app.app_context():
                    testapp.db.engine.dispose()
    assert exchanges[5] == exchanges[None]
