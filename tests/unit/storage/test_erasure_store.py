"""Erasure's statements keep one contract on every storage implementation
(:mod:`flask_idempotency._storage.erasure`), read back on a connection of
their own: a batch takes at most its limit, in key order after the position
given; it never takes a live lease nor another scope; a second pass takes
nothing; and a completion that commits while a batch waits on its row is not
lost (the completed row is what the batch then erases).
"""

from __future__ import annotations

import datetime as dt
import sqlite3
import threading
import time

import pytest

from flask_idempotency._storage import COMPLETED, IN_PROGRESS
from flask_idempotency._storage.erasure import erase_records
from flask_idempotency._storage.schema import ERASED, ERASED_HASH, record_table
from flask_idempotency._storage.sql import text_param
from tests.support.storage import SCOPE, Impl, claimed, now_ms, record_values

HOUR = dt.timedelta(hours=1)


def completed(key: str, now: dt.datetime, scope: str = SCOPE) -> dict[str, object]:
    values = record_values(key, now)
    values.update(
        status=COMPLETED,
        locked_until=None,
        response_code=201,
        response_headers='[["Location", "/x"]]',
        response_body=b'{"card": "4242"}',
        recovery_points='{"a": 1}',
        request_method="POST",
        request_path="/x",
        request_content_type="application/json",
        request_body=b'{"card": "4242"}',
        completed_at=now,
        scope=scope,
    )
    return values


def test_a_batch_takes_at_most_its_limit_in_key_order(impl: Impl) -> None:
    now = now_ms()
    for key in ("a", "b", "c", "d", "e"):
        claimed(impl, completed(key, now))
    claimed(impl, completed("z", now, scope="other"))
    before = impl.rows()
    table = impl.store.table
    done, after = [], None
    while True:
        with impl.engine.begin() as conn:
            batch = erase_records(conn, table, SCOPE, None, now, 2, after)
        if batch.last is None:
            break
        done.append((batch.erased, batch.skipped, batch.last))
        after = batch.last
    assert done == [(2, 0, "b"), (2, 0, "d"), (1, 0, "e")]
    rows = impl.rows()
    assert {k: r["status"] for k, r in rows.items()} == {
        **dict.fromkeys("abcde", ERASED),
        "z": COMPLETED,  # the other scope's
    }
    for key in "abcde":
        row = rows[key]
        assert row["request_hash"] == ERASED_HASH
        for column in ("response_body", "response_headers", "recovery_points", "request_body"):
            assert row[column] is None
        assert row["expires_at"] == before[key]["expires_at"]
    with impl.engine.begin() as conn:
        assert erase_records(conn, table, SCOPE, None, now, 10, None) == (0, 0, None)


def test_other_scopes_and_live_leases_are_left(impl: Impl) -> None:
    now = now_ms()
    claimed(impl, completed("mine", now))
    claimed(impl, completed("theirs", now, scope="conformance-other"))
    claimed(impl, record_values("running", now, lease=HOUR))
    table = impl.store.table
    with impl.engine.begin() as conn:
        batch = erase_records(conn, table, SCOPE, None, now, 10, None)
    assert (batch.erased, batch.skipped) == (1, 1)
    rows = impl.rows()
    assert rows["mine"]["status"] == ERASED
    assert rows["theirs"]["status"] == COMPLETED
    assert rows["running"]["status"] == IN_PROGRESS
    with impl.engine.begin() as conn:  # by key: only that key
        assert erase_records(conn, table, SCOPE, "running", now + 2 * HOUR, 10, None)[:2] == (1, 0)


def test_a_completion_committed_while_the_batch_waits_is_not_lost(impl: Impl) -> None:
    """The holder of a record whose lease ended completes it while an erasure
    batch, which read it in progress, waits on its row lock: the batch then
    erases the completed row, and the completion's commit stood. (SQLite
    serializes the two: the batch takes the write lock first.)"""
    if impl.name == "generic":
        pytest.skip("an engine without a module here has no way to take SQLite's lock first")
    now = now_ms()
    values = record_values("k", now - 2 * HOUR, lease=HOUR)  # lease over an hour ago
    claimed(impl, values)
    token = int(values["fencing_token"])  # type: ignore[call-overload]
    holder = impl.engine.connect()
    holder.begin()
    assert impl.store.complete(
        holder,
        SCOPE,
        "k",
        token,
        response_code=201,
        response_headers=[],
        response_body=b"{}",
        body_omitted=False,
        now=now,
    )
    result: list[object] = []

    def erase() -> None:
        table = record_table(impl.store.table.metadata)
        with impl.engine.begin() as conn:
            result.append(erase_records(conn, table, SCOPE, "k", now, 10, None))

    eraser = threading.Thread(target=erase)
    eraser.start()
    time.sleep(0.3)  # the batch reads, then waits on the holder's row lock (or the database's)
    holder.commit()
    holder.close()
    eraser.join(30)
    [batch] = result
    row = impl.rows()["k"]
    # The completion committed (its time stays on the tombstone), then the
    # batch, which had waited, erased the completed row.
    assert batch == (1, 0, "k")
    assert (row["status"], row["completed_at"], row["fencing_token"]) == (ERASED, now, token)


def test_a_batch_larger_than_an_in_list_runs_on_a_999_variable_sqlite(impl: Impl) -> None:
    """A batch binds a key and a token per record: it is split into statements
    of at most MAX_IN_LIST records, so SQLite before 3.32 (999 variables, here
    set by ``setlimit``) takes the default batch of 1000."""
    now = now_ms()
    table = impl.store.table
    with impl.engine.begin() as conn:
        # Scope and key bound as strings (MySQL's VARBINARY columns), as the store does.
        insert = table.insert().values(scope=text_param("scope"), key=text_param("key"))
        conn.execute(insert, [completed(f"k{n:04}", now) for n in range(1000)])
    with impl.engine.begin() as conn:
        raw = conn.connection.driver_connection
        if impl.engine.dialect.name == "sqlite":
            assert raw is not None
            previous = raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        try:
            batch = erase_records(conn, table, SCOPE, None, now, 1000, None)
        finally:
            if impl.engine.dialect.name == "sqlite":
                raw.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, previous)
    assert (batch.erased, batch.skipped) == (1000, 0)
    assert {row["status"] for row in impl.rows().values()} == {ERASED}
