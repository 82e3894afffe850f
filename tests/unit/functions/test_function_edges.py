"""``idem.function`` where it meets other parts of the extension and odd
signatures: an inbox delivery whose row the call would commit halfway, a
positional-only parameter shadowed by a ``**kwargs`` item, a schema that dumps
what it does not load back. Side effects read from the database.
"""

from __future__ import annotations

import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask
from marshmallow import Schema, fields

from flask_idempotency import inbox
from tests.conftest import ledger_count, record_rows
from tests.support.testapp import Ledger, db, idem

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
