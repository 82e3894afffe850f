"""The relay's take reads the rows of its batch, not the backlog: its statement,
as the relay sends it, is answered from the pending index in id order, with no
sort, on every engine. A backlog is when the relay has to be fast (after a
broker outage); a take that reads every pending row gets slower as it grows."""

from __future__ import annotations

import datetime as dt
import json
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._messaging.relay import relay_once
from flask_idempotency._storage import outbox_table, text_param
from flask_idempotency._storage.leases import Leases
from flask_idempotency.publishers import ListPublisher
from tests.conftest import Clock
from tests.support import outbox_app
from tests.support.outbox import fresh_app

PENDING = 1500
PUBLISHED = 500
BATCH = 10


@pytest.fixture
def app(database_url: str, clock: Clock) -> t.Iterator[Flask]:
    with fresh_app(database_url, clock) as app:
        yield app


def seed(app: Flask, clock: Clock) -> None:
    """Published events first (the lowest ids, as after a while), then a backlog."""
    with app.app_context(), outbox_app.db.engine.begin() as conn:
        table = outbox_table(outbox_app.db.metadata)
        insert = sa.insert(table).values(event_id=text_param("event_id"))
        published = clock.now - dt.timedelta(minutes=1)
        conn.execute(
            insert,
            [
                {
                    "event_id": f"e{n}",
                    "topic": "t",
                    "payload": json.dumps({"n": n}),
                    "created_at": clock.now,
                    "attempts": 0,
                    "published_at": published if n < PUBLISHED else None,
                }
                for n in range(PUBLISHED + PENDING)
            ],
        )


class Plans:
    """Explains the relay's take as it is sent (same text, same parameters, same
    transaction), just before it runs."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        self.found: list[t.Any] = []
        sa.event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(
        self, conn: t.Any, cursor: t.Any, statement: str, parameters: t.Any, *rest: t.Any
    ) -> None:
        if not self.is_take(statement):
            return
        name = self.engine.dialect.name
        if name == "postgresql":
            cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters)
            (plan,) = cursor.fetchone()
            self.found.append(json.loads(plan) if isinstance(plan, str) else plan)
        elif name == "mysql":
            cursor.execute("EXPLAIN " + statement, parameters)
            names = [column[0].lower() for column in cursor.description]
            self.found.append([dict(zip(names, row, strict=True)) for row in cursor.fetchall()])
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + statement, parameters)
            self.found.append([row[-1] for row in cursor.fetchall()])

    @staticmethod
    def is_take(statement: str) -> bool:
        text = " ".join(statement.split()).lower()
        return text.startswith("select") and "published_at is null" in text and " limit " in text

    def close(self) -> None:
        sa.event.remove(self.engine, "before_cursor_execute", self._seen)


def nodes(plan: dict[str, t.Any]) -> t.Iterator[dict[str, t.Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def test_the_take_reads_its_batch_from_the_pending_index_without_sorting_the_backlog(
    app: Flask, clock: Clock
) -> None:
    seed(app, clock)
    with app.app_context():
        plans = Plans(outbox_app.db.engine)
    publisher = ListPublisher()
    try:
        assert relay_once(app, publisher, batch=BATCH) == BATCH
    finally:
        plans.close()
    assert [ev.event_id for ev in publisher.events] == [
        f"e{n}" for n in range(PUBLISHED, PUBLISHED + BATCH)
    ]
    [plan] = plans.found
    name = plans.engine.dialect.name
    if name == "postgresql":
        steps = list(nodes(plan[0]["Plan"]))
        assert not [step for step in steps if step["Node Type"] in ("Sort", "Incremental Sort")]
        scans = [step for step in steps if "Scan" in step["Node Type"]]
        assert [scan.get("Index Name") for scan in scans] == ["idempotency_outbox_pending"]
        # The rows the scan read: the batch's, not the 1,500 pending nor the 500 published.
        read = sum(scan["Actual Rows"] + scan.get("Rows Removed by Filter", 0) for scan in scans)
        assert read <= 2 * BATCH, steps
    elif name == "mysql":
        # The pending index, looked up by its NULLs (ref, or range as the table's
        # statistics go), in its own order: a scan of the primary key in id order
        # would read every published row first.
        [row] = plan
        assert row["key"] == "idempotency_outbox_pending", plan
        assert row["type"] in ("ref", "ref_or_null", "range"), plan
        assert "filesort" not in (row["extra"] or "").lower(), plan
    else:
        # SQLite before 3.36 said "SEARCH TABLE idempotency_outbox ...".
        [step] = plan
        assert step.startswith("SEARCH "), plan
        assert "USING INDEX idempotency_outbox_pending (published_at=? AND failed_at=?)" in step


def test_a_copy_of_the_table_takes_its_own_rows(pg_url: str) -> None:
    """A table copied to another schema (``Table.to_metadata``, which shares the
    original's ``info``) after the original relayed gets statements of its own:
    its relay takes its rows, never the original's."""
    engine = sa.create_engine(pg_url)
    # Both in schemas of their own: the suite's outbox is left alone.
    table = outbox_table(sa.MetaData()).to_metadata(sa.MetaData(), schema="relay_take_a")
    now = dt.datetime.now(dt.timezone.utc)
    row = {"topic": "t", "payload": "{}", "created_at": now, "attempts": 0}

    def take(of: sa.Table) -> list[str]:
        leases = Leases(engine, of, lambda: now, database_clock=True)
        _, taken = leases.take(1, dt.timedelta(seconds=30), lambda row: row.event_id)
        return taken

    try:
        with engine.begin() as conn:
            for schema in ("relay_take_a", "relay_take_b"):
                conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA relay_take_a")
            table.create(conn)
            for n in range(2):
                conn.execute(sa.insert(table).values(event_id=f"original-{n}", **row))
        assert take(table) == ["original-0"]
        copy = table.to_metadata(sa.MetaData(), schema="relay_take_b")
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE SCHEMA relay_take_b")
            copy.create(conn)
            conn.execute(sa.insert(copy).values(event_id="copied", **row))
        assert take(copy) == ["copied"]
        assert take(table) == ["original-1"]
    finally:
        with engine.begin() as conn:
            for schema in ("relay_take_a", "relay_take_b"):
                conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        engine.dispose()
