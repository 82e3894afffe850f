"""``idem.function`` where it meets other parts of the extension and odd
signatures: an inbox delivery whose row the call would commit halfway, a
positional-only parameter shadowed by a ``**kwargs`` item, a schema that dumps
what it does not load back. Side effects read from the database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask
from marshmallow import Schema, fields

from flask_idempotency import COMPLETED, inbox
from flask_idempotency.errors import FailedAfterCommitError
from flask_idempotency.jobs import recover_abandoned
from tests.conftest import Clock, ledger_count, record_rows, reset_tables
from tests.support import function_jobs
from tests.support.testapp import Ledger, db, idem

ROOT = Path(__file__).resolve().parents[3]
RUN = "import sys; from tests.support.function_jobs import main; main(*sys.argv[1:])"

CALLS: list[str] = []


@pytest.fixture(autouse=True)
def _no_calls() -> None:
    CALLS.clear()


@idem.function(scope="edges.consume", key="key")
def consume(key: str) -> int:
    CALLS.append(key)
    db.session.add(Ledger(route="consume", key=key, amount=1))
    return 1


def inbox_rows(app: Flask) -> int:
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM idempotency_inbox")).scalar_one())


def test_inside_an_inbox_delivery_it_is_refused(app: Flask) -> None:
    # The call would commit the delivery's inbox row before the consumer's
    # work is done: a consumer failing after it would lose the event.
    def deliver() -> None:
        with inbox.process(db.session, consumer="c", event_id="e-1", commit=True) as fresh:
            assert fresh
            consume("k-1")

    with app.app_context():
        with pytest.raises(RuntimeError, match="inbox delivery"):
            deliver()
        # The redelivery does the work; the function, called outside the
        # delivery's transaction, runs once.
        assert consume("k-1") == 1
        with inbox.process(db.session, consumer="c", event_id="e-1", commit=True) as fresh:
            assert fresh
            db.session.add(Ledger(route="consumer", key="e-1", amount=2))
        # A committed delivery no longer holds its row: calls are allowed again.
        assert consume.outcome("k-1").replayed
    assert CALLS == ["k-1"]
    assert inbox_rows(app) == 1
    assert ledger_count(app) == 2
    assert [(r["scope"], r["key"]) for r in record_rows(app)] == [("edges.consume", "k-1")]


def test_a_duplicate_delivery_does_not_hold_the_row(app: Flask) -> None:
    with app.app_context():
        with inbox.process(db.session, consumer="c", event_id="e-2", commit=True):
            pass
        with inbox.process(db.session, consumer="c", event_id="e-2") as fresh:
            assert not fresh  # nothing written: the call may commit
            consume("k-2")
    assert CALLS == ["k-2"]


@idem.function(scope="edges.posonly", key=lambda account, /, **kw: kw["op"])
def transfer(account: str, /, **kw: t.Any) -> str:
    CALLS.append(account)
    return account


def test_a_keyword_named_as_a_positional_only_parameter_is_refused(app: Flask) -> None:
    with app.app_context():
        with pytest.raises(TypeError, match="transfer: the keyword argument 'account'"):
            transfer("alice", op="t-1", account="x")
        assert transfer("alice", op="t-1", amount=5) == "alice"
        assert transfer.outcome("alice", op="t-1", amount=5).replayed
    assert CALLS == ["alice"]


class Receipt(Schema):
    id = fields.Integer(dump_only=True)
    total = fields.Integer()


class Total(Schema):
    total = fields.Integer()


@idem.function(scope="edges.schema", key="key", exclude=("schema",))
def pay(key: str, schema: str) -> dict[str, int]:
    CALLS.append(key)
    db.session.add(Ledger(route="pay", key=key, amount=1))
    return {"id": 7, "total": 5}


def test_a_value_its_schema_does_not_load_back_is_not_stored(app: Flask) -> None:
    receipt = idem.function(scope="edges.schema", key="key", schema=Receipt)(pay.__wrapped__)
    total = idem.function(scope="edges.schema", key="key", schema=Total)(pay.__wrapped__)
    with app.app_context():
        with pytest.raises(TypeError, match=r"pay: .*through Receipt .*Unknown field"):
            receipt("s-1", "receipt")
        # Nothing stored, the key free: a schema that loads what it dumps runs it.
        assert record_rows(app) == []
        assert ledger_count(app) == 0
        assert total("s-1", "total") == {"id": 7, "total": 5}
        assert total.outcome("s-1", "total").value == {"total": 5}
    assert CALLS == ["s-1", "s-1"]


def test_the_reconcile_hooks_never_answer_for_a_function(
    make_app: t.Callable[..., Flask], clock: Clock, database_url: str
) -> None:
    # An app-wide hook (written for routes) that would find the committed row:
    # asked for a function's record, its HTTP answer would become the value.
    asked: list[str] = []

    def hook(attempt: t.Any) -> t.Any:
        asked.append(attempt.key)
        return {"ledger": "found"}, 200

    app = make_app(IDEMPOTENCY_RECONCILE=hook)
    reset_tables(database_url)
    # Killed (SIGKILL) right after the function's own commit: in progress,
    # holding the failure its commit stored.
    run = subprocess.run(
        [sys.executable, "-c", RUN, database_url, "book", "b-1", "-", "commit"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        timeout=120,
    )
    assert run.returncode == -9, run.stderr.decode()
    # And one that raised after its commit: completed with its failure.
    with app.app_context(), pytest.raises(KeyboardInterrupt):
        interrupted("i-1")
    cli = app.test_cli_runner()
    listed = cli.invoke(args=["idempotency", "reconcile", "--list"])
    assert "b-1" not in listed.output
    assert "i-1" not in listed.output
    assert cli.invoke(args=["idempotency", "reconcile", "--yes"]).exit_code == 0
    clock.advance(seconds=3600)  # past the lease the killed call's commit took
    assert recover_abandoned(app).completed == 1  # settled with its failure
    with app.app_context():
        with pytest.raises(FailedAfterCommitError):
            function_jobs.book("b-1")
        with pytest.raises(FailedAfterCommitError):
            interrupted("i-1")
    assert asked == []
    found = {(r["scope"], r["key"]): r for r in record_rows(app)}
    assert {(r["status"], r["response_code"]) for r in found.values()} == {(COMPLETED, 500)}
    # The function's name, not a request: shown to the operator, never sent.
    assert {r["request_method"] for r in found.values()} == {None}
    shown = cli.invoke(args=["idempotency", "show", "jobs.book", "b-1"])
    assert json.loads(shown.output)["function"] == "tests.support.function_jobs.book"


@idem.function(scope="edges.interrupted", key="key")
def interrupted(key: str) -> None:
    db.session.add(Ledger(route="interrupted", key=key, amount=1))
    db.session.commit()
    raise KeyboardInterrupt


def test_a_lease_longer_than_the_apps_ttl_names_the_function(
    make_app: t.Callable[..., Flask],
) -> None:
    app = make_app(IDEMPOTENCY_TTL=300)
    leased = idem.function(scope="edges.lease", key="key", lease=600)(interrupted.__wrapped__)
    with app.app_context(), pytest.raises(ValueError, match=r"^@idem.function tests\.") as raised:
        leased("l-1")
    assert "@idem.idempotent" not in str(raised.value)
    assert record_rows(app) == []


def _options(k: str, *items: t.Any, **opts: t.Any) -> None: ...


@pytest.mark.parametrize(
    ("options", "match"),
    [
        # **opts's items count as parameters: a path through it would do nothing.
        ({"exclude": ("opts.trace",)}, r"'opts\.trace' reaches into its \*\*opts parameter"),
        ({"exclude": ("opts",)}, r"reaches into its \*\*opts"),
        ({"exclude": ("items.0",)}, r"'items\.0' reaches into its \*items"),
        ({"key": "opts"}, r"key='opts' names its \*\*opts parameter"),
        ({"key": "items"}, r"key='items' names its \*items parameter"),
    ],
)
def test_variadic_parameters_are_named_by_their_items(
    options: dict[str, t.Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        idem.function(**{"scope": "s", "key": "k", **options})(_options)
    # What works: an item of **opts by its name, all of *items.
    idem.function(scope="s", key="trace", exclude=("items", "attempt"))(_options)
