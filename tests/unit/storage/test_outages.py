"""The database fails under a protected route: 503 or 409 problem+json, never an HTML 500.

Real failures only: a TCP proxy (tests/support/tcp_proxy.py) between the app and the
real PostgreSQL cuts connections or loses a commit's reply; real row locks
produce lock timeouts, deadlocks and serialization failures; a real SQLite file
is locked or cannot be opened. Each test counts the business rows and records
it left, and retries with the same key to show the retry is safe.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import threading
import time
import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Blueprint, Flask, current_app, g, request
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import orm

from flask_idempotency import Idempotency
from tests.conftest import Clock, pg_options, run_sql
from tests.support import pgbouncer
from tests.support.live import MERCHANT, LiveServer, Reply
from tests.support.tcp_proxy import TcpProxy

db = SQLAlchemy()
idem = Idempotency()
bp = Blueprint("outages", __name__)

PROBLEM_JSON = "application/problem+json"


class Account(db.Model):  # type: ignore[name-defined,misc]
    __tablename__ = "outage_accounts"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True, autoincrement=False)
    balance: orm.Mapped[int] = orm.mapped_column(default=0)


class Entry(db.Model):  # type: ignore[name-defined,misc]
    """One row per side effect, tagged with the request's key."""

    __tablename__ = "outage_entries"
    id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    key: orm.Mapped[str | None] = orm.mapped_column(db.String(300))
    route: orm.Mapped[str] = orm.mapped_column(db.String(50))


def hook(name: str) -> None:
    """Call the test's hook ``name``, if it installed one (app.config["HOOKS"])."""
    found = current_app.config.get("HOOKS", {}).get(name)
    if found is not None:
        found()


def write_entry(route: str) -> Entry:
    entry = Entry(key=idem.key or request.headers.get("X-Tag"), route=route)
    db.session.add(entry)
    db.session.flush()
    return entry


@bp.post("/entries")
@idem.idempotent()
def entries() -> tuple[dict[str, t.Any], int]:
    entry = write_entry("entries")
    hook("after-write")
    return {"id": entry.id}, 201


@bp.post("/debit")
@idem.idempotent()
def debit() -> tuple[dict[str, t.Any], int]:
    """Debit accounts in the order given, then book an entry: business writes
    that take row locks, as real views do."""
    for account_id in request.get_json()["accounts"]:
        db.session.execute(
            sa.update(Account).where(Account.id == account_id).values(balance=Account.balance - 1)
        )
        hook("after-lock")
    entry = write_entry("debit")
    return {"id": entry.id}, 201


@bp.post("/leased")
@idem.idempotent(lease=dt.timedelta(seconds=30))
def leased() -> tuple[dict[str, t.Any], int]:
    """The record commits (leased) before this runs."""
    hook("before-write")
    entry = write_entry("leased")
    return {"id": entry.id}, 201


@bp.post("/unique")
@idem.idempotent()
def unique() -> tuple[dict[str, t.Any], int]:
    """A business error the database reports: not an outage, not a conflict."""
    db.session.add(Account(id=1))
    db.session.flush()
    return {}, 201


def create_app(
    url: str, *, clock: Clock | None = None, engine_options: dict[str, t.Any] | None = None
) -> Flask:
    app = Flask(__name__)
    app.config.update(
        SQLALCHEMY_DATABASE_URI=url,
        # A real app's choice (see the README): dead pooled connections are
        # replaced at checkout instead of failing one request each.
        SQLALCHEMY_ENGINE_OPTIONS=engine_options or {"pool_pre_ping": True},
    )
    db.init_app(app)
    idem.init_app(app, db, clock=clock)
    app.register_blueprint(bp)
    return app


def reset(url: str) -> None:
    """Fresh tables (after a create_app: it puts the record table on the metadata)."""
    engine = sa.create_engine(url)
    try:
        db.metadata.drop_all(engine)
        db.metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(sa.insert(Account.__table__), [{"id": 1}, {"id": 2}])
    finally:
        engine.dispose()


def stored(url: str, key: str) -> tuple[int, list[str]]:
    """(entries with this key, statuses of its records), read outside the app."""
    entries = run_sql(url, "SELECT count(*) FROM outage_entries WHERE key = :k", k=key)
    records = run_sql(url, "SELECT status FROM idempotency_keys WHERE key = :k", k=key)
    return int(entries[0][0]), [r[0] for r in records]


def assert_problem(response: t.Any, status: int, slug: str) -> dict[str, t.Any]:
    assert response.status_code == status, response.data[:500]
    assert response.content_type == PROBLEM_JSON
    assert int(response.headers["Retry-After"]) >= 1
    problem = t.cast(dict[str, t.Any], response.get_json())
    assert problem["status"] == status
    assert problem["type"].endswith("/" + slug)
    return problem


@pytest.fixture
def proxied_app(pg_url: str, proxy: TcpProxy, clock: Clock) -> t.Iterator[Flask]:
    """The app on PostgreSQL through the proxy, with one pooled connection."""
    app = create_app(proxy.url(pg_url), clock=clock)
    reset(pg_url)
    with app.app_context():
        db.session.execute(sa.text("SELECT 1"))  # warm the pool, as a serving app is
        db.session.remove()
    yield app
    proxy.heal()
    with app.app_context():
        db.engine.dispose()


def post(app: Flask, path: str, key: str | None, **kwargs: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key} if key else {"X-Tag": "no-key"}
    return app.test_client().post(path, headers=headers, **kwargs)


# -- the database is unreachable: 503 -------------------------------------------------


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no-key"])
def test_cut_connections_answer_503_and_store_nothing(
    proxied_app: Flask,
    proxy: TcpProxy,
    pg_url: str,
    with_key: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = str(uuid.uuid4()) if with_key else None
    proxy.cut()
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        response = post(proxied_app, "/entries", key)
    problem = assert_problem(response, 503, "database-unavailable")
    assert "Retry-After" in problem["detail"]
    tag = key or "no-key"
    assert stored(pg_url, tag) == (0, [])
    # Logged once, at warning, by the extension; not as an unhandled exception.
    mine = [r for r in caplog.records if "answered 503" in r.getMessage()]
    assert len(mine) == 1
    assert mine[0].levelno == logging.WARNING
    assert "unavailable" in mine[0].getMessage()

    proxy.heal()
    retry = post(proxied_app, "/entries", key)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers  # the 503 left nothing to replay
    assert stored(pg_url, tag) == (1, ["completed"] if with_key else [])


def test_a_replay_during_the_outage_is_503_then_replays(
    proxied_app: Flask, proxy: TcpProxy, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    first = post(proxied_app, "/entries", key)
    assert first.status_code == 201
    proxy.cut()
    assert_problem(post(proxied_app, "/entries", key), 503, "database-unavailable")
    proxy.heal()
    again = post(proxied_app, "/entries", key)
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.data == first.data
    assert stored(pg_url, key) == (1, ["completed"])


def test_connection_lost_in_the_view_answers_503_and_rolls_back(
    proxied_app: Flask, proxy: TcpProxy, pg_url: str
) -> None:
    """The business row was flushed, then the connection died: nothing of it stays."""
    key = str(uuid.uuid4())
    proxied_app.config["HOOKS"] = {"after-write": proxy.cut}
    assert_problem(post(proxied_app, "/entries", key), 503, "database-unavailable")
    proxied_app.config["HOOKS"] = {}
    proxy.heal()
    assert stored(pg_url, key) == (0, [])
    retry = post(proxied_app, "/entries", key)
    assert retry.status_code == 201
    assert stored(pg_url, key) == (1, ["completed"])


def test_commit_that_never_reached_the_database_stores_nothing(
    proxied_app: Flask, proxy: TcpProxy, pg_url: str
) -> None:
    key = str(uuid.uuid4())
    proxy.trap_commit(deliver=False)
    assert_problem(post(proxied_app, "/entries", key), 503, "database-unavailable")
    proxy.heal()
    assert stored(pg_url, key) == (0, [])
    retry = post(proxied_app, "/entries", key)
    assert retry.status_code == 201
    assert "Idempotent-Replayed" not in retry.headers
    assert stored(pg_url, key) == (1, ["completed"])


def test_commit_whose_reply_was_lost_is_503_and_the_retry_replays(
    proxied_app: Flask, proxy: TcpProxy, pg_url: str
) -> None:
    """The ambiguous case the README describes: the database committed, the
    connection broke before the app heard so. The client got 503; its retry
    with the same key replays the committed response instead of charging twice."""
    key = str(uuid.uuid4())
    proxy.trap_commit(deliver=True)
    assert_problem(post(proxied_app, "/entries", key), 503, "database-unavailable")
    proxy.heal()
    assert stored(pg_url, key) == (1, ["completed"])  # it did commit
    retry = post(proxied_app, "/entries", key)
    assert retry.status_code == 201
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert stored(pg_url, key) == (1, ["completed"])


def test_leased_record_left_by_an_outage_blocks_until_its_lease_ends(
    proxied_app: Flask, proxy: TcpProxy, pg_url: str, clock: Clock
) -> None:
    """On a leased route the claim committed before the outage, and releasing it
    needs the database: retries get 409 until the lease ends, then run once."""
    key = str(uuid.uuid4())
    proxied_app.config["HOOKS"] = {"before-write": proxy.cut}
    assert_problem(post(proxied_app, "/leased", key), 503, "database-unavailable")
    proxied_app.config["HOOKS"] = {}
    proxy.heal()
    assert stored(pg_url, key) == (0, ["in_progress"])
    assert_problem(post(proxied_app, "/leased", key), 409, "request-in-progress")
    clock.advance(seconds=31)
    retry = post(proxied_app, "/leased", key)
    assert retry.status_code == 201
    assert stored(pg_url, key) == (1, ["completed"])


def test_sqlite_that_cannot_be_opened_answers_503(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'missing-dir' / 'db.sqlite3'}")
    for key in (str(uuid.uuid4()), None):
        assert_problem(post(app, "/entries", key), 503, "database-unavailable")
    with app.app_context():
        db.engine.dispose()


# -- lock conflicts: 409 ---------------------------------------------------------------


@pytest.fixture
def pg_app(pg_url: str) -> t.Iterator[Flask]:
    """The app on PostgreSQL, waiting for row locks as long as it takes."""
    app = create_app(pg_url)
    reset(pg_url)
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.fixture
def impatient_app(pg_url: str, pooled_role: t.Callable[..., str]) -> t.Iterator[Flask]:
    """The app on PostgreSQL with a short lock_timeout for its own statements
    (behind the pooler: its role's)."""
    if pgbouncer.is_pooled(pg_url):
        app = create_app(pooled_role(pg_url, lock_timeout="300ms"))
    else:
        app = create_app(
            pg_url,
            engine_options={
                "connect_args": {"options": pg_options(pg_url, "-c lock_timeout=300ms")}
            },
        )
    reset(pg_url)
    yield app
    with app.app_context():
        db.engine.dispose()


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no-key"])
def test_lock_timeout_in_the_view_answers_409(
    impatient_app: Flask, pg_url: str, with_key: bool, caplog: pytest.LogCaptureFixture
) -> None:
    pg_app = impatient_app
    key = str(uuid.uuid4()) if with_key else None
    tag = key or "no-key"
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT * FROM outage_accounts WHERE id = 1 FOR UPDATE"))
            with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
                response = post(pg_app, "/debit", key, json={"accounts": [1]})
            assert_problem(response, 409, "transaction-conflict")
            assert "LockNotAvailable" in caplog.text
            assert stored(pg_url, tag) == (0, [])
            holder.rollback()
    finally:
        engine.dispose()
    retry = post(pg_app, "/debit", key, json={"accounts": [1]})
    assert retry.status_code == 201
    assert stored(pg_url, tag) == (1, ["completed"] if with_key else [])


def test_deadlock_between_two_requests_answers_409_to_one(
    pg_app: Flask, pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two requests lock two accounts in opposite orders; PostgreSQL aborts one."""
    both_hold_one = threading.Barrier(2)

    def after_first_lock() -> None:
        if not g.get("held_one"):
            g.held_one = True
            both_hold_one.wait(10)

    pg_app.config["HOOKS"] = {"after-lock": after_first_lock}
    keys = [str(uuid.uuid4()), str(uuid.uuid4())]
    orders = [[1, 2], [2, 1]]
    responses: list[t.Any] = [None, None]

    def call(i: int) -> None:
        responses[i] = post(pg_app, "/debit", keys[i], json={"accounts": orders[i]})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    pg_app.config["HOOKS"] = {}
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [201, 409], [r.data[:300] for r in responses]
    [loser] = [i for i, r in enumerate(responses) if r.status_code == 409]
    assert_problem(responses[loser], 409, "transaction-conflict")
    assert "DeadlockDetected" in caplog.text
    winner = 1 - loser
    assert stored(pg_url, keys[winner]) == (1, ["completed"])
    assert stored(pg_url, keys[loser]) == (0, [])
    retry = post(pg_app, "/debit", keys[loser], json={"accounts": orders[loser]})
    assert retry.status_code == 201
    assert stored(pg_url, keys[loser]) == (1, ["completed"])


def test_serialization_failure_answers_409(pg_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """REPEATABLE READ: a concurrent transaction changed the row after this
    request's snapshot; PostgreSQL refuses the update (40001)."""
    app = create_app(pg_url, engine_options={"isolation_level": "REPEATABLE READ"})
    reset(pg_url)
    key = str(uuid.uuid4())
    engine = sa.create_engine(pg_url)
    response: list[t.Any] = []
    try:
        with engine.connect() as other:
            other.execute(sa.text("UPDATE outage_accounts SET balance = 10 WHERE id = 1"))
            th = threading.Thread(
                target=lambda: response.append(post(app, "/debit", key, json={"accounts": [1]}))
            )
            with caplog.at_level(logging.WARNING, logger="flask_idempotency"):
                th.start()
                _wait_for_lock_waiter(engine)
                other.commit()
                th.join(30)
        assert_problem(response[0], 409, "transaction-conflict")
        assert "SerializationFailure" in caplog.text
        assert stored(pg_url, key) == (0, [])
        retry = post(app, "/debit", key, json={"accounts": [1]})
        assert retry.status_code == 201
        assert stored(pg_url, key) == (1, ["completed"])
    finally:
        engine.dispose()
        with app.app_context():
            db.engine.dispose()


def _wait_for_lock_waiter(engine: sa.Engine) -> None:
    """Until another backend waits for a lock on this test's table (the request is
    blocked on our row; other tests of the run share the server)."""
    deadline = time.monotonic() + 20
    query = sa.text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        " AND query LIKE '%outage_accounts%' AND pid <> pg_backend_pid()"
    )
    while time.monotonic() < deadline:
        # A fresh transaction each time: pg_stat_activity is a per-transaction snapshot.
        with engine.connect() as conn:
            if conn.execute(query).scalar_one():
                return
        time.sleep(0.02)
    raise AssertionError("the request never waited for the row lock")


def test_sqlite_locked_database_answers_409(tmp_path: Path) -> None:
    """Another writer holds SQLite's write lock past the busy timeout."""
    url = f"sqlite:///{tmp_path / 'locked.sqlite3'}"
    app = create_app(url, engine_options={"connect_args": {"timeout": 0.2}})
    reset(url)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as holder:
            holder.exec_driver_sql("BEGIN IMMEDIATE")
            for key in (None, str(uuid.uuid4())):
                response = post(app, "/entries", key)
                assert response.status_code == 409, response.data[:300]
                assert response.content_type == PROBLEM_JSON
                assert int(response.headers["Retry-After"]) >= 1
            holder.rollback()
        assert run_sql(url, "SELECT count(*) FROM outage_entries")[0][0] == 0
        assert post(app, "/entries", None).status_code == 201
    finally:
        engine.dispose()
        with app.app_context():
            db.engine.dispose()


# -- everything else propagates unchanged ------------------------------------------------


def test_other_database_errors_propagate_unchanged(pg_app: Flask) -> None:
    pg_app.config["PROPAGATE_EXCEPTIONS"] = True
    with pytest.raises(sa.exc.IntegrityError):
        post(pg_app, "/unique", str(uuid.uuid4()))
    with pytest.raises(sa.exc.IntegrityError):
        post(pg_app, "/unique", None)


# -- a live server under load while the database flaps ---------------------------------

CHARGE = {"customer_id": "cus_load", "amount": 1250, "currency": "EUR"}


def _kind(reply: Reply) -> str:
    content_type = reply.headers.get("content-type", "")
    if reply.status == 201:
        return "201 replayed" if reply.replayed else "201"
    if reply.status in (409, 503) and content_type == PROBLEM_JSON:
        return str(reply.status) if reply.headers.get("retry-after", "").isdigit() else "bad"
    if reply.status == 500 and content_type.startswith("text/html"):
        return "HTML 500"
    return f"other {reply.status} {content_type}"


@pytest.mark.slow
def test_database_flapping_under_load_answers_503_never_html_500(
    example_behind_proxy: LiveServer, proxy: TcpProxy, pg_url: str
) -> None:
    """Four clients send charges, each with its own key, retrying a 503 or 409
    twice, for ~5 s while the proxy cuts the database off for 0.3 s every
    0.5 s. Then every key is retried until it succeeds.

    Every answer is 201, a replayed 201, or 409/503 problem+json with
    Retry-After. Each key ends with exactly one ledger row and one completed
    record, and the response the client finally got names that row. A 503 left
    nothing behind, except a 503 whose COMMIT reached the database before the
    connection broke: then the retry replays (counted, not forbidden; see the
    README)."""
    server = example_behind_proxy
    direct = sa.create_engine(pg_url)
    history: dict[str, list[Reply]] = collections.defaultdict(list)
    half_stored: list[tuple[str, int, list[str]]] = []
    lock = threading.Lock()
    load_ends = time.monotonic() + 5
    stop_flapping = threading.Event()

    def state_of(key: str) -> tuple[int, list[str]]:
        # One statement, one snapshot: a commit landing between two reads
        # would look like half of one.
        query = sa.text(
            "SELECT (SELECT count(*) FROM ledger WHERE description = :k),"
            " ARRAY(SELECT status FROM idempotency_keys WHERE key = :k)"
        )
        with direct.connect() as conn:
            rows, records = conn.execute(query, {"k": key}).one()
            return int(rows), list(records)

    def attempt(key: str) -> Reply:
        reply = server.post(
            "/payments", {**CHARGE, "description": key}, key, headers=MERCHANT, timeout=60
        )
        with lock:
            history[key].append(reply)
        if reply.status == 503:
            rows, records = state_of(key)
            # Nothing, or (a lost COMMIT reply) everything; never half of it.
            if (rows, records) not in ((0, []), (1, ["completed"])):
                half_stored.append((key, rows, records))
        return reply

    def client(n: int) -> None:
        i = 0
        while time.monotonic() < load_ends:
            key = f"load-{n}-{i}-{uuid.uuid4()}"
            i += 1
            for _ in range(3):
                if attempt(key).status not in (409, 503):
                    break
                time.sleep(0.05)

    flapper = proxy.flap(down=0.3, up=0.5, until=stop_flapping)
    clients = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for th in clients:
        th.start()
    for th in clients:
        th.join(120)
    stop_flapping.set()
    flapper.join(10)
    proxy.heal()

    kinds = collections.Counter(_kind(r) for replies in history.values() for r in replies)
    summary = f"{dict(kinds)}, {len(history)} keys, {proxy.cuts} cuts"
    print("\noutage load:", summary)
    assert set(kinds) <= {"201", "201 replayed", "409", "503"}, summary
    assert kinds["503"] > 0, f"the outage never reached a request: {summary}"
    assert not half_stored, half_stored

    # Afterwards, every client retries its key until it succeeds.
    final: dict[str, Reply] = {}
    for key, replies in history.items():
        reply = replies[-1]
        for _ in range(20):
            if reply.status == 201:
                break
            time.sleep(0.2)
            reply = attempt(key)
        assert reply.status == 201, (key, reply.status, reply.body[:300])
        final[key] = reply

    lost_commit_replies = 0
    with direct.connect() as conn:
        ledger = collections.defaultdict(list)
        for charge_id, key in conn.execute(sa.text("SELECT id, description FROM ledger")):
            ledger[key].append(charge_id)
        records = dict(conn.execute(sa.text("SELECT key, status FROM idempotency_keys")).all())
    direct.dispose()
    assert set(ledger) == set(history) == set(records)
    for key, replies in history.items():
        assert len(ledger[key]) == 1, (key, ledger[key])
        assert records[key] == "completed"
        assert final[key].json()["charge_id"] == ledger[key][0]
        first_success = next(r for r in replies if r.status == 201)
        if first_success.replayed:
            # The operation was stored by an attempt that answered 503: its
            # COMMIT reached the database, the reply did not reach the app.
            assert any(r.status == 503 for r in replies), key
            lost_commit_replies += 1
    print(f"outage load: {lost_commit_replies} of {kinds['503']} 503s had committed")


def test_exhausted_pool_answers_503(pg_url: str) -> None:
    """Every pooled connection is busy past ``pool_timeout``: 503, not a hang or a 500."""
    app = create_app(
        pg_url, engine_options={"pool_size": 1, "max_overflow": 0, "pool_timeout": 0.5}
    )
    reset(pg_url)
    key = str(uuid.uuid4())
    try:
        with app.app_context(), db.engine.connect():  # the only connection, held
            response = post(app, "/entries", key)
        assert_problem(response, 503, "database-unavailable")
        assert stored(pg_url, key) == (0, [])
        assert post(app, "/entries", key).status_code == 201
        assert stored(pg_url, key) == (1, ["completed"])
    finally:
        with app.app_context():
            db.engine.dispose()


def test_statement_timeout_answers_503(pg_url: str, pooled_role: t.Callable[..., str]) -> None:
    """The server cancelled a statement that ran past ``statement_timeout``
    (behind the pooler: its role's)."""
    if pgbouncer.is_pooled(pg_url):
        app = create_app(pooled_role(pg_url, statement_timeout="300"))
    else:
        options = {"connect_args": {"options": pg_options(pg_url, "-c statement_timeout=300")}}
        app = create_app(pg_url, engine_options=options)
    reset(pg_url)
    key = str(uuid.uuid4())
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as holder:
            holder.execute(sa.text("SELECT * FROM outage_accounts WHERE id = 1 FOR UPDATE"))
            response = post(app, "/debit", key, json={"accounts": [1]})
            holder.rollback()
        assert_problem(response, 503, "database-unavailable")
        assert stored(pg_url, key) == (0, [])
    finally:
        engine.dispose()
        with app.app_context():
            db.engine.dispose()
