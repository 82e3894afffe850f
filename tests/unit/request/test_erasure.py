"""Erasure that keeps the fence (``idem.erase``), on every engine: a tombstone
keeps scope, key, times and status, loses everything the operation stored,
and answers every retry 410 ``key-erased`` without running the view; a live
lease is skipped; batches are bounded; a second run erases nothing new;
cleanup removes an expired tombstone, and the key then runs anew.

Side effects are ledger rows and the record's columns, read from the database.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime as dt
import logging
import shutil
import sqlite3
import threading
import time
import typing as t
from pathlib import Path

import flask
import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import COMPLETED, IN_PROGRESS
from flask_idempotency._storage import new_fencing_token, operation_values
from flask_idempotency._storage.schema import ERASED, ERASED_HASH
from flask_idempotency.errors import PROBLEM_TYPE_BASE
from flask_idempotency.jobs import ErasureReport, purge_expired, recover_abandoned
from tests.conftest import Clock, insert_records, ledger_count, record_rows
from tests.support import testapp
from tests.support.flow import assert_problem, post

CHARGE = {"amount": 500, "currency": "EUR"}
HOUR = dt.timedelta(hours=1)
#: The columns a tombstone must not keep (what the operation stored).
STORED = (
    "response_code",
    "response_headers",
    "response_body",
    "recovery_points",
    "request_method",
    "request_path",
    "request_content_type",
    "request_body",
    "locked_until",
)


def tenant(client: t.Any, who: str, key: str, body: t.Any = None) -> t.Any:
    return post(client, "/tenant", body or {"x": 1}, key=key, headers={"X-Tenant": who})


def erase(app: Flask, scope: str, key: str | None = None, **options: t.Any) -> ErasureReport:
    with app.app_context():
        return testapp.idem.erase(scope, key, **options)


def by_key(app: Flask) -> dict[tuple[str, str], dict[str, t.Any]]:
    return {(row["scope"], row["key"]): row for row in record_rows(app)}


def assert_tombstone(row: dict[str, t.Any], before: dict[str, t.Any]) -> None:
    assert row["status"] == ERASED
    assert row["request_hash"] == ERASED_HASH
    for column in STORED:
        assert row[column] is None, column
    # The fence stays: identity, token and times.
    for column in ("fencing_token", "created_at", "expires_at"):
        assert row[column] == before[column], column


def put_record(app: Flask, clock: Clock, scope: str, key: str, **columns: t.Any) -> int:
    """One record as the request path leaves it; its fencing token."""
    now = clock()
    token = new_fencing_token()
    values = operation_values(
        **{
            "request_hash": "h",
            "status": IN_PROGRESS,
            "created_at": now - HOUR,
            "expires_at": now + 24 * HOUR,
            **columns,
        }
    )
    with app.app_context(), testapp.db.engine.begin() as conn:
        insert_records(conn, [{"scope": scope, "key": key, "fencing_token": token, **values}])
    return token


def test_erase_by_key_keeps_the_fence_and_the_retry_gets_410(
    app: Flask, client: t.Any, caplog: pytest.LogCaptureFixture
) -> None:
    for who, key in (("a", "k1"), ("a", "k2"), ("b", "k1")):
        assert tenant(client, who, key).status_code == 201
    before = by_key(app)
    assert ledger_count(app) == 3

    report = erase(app, "tenant:a", "k1")

    assert (report.erased, report.skipped, report.complete) == (1, 0, True)
    after = by_key(app)
    assert_tombstone(after[("tenant:a", "k1")], before[("tenant:a", "k1")])
    # Nothing else changed: the other key, the other tenant's same key.
    assert after[("tenant:a", "k2")] == before[("tenant:a", "k2")]
    assert after[("tenant:b", "k1")] == before[("tenant:b", "k1")]
    # The retry, with the same payload or another (its fingerprint is gone):
    # 410, never the view, never a replay, nothing stored.
    with caplog.at_level(logging.INFO, "flask_idempotency"):
        for body in ({"x": 1}, {"x": 2}):
            doc = assert_problem(tenant(client, "a", "k1", body), 410)
            assert doc["type"] == PROBLEM_TYPE_BASE + "key-erased"
    assert ledger_count(app) == 3
    assert by_key(app) == after
    outcomes = [
        getattr(r, "idempotency_outcome", None)
        for r in caplog.records
        if r.getMessage() == "idempotency request"
    ]
    assert outcomes == ["erased", "erased"]
    # The other tenant's k1 still replays.
    replay = tenant(client, "b", "k1")
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert ledger_count(app) == 3


def test_erase_by_scope_runs_in_bounded_batches_and_is_idempotent(
    app: Flask, client: t.Any
) -> None:
    keys = [f"k{n}" for n in range(7)]
    for key in keys:
        assert tenant(client, "a", key).status_code == 201
    assert tenant(client, "b", "k0").status_code == 201
    before = by_key(app)

    report = erase(app, "tenant:a", batch=3)

    # Seven records, three a batch: three batches that found some, one that
    # found none, then the outbox's.
    assert (report.erased, report.skipped) == (7, 0)
    assert report.batches >= 4
    after = by_key(app)
    for key in keys:
        assert_tombstone(after[("tenant:a", key)], before[("tenant:a", key)])
    assert after[("tenant:b", "k0")] == before[("tenant:b", "k0")]

    again = erase(app, "tenant:a", batch=3)
    assert (again.erased, again.skipped, again.events_erased) == (0, 0, 0)
    assert by_key(app) == after  # tombstones keep their expiry
    for key in keys:
        assert_problem(tenant(client, "a", key), 410)
    assert ledger_count(app) == 8


def test_a_record_under_a_live_lease_is_skipped_and_counted(app: Flask, clock: Clock) -> None:
    now = clock()
    running = put_record(app, clock, "s", "running", locked_until=now + dt.timedelta(seconds=30))
    put_record(app, clock, "s", "done", status=COMPLETED, response_code=201, response_body=b"{}")
    # Abandoned with finished steps and a kept request: erased with them.
    put_record(
        app,
        clock,
        "s",
        "abandoned",
        locked_until=now - dt.timedelta(seconds=5),
        recovery_points='{"charge":"ch_1"}',
        request_method="POST",
        request_path="/checkout",
        request_body=b'{"card":"4242"}',
    )

    report = erase(app, "s")

    assert (report.erased, report.skipped, report.complete) == (2, 1, False)
    rows = by_key(app)
    assert rows[("s", "running")]["status"] == IN_PROGRESS
    assert rows[("s", "running")]["fencing_token"] == running
    assert {rows[("s", k)]["status"] for k in ("done", "abandoned")} == {ERASED}
    assert rows[("s", "abandoned")]["request_body"] is None
    # The lease ends: a later run erases it.
    clock.advance(seconds=31)
    assert (erase(app, "s").erased, erase(app, "s").erased) == (1, 0)
    # The recovery job leaves tombstones alone.
    assert recover_abandoned(app).completed + recover_abandoned(app).released == 0
    assert {row["status"] for row in record_rows(app)} == {ERASED}


def test_a_view_that_committed_stays_fenced_past_its_ttl(app: Flask, clock: Clock) -> None:
    """In progress with its answer stored (the view committed, then never
    finished) never expires: its tombstone is kept a retention from the erasure,
    or the next retry would find it expired and run the view again."""
    now = clock()
    put_record(
        app,
        clock,
        "s",
        "k",
        locked_until=now - dt.timedelta(seconds=5),
        response_code=500,
        created_at=now - 48 * HOUR,
        expires_at=now - 24 * HOUR,
    )
    assert erase(app, "s").erased == 1
    [row] = record_rows(app)
    assert row["status"] == ERASED
    assert row["expires_at"] == now + 24 * HOUR
    assert purge_expired(app).deleted == 0


def test_cleanup_removes_an_expired_tombstone_and_the_key_then_runs_anew(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    assert tenant(client, "a", "k1").status_code == 201
    assert erase(app, "tenant:a", "k1").erased == 1
    assert purge_expired(app).deleted == 0  # not expired yet
    [row] = record_rows(app)
    clock.now = row["expires_at"] + dt.timedelta(seconds=1)

    assert purge_expired(app).deleted == 1
    assert record_rows(app) == []
    assert tenant(client, "a", "k1").status_code == 201
    assert ledger_count(app) == 2
    assert [row["status"] for row in record_rows(app)] == [COMPLETED]


def test_an_expired_tombstone_not_yet_purged_is_replaced(
    app: Flask, client: t.Any, clock: Clock
) -> None:
    assert tenant(client, "a", "k1").status_code == 201
    erase(app, "tenant:a")
    clock.advance(hours=25)
    assert tenant(client, "a", "k1").status_code == 201
    assert ledger_count(app) == 2


def test_an_optimistic_route_answers_410_and_its_writes_roll_back(
    app: Flask, client: t.Any
) -> None:
    assert post(client, "/optimistic", CHARGE).status_code == 201
    [row] = record_rows(app)
    assert erase(app, row["scope"], "k1").erased == 1
    assert_problem(post(client, "/optimistic", CHARGE), 410)
    assert_problem(post(client, "/optimistic", {**CHARGE, "amount": 1}), 410)
    assert ledger_count(app, "optimistic") == 1


def test_a_leased_route_answers_410_without_running(app: Flask, client: t.Any) -> None:
    assert post(client, "/leased/201", {}).status_code == 201
    [row] = record_rows(app)
    assert erase(app, row["scope"]).erased == 1
    assert_problem(post(client, "/leased/201", {}), 410)
    assert ledger_count(app, "leased") == 1


def test_bad_arguments_are_refused_before_anything_is_erased(app: Flask, client: t.Any) -> None:
    assert tenant(client, "a", "k1").status_code == 201
    for scope, key, batch in (("", None, None), ("tenant:a", "", None), ("tenant:a", None, 0)):
        with pytest.raises(ValueError, match="must be"):
            erase(app, scope, key, batch=batch)
    assert [row["status"] for row in record_rows(app)] == [COMPLETED]


@pytest.mark.parametrize("route", ["tenant", "leased"])
def test_concurrent_traffic_while_erasing_never_loses_a_completion(app: Flask, route: str) -> None:
    """Requests with new keys in the scope race repeated erasures of it (on a
    leased route their claims commit first, under a live lease, while the view
    runs). A request answered 201 committed its ledger row; a tombstone is only
    ever left where the operation happened (an erasure never cuts off a running
    one); and once erased, a retry gets 410 and the view never runs again."""
    path, ledger_route = "/tenant", "tenant"
    if route == "leased":
        path = ledger_route = "/erase-race"

        @app.post(path)
        @testapp.idem.idempotent(lease=dt.timedelta(seconds=60), ttl=testapp.LEASED_TTL)
        def leased_view() -> tuple[dict[str, t.Any], int]:
            row = testapp.write_ledger(ledger_route)
            time.sleep(0.05)  # the claim is committed, the view runs: a live lease
            return {"id": row.id}, 201

    def send(key: str) -> tuple[str, int]:
        headers = {"X-Tenant": "c"}
        return key, post(app.test_client(), path, {"x": 1}, key=key, headers=headers).status_code

    assert send("first")[1] == 201  # the scope, as the route builds it
    [scope] = {row["scope"] for row in record_rows(app)}
    keys = [f"c{n}" for n in range(24)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        sent = [pool.submit(send, key) for key in keys]
        while not all(future.done() for future in sent):  # erasing all along
            erase(app, scope, batch=2)
        answers = dict(future.result() for future in sent)
    erase(app, scope, batch=2)  # nothing runs now
    rows = {key: row for (_, key), row in by_key(app).items()}
    with app.app_context(), testapp.db.engine.connect() as conn:
        ledger = dict(
            conn.execute(
                testapp.db.select(testapp.Ledger.key, testapp.db.func.count())
                .where(testapp.Ledger.route == ledger_route)
                .group_by(testapp.Ledger.key)
            ).all()
        )
    for key, code in answers.items():
        if code == 201:
            assert ledger.get(key) == 1, key  # the completion stands
            assert rows[key]["status"] == ERASED, key
        else:  # a busy database's 409 (SQLite's one lock): nothing committed
            assert code in (409, 503), (key, code)
            assert key not in ledger, key
    for key, row in rows.items():
        if row["status"] == ERASED:
            assert ledger.get(key) == 1, key  # erased only where it happened
    for key, code in answers.items():
        if code == 201:
            answer = post(app.test_client(), path, {"x": 1}, key=key, headers={"X-Tenant": "c"})
            assert_problem(answer, 410)
    assert sum(ledger.values()) == ledger_count(app, ledger_route)


def test_a_form_sent_again_after_erasure_gets_a_page_for_a_visitor(
    database_url: str, clock: Clock
) -> None:
    from tests.support import formapp
    from tests.unit.request.test_form_keys import BROWSER_ACCEPT, fields, records, rendered_key

    shop = formapp.create_app(database_url, clock)
    try:
        browser = shop.test_client()
        key = rendered_key(browser.get("/checkout").text)
        assert browser.post("/checkout", data=fields(key)).status_code == 303
        [(scope, stored_key)] = records(shop)
        with shop.app_context():
            idem = shop.extensions["form_test"]["idem"]
            assert idem.erase(scope, stored_key).erased == 1
        again = browser.post("/checkout", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
        assert again.status_code == 410
        assert again.mimetype == "text/html"
        assert "erased" in again.text
        assert "reload the page to start anew" in again.text
        assert formapp.order_count(shop) == 1
    finally:
        with shop.app_context():
            shop.extensions["form_test"]["db"].engine.dispose()


def test_a_manual_route_answers_410_without_calling_its_view(
    database_url: str, clock: Clock
) -> None:
    from tests.unit.request.test_options import call, options_app

    app = options_app(database_url, clock)
    try:
        client = app.test_client()
        assert call(client, "POST", "/manual").status_code == 201
        [row] = record_rows(app)
        assert erase(app, row["scope"], "K").erased == 1
        for want in ("replay", "own"):
            assert_problem(call(client, "POST", "/manual", **{"X-Want": want}), 410)
        assert ledger_count(app, "manual") == 1
        assert ledger_count(app, "manual-retry") == 0
    finally:
        with app.app_context():
            testapp.db.engine.dispose()


def test_an_expired_form_key_meets_the_tombstone_too(database_url: str, clock: Clock) -> None:
    """A form past its max age only replays or resumes; after erasure it gets
    the visitor's page too, never a new order."""
    from tests.support import formapp
    from tests.unit.request.test_form_keys import BROWSER_ACCEPT, fields, records, rendered_key

    shop = formapp.create_app(database_url, clock, IDEMPOTENCY_FORM_KEY_MAX_AGE=300)
    try:
        browser = shop.test_client()
        key = rendered_key(browser.get("/checkout").text)
        assert browser.post("/checkout", data=fields(key)).status_code == 303
        [(scope, stored_key)] = records(shop)
        with shop.app_context():
            assert shop.extensions["form_test"]["idem"].erase(scope, stored_key).erased == 1
        clock.advance(seconds=3600)
        again = browser.post("/checkout", data=fields(key), headers={"Accept": BROWSER_ACCEPT})
        assert (again.status_code, again.mimetype) == (410, "text/html")
        assert formapp.order_count(shop) == 1
    finally:
        with shop.app_context():
            shop.extensions["form_test"]["db"].engine.dispose()


def test_settle_erases_what_a_request_running_at_the_start_stored(app: Flask) -> None:
    """A request of the scope already running on a default route when the
    erasure starts: its claim is not committed, so the first pass cannot see
    it (on the server engines); the second pass (``settle=``) erases the
    record it then committed, and the report says so."""
    entered, go = threading.Event(), threading.Event()

    @app.post("/erase-inflight")
    @testapp.idem.idempotent
    def inflight_view() -> tuple[dict[str, t.Any], int]:
        testapp.write_ledger("inflight")
        entered.set()
        go.wait(10)
        return {"card": "4111-PERSONAL"}, 201

    go.set()
    assert post(app.test_client(), "/erase-inflight", {"x": 1}, key="first").status_code == 201
    [scope] = {row["scope"] for row in record_rows(app)}
    entered.clear()
    go.clear()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(post, app.test_client(), "/erase-inflight", {"x": 1}, key="p1")
        assert entered.wait(10)
        threading.Timer(0.3, go.set).start()
        report = erase(app, scope, settle=dt.timedelta(seconds=2))
        assert running.result().status_code == 201
    assert ledger_count(app, "inflight") == 2
    for row in record_rows(app):
        assert row["status"] == ERASED, row["key"]
        assert row["response_body"] is None, row["key"]
    assert (report.erased, report.matched, report.complete) == (2, 2, True)
    # SQLite's one write lock made the first pass wait for the request instead.
    with app.app_context():
        sqlite = testapp.db.engine.dialect.name == "sqlite"
    assert report.settled == (0 if sqlite else 1)
    with pytest.raises(ValueError, match="settle"):
        erase(app, scope, settle=-1)


def test_the_report_counts_tombstones_and_says_when_nothing_matched(
    app: Flask, client: t.Any, caplog: pytest.LogCaptureFixture
) -> None:
    assert tenant(client, "a", "k1").status_code == 201
    assert erase(app, "tenant:a").matched == 1
    again = erase(app, "tenant:a")
    assert (again.erased, again.already_erased, again.matched) == (0, 1, 1)
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        typo = erase(app, "tenant:a ")
    assert (typo.erased, typo.already_erased, typo.matched) == (0, 0, 0)
    assert "no record of scope 'tenant:a '" in caplog.text


def test_sqlite_overwrites_what_it_erases_and_gives_the_connection_back_as_it_was(
    app: Flask, client: t.Any
) -> None:
    """SQLite's upstream default leaves freed cells in the file as they were
    (``secure_delete`` off): the erasure turns it on for its own batches, puts
    the pooled connection's value back, and checkpoints a WAL. No erased body
    stays in the database's files but the copies SQLite's reorganisations left
    before the erasure (documented: VACUUM removes them)."""
    with app.app_context():
        engine = testapp.db.engine
    if engine.dialect.name != "sqlite":
        pytest.skip("SQLite's secure_delete")

    @app.post("/erase-echo")
    @testapp.idem.idempotent(scope=testapp.tenant_scope)
    def echo() -> tuple[t.Any, int]:
        return flask.request.get_json(), 201

    sa.event.listen(engine, "connect", lambda raw, _: raw.execute("PRAGMA secure_delete=0"))
    engine.dispose()
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    secret = "MARKER-" + "s" * 300
    for n in range(5):
        sent = post(client, "/erase-echo", {"card": secret}, key=f"k{n}", headers={"X-Tenant": "a"})
        assert sent.status_code == 201
        assert tenant(client, "a", f"r{n}").status_code == 201
    assert sum(row["response_body"] is not None for row in record_rows(app)) == 10
    path = Path(str(engine.url.database))

    def markers() -> int:
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*")).count(b"MARKER-")

    # Copies SQLite left in free space when it reorganised pages before the
    # erasure (secure_delete off) stay until VACUUM, as docs/erasure.md says;
    # how many there are depends on the rows' sizes. Counted on a copy of the
    # files, its log checkpointed (the live log is the erasure's to empty).
    copy = path.parent / "copy"
    copy.mkdir()
    for part in path.parent.glob(path.name + "*"):
        shutil.copyfile(part, copy / part.name)
    with contextlib.closing(sqlite3.connect(copy / path.name)) as raw:
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    copied = b"".join(p.read_bytes() for p in copy.glob(path.name + "*"))
    left_by_reorganising = copied.count(b"MARKER-") - 5
    shutil.rmtree(copy)
    erase(app, "tenant:a")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA secure_delete").scalar() == 0
    engine.dispose()
    assert markers() == left_by_reorganising
