"""An answer names its true cause: a claim that waited behind an unrelated
writer's lock is the database's 409 ``transaction-conflict``, never 409
``request-in-progress`` ("another request with this key is still running"),
which is for a running duplicate only. On every engine: PostgreSQL (both
drivers: a table lock, as a migration takes), SQLite (a writer holding the
database's one write lock), MariaDB (a gap lock on the record table, and a
lock on the table itself).
"""

from __future__ import annotations

import sqlite3
import threading
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from tests.conftest import ledger_count, record_rows
from tests.support.flow import assert_problem as problem
from tests.support.gates import Gates, send
from tests.unit.storage.test_engines import post, slow_app


def duplicate_while_first_runs(app: Flask, gates: Gates) -> tuple[t.Any, t.Any]:
    """The first request holds its claim until the duplicate has its answer."""
    first = send(app, "/held", {}, **{"X-Who": "first"})
    try:
        assert gates.arrived("first")
        dup = send(app, "/held", {}, **{"X-Who": "dup"}).result(timeout=20)
    finally:
        gates.open("first")
    return first.result(), dup


class UnrelatedWriter:
    """Another transaction that holds a lock a new key's claim must wait for,
    on no record of that key."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.raw: sqlite3.Connection | None = None
        self.conn: sa.Connection | None = None
        self.engine: sa.Engine | None = None

    def __enter__(self) -> UnrelatedWriter:
        if self.url.startswith("sqlite"):
            self.raw = sqlite3.connect(sa.make_url(self.url).database or "", isolation_level=None)
            self.raw.execute("BEGIN IMMEDIATE")  # the database's write lock
            self.raw.execute("CREATE TABLE IF NOT EXISTS audit (x)")
            return self
        self.engine = sa.create_engine(self.url)
        self.conn = self.engine.connect()
        if self.url.startswith("postgresql"):
            # A migration's lock: every insert into the table waits.
            self.conn.execute(sa.text("LOCK TABLE idempotency_keys IN SHARE MODE"))
        else:
            # A locking read over the whole (empty) index: its next-key lock on
            # the supremum makes every insert wait, for no key in particular.
            self.conn.execute(sa.text("SELECT scope FROM idempotency_keys FOR UPDATE"))
        return self

    def __exit__(self, *exc: object) -> None:
        if self.raw is not None:
            self.raw.execute("ROLLBACK")
            self.raw.close()
        if self.conn is not None:
            self.conn.rollback()
            self.conn.close()
        if self.engine is not None:
            self.engine.dispose()


def test_a_new_key_behind_an_unrelated_writer_is_a_transaction_conflict(
    database_url: str,
) -> None:
    app, _ = slow_app(database_url, IDEMPOTENCY_WAIT=0.5)
    with UnrelatedWriter(database_url):
        answer = post(app.test_client(), "/held", {}, "never-used-before")
    assert problem(answer, 409)["type"].endswith("transaction-conflict")
    assert answer.headers["Retry-After"] == "1"
    assert record_rows(app) == []
    assert ledger_count(app, "held") == 0
    # The database free again, the same key runs, once.
    assert post(app.test_client(), "/held", {}, "never-used-before").status_code == 201
    assert ledger_count(app, "held") == 1


def test_a_claim_behind_a_lock_on_the_record_table_is_bounded_on_mariadb(
    database_url: str,
) -> None:
    """MariaDB/MySQL: a lock on the record table itself (``LOCK TABLES``, a
    migration's ``ALTER TABLE``: a metadata lock) is waited for
    ``lock_wait_timeout`` (a day by default), not ``innodb_lock_wait_timeout``:
    the claim bounds both with ``IDEMPOTENCY_WAIT``, and the no-wait probe does
    not take the table's lock for a duplicate's. The lock is held until the
    claim is answered (30 s at most): a claim that waited for it would have
    run, and been answered 201."""
    if not database_url.startswith("mysql"):
        pytest.skip("MariaDB/MySQL's metadata locks")
    app, _ = slow_app(database_url, IDEMPOTENCY_WAIT=0.5)
    holding, answered = threading.Event(), threading.Event()

    def migration() -> None:
        engine = sa.create_engine(database_url)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("LOCK TABLES idempotency_keys WRITE"))
                holding.set()
                answered.wait(30)
                conn.execute(sa.text("UNLOCK TABLES"))
        finally:
            engine.dispose()

    holder = threading.Thread(target=migration)
    holder.start()
    try:
        assert holding.wait(10)
        answer = post(app.test_client(), "/held", {}, "never-used-before")
    finally:
        answered.set()
        holder.join()
    assert problem(answer, 409)["type"].endswith("transaction-conflict")
    assert answer.headers["Retry-After"] == "1"
    assert record_rows(app) == []
    assert ledger_count(app, "held") == 0
    assert post(app.test_client(), "/held", {}, "never-used-before").status_code == 201
    assert ledger_count(app, "held") == 1


def test_a_waiting_duplicate_is_in_progress_where_the_database_can_tell(
    database_url: str,
) -> None:
    """PostgreSQL's error names the key's row, MariaDB's no-wait probe finds it
    locked: request-in-progress. SQLite's lock is the whole database's and
    the first request's claim is not committed: nothing tells a duplicate from
    any other writer there, so the answer is the database's
    transaction-conflict (the same 409, the same Retry-After, the same
    advice: retry with the same key)."""
    app, gates = slow_app(database_url, IDEMPOTENCY_WAIT=0.5)
    first, dup = duplicate_while_first_runs(app, gates)
    assert first.status_code == 201
    expected = (
        "transaction-conflict" if database_url.startswith("sqlite") else "request-in-progress"
    )
    assert problem(dup, 409)["type"].endswith(expected)
    assert ledger_count(app, "held") == 1


def test_a_duplicate_of_a_leased_claim_on_sqlite_is_in_progress(database_url: str) -> None:
    """SQLite: the first request's claim is committed under a live lease and
    its view holds the write lock: the waiting duplicate finds that record,
    and is answered in progress."""
    if not database_url.startswith("sqlite"):
        pytest.skip("SQLite's database lock")
    app, gates = slow_app(database_url, route={"lease": 30}, IDEMPOTENCY_WAIT=0.5)
    first, dup = duplicate_while_first_runs(app, gates)
    assert first.status_code == 201
    assert problem(dup, 409)["type"].endswith("request-in-progress"), dup.get_json()
    assert ledger_count(app, "held") == 1
