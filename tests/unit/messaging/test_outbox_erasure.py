"""Erasure of the outbox events an operation emitted, on every engine: an
event emitted inside a protected request names its operation (owner columns);
erasing the operation empties a published or parked event (payload a fixed
placeholder, headers NULL), skips and counts a pending one (the relay must
publish it first), and never touches another operation's or an event emitted
outside one. An erased parked event is never un-parked nor published."""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._messaging.admin import retry_parked
from flask_idempotency._messaging.outbox import add_event
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._storage.schema import ERASED, ERASED_PAYLOAD, outbox_table
from flask_idempotency.publishers import ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import fresh_app, post, rows


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock) as app:
        yield app


def text(value: t.Any) -> t.Any:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def by_event(app: Flask) -> dict[str, dict[str, t.Any]]:
    return {text(row["event_id"]): row for row in rows(app)}


def test_an_operations_events_are_erased_published_ones_now_pending_ones_later(
    app: Flask,
) -> None:
    first = post(app, key="k1", twice=True).get_json()["events"]
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 2
    pending = post(app, key="k2").get_json()["events"]
    with app.app_context():  # outside any operation: no owner
        session = outbox_app.db.session
        add_event(session, "audit", {"who": "x"}, event_id="loose", headers={"a": "b"})
        outbox_app.db.session.commit()
    events = by_event(app)
    scope = text(events[first[0]]["owner_scope"])
    assert [text(events[e]["owner_key"]) for e in (*first, *pending)] == ["k1", "k1", "k2"]
    assert events["loose"]["owner_scope"] is None
    loose = events["loose"]

    with app.app_context():
        report = outbox_app.idem.erase(scope)

    assert (report.erased, report.skipped) == (2, 0)
    assert (report.events_erased, report.events_skipped, report.complete) == (1 + 1, 1, False)
    events = by_event(app)
    for event_id in first:
        assert text(events[event_id]["payload"]) == ERASED_PAYLOAD
        assert events[event_id]["headers"] is None
        assert events[event_id]["published_at"] is not None
    assert text(events[pending[0]]["payload"]) != ERASED_PAYLOAD
    assert events["loose"] == loose
    # Published by the relay (its payload intact, as the loose one's), the
    # pending one goes next run.
    later = ListPublisher()
    assert relay_once(app, later) == 2
    assert {e.event_id: e.payload for e in later.events}[pending[0]]["amount"] == 5
    with app.app_context():
        again = outbox_app.idem.erase(scope)
        assert (again.events_erased, again.events_skipped, again.erased) == (1, 0, 0)
        assert outbox_app.idem.erase(scope).events_erased == 0
    assert text(by_event(app)[pending[0]]["payload"]) == ERASED_PAYLOAD


def test_an_erased_parked_event_is_never_unparked_nor_published(app: Flask) -> None:
    [event_id] = post(app, key="k1").get_json()["events"]
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
        with outbox_app.db.engine.begin() as conn:
            conn.execute(sa.update(table).values(failed_at=sa.func.now(), attempts=9))
    scope = text(by_event(app)[event_id]["owner_scope"])
    with app.app_context():
        report = outbox_app.idem.erase(scope, "k1")
    assert (report.events_erased, report.events_skipped) == (1, 0)
    assert retry_parked(app) == 0
    publisher = ListPublisher()
    assert relay_once(app, publisher) == 0
    assert publisher.events == []
    [row] = rows(app)
    assert text(row["payload"]) == ERASED_PAYLOAD
    assert row["failed_at"] is not None


def test_a_retry_of_an_erased_operation_emits_nothing(app: Flask) -> None:
    post(app, key="k1")
    relay_once(app, ListPublisher())
    scope = text(rows(app)[0]["owner_scope"])
    with app.app_context():
        outbox_app.idem.erase(scope, "k1")
    answer = post(app, key="k1")
    assert answer.status_code == 410
    assert len(rows(app)) == 1
    with app.app_context(), outbox_app.db.engine.connect() as conn:
        table = outbox_app.db.metadata.tables["idempotency_keys"]
        assert [r.status for r in conn.execute(sa.select(table.c.status))] == [ERASED]


def test_an_outbox_from_before_erasure_works_without_its_owner_columns(
    app: Flask, database_url: str, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``idempotency_outbox`` created before erasure (no owner columns): an
    emit answers 201 and stores its event without an owner, the relay
    publishes it, one WARNING per engine and column names the ALTER TABLE to
    run, erasure erases the records and says it could not search the events,
    and ``create-tables`` exits 78 with the statements."""
    from flask_idempotency._storage.outbox import add_column_sql

    fresh = outbox_app.create_app(database_url, clock=clock)  # a process of its own
    with fresh.app_context():
        engine = outbox_app.db.engine
        table = outbox_table(outbox_app.db.metadata)
        alters = [add_column_sql(engine.dialect, table, c) for c in ("owner_scope", "owner_key")]
        with engine.begin() as conn:
            found = sa.Table(table.name, sa.MetaData(), autoload_with=conn)
            [index] = [i for i in found.indexes if i.name == "idempotency_outbox_owner"]
            index.drop(conn)
            for column in ("owner_scope", "owner_key"):
                conn.execute(sa.text(f"ALTER TABLE {table.name} DROP COLUMN {column}"))
        engine.dispose()
    try:
        with caplog.at_level("WARNING", "flask_idempotency"):
            assert post(fresh, key="k1").status_code == 201
            assert post(fresh, key="k2").status_code == 201
            assert relay_once(fresh, ListPublisher()) == 2
            with fresh.app_context():
                scope = (
                    outbox_app.db.session.execute(sa.text("SELECT scope FROM idempotency_keys"))
                    .scalars()
                    .first()
                )
                report = outbox_app.idem.erase(text(scope))
        assert (report.erased, report.events_erased) == (2, 0)
        warnings = [r.getMessage() for r in caplog.records if "owner" in r.getMessage()]
        assert len(warnings) == 3  # one per column, and the erasure's
        assert alters[0] in warnings[0]
        assert alters[1] in warnings[1]
        assert "its events were not erased" in warnings[2]
        result = fresh.test_cli_runner().invoke(args=["idempotency", "create-tables"])
        assert result.exit_code == 78
        assert all(alter in result.output for alter in alters)
    finally:
        with fresh.app_context():
            outbox_app.db.engine.dispose()
