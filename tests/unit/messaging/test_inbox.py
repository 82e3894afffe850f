"""The inbox: each event processed once per consumer, on every engine, under
redelivery, failure, concurrency and expiry."""

from __future__ import annotations

import datetime as dt
import random
import threading
import time
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency import inbox, models, signals
from flask_idempotency._maintenance.jobs import purge_expired
from flask_idempotency._messaging import inbox as inbox_impl
from flask_idempotency._storage.schema import as_utc
from tests.conftest import Clock
from tests.support import testapp

Ledger = testapp.Ledger
db = testapp.db


class Boom(Exception):
    pass


def deliver(
    app: Flask, event_id: str, *, consumer: str = "billing", fail: bool = False, hold: float = 0
) -> bool:
    """One delivery: the work is a ledger row keyed by the event; ``True`` if it ran."""
    with app.app_context():
        with inbox.process(db.session, consumer=consumer, event_id=event_id, commit=True) as fresh:
            if fresh:
                db.session.add(Ledger(route=consumer, key=event_id))
                db.session.flush()
                if hold:
                    time.sleep(hold)
                if fail:
                    raise Boom(event_id)
        return fresh


def work(app: Flask, consumer: str | None = None) -> list[tuple[str, str]]:
    with app.app_context():
        rows = db.session.execute(sa.select(Ledger.route, Ledger.key)).all()
        return sorted((r, k) for r, k in rows if consumer is None or r == consumer)


def inbox_ids(app: Flask) -> set[tuple[str, str]]:
    with app.app_context():
        table = db.metadata.tables[models.INBOX_TABLE_NAME]
        rows = db.session.execute(sa.select(table.c.consumer, table.c.event_id)).all()

    def text(v: t.Any) -> str:
        return bytes(v).decode() if isinstance(v, (bytes, bytearray, memoryview)) else v

    return {(text(c), text(e)) for c, e in rows}


def test_redelivered_event_is_skipped(app: Flask) -> None:
    assert deliver(app, "evt-1") is True
    assert deliver(app, "evt-1") is False
    assert deliver(app, "evt-1") is False
    assert work(app) == [("billing", "evt-1")]
    assert inbox_ids(app) == {("billing", "evt-1")}


def test_ids_compare_exactly(app: Flask) -> None:
    # MySQL's default collations would fold case and trailing spaces.
    for eid in ("Evt", "evt", "evt "):
        assert deliver(app, eid) is True
    assert len(work(app)) == 3


def test_failure_rolls_back_work_and_id_and_redelivery_does_the_work(app: Flask) -> None:
    with pytest.raises(Boom):
        deliver(app, "evt-1", fail=True)
    assert work(app) == []
    assert inbox_ids(app) == set()
    assert deliver(app, "evt-1") is True
    assert deliver(app, "evt-1") is False
    assert work(app) == [("billing", "evt-1")]


def test_without_commit_the_caller_commits(app: Flask) -> None:
    with app.app_context():
        with inbox.process(db.session, consumer="billing", event_id="e") as fresh:
            assert fresh
            db.session.add(Ledger(route="billing", key="e"))
        db.session.rollback()  # never committed: never processed
    assert work(app) == []
    with app.app_context():
        with inbox.process(db.session, consumer="billing", event_id="e") as fresh:
            assert fresh
            db.session.add(Ledger(route="billing", key="e"))
        db.session.commit()
    assert deliver(app, "e") is False
    assert work(app) == [("billing", "e")]


def test_two_consumers_each_process_the_event_once(app: Flask) -> None:
    for _ in range(2):
        deliver(app, "evt-1", consumer="billing")
        deliver(app, "evt-1", consumer="shipping")
    assert work(app) == [("billing", "evt-1"), ("shipping", "evt-1")]


def test_concurrent_deliveries_do_the_work_once(app: Flask) -> None:
    n = 8
    barrier = threading.Barrier(n)
    results: list[bool] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            barrier.wait()
            results.append(deliver(app, "evt-c", hold=0.2))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(results) == [False] * (n - 1) + [True]
    assert work(app) == [("billing", "evt-c")]


def test_waiting_deliveries_do_the_work_once_when_the_first_rolls_back(app: Flask) -> None:
    # On MySQL/MariaDB the waiters deadlock each other once the first rolls back:
    # the victims run their insert again (nothing else was in their transaction).
    first_inserted = threading.Event()
    outcome: list[t.Any] = []
    errors: list[BaseException] = []

    def first() -> None:
        with app.app_context():
            try:
                with inbox.process(db.session, consumer="billing", event_id="e", commit=True):
                    db.session.add(Ledger(route="billing", key="e"))
                    db.session.flush()
                    first_inserted.set()
                    time.sleep(0.5)  # the other deliveries wait on our row meanwhile
                    raise Boom()
            except Boom:
                outcome.append("rolled back")

    def waiter() -> None:
        first_inserted.wait()
        try:
            outcome.append(deliver(app, "e", hold=0.1))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first)] + [threading.Thread(target=waiter) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(outcome, key=str) == [False, False, False, True, "rolled back"]
    assert work(app) == [("billing", "e")]


def test_decorated_consumer(app: Flask) -> None:
    calls: list[dict[str, t.Any]] = []
    skipped: list[dict[str, t.Any]] = []

    @inbox.consumer("billing", session=lambda: db.session, event_id=lambda msg: msg["id"])
    def bill(msg: dict[str, t.Any]) -> str:
        calls.append(msg)
        db.session.add(Ledger(route="billing", key=msg["id"], amount=msg["amount"]))
        return "billed"

    @inbox.consumer("billing", session=db.session, event_id=lambda msg: msg["id"])
    def bill_failing(msg: dict[str, t.Any]) -> str:
        db.session.add(Ledger(route="billing", key=msg["id"]))
        raise Boom()

    def on_skip(sender: t.Any, **kw: t.Any) -> None:
        skipped.append({"sender": sender, **kw})

    with signals.event_skipped_duplicate.connected_to(on_skip), app.app_context():
        with pytest.raises(Boom):
            bill_failing({"id": "e1", "amount": 5})
        assert bill({"id": "e1", "amount": 5}) == "billed"
        assert bill({"id": "e1", "amount": 5}) is None
        assert bill({"id": "e2", "amount": 7}) == "billed"
    assert [m["id"] for m in calls] == ["e1", "e2"]
    assert work(app) == [("billing", "e1"), ("billing", "e2")]
    assert skipped == [{"sender": app, "consumer": "billing", "event_id": "e1"}]


def test_processed_ids_expire_and_are_purged(app: Flask, clock: Clock) -> None:
    for i in range(5):
        deliver(app, f"old{i}")
    clock.advance(days=6)
    deliver(app, "young")
    clock.advance(days=1, seconds=1)  # the old ones are past the default 7 days
    assert deliver(app, "young") is False
    # An expired id counts as new even before cleanup: the redelivery does the work.
    assert deliver(app, "old0") is True
    assert deliver(app, "old0") is False
    assert purge_expired(app, dry_run=True).inbox_deleted == 4
    report = purge_expired(app, batch_size=3)
    assert (report.inbox_deleted, report.inbox_batches) == (4, 2)
    assert "4 expired inbox id(s)" in str(report)
    assert inbox_ids(app) == {("billing", "young"), ("billing", "old0")}
    assert len(work(app)) == 7


def test_inbox_ttl_setting_and_argument(make_app: t.Callable[..., Flask], clock: Clock) -> None:
    app = make_app(IDEMPOTENCY_INBOX_TTL=60)
    deliver(app, "e")
    clock.advance(seconds=61)
    assert deliver(app, "e") is True
    with app.app_context():
        start = clock()
        with inbox.process(db.session, consumer="c", event_id="x", ttl=dt.timedelta(hours=1)):
            pass
        db.session.commit()
        with inbox.process(
            db.session, consumer="c", event_id="x", now=start + dt.timedelta(minutes=59)
        ) as fresh:
            assert not fresh
        with inbox.process(
            db.session, consumer="c", event_id="x", now=start + dt.timedelta(minutes=61)
        ) as fresh:
            assert fresh
    with pytest.raises(ValueError, match="IDEMPOTENCY_INBOX_TTL"):
        make_app(IDEMPOTENCY_INBOX_TTL=0)


def test_outside_an_app_context_the_default_ttl_applies_and_is_logged(
    make_app: t.Callable[..., Flask], caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer thread without an app context cannot read IDEMPOTENCY_INBOX_TTL:
    the id is kept for the documented default, and a warning says so, once."""
    app = make_app(IDEMPOTENCY_INBOX_TTL=60)
    with app.app_context():
        engine = db.engine
    inbox_impl._DEFAULT_TTL_TOLD.clear()
    before = dt.datetime.now(dt.timezone.utc)
    with caplog.at_level("WARNING", logger="flask_idempotency"):
        for event_id in ("plain-1", "plain-2"):
            with (
                sa.orm.Session(engine) as session,
                inbox.process(session, consumer="plain", event_id=event_id, commit=True),
            ):
                pass
    told = [r for r in caplog.records if "IDEMPOTENCY_INBOX_TTL" in r.getMessage()]
    assert len(told) == 1
    with app.app_context():
        table = db.metadata.tables[models.INBOX_TABLE_NAME]
        expiries = db.session.execute(sa.select(table.c.expires_at)).scalars().all()
    assert len(expiries) == 2
    for expires in expiries:
        kept = as_utc(expires) - before
        assert abs(kept - dt.timedelta(days=7)) < dt.timedelta(minutes=1)


def test_many_events_delivered_twice_in_three_threads(database_url: str, app: Flask) -> None:
    if not database_url.startswith("postgresql"):
        pytest.skip("the volume run is for PostgreSQL")
    events = [f"evt-{i}" for i in range(2000)]
    deliveries = events * 2
    random.Random(9).shuffle(deliveries)
    chunks = [deliveries[i::3] for i in range(3)]
    ran: list[int] = [0, 0, 0]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            with app.app_context():
                for eid in chunks[i]:
                    with inbox.process(
                        db.session, consumer="bulk", event_id=eid, commit=True
                    ) as fresh:
                        if fresh:
                            db.session.add(Ledger(route="bulk", key=eid))
                            ran[i] += 1
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sum(ran) == 2000
    rows = work(app, "bulk")
    assert len(rows) == 2000
    assert {k for _, k in rows} == set(events)


def test_ids_hold_255_characters_of_any_script_and_longer_ones_are_refused(app: Flask) -> None:
    """255 characters are kept exactly on every engine (4-byte characters too, on
    MySQL/MariaDB's byte columns); a longer id is a ``ValueError`` before the
    insert, the same on every engine, and nothing is stored."""
    longest = "€𝄞" * 127 + "x"  # 255 characters, 3- and 4-byte ones
    for _ in range(2):
        with app.app_context():
            with inbox.process(db.session, consumer="c" * 255, event_id=longest) as fresh:
                pass
            db.session.commit()
        assert fresh is (_ == 0)
    with app.app_context(), pytest.raises(ValueError, match="at most 255"):
        inbox.mark_processed(db.session, "billing", longest + "y")
    assert inbox_ids(app) == {("c" * 255, longest)}


@pytest.mark.parametrize("purged_after", ["INSERT", "SELECT"])
def test_an_expired_id_purged_midway_is_processed_again(
    database_url: str, app: Flask, clock: Clock, purged_after: str
) -> None:
    """A redelivery meets the expired row of its id, and cleanup deletes that
    row right after the delivery's insert (or its read of the row): the row
    being gone means "not processed", so the delivery inserts the id again and
    does the work. (It used to read no row and skip the delivery as processed
    "just now": the work never ran and no id was kept.)"""
    if not database_url.startswith("postgresql"):
        # MySQL/MariaDB keep a shared lock on the duplicate row, and SQLite has
        # one writer: cleanup waits for the delivery's transaction there.
        pytest.skip("only PostgreSQL lets cleanup delete the row mid-delivery")
    assert deliver(app, "evt-1") is True
    clock.advance(days=8)  # past the 7-day default: expired, awaiting cleanup
    purged: list[int] = []

    def purge_midway(conn: t.Any, cursor: t.Any, statement: str, *args: t.Any) -> None:
        words = statement.split(None, 3)
        if not purged and purged_after in words[0] and "idempotency_inbox" in statement:
            if purged_after == "SELECT" and "expires_at" not in words[1]:
                return
            purged.append(purge_expired(app).inbox_deleted)

    with app.app_context():
        engine = db.engine
    sa.event.listen(engine, "after_cursor_execute", purge_midway)
    try:
        assert deliver(app, "evt-1") is True
    finally:
        sa.event.remove(engine, "after_cursor_execute", purge_midway)
    assert purged == [1]
    assert work(app) == [("billing", "evt-1"), ("billing", "evt-1")]
    assert inbox_ids(app) == {("billing", "evt-1")}
    assert deliver(app, "evt-1") is False  # kept again, for a new window


def test_integer_event_ids_are_kept_in_decimal(app: Flask) -> None:
    """``event_id=lambda m: m["id"]`` with integer ids works: 7 is the id "7".
    Another type is a ``TypeError`` that says so. (An integer used to fail
    with "object of type 'int' has no len()".)"""
    calls: list[int] = []

    @inbox.consumer("billing", session=lambda: db.session, event_id=lambda msg: msg["id"])
    def bill(msg: dict[str, t.Any]) -> None:
        calls.append(msg["id"])

    with app.app_context():
        bill({"id": 7})
        bill({"id": 7})
        bill({"id": 8})
        assert inbox.mark_processed(db.session, "billing", "7") is False
        db.session.rollback()
        with pytest.raises(TypeError, match="string or an integer, got float"):
            bill({"id": 7.5})
        with pytest.raises(TypeError, match="got bool"):
            inbox.mark_processed(db.session, "billing", True)
    assert calls == [7, 8]
    assert inbox_ids(app) == {("billing", "7"), ("billing", "8")}
