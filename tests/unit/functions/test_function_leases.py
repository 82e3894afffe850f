"""``idem.function`` beyond one transaction, on every engine: a leased call
killed (SIGKILL, in a subprocess) between its steps is refused while its
lease lives and resumed after it, each step's downstream call made once;
its event goes to the outbox with the record; the recovery job and the CLI
handle function records (never re-run over HTTP). And schemas, sealed
records, calls inside a protected view, options refused at decoration.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import json
import os
import subprocess
import sys
import threading
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from marshmallow import Schema, fields, post_load

from flask_idempotency import COMPLETED, IN_PROGRESS
from flask_idempotency._storage.schema import OUTBOX_TABLE_NAME
from flask_idempotency.errors import (
    ConflictError,
    FailedAfterCommitError,
    OperationInProgressError,
    RecordUnreadableError,
    TransactionConflictError,
)
from flask_idempotency.jobs import recover_abandoned
from tests.conftest import Clock, insert_records, ledger_count, record_rows
from tests.support import function_jobs, testapp
from tests.support.keyrings import KEY_A, KEY_B, keys_config
from tests.support.sealing import clear_in_rows, sealed_config
from tests.support.testapp import Ledger, db, idem

ROOT = Path(__file__).resolve().parents[3]
RUN = "import sys; from tests.support.function_jobs import main; main(*sys.argv[1:])"


def rows(app: Flask) -> dict[tuple[str, str], dict[str, t.Any]]:
    return {(r["scope"], r["key"]): r for r in record_rows(app)}


def text(value: t.Any) -> t.Any:
    """A column as text (MySQL's VARBINARY reads back as bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def lines(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def events(app: Flask) -> list[dict[str, t.Any]]:
    with app.app_context(), testapp.db.engine.connect() as conn:
        table = testapp.db.metadata.tables[OUTBOX_TABLE_NAME]
        return [dict(r._mapping) for r in conn.execute(sa.select(table))]


def test_a_leased_call_killed_between_steps_resumes_after_its_lease(
    app: Flask, clock: Clock, database_url: str, tmp_path: Path
) -> None:
    log = tmp_path / "downstream.log"
    run = subprocess.run(
        # Imported, not run as __main__: the function's module counts in its fingerprint.
        [sys.executable, "-c", RUN, database_url, "ship", "o-1", str(log), "charge"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    assert lines(log) == ["charge"]
    row = rows(app)[("jobs.ship", "o-1")]
    assert row["status"] == IN_PROGRESS
    assert list(json.loads(row["recovery_points"])) == ["charge"]
    assert ledger_count(app) == 0

    with app.app_context():
        # Its lease lives: refused, saying when to retry; nothing runs.
        with pytest.raises(OperationInProgressError) as refused:
            function_jobs.ship("o-1", str(log))
        assert refused.value.retry_after > 1
        assert lines(log) == ["charge"]
        # The recovery job leaves it (steps to resume; no request to re-run).
        # Past the lease the subprocess wrote (its real clock: started after ours).
        clock.advance(seconds=300)
        assert recover_abandoned(app).completed == 0
        resumed = function_jobs.ship.outcome("o-1", str(log))
    assert not resumed.replayed
    # The charge's step was not called again: its saved result came back.
    assert lines(log) == ["charge", "email"]
    first_key = log.read_text().split()[1]
    assert resumed.value["charge"] == {"done": "charge", "key": first_key}
    assert ledger_count(app) == 1
    (event,) = events(app)
    assert text(event["event_id"]) == resumed.value["event"]
    # Owned by the function's operation (erasure finds it by scope and key).
    assert (text(event["owner_scope"]), text(event["owner_key"])) == ("jobs.ship", "o-1")
    with app.app_context():
        again = function_jobs.ship.outcome("o-1", str(log))
    assert again.replayed
    assert again.value == resumed.value
    assert lines(log) == ["charge", "email"]
    assert len(events(app)) == 1
    with app.app_context():
        report = idem.erase("jobs.ship", "o-1")
    # The record is erased; its event, not published yet, waits for the relay.
    assert (report.erased, report.events_erased) == (1, 0)


def test_a_call_killed_after_a_commit_of_its_own_is_settled_as_failed(
    app: Flask, clock: Clock, database_url: str, tmp_path: Path
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", RUN, database_url, "book", "b-1", "-", "commit"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    assert ledger_count(app) == 1
    row = rows(app)[("jobs.book", "b-1")]
    assert (row["status"], row["response_code"]) == (IN_PROGRESS, 500)
    with app.app_context():
        with pytest.raises(OperationInProgressError):
            function_jobs.book("b-1")
        clock.advance(seconds=3600)  # past the lease its commit took
        for _ in range(2):
            with pytest.raises(FailedAfterCommitError):
                function_jobs.book("b-1")
    assert ledger_count(app) == 1
    assert rows(app)[("jobs.book", "b-1")]["status"] == COMPLETED


def test_a_caller_past_its_wait_is_told_the_operation_is_in_progress(app: Flask) -> None:
    gate, holding = threading.Event(), threading.Event()

    @idem.function(scope="jobs.held", key="key", wait=0.3)
    def held(key: str, hold: bool) -> str:
        db.session.add(Ledger(route="held", key=key, amount=1))
        db.session.flush()
        if hold:
            holding.set()
            gate.wait(20)
        return "done"

    def first() -> None:
        with app.app_context():
            held("h-1", True)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert holding.wait(20)
        with app.app_context(), pytest.raises(ConflictError) as refused:
            held("h-1", True)
    finally:
        gate.set()
        thread.join(30)
    # A running duplicate where the engine can tell (SQLite's one lock is the
    # whole database's: a busy database there, unless the record says otherwise).
    assert isinstance(refused.value, (OperationInProgressError, TransactionConflictError))
    if not app.config["SQLALCHEMY_DATABASE_URI"].startswith("sqlite"):
        assert isinstance(refused.value, OperationInProgressError)
    assert ledger_count(app) == 1


def test_a_failed_leased_call_keeps_its_steps_and_the_next_call_resumes(
    app: Flask, tmp_path: Path
) -> None:
    log = tmp_path / "downstream.log"
    calls = []

    @idem.function(scope="jobs.two", key="order", lease=True, exclude=("fail",))
    def two_steps(order: str, fail: bool) -> str:
        calls.append(order)
        idem.step("charge", lambda: function_jobs.downstream(str(log), "charge"))
        if fail:
            raise KeyboardInterrupt
        return "ok"

    with app.app_context():
        with pytest.raises(KeyboardInterrupt):
            two_steps("o-2", True)
        row = rows(app)[("jobs.two", "o-2")]
        assert (row["status"], row["locked_until"]) == (IN_PROGRESS, None)
        assert two_steps("o-2", False) == "ok"
    assert lines(log) == ["charge"]
    assert calls == ["o-2", "o-2"]


def test_steps_and_derived_keys_need_a_lease(app: Flask) -> None:
    @idem.function(scope="jobs.nolease", key="order")
    def no_lease(order: str) -> str:
        return idem.derived_key("pay")

    with app.app_context(), pytest.raises(RuntimeError, match="leased"):
        no_lease("o-3")
    assert rows(app) == {}


@dataclasses.dataclass
class Receipt:
    amount: decimal.Decimal
    at: dt.datetime


class ReceiptSchema(Schema):
    amount = fields.Decimal()
    at = fields.AwareDateTime()

    @post_load
    def make(self, data: dict[str, t.Any], **_: t.Any) -> Receipt:
        return Receipt(**data)


def test_a_schema_round_trips_rich_values(app: Flask) -> None:
    at = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.timezone.utc)
    calls = []

    @idem.function(scope="receipts", key="key", schema=ReceiptSchema)
    def receipt(key: str) -> Receipt:
        calls.append(key)
        return Receipt(decimal.Decimal("10.10"), at)

    with app.app_context():
        first = receipt.outcome("r-1")
        again = receipt.outcome("r-1")
    assert first.value == again.value == Receipt(decimal.Decimal("10.10"), at)
    assert isinstance(again.value.amount, decimal.Decimal)
    assert (first.replayed, again.replayed, calls) == (False, True, ["r-1"])


def test_a_sealed_app_seals_the_stored_value(make_app: t.Callable[..., Flask]) -> None:
    app = make_app(**sealed_config())

    @idem.function(scope="sealed", key="key")
    def secret(key: str) -> dict[str, str]:
        return {"card": "4242-SECRET-VALUE"}

    with app.app_context():
        assert secret("s-1") == {"card": "4242-SECRET-VALUE"}
        assert secret.outcome("s-1").replayed
        assert secret("s-1") == {"card": "4242-SECRET-VALUE"}
    assert rows(app)[("sealed", "s-1")]["status"] == COMPLETED
    assert clear_in_rows(app, "SECRET-VALUE") == []


def test_a_value_sealed_under_a_key_no_longer_configured_is_refused(
    make_app: t.Callable[..., Flask],
) -> None:
    calls = []

    @idem.function(scope="sealed", key="key")
    def secret(key: str) -> str:
        calls.append(key)
        return "SECRET-VALUE"

    with make_app(**keys_config(KEY_A)).app_context():
        assert secret("s-2") == "SECRET-VALUE"
    with make_app(**keys_config(KEY_B)).app_context(), pytest.raises(RecordUnreadableError):
        secret("s-2")
    assert calls == ["s-2"]


def test_inside_a_protected_view_it_is_refused(app: Flask) -> None:
    @idem.function(scope="in.view", key="key")
    def job(key: str) -> int:
        db.session.add(Ledger(route="job", key=key, amount=1))
        return 1

    @app.post("/calls-a-function")
    @idem.idempotent
    def view() -> t.Any:
        db.session.add(Ledger(route="view", key="v", amount=1))
        return {"job": job("j-1")}, 201

    response = app.test_client().post(
        "/calls-a-function", json={}, headers={"Idempotency-Key": "v-1"}
    )
    assert response.status_code == 500
    assert ledger_count(app) == 0
    assert rows(app) == {}


def test_the_recovery_job_releases_an_abandoned_function_record(app: Flask, clock: Clock) -> None:
    # (One whose function committed is settled: the SIGKILL test above, and
    # test_conformance_functions on every storage implementation.)
    with app.app_context():
        # A claim left by a worker that died before any step: released, not re-run.
        with testapp.db.engine.begin() as conn:
            now = clock()
            values = {
                "scope": "jobs.abandoned",
                "key": "a-1",
                "request_hash": "h",
                "status": IN_PROGRESS,
                "fencing_token": 7,
                "locked_until": now + dt.timedelta(seconds=30),
                "created_at": now,
                "expires_at": now + dt.timedelta(hours=1),
            }
            insert_records(conn, [values])
        clock.advance(seconds=31)
        report = recover_abandoned(app)
    assert (report.released, report.completed) == (1, 0)
    assert rows(app) == {}


def test_the_cli_shows_and_releases_a_function_record(app: Flask, clock: Clock) -> None:
    with app.app_context(), testapp.db.engine.begin() as conn:
        now = clock()
        insert_records(
            conn,
            [
                {
                    "scope": "jobs.cli",
                    "key": "c-1",
                    "request_hash": "h",
                    "status": IN_PROGRESS,
                    "fencing_token": 9,
                    "locked_until": now - dt.timedelta(seconds=1),
                    "created_at": now,
                    "expires_at": now + dt.timedelta(hours=1),
                }
            ],
        )
    runner = app.test_cli_runner()
    shown = runner.invoke(args=["idempotency", "show", "jobs.cli", "c-1", "--reveal"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["status"] == IN_PROGRESS
    released = runner.invoke(args=["idempotency", "release", "jobs.cli", "c-1", "--yes"])
    assert released.exit_code == 0, released.output
    assert rows(app) == {}


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"scope": "s", "key": "nope"}, ValueError, "names no parameter"),
        ({"scope": "", "key": "k"}, TypeError, "non-empty str"),
        ({"scope": "s" * 513, "key": "k"}, ValueError, "512"),
        ({"scope": 3, "key": "k"}, TypeError, "scope= must be"),
        ({"scope": "s", "key": 3}, TypeError, "key= must be"),
        ({"scope": "s", "key": "k", "exclude": "k"}, TypeError, "not the string"),
        ({"scope": "s", "key": "k", "exclude": ("other",)}, ValueError, "names no parameter"),
        ({"scope": "s", "key": "k", "ttl": "1 day"}, TypeError, "ttl"),
        ({"scope": "s", "key": "k", "lease": "long"}, TypeError, "lease"),
        # Zero: the routes' decorator lets it through to init_app's settings.
        ({"scope": "s", "key": "k", "ttl": 0}, ValueError, "@idem.function: ttl= must be positive"),
        ({"scope": "s", "key": "k", "lease": 0.0}, ValueError, "lease= must be positive"),
        ({"scope": "s", "key": "k", "schema": dict}, TypeError, "schema"),
    ],
)
def test_options_are_checked_when_decorating(
    options: dict[str, t.Any], error: type[Exception], match: str
) -> None:
    def fn(k: str) -> None: ...

    with pytest.raises(error, match=match):
        idem.function(**options)(fn)


def test_async_functions_are_refused() -> None:
    async def fn(k: str) -> None: ...

    with pytest.raises(TypeError, match="async"):
        idem.function(scope="s", key="k")(fn)


@pytest.mark.parametrize(
    ("key", "error"),
    [(None, TypeError), ("", ValueError), ("x" * 256, ValueError), ("é", ValueError)],
)
def test_bad_keys_name_the_function(app: Flask, key: t.Any, error: type[Exception]) -> None:
    @idem.function(scope="s", key="k")
    def keyed(k: t.Any) -> None: ...

    with app.app_context(), pytest.raises(error, match="keyed"):
        keyed(key)
    with app.app_context():
        assert keyed(12) is None  # an int is its decimal string
    assert list(rows(app)) == [("s", "12")]
