"""The outbox and inbox for an operator: the cleanup window of published events
and ``flask idempotency stats``, on every engine."""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._messaging import inbox
from flask_idempotency._messaging.outbox import OutboxEvent, add_event
from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._storage.schema import outbox_table
from flask_idempotency.publishers import CallablePublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import fresh_app

HOUR = dt.timedelta(hours=1)


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(
        database_url,
        clock,
        IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=1,  # one failure parks
        IDEMPOTENCY_OUTBOX_RETENTION=HOUR,
    ) as app:
        yield app


def add(app: Flask, *event_ids: str) -> None:
    with app.app_context():
        for eid in event_ids:
            add_event(outbox_app.db.session, "t", {"id": eid}, event_id=eid)
        outbox_app.db.session.commit()


def refusing(*bad: str) -> CallablePublisher:
    """Publishes everything but the ids in ``bad``, which fail (and park)."""

    def publish(event: OutboxEvent) -> None:
        if event.event_id in bad:
            raise ValueError(f"rejected {event.event_id}")

    return CallablePublisher(publish)


def left(app: Flask) -> list[str]:
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
        with outbox_app.db.engine.connect() as conn:
            ids = conn.execute(sa.select(table.c.event_id).order_by(table.c.id)).scalars()
            return [i.decode() if isinstance(i, bytes) else i for i in ids]


def test_cleanup_purges_published_events_after_the_retention(app: Flask, clock: Clock) -> None:
    """purge_expired (the scheduler's purge job) deletes published events older
    than IDEMPOTENCY_OUTBOX_RETENTION, in batches; never pending or parked ones."""
    add(app, "old-1", "old-2", "old-3", "parked")
    assert relay_once(app, refusing("parked")) == 3  # "parked" fails once: parked
    clock.advance(minutes=50)
    add(app, "recent")
    assert relay_once(app, refusing()) == 1
    add(app, "pending")  # never relayed
    clock.advance(minutes=11)  # old-*: published 61 min ago; recent: 11 min ago

    dry = purge_expired(app, dry_run=True)
    assert dry.outbox_deleted == 3
    assert len(left(app)) == 6

    report = purge_expired(app, batch_size=2)
    assert (report.outbox_deleted, report.outbox_batches) == (3, 2)
    assert "3 published outbox event(s)" in str(report)
    assert left(app) == ["parked", "recent", "pending"]

    clock.advance(days=30)  # long after: parked and pending events still stay
    assert purge_expired(app).outbox_deleted == 1
    assert left(app) == ["parked", "pending"]


def test_the_scheduler_purge_job_purges_the_outbox(app: Flask, clock: Clock) -> None:
    from flask_idempotency._maintenance.scheduler import JobScheduler

    add(app, "a", "b")
    assert relay_once(app, refusing()) == 2
    clock.advance(hours=2)
    jobs = JobScheduler(app)
    job = jobs._scheduler.get_job("purge")
    assert job is not None
    assert jobs.run_job("purge", job.args[1])
    assert left(app) == []


def test_outbox_purge_command_defaults_to_the_retention(app: Flask, clock: Clock) -> None:
    add(app, "a")
    relay_once(app, refusing())
    clock.advance(minutes=30)
    runner = app.test_cli_runner()
    assert "deleted 0 published" in runner.invoke(args=["idempotency", "outbox-purge"]).output
    clock.advance(minutes=31)
    assert "deleted 1 published" in runner.invoke(args=["idempotency", "outbox-purge"]).output


def test_the_retention_setting(database_url: str) -> None:
    app = outbox_app.create_app(database_url)
    with app.app_context():
        from flask_idempotency._context import app_state

        assert app_state(app).settings.outbox_retention == dt.timedelta(days=7)
    for bad in (0, -5):
        with pytest.raises(ValueError, match="IDEMPOTENCY_OUTBOX_RETENTION"):
            outbox_app.create_app(database_url, IDEMPOTENCY_OUTBOX_RETENTION=bad)


def test_cleanup_without_an_outbox_table_leaves_it_alone(app: Flask, database_url: str) -> None:
    """An app that upgraded without migrating: cleanup and stats still work."""
    engine = sa.create_engine(database_url)
    try:
        with app.app_context():
            outbox_table(outbox_app.db.metadata).drop(engine)
    finally:
        engine.dispose()
    report = purge_expired(app)
    assert (report.outbox_deleted, report.outbox_batches) == (0, 0)
    numbers = json.loads(app.test_cli_runner().invoke(args=["idempotency", "stats"]).output)
    assert "outbox_pending" not in numbers
    assert numbers["inbox_processed"] == 0


def test_stats_shows_the_outbox_and_the_inbox(app: Flask, clock: Clock) -> None:
    add(app, "published", "parked")
    relay_once(app, refusing("parked"))
    clock.advance(minutes=1)
    add(app, "first-pending")
    clock.advance(minutes=1)
    add(app, "retrying")
    # A second app on the same tables, allowing three attempts: these two back
    # off instead of parking.
    retry_app = outbox_app.create_app(
        str(app.config["SQLALCHEMY_DATABASE_URI"]), clock=clock, IDEMPOTENCY_OUTBOX_MAX_ATTEMPTS=3
    )
    try:
        calls: list[str] = []

        def fail_retrying(event: OutboxEvent) -> None:
            calls.append(event.event_id)
            if event.event_id == "retrying":
                raise ConnectionError("broker down")
            raise ConnectionError("not now")  # first-pending fails too, once

        relay_once(retry_app, CallablePublisher(fail_retrying))
    finally:
        with retry_app.app_context():
            outbox_app.db.engine.dispose()
    assert calls == ["first-pending", "retrying"]
    clock.advance(seconds=30)

    with app.app_context():
        session = outbox_app.db.session
        for consumer, event_id in [("billing", "e1"), ("billing", "e2"), ("audit", "e1")]:
            with inbox.process(session, consumer=consumer, event_id=event_id, commit=True):
                pass
        with inbox.process(session, consumer="audit", event_id="old", ttl=10, commit=True):
            pass
    clock.advance(seconds=11)

    numbers = json.loads(app.test_cli_runner().invoke(args=["idempotency", "stats"]).output)
    assert numbers["outbox_pending"] == 2
    assert numbers["outbox_retrying"] == 2
    assert numbers["outbox_parked"] == 1
    assert numbers["outbox_published"] == 1
    # first-pending was written 1 min + 30 s + 11 s ago
    assert numbers["outbox_oldest_age_s"] == pytest.approx(101, abs=0.5)
    assert numbers["inbox_processed"] == 4
    assert numbers["inbox_by_consumer"] == {"audit": 2, "billing": 2}
    assert numbers["inbox_expired"] == 1
    assert "by_status" in numbers  # the records' figures are still there
