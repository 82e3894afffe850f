"""``flask idempotency erase`` end to end (click's runner, the real database on
every engine): it asks first (``--yes`` does not), refuses a missing or empty
scope (exit 2), prints its counts, exits 1 when it skipped something; and
the record commands treat a tombstone right: ``release`` refuses it as the
recovery job leaves it, ``list``/``show``/``stats`` show it as ``erased``.
"""

from __future__ import annotations

import datetime as dt
import json
import typing as t

from flask import Flask

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
