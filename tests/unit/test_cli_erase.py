"""``flask idempotency erase`` end to end (click's runner, the real database on
every engine): it asks first (``--yes`` does not), refuses a missing or empty
scope (exit 2), prints its counts, exits 1 when it skipped something; and
the record commands treat a tombstone right: ``release`` refuses it as the
recovery job leaves it, ``list``/``show``/``stats`` show it as ``erased``.
"""

from __future__ import annotations

import datetime as dt
import json
import time
import typing as t
from pathlib import Path

from flask import Flask

from flask_idempotency._maintenance.erasure import reclaim
from flask_idempotency._storage import COMPLETED, IN_PROGRESS, new_fencing_token, operation_values
from flask_idempotency._storage.schema import ERASED
from tests.conftest import Clock, insert_records, ledger_count, record_rows
from tests.support import testapp
from tests.support.flow import assert_problem, post


def cli(app: Flask, *args: str, input: str | None = None) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)


def charge(app: Flask, who: str, key: str) -> None:
    answer = post(app.test_client(), "/tenant", {"x": 1}, key=key, headers={"X-Tenant": who})
    assert answer.status_code == 201


def statuses(app: Flask) -> dict[tuple[str, str], str]:
    return {(row["scope"], row["key"]): row["status"] for row in record_rows(app)}


def test_erase_refuses_a_missing_or_empty_scope(app: Flask) -> None:
    charge(app, "a", "k1")
    for args in ([], ["--scope", ""], ["--scope", "tenant:a", "--batch", "0"]):
        result = cli(app, "erase", "--yes", *args)
        assert result.exit_code == 2, result.output
    assert statuses(app) == {("tenant:a", "k1"): COMPLETED}


def test_erase_asks_first_then_prints_its_counts(app: Flask) -> None:
    for who, key in (("a", "k1"), ("a", "k2"), ("b", "k1")):
        charge(app, who, key)

    declined = cli(app, "erase", "--scope", "tenant:a", input="n\n")
    assert declined.exit_code == 1
    assert "Erase every record in scope 'tenant:a'" in declined.output
    assert set(statuses(app).values()) == {COMPLETED}

    one = cli(app, "erase", "--scope", "tenant:a", "--key", "k1", input="y\n")
    assert one.exit_code == 0, one.output
    assert "erased 1 record(s), skipped 0" in one.output

    rest = cli(app, "erase", "--scope", "tenant:a", "--batch", "1", "--yes")
    assert rest.exit_code == 0, rest.output
    assert rest.output.startswith("erased 1 record(s), skipped 0 (in progress)")
    again = cli(app, "erase", "--scope", "tenant:a", "--yes")
    assert again.output.startswith("erased 0 record(s), skipped 0")
    assert statuses(app) == {
        ("tenant:a", "k1"): ERASED,
        ("tenant:a", "k2"): ERASED,
        ("tenant:b", "k1"): COMPLETED,
    }
    retry = post(app.test_client(), "/tenant", {"x": 1}, key="k2", headers={"X-Tenant": "a"})
    assert_problem(retry, 410)
    assert ledger_count(app) == 3


def test_erase_exits_1_when_a_live_lease_is_skipped(app: Flask, clock: Clock) -> None:
    now = clock()
    values = operation_values(
        request_hash="h",
        status=IN_PROGRESS,
        locked_until=now + dt.timedelta(seconds=30),
        created_at=now,
        expires_at=now + dt.timedelta(days=1),
    )
    with app.app_context(), testapp.db.engine.begin() as conn:
        row = {"scope": "s", "key": "running", "fencing_token": new_fencing_token(), **values}
        insert_records(conn, [row])

    result = cli(app, "erase", "--scope", "s", "--yes")

    assert result.exit_code == 1
    assert "erased 0 record(s), skipped 1" in result.stdout
    assert "Error: not all erased: 1 record(s) in progress under a live lease" in result.output
    assert statuses(app) == {("s", "running"): IN_PROGRESS}


def test_the_record_commands_treat_a_tombstone_right(app: Flask) -> None:
    charge(app, "a", "k1")
    assert cli(app, "erase", "--scope", "tenant:a", "--yes").exit_code == 0

    released = cli(app, "release", "tenant:a", "k1", "--yes")
    assert released.exit_code == 1
    assert "not released: it is an erased tombstone" in released.output
    for override in ("live-lease", "recovery-points"):
        assert cli(app, "release", "tenant:a", "k1", "--yes", "--override", override).exit_code == 1
    assert statuses(app) == {("tenant:a", "k1"): ERASED}

    listed = json.loads(cli(app, "list", "--status", "erased").output)
    assert [(r["key"], r["status"], r["response_code"]) for r in listed] == [("k1", ERASED, None)]
    shown = json.loads(cli(app, "show", "tenant:a", "k1", "--reveal").output)
    assert shown["status"] == ERASED
    assert (shown["response_body"], shown["response_headers"], shown["recovery_points"]) == (
        None,
        [],
        {},
    )
    assert (shown["request_body"], shown["response_body_bytes"], shown["request_hash"]) == (
        None,
        None,
        "erased",
    )
    stats = json.loads(cli(app, "stats").output)
    assert stats["by_status"] == {ERASED: 1}


def test_erase_exits_1_when_nothing_matched(app: Flask) -> None:
    """A scope or key that names nothing kept (a typo, a pasted trailing space)
    is not "everything erased": exit 1, and the hint. A scope already erased
    matched its tombstones: exit 0."""
    charge(app, "a", "k1")
    for args in (
        ["--scope", "tenant:a "],
        ["--scope", "Tenant:a"],
        ["--scope", "tenant:a", "--key", "nope"],
    ):
        result = cli(app, "erase", "--yes", *args)
        assert result.exit_code == 1, result.output
        assert "check the exact scope with `flask idempotency list`" in result.output
    assert statuses(app) == {("tenant:a", "k1"): COMPLETED}
    assert cli(app, "erase", "--scope", "tenant:a", "--yes", "--settle", "0").exit_code == 0
    again = cli(app, "erase", "--scope", "tenant:a", "--yes")
    assert again.exit_code == 0, again.output
    assert "1 already erased" in again.output
    assert cli(app, "erase", "--scope", "tenant:a", "--yes", "--settle", "-1").exit_code == 2


def _table_files(conn: t.Any, engine: t.Any) -> bytes:
    """The record table's bytes as they are on disk (SQLite's files; PostgreSQL's
    heap and TOAST files, read by the server)."""
    if engine.dialect.name == "sqlite":
        path = Path(str(engine.url.database))
        return b"".join(p.read_bytes() for p in path.parent.glob(path.name + "*"))
    conn.exec_driver_sql("CHECKPOINT")
    files = conn.exec_driver_sql(
        "SELECT pg_relation_filepath(oid) FROM pg_class WHERE oid IN ('idempotency_keys'::regclass,"
        " (SELECT reltoastrelid FROM pg_class WHERE oid = 'idempotency_keys'::regclass))"
        " AND pg_relation_filepath(oid) IS NOT NULL"
    ).scalars()
    read = "SELECT pg_read_binary_file(%(f)s)"
    return b"".join(bytes(conn.exec_driver_sql(read, {"f": f}).scalar()) for f in list(files))


def test_erase_vacuum_leaves_no_erased_row_version_in_the_files(app: Flask) -> None:
    """``--vacuum`` rewrites the tables (SQLite VACUUM, PostgreSQL VACUUM FULL,
    MariaDB OPTIMIZE TABLE): the bodies' old row versions are gone from the files
    (read back on SQLite and PostgreSQL)."""
    for key in ("k1", "k2", "k3"):
        charge(app, "a", key)
    result = cli(app, "erase", "--scope", "tenant:a", "--yes", "--vacuum")
    assert result.exit_code == 0, result.output
    assert "rewrote idempotency_keys" in result.output
    with app.app_context():
        engine = testapp.db.engine
    engine.dispose()
    if engine.dialect.name in ("sqlite", "postgresql"):
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for _ in range(50):
                if b'"tenant"' not in _table_files(conn, engine):
                    break
                # VACUUM FULL keeps a version a transaction still open may see
                # (other tests' on this database): run again once they ended.
                time.sleep(0.1)
                reclaim(app)
            assert b'"tenant"' not in _table_files(conn, engine)
    assert set(statuses(app).values()) == {ERASED}
