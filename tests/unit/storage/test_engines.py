"""The record is exact on every engine, and every engine's refusals are a 409.

Run on PostgreSQL, SQLite and MariaDB/MySQL: scope and key compare byte for
byte (no case folding, no trailing-space padding), timestamps keep microseconds,
large response bodies are stored, a duplicate waits no longer than
``IDEMPOTENCY_WAIT``, and the engine's own lock timeout, a deadlock or a
snapshot that hides the winner end in the documented answer (409 problem+json or
the replay), never a 500.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask, request

from flask_idempotency.models import outbox_table
from flask_idempotency.outbox import add_event
from tests.conftest import Clock, ledger_count, pg_options, record_rows, reset_tables
from tests.support import pgbouncer, testapp
from tests.support.flow import assert_problem
from tests.support.gates import Gates, send


def make_app(database_url: str, clock: Clock | None = None, **config: t.Any) -> Flask:
    app = testapp.create_app(database_url, clock=clock, **config)
    reset_tables(database_url)
    return app


def post(client: t.Any, path: str, body: t.Any, key: str, **headers: str) -> t.Any:
    return client.post(
        path,
        data=json.dumps(body),
        content_type="application/json",
        headers={"Idempotency-Key": key, **headers},
    )


# -- exact comparison ------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [("Order-42", "order-42"), ("k", '"k "'), ('"k "', '"k  "'), ("abc", "ABC")],
)
def test_keys_differing_in_case_or_trailing_spaces_are_different_keys(
    database_url: str, first: str, second: str
) -> None:
    app = make_app(database_url)
    client = app.test_client()
    one = post(client, "/tenant", {"amount": 1}, first, **{"X-Tenant": "a"})
    two = post(client, "/tenant", {"amount": 1}, second, **{"X-Tenant": "a"})
    assert one.status_code == two.status_code == 201
    assert two.headers.get("Idempotent-Replayed") is None
    assert one.get_json()["id"] != two.get_json()["id"]
    assert ledger_count(app, "tenant") == 2
    assert sorted(r["key"] for r in record_rows(app)) == sorted(
        k.strip('"') for k in (first, second)
    )


@pytest.mark.parametrize(("first", "second"), [("Acme", "acme"), ("acme", "acme ")])
def test_scopes_differing_in_case_or_trailing_spaces_never_share(
    database_url: str, first: str, second: str
) -> None:
    app = make_app(database_url)
    client = app.test_client()
    post(client, "/tenant", {"amount": 1}, "k", **{"X-Tenant": first})
    two = post(client, "/tenant", {"amount": 1}, "k", **{"X-Tenant": second})
    assert two.headers.get("Idempotent-Replayed") is None
    assert two.get_json()["tenant"] == second  # not the other tenant's response
    assert ledger_count(app, "tenant") == 2
    assert {r["scope"] for r in record_rows(app)} == {f"tenant:{first}", f"tenant:{second}"}


def test_non_ascii_scope_round_trips(database_url: str) -> None:
    app = testapp.create_app(database_url)

    @app.post("/intl")
    @testapp.idem.idempotent(scope=lambda: "tenant:Zürich-東京")
    def intl() -> tuple[dict[str, t.Any], int]:
        return {"id": testapp.write_ledger("intl").id}, 201

    reset_tables(database_url)
    client = app.test_client()
    assert post(client, "/intl", {}, "k").status_code == 201
    assert post(client, "/intl", {}, "k").headers["Idempotent-Replayed"] == "true"
    [record] = record_rows(app)
    assert record["scope"] == "tenant:Zürich-東京"
    assert ledger_count(app, "intl") == 1


def test_an_event_id_bound_as_text_finds_its_row_on_every_engine(database_url: str) -> None:
    """docs/databases.md: a query of one's own on the public tables binds an id as
    text, one query for every engine (a plain string fails in PyMySQL against
    MySQL's VARBINARY), and matches byte for byte."""
    app = make_app(database_url)
    with app.app_context():
        add_event(testapp.db.session, "t", {"n": 1}, event_id="Evt-1")
        testapp.db.session.commit()
        table = outbox_table(testapp.db.metadata)

        def topics(event_id: str) -> list[str]:
            wanted = table.c.event_id == sa.bindparam("id", event_id, type_=sa.String())
            query = sa.select(table.c.topic).where(wanted)
            return list(testapp.db.session.execute(query).scalars())

        assert topics("Evt-1") == ["t"]
        assert topics("evt-1") == []
        assert topics("Evt-1 ") == []


# -- precision and size -----------------------------------------------------------


def test_timestamps_keep_microseconds(database_url: str, clock: Clock) -> None:
    clock.now = clock.now.replace(microsecond=123456)
    app = make_app(database_url, clock)
    assert post(app.test_client(), "/short-ttl", {}, "k").status_code == 201
    [record] = record_rows(app)
    assert record["created_at"] == clock.now
    assert record["expires_at"] == clock.now + dt.timedelta(minutes=5)
    assert record["created_at"].microsecond == 123456


def test_sub_second_expiry_is_exact(database_url: str, clock: Clock) -> None:
    app = make_app(database_url, clock)
    client = app.test_client()
    post(client, "/short-ttl", {}, "k")
    clock.advance(minutes=5, microseconds=-1)
    assert post(client, "/short-ttl", {}, "k").headers.get("Idempotent-Replayed") == "true"
    clock.advance(microseconds=1)  # exactly at expires_at: expired
    assert post(client, "/short-ttl", {}, "k").headers.get("Idempotent-Replayed") is None
    assert ledger_count(app, "short-ttl") == 2


def test_response_body_over_64_kib_is_stored_and_replayed(database_url: str) -> None:
    app = make_app(database_url, IDEMPOTENCY_MAX_BODY=1024 * 1024)
    client = app.test_client()
    first = post(client, "/big/300000", {}, "big")
    assert first.status_code == 201
    again = post(client, "/big/300000", {}, "big")
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data()
    assert len(again.get_data()) == 300000
    assert ledger_count(app, "big") == 1


# -- waiting, and what each engine does when it stops waiting ---------------------


def slow_app(
    database_url: str,
    clock: Clock | None = None,
    route: dict[str, t.Any] | None = None,
    **config: t.Any,
) -> tuple[Flask, Gates]:
    gates = Gates()
    app = testapp.create_app(database_url, clock=clock, **config)

    @app.post("/held")
    @testapp.idem.idempotent(**(route or {}))
    def held() -> tuple[dict[str, t.Any], int]:
        row = testapp.write_ledger("held")
        who = request.headers.get("X-Who", "")
        if who.startswith("first"):
            gates.pause(who)
        if who.endswith("fails"):
            return {"error": "boom"}, 500
        return {"id": row.id}, 201

    reset_tables(database_url)
    return app, gates


def first_then_waiting_duplicate(
    app: Flask, gates: Gates, dup_started: threading.Event | None = None
) -> tuple[t.Any, t.Any]:
    """The first request holds its claim; a duplicate arrives and waits on it
    (after the app's before_request hooks ran; ``dup_started``, when given, is
    set by such a hook); then the first goes on. The two answers, first's and
    the duplicate's."""
    first = send(app, "/held", {}, **{"X-Who": "first"})
    try:
        assert gates.arrived("first")
        dup = send(app, "/held", {}, **{"X-Who": "dup"})
        # A slow machine may take longer than the sleep to start the duplicate
        # (a new thread, a second connection): where the outcome depends on
        # it, the hook tells.
        if dup_started is not None:
            assert dup_started.wait(30)
        time.sleep(0.5)  # the duplicate has started, and now waits on the claim
    finally:
        gates.open("first")
    return first.result(), dup.result()


@pytest.mark.parametrize("where", ["app", "route"])
def test_duplicate_waits_no_longer_than_the_wait_setting(database_url: str, where: str) -> None:
    """The first request holds its claim; the duplicate gives up after
    IDEMPOTENCY_WAIT (or the route's ``wait=``, which wins) with 409 and
    Retry-After, long before the first ends."""
    if where == "app":
        app, gates = slow_app(database_url, IDEMPOTENCY_WAIT=0.5)
    else:
        app, gates = slow_app(database_url, route={"wait": 0.5}, IDEMPOTENCY_WAIT=None)
    first = send(app, "/held", {}, **{"X-Who": "first"})
    try:
        assert gates.arrived("first")
        started = time.monotonic()
        dup = send(app, "/held", {}, **{"X-Who": "dup"}).result(timeout=20)
        waited = time.monotonic() - started
    finally:
        gates.open("first")
    assert_problem(dup, 409)
    assert dup.headers["Retry-After"] == "1"
    # About the bound (MySQL counts whole seconds, so 1 s there), not the first
    # request (held 30 s); generous above, for a shared machine.
    assert 0.4 <= waited < 8
    assert first.result().status_code == 201
    assert ledger_count(app, "held") == 1


def assert_duplicate_gets_409_and_one_charge(app: Flask, gates: Gates) -> None:
    """The first request holds its claim; the duplicate's wait ends in a 409
    problem; the first then completes, with one ledger row."""
    first = send(app, "/held", {}, **{"X-Who": "first"})
    try:
        assert gates.arrived("first")
        dup = send(app, "/held", {}, **{"X-Who": "dup"}).result(timeout=20)
    finally:
        gates.open("first")
    assert_problem(dup, 409)
    assert first.result().status_code == 201
    assert ledger_count(app, "held") == 1


def _engine_timeout_options(database_url: str) -> dict[str, t.Any]:
    """Engine options that make the database itself stop waiting after ~1 s."""
    if database_url.startswith("postgresql"):
        return {
            "connect_args": {"options": pg_options(database_url, "-c lock_timeout=1000")},
            "pool_size": 10,
        }
    if database_url.startswith("mysql"):

        def on_connect(dbapi_conn: t.Any, record: t.Any) -> None:
            with dbapi_conn.cursor() as cur:
                cur.execute("SET SESSION innodb_lock_wait_timeout = 1")

        return {"_on_connect": on_connect}
    return {"connect_args": {"timeout": 1}}


def test_engines_own_lock_timeout_is_a_409_not_a_500(
    database_url: str, pooled_role: t.Callable[..., str]
) -> None:
    """No bound of ours (IDEMPOTENCY_WAIT=None): the engine's own lock timeout
    (PostgreSQL lock_timeout, innodb_lock_wait_timeout, SQLite's busy timeout)
    ends the wait, and the client still gets the documented 409."""
    url = database_url
    if pgbouncer.is_pooled(database_url):  # behind the pooler: the role's lock_timeout
        url, options = pooled_role(database_url, lock_timeout="1000"), {"pool_size": 10}
    else:
        options = _engine_timeout_options(database_url)
    on_connect = options.pop("_on_connect", None)
    app, gates = slow_app(url, IDEMPOTENCY_WAIT=None, SQLALCHEMY_ENGINE_OPTIONS=options)
    if on_connect is not None:
        with app.app_context():
            sa.event.listen(testapp.db.engine, "connect", on_connect)
            testapp.db.engine.dispose()
    assert_duplicate_gets_409_and_one_charge(app, gates)


def test_first_request_failing_under_waiting_duplicates_never_shows_a_500_page(
    database_url: str,
) -> None:
    """The first request rolls back while two duplicates wait on its claim: on
    MySQL one of them becomes a deadlock victim. Each duplicate either runs the
    view (its own answer) or gets 409 problem+json; none gets an HTML 500."""
    app, gates = slow_app(database_url, IDEMPOTENCY_WAIT=20)
    first = send(app, "/held", {}, **{"X-Who": "first-fails"})
    try:
        assert gates.arrived("first-fails")
        dups = [send(app, "/held", {}, **{"X-Who": f"dup{i}-fails"}) for i in range(2)]
        time.sleep(0.5)  # both are waiting on the first request's claim
    finally:
        gates.open("first-fails")
    assert first.result().status_code == 500
    for dup in dups:
        answer = dup.result()
        if answer.status_code == 409:
            assert_problem(answer, 409)
        else:
            assert answer.status_code == 500
            assert answer.get_json() == {"error": "boom"}  # the view's own answer
    assert ledger_count(app, "held") == 0
    assert record_rows(app) == []


def test_duplicate_replays_even_after_an_earlier_read_in_its_transaction(
    database_url: str,
) -> None:
    """A before_request hook reads through db.session, so under REPEATABLE READ
    (MySQL's default) the duplicate's snapshot predates the winner's commit.
    It must still find the winner's record and replay it."""
    app, gates = slow_app(database_url, IDEMPOTENCY_WAIT=20)

    @app.before_request
    def load_user() -> None:
        testapp.db.session.execute(sa.text("SELECT 1 FROM ledger")).all()

    first, answer = first_then_waiting_duplicate(app, gates)
    assert first.status_code == 201
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "held") == 1


def test_serialization_failure_under_repeatable_read_is_a_409(pg_url: str) -> None:
    """PostgreSQL at REPEATABLE READ refuses the duplicate's insert when the
    winner committed after its snapshot: that is a 409 (retry), not a 500."""
    app, gates = slow_app(
        pg_url,
        IDEMPOTENCY_WAIT=20,
        SQLALCHEMY_ENGINE_OPTIONS={"isolation_level": "REPEATABLE READ"},
    )

    snapshot_taken = threading.Event()

    @app.before_request
    def load_user() -> None:
        testapp.db.session.execute(sa.text("SELECT 1 FROM ledger")).all()
        if request.headers.get("X-Who") == "dup":
            snapshot_taken.set()  # its snapshot is older than the first's commit

    first, answer = first_then_waiting_duplicate(app, gates, snapshot_taken)
    assert first.status_code == 201
    assert_problem(answer, 409)
    retry = send(app, "/held", {}, **{"X-Who": "dup"}).result()
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app, "held") == 1


def test_body_over_the_engines_packet_limit_is_413_not_500(clock: Clock) -> None:
    """MySQL/MariaDB refuse a statement over max_allowed_packet: a recover=True
    route storing such a body answers 413 problem+json, and nothing is stored."""
    from tests.conftest import mysql_url

    url = mysql_url()
    if url is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    app = testapp.create_app(url, clock=clock)

    @app.post("/upload")
    @testapp.idem.idempotent(lease=30, recover=True)
    def upload() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("upload")
        return {"ok": True}, 201

    reset_tables(url)
    with app.app_context(), testapp.db.engine.connect() as conn:
        limit = conn.execute(sa.text("SELECT @@max_allowed_packet")).scalar_one()
    response = app.test_client().post(
        "/upload",
        data=b"x" * (int(limit) + 1024),
        content_type="application/octet-stream",
        headers={"Idempotency-Key": "big"},
    )
    assert_problem(response, 413)
    assert record_rows(app) == []
    assert ledger_count(app, "upload") == 0


def test_a_claim_that_waited_counts_its_times_from_when_it_got_the_key(
    database_url: str, clock: Clock
) -> None:
    """A duplicate waits on the first request's claim; meanwhile 45 s pass (by the
    app's clock) and the first fails. The duplicate's operation then counts its
    creation, lease and retention from when it got the key, not from when it
    arrived."""
    app, gates = slow_app(database_url, clock, IDEMPOTENCY_WAIT=20)
    first = send(app, "/held", {}, **{"X-Who": "first-fails"})
    try:
        assert gates.arrived("first-fails")
        dup = send(app, "/held", {}, **{"X-Who": "dup"})
        assert not dup.done(0.5)  # waiting on the first request's claim
        clock.advance(seconds=45)
    finally:
        gates.open("first-fails")
    assert first.result().status_code == 500
    assert dup.result().status_code == 201
    [record] = record_rows(app)
    assert record["created_at"] == clock.now
    assert record["expires_at"] == clock.now + dt.timedelta(hours=24)


def test_claim_follows_the_apps_schema_translate_map(pg_url: str) -> None:
    """An app that maps its tables to a tenant's schema (schema_translate_map):
    the claim, the completion and the replay all use the mapped table (the
    one-round-trip claim is compiled once, so it must step aside here)."""
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP SCHEMA IF EXISTS tenant_x CASCADE"))
        conn.execute(sa.text("CREATE SCHEMA tenant_x"))
    mapped = {"execution_options": {"schema_translate_map": {None: "tenant_x"}}}
    app = testapp.create_app(pg_url, SQLALCHEMY_ENGINE_OPTIONS=mapped)
    try:
        with app.app_context():
            testapp.db.create_all()
        client = app.test_client()
        body = {"amount": 5, "currency": "EUR"}
        headers = {"Idempotency-Key": "tenant-k"}
        first = client.post("/charges", json=body, headers=headers)
        again = client.post("/charges", json=body, headers=headers)
        assert first.status_code == 201, first.get_data(as_text=True)
        assert again.headers["Idempotent-Replayed"] == "true"
        with engine.connect() as conn:
            mapped_rows = conn.execute(
                sa.text("SELECT count(*) FROM tenant_x.idempotency_keys")
            ).scalar_one()
            ledger = conn.execute(sa.text("SELECT count(*) FROM tenant_x.ledger")).scalar_one()
        assert (mapped_rows, ledger) == (1, 1)
    finally:
        with app.app_context():
            testapp.db.engine.dispose()
        with engine.begin() as conn:
            conn.execute(sa.text("DROP SCHEMA tenant_x CASCADE"))
        engine.dispose()


def test_apps_statement_timeout_ending_the_wait_is_a_409(
    pg_url: str, pooled_role: t.Callable[..., str]
) -> None:
    """No bound of ours, and the app's statement_timeout (not lock_timeout) ends
    the duplicate's wait on the claim: the documented 409, not a 503."""
    url, options = (
        pg_url,
        {"connect_args": {"options": pg_options(pg_url, "-c statement_timeout=700")}},
    )
    if pgbouncer.is_pooled(pg_url):  # behind the pooler: the role's statement_timeout
        url, options = pooled_role(pg_url, statement_timeout="700"), {}
    app, gates = slow_app(url, IDEMPOTENCY_WAIT=None, SQLALCHEMY_ENGINE_OPTIONS=options)
    assert_duplicate_gets_409_and_one_charge(app, gates)


@pytest.mark.parametrize("where", ["engine", "view", "pysqlite"])
def test_an_autocommit_session_is_refused_before_anything_is_written(
    database_url: str, where: str
) -> None:
    """``isolation_level="AUTOCOMMIT"`` commits each statement on its own: the
    claim could not roll back with a view that fails, which would leave its rows
    committed under a record in progress, run again after the lease. Refused,
    saying why, before anything is written: on the engine (at the claim), asked
    for by the view on a leased route (at the view's transaction), and
    pysqlite's own autocommit (``isolation_level=None``), which SQLAlchemy does
    not see."""
    if where == "pysqlite" and not database_url.startswith("sqlite"):
        pytest.skip("pysqlite's autocommit is SQLite's")
    options: dict[str, t.Any] = {
        "engine": {"isolation_level": "AUTOCOMMIT"},
        "view": {},
        "pysqlite": {"connect_args": {"isolation_level": None}},
    }[where]
    extra = {"SQLALCHEMY_ENGINE_OPTIONS": options} if options else {}
    app = testapp.create_app(database_url, **extra)
    reset_tables(database_url)
    app.testing = True  # the error itself, not Flask's page for it
    client = app.test_client()
    path = "/leased-autocommit-view" if where == "view" else "/status/502"
    with pytest.raises(RuntimeError, match="AUTOCOMMIT"):
        client.post(path, json={}, headers={"Idempotency-Key": "auto"})
    assert ledger_count(app) == 0
    assert record_rows(app) == []  # (a leased claim, committed, released: retries run)


def test_sqlalchemys_pysqlite_savepoint_recipe_is_transactional(tmp_path: t.Any) -> None:
    """pysqlite's ``isolation_level=None`` with a "begin" listener sending BEGIN
    (SQLAlchemy's documented recipe for SAVEPOINT on SQLite) is transactional:
    served, and a failing view leaves nothing."""
    url = f"sqlite:///{tmp_path / 'recipe.sqlite3'}"
    app = testapp.create_app(
        url, SQLALCHEMY_ENGINE_OPTIONS={"connect_args": {"isolation_level": None}}
    )
    with app.app_context():
        engine = testapp.db.engine

    @sa.event.listens_for(engine, "begin")
    def begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN")

    reset_tables(url)
    client = app.test_client()
    ok = client.post("/status/201", json={}, headers={"Idempotency-Key": "recipe"})
    assert ok.status_code == 201
    failed = client.post("/status/502", json={}, headers={"Idempotency-Key": "recipe-2"})
    assert failed.status_code == 502
    assert ledger_count(app) == 1
    assert [r["key"] for r in record_rows(app)] == ["recipe"]


def test_an_autocommit_bind_that_holds_no_record_is_left_alone(tmp_path: t.Any) -> None:
    """A Flask-SQLAlchemy bind in AUTOCOMMIT (a reporting database) that the
    view reads: the record is not on it, so the claim has nothing to refuse."""
    from flask_sqlalchemy import SQLAlchemy

    url = f"sqlite:///{tmp_path / 'main.sqlite3'}"
    reports_url = f"sqlite:///{tmp_path / 'reports.sqlite3'}"
    app = testapp.create_app(
        url,
        SQLALCHEMY_BINDS={"reports": {"url": reports_url, "isolation_level": "AUTOCOMMIT"}},
    )
    reset_tables(url)
    db: SQLAlchemy = testapp.db

    @app.post("/reads-reports")
    @testapp.idem.idempotent()
    def reads_reports() -> tuple[dict[str, t.Any], int]:
        total = db.session.execute(
            sa.text("SELECT 41 + 1"), bind_arguments={"bind": db.engines["reports"]}
        ).scalar_one()
        row = testapp.write_ledger("reads-reports")
        return {"id": row.id, "total": total}, 201

    client = app.test_client()
    answer = client.post("/reads-reports", json={}, headers={"Idempotency-Key": "reports"})
    assert answer.status_code == 201, answer.get_data(as_text=True)
    assert answer.get_json()["total"] == 42
    assert ledger_count(app) == 1
