"""The observable gauges: what the database holds, read at most once per
IDEMPOTENCY_METRICS_INTERVAL per process whatever the collections, and a
database that fails makes them report nothing, never an error."""

from __future__ import annotations

import datetime as dt
import gc
import logging
import types
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import IN_PROGRESS
from flask_idempotency._messaging import inbox
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._storage import record_table, text_param
from flask_idempotency._telemetry import GAUGES, figures
from flask_idempotency.publishers import CallablePublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import reset
from tests.support.tcp_proxy import TcpProxy

from .conftest import Otel

GAUGE_NAMES = {gauge.name for gauge in GAUGES}


class FakeTime:
    """The figures' clock (time.monotonic), moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def ticks(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(figures, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


def make(url: str, clock: Clock, **config: t.Any) -> Flask:
    return outbox_app.create_app(url, clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=1, **config)


class Statements:
    """Counts the statements sent through ``app``'s engine."""

    def __init__(self, app: Flask) -> None:
        self.count = 0
        with app.app_context():
            self.engine = outbox_app.db.engine
        sa.event.listen(self.engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: t.Any) -> None:
        self.count += 1

    def close(self) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._seen)


def collected(otel: Otel) -> dict[str, list[tuple[float, dict[str, t.Any]]]]:
    """The gauges of one collection, as it answers."""
    found: dict[str, list[tuple[float, dict[str, t.Any]]]] = {}
    for point in otel.collect():
        if point.metric in GAUGE_NAMES:
            found.setdefault(point.metric, []).append((point.value, point.attributes))
    return found


def gauges(otel: Otel) -> dict[str, list[tuple[float, dict[str, t.Any]]]]:
    """The gauges once every read a collection started has ended. A healthy read
    slower than the ready timeout (a new connection on a busy machine: CI saw one
    past 2 s) gives nothing to its own collection and its figures to the next
    one, in the same interval: that one is what the tests compare."""
    found = collected(otel)
    slow = [
        reading
        for source in figures._sources
        if (reading := source._reading) is not None and reading.is_alive()
    ]
    if not slow:
        return found
    for reading in slow:
        reading.join(30)
        assert not reading.is_alive()
    return collected(otel)


def values(otel: Otel) -> dict[str, float]:
    return {name: found[0][0] for name, found in gauges(otel).items()}


def fill(app: Flask, clock: Clock) -> None:
    """Records live (completed, in progress, past its lease) and expired, outbox
    events pending and parked, inbox ids."""
    now = clock.now
    hour = dt.timedelta(hours=1)

    def record(
        key: str, status: str, locked_until: dt.datetime | None, expires: dt.datetime
    ) -> t.Any:
        return {
            "scope": "s",
            "key": key,
            "request_hash": "h",
            "status": status,
            "fencing_token": 1,
            "body_omitted": False,
            "locked_until": locked_until,
            "created_at": now - hour,
            "expires_at": expires,
        }

    with app.app_context():
        with outbox_app.db.engine.begin() as conn:
            table = record_table(outbox_app.db.metadata)
            insert = sa.insert(table).values(scope=text_param("scope"), key=text_param("key"))
            conn.execute(
                insert,
                [
                    record("done-1", "completed", None, now + hour),
                    record("done-2", "completed", None, now + hour),
                    record("running", IN_PROGRESS, now + hour, now + hour),
                    record("abandoned-1", IN_PROGRESS, now - hour, now + hour),
                    record("abandoned-2", IN_PROGRESS, now - hour, now + hour),
                    record("expired", "completed", None, now - hour),
                ],
            )
        for eid in ("parked", "old", "new"):
            add_event(outbox_app.db.session, "t", {"id": eid}, event_id=eid)
            outbox_app.db.session.commit()
    clock.advance(seconds=90)

    def refuse(event: OutboxEvent) -> None:
        raise ValueError("refused")

    assert relay_once(app, CallablePublisher(refuse), batch=1) == 0  # "parked": parked
    with app.app_context():
        for n in range(3):
            inbox.mark_processed(outbox_app.db.session, "billing", f"e{n}")
        outbox_app.db.session.commit()


def test_the_gauges_report_what_the_database_holds(
    otel: Otel, database_url: str, clock: Clock
) -> None:
    app = make(database_url, clock)
    reset(database_url)
    fill(app, clock)
    assert values(otel) == {
        "idempotency.records.live": 5,
        "idempotency.records.in_flight": 3,
        "idempotency.records.past_lease": 2,
        "idempotency.outbox.unpublished": 2,
        "idempotency.outbox.parked": 1,
        "idempotency.outbox.oldest_age": 90.0,
        "idempotency.inbox.rows": 3,
    }
    # No attribute: one database.
    assert all(attributes == {} for found in gauges(otel).values() for _, attributes in found)


def test_the_database_is_read_at_most_once_per_interval(
    otel: Otel, database_url: str, clock: Clock, ticks: FakeTime
) -> None:
    app = make(database_url, clock, IDEMPOTENCY_METRICS_INTERVAL=30)
    reset(database_url)
    statements = Statements(app)
    try:
        assert values(otel)["idempotency.records.live"] == 0
        first = statements.count
        assert first > 0
        fill(app, clock)
        statements.count = 0
        for _ in range(5):  # collections within the interval: the snapshot, no query
            assert values(otel)["idempotency.records.live"] == 0
            ticks.now += 5
        assert statements.count == 0
        ticks.now += 5  # 30 s since the read
        assert values(otel)["idempotency.records.live"] == 5
        assert statements.count == first
        assert values(otel)["idempotency.records.live"] == 5
        assert statements.count == first
    finally:
        statements.close()


def test_a_forked_process_reads_its_own_figures(
    otel: Otel, database_url: str, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make(database_url, clock)
    reset(database_url)
    assert values(otel)["idempotency.records.live"] == 0
    fill(app, clock)
    assert values(otel)["idempotency.records.live"] == 0  # the parent's snapshot
    monkeypatch.setattr(figures, "os", types.SimpleNamespace(getpid=lambda: -1))
    assert values(otel)["idempotency.records.live"] == 5  # a child's first read


def test_apps_on_one_database_share_one_read(otel: Otel, database_url: str, clock: Clock) -> None:
    first = make(database_url, clock)
    reset(database_url)
    second = make(database_url, clock)
    statements = Statements(first)
    try:
        found = gauges(otel)
        assert found["idempotency.records.live"] == [(0, {})]
    finally:
        statements.close()
    assert statements.count > 0
    del second


def test_apps_on_two_databases_are_told_apart_by_db_namespace(
    otel: Otel, pg_url: str, clock: Clock, tmp_path: t.Any
) -> None:
    on_pg = make(pg_url, clock)
    reset(pg_url)
    lite = f"sqlite:///{tmp_path / 'other.sqlite3'}"
    on_sqlite = make(lite, clock)
    reset(lite)
    fill(on_sqlite, clock)
    found = sorted(
        (attributes["db.namespace"].rsplit("/", 1)[-1], value)
        for value, attributes in gauges(otel)["idempotency.records.live"]
    )
    assert found == [("other.sqlite3", 5), (sa.make_url(pg_url).database, 0)]
    del on_pg


def test_a_database_outage_reports_nothing_and_is_logged_once(
    otel: Otel,
    pg_url: str,
    proxy: TcpProxy,
    clock: Clock,
    ticks: FakeTime,
    caplog: pytest.LogCaptureFixture,
) -> None:
    app = make(proxy.url(pg_url), clock)
    reset(pg_url)
    assert values(otel)["idempotency.records.live"] == 0
    proxy.cut()
    caplog.clear()  # what a slow first read logged (it answered since)
    with caplog.at_level(logging.DEBUG, logger="flask_idempotency"):
        for _ in range(3):
            ticks.now += 31
            points = otel.collect()  # never raises
            assert not [p for p in points if p.metric in GAUGE_NAMES]
        proxy.heal()
        ticks.now += 31
        assert values(otel)["idempotency.records.live"] == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "metrics" in r.msg]
    assert len(warnings) == 1
    assert "works again" in caplog.records[-1].getMessage()
    with app.app_context():
        outbox_app.db.engine.dispose()


def test_a_missing_table_reports_nothing_on_every_engine(
    otel: Otel, database_url: str, clock: Clock
) -> None:
    app = make(database_url, clock)
    reset(database_url)
    with app.app_context(), outbox_app.db.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE idempotency_keys"))
    assert gauges(otel) == {}


def test_apps_that_are_gone_are_forgotten(otel: Otel, tmp_path: t.Any, clock: Clock) -> None:
    for n in range(3):
        url = f"sqlite:///{tmp_path / f'gone-{n}.sqlite3'}"
        app = make(url, clock)
        with app.app_context():
            outbox_app.db.engine.dispose()
        del app
        gc.collect()
    assert len(figures._sources) == 1  # the last one's, until the next app comes
    assert gauges(otel) == {}  # its app is gone too: nothing to read, nothing reported
    assert figures._sources == []


def test_a_database_that_hangs_holds_no_collection_longer_than_the_ready_timeout(
    otel: Otel, pg_url: str, proxy: TcpProxy, clock: Clock, ticks: FakeTime
) -> None:
    """Blackholed: each collection waits at most IDEMPOTENCY_READY_TIMEOUT for the
    read, reports nothing, and starts no second read while the first hangs; the
    held read finishes once the database answers again."""
    app = make(proxy.url(pg_url), clock, IDEMPOTENCY_READY_TIMEOUT=0.2)
    reset(pg_url)
    [source] = figures._sources
    assert values(otel)["idempotency.records.live"] == 0
    proxy.blackhole()
    try:
        ticks.now += 31
        assert collected(otel) == {}
        hung = source._reading
        assert hung is not None
        assert hung.is_alive()
        ticks.now += 31
        assert collected(otel) == {}
        assert source._reading is hung  # no second read beside it
    finally:
        proxy.heal()
    hung.join(30)
    assert not hung.is_alive()
    ticks.now += 31
    assert values(otel)["idempotency.records.live"] == 0  # it answers again
    with app.app_context():
        outbox_app.db.engine.dispose()


@pytest.mark.parametrize("bad", [0, -1, "30s", None])
def test_the_interval_is_checked_at_init_app(bad: t.Any, tmp_path: t.Any, clock: Clock) -> None:
    with pytest.raises((ValueError, TypeError), match="IDEMPOTENCY_METRICS_INTERVAL"):
        make(f"sqlite:///{tmp_path / 'x.sqlite3'}", clock, IDEMPOTENCY_METRICS_INTERVAL=bad)
