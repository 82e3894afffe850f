"""``idem.function`` on every engine: the first call runs and stores its
return value (read from the row), a repeat returns it without running (calls
counted), other arguments are refused, excluded ones do not count; failures
release the key (any BaseException), a commit then a failure is recorded;
erased and expired records; concurrent callers in real threads.

Side effects are ledger rows, counted calls and the record's columns, read
from the database on a connection of their own.
"""

from __future__ import annotations

import json
import threading
import typing as t

import pytest
from flask import Flask

from flask_idempotency import COMPLETED, FunctionOutcome
from flask_idempotency._storage.schema import ERASED
from flask_idempotency.errors import (
    FailedAfterCommitError,
    KeyErasedError,
    KeyReusedError,
)
from flask_idempotency.jobs import purge_expired
from tests.conftest import Clock, ledger_count, record_rows
from tests.support.testapp import Ledger, db, idem

CALLS: list[tuple[str, int]] = []


@idem.function(scope="billing.charge", key="invoice_id", exclude=("attempt",))
def charge(invoice_id: str, amount: int, attempt: int = 0) -> dict[str, t.Any]:
    CALLS.append((invoice_id, amount))
    db.session.add(Ledger(route="charge", key=invoice_id, amount=amount))
    return {"invoice": invoice_id, "charged": amount, "pair": (1, 2)}


@pytest.fixture(autouse=True)
def _no_calls() -> None:
    CALLS.clear()


def rows(app: Flask) -> dict[tuple[str, str], dict[str, t.Any]]:
    return {(r["scope"], r["key"]): r for r in record_rows(app)}


def test_first_call_runs_and_stores_a_repeat_returns_the_value_without_running(
    app: Flask,
) -> None:
    with app.app_context():
        first = charge.outcome("inv-1", 500)
    assert first == FunctionOutcome(
        {"invoice": "inv-1", "charged": 500, "pair": (1, 2)}, False, "billing.charge", "inv-1"
    )
    row = rows(app)[("billing.charge", "inv-1")]
    assert row["status"] == COMPLETED
    assert row["response_code"] == 200
    assert json.loads(row["response_body"]) == {"invoice": "inv-1", "charged": 500, "pair": [1, 2]}
    assert row["request_method"] is None
    assert ledger_count(app) == 1

    with app.app_context():
        again = charge.outcome("inv-1", 500, attempt=2)
        plain = charge("inv-1", amount=500)
    # The stored JSON: the tuple comes back a list.
    assert again == FunctionOutcome(
        {"invoice": "inv-1", "charged": 500, "pair": [1, 2]}, True, "billing.charge", "inv-1"
    )
    assert plain == again.value
    assert CALLS == [("inv-1", 500)]
    assert ledger_count(app) == 1


def test_other_arguments_are_refused(app: Flask) -> None:
    with app.app_context():
        charge("inv-1", 500)
        with pytest.raises(KeyReusedError, match="charge"):
            charge("inv-1", 700)
        # The session is usable afterwards: the refusal rolled back.
        assert db.session.query(Ledger).count() == 1
    assert CALLS == [("inv-1", 500)]


def test_excluded_and_defaulted_arguments(app: Flask) -> None:
    with app.app_context():
        charge("inv-2", 300)
        # The default counts as if given; the excluded argument never counts.
        assert charge.outcome("inv-2", 300, 0).replayed
        assert charge.outcome(amount=300, invoice_id="inv-2", attempt=9).replayed
    assert CALLS == [("inv-2", 300)]


@idem.function(scope="other.fn", key="invoice_id")
def other(invoice_id: str, amount: int, attempt: int = 0) -> int:
    CALLS.append((invoice_id, -amount))
    return amount


@idem.function(scope="billing.charge", key="invoice_id", exclude=("attempt",))
def look_alike(invoice_id: str, amount: int, attempt: int = 0) -> int:
    return amount


def test_scopes_keep_functions_apart_and_the_name_counts(app: Flask) -> None:
    with app.app_context():
        charge("inv-3", 100)
        assert other("inv-3", 100) == 100  # another scope: its own record
        # The same scope and arguments, another function: a mismatch, not a replay.
        with pytest.raises(KeyReusedError):
            look_alike("inv-3", 100)
    assert CALLS == [("inv-3", 100), ("inv-3", -100)]
    assert {k for k in rows(app)} == {("billing.charge", "inv-3"), ("other.fn", "inv-3")}


@idem.function(scope="fail", key="key", exclude=("error",))
def failing(key: str, error: type[BaseException], commit: bool = False) -> None:
    CALLS.append((key, 0))
    db.session.add(Ledger(route="failing", key=key, amount=1))
    if commit:
        db.session.commit()
    raise error("boom")


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt, SystemExit, GeneratorExit])
def test_a_failure_rolls_back_and_releases_the_key(app: Flask, error: type[BaseException]) -> None:
    with app.app_context():
        for _ in range(2):  # the second call runs again
            with pytest.raises(error):
                failing("f-1", error)
    assert CALLS == [("f-1", 0), ("f-1", 0)]
    assert ledger_count(app) == 0
    assert rows(app) == {}


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_failure_after_a_commit_of_its_own_is_recorded(
    app: Flask, error: type[BaseException]
) -> None:
    with app.app_context():
        with pytest.raises(error):
            failing("f-2", error, commit=True)
        for _ in range(2):
            with pytest.raises(FailedAfterCommitError, match="failing"):
                failing("f-2", error, commit=True)
    assert CALLS == [("f-2", 0)]
    assert ledger_count(app) == 1  # the committed work stays
    row = rows(app)[("fail", "f-2")]
    assert (row["status"], row["response_code"]) == (COMPLETED, 500)


@idem.function(scope="values", key="key", exclude=("value",))
def returns(key: str, value: t.Any) -> t.Any:
    CALLS.append((key, 0))
    db.session.add(Ledger(route="returns", key=key, amount=1))
    return value


def test_a_value_that_cannot_be_stored_releases_the_key(app: Flask) -> None:
    with app.app_context():
        for value in (object(), {"n": float("nan")}, "x" * 2000):  # the app's MAX_BODY is 1000
            with pytest.raises(TypeError, match="returns"):
                returns("v-1", value)
        assert returns("v-1", [1]) == [1]
    assert len(CALLS) == 4
    assert ledger_count(app) == 1
    assert rows(app)[("values", "v-1")]["status"] == COMPLETED


def test_an_argument_the_fingerprint_cannot_represent_stores_nothing(app: Flask) -> None:
    with app.app_context():
        with pytest.raises(TypeError, match=r"charge: argument amount is a builtins.object"):
            charge("v-2", object())  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"charge: .*finite"):
            charge("v-2", float("inf"))  # type: ignore[arg-type]
    assert CALLS == []
    assert rows(app) == {}


def test_erased_then_expired(app: Flask, clock: Clock) -> None:
    with app.app_context():
        charge("inv-4", 100)
        report = idem.erase("billing.charge", "inv-4")
        assert report.erased == 1
        assert rows(app)[("billing.charge", "inv-4")]["status"] == ERASED
        with pytest.raises(KeyErasedError):
            charge("inv-4", 100)
        clock.advance(hours=25)
        # Expired (not yet purged): a new operation.
        assert not charge.outcome("inv-4", 100).replayed
        clock.advance(hours=25)
        purge_expired(app)
        assert rows(app) == {}
        assert not charge.outcome("inv-4", 100).replayed
    assert CALLS == [("inv-4", 100)] * 3


def test_outside_an_app_context_and_inside_a_function_it_is_refused(app: Flask) -> None:
    with pytest.raises(RuntimeError, match="app context"):
        charge("inv-5", 1)

    @idem.function(scope="outer", key="key")
    def outer(key: str) -> t.Any:
        return charge(key, 1)

    with app.app_context(), pytest.raises(RuntimeError, match="inside an idempotent"):
        outer("o-1")
    assert CALLS == []
    assert rows(app) == {}


def test_pending_changes_of_the_caller_are_refused(app: Flask) -> None:
    with app.app_context():
        db.session.add(Ledger(route="caller", key="c", amount=1))
        with pytest.raises(RuntimeError, match="not flushed"):
            charge("inv-6", 1)
        db.session.rollback()
    assert rows(app) == {}


def test_concurrent_callers_run_it_once_and_all_get_the_value(app: Flask) -> None:
    gate = threading.Event()
    results: list[t.Any] = []
    errors: list[BaseException] = []

    @idem.function(scope="slow", key="key", wait=30)
    def slow(key: str) -> int:
        CALLS.append((key, 0))
        db.session.add(Ledger(route="slow", key=key, amount=1))
        db.session.flush()  # the claim and the row, held in this transaction
        gate.wait(10)
        return 42

    def caller() -> None:
        try:
            with app.app_context():
                results.append(slow.outcome("s-1"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for thread in threads:
        thread.start()
    # Let the duplicates reach the claim's wait, then let the first finish.
    threading.Timer(0.5, gate.set).start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert len(CALLS) == 1
    assert sorted(o.replayed for o in results) == [False, True, True, True]
    assert {o.value for o in results} == {42}
    assert ledger_count(app) == 1


@idem.function(
    scope=lambda tenant, order: f"tenant:{tenant}",
    key=lambda tenant, order: order["id"],
    exclude=("order.note",),
)
def place(tenant: str, order: dict[str, t.Any]) -> int:
    CALLS.append((tenant, order["total"]))
    return int(order["total"])


def test_scope_and_key_from_callables_and_a_dotted_exclude(app: Flask) -> None:
    with app.app_context():
        assert place("a", {"id": "o-1", "total": 5, "note": "x"}) == 5
        assert place.outcome("a", {"id": "o-1", "total": 5, "note": "y"}).replayed
        assert not place.outcome("b", {"id": "o-1", "total": 5}).replayed  # another tenant
        with pytest.raises(KeyReusedError):
            place("a", {"id": "o-1", "total": 6})
        with pytest.raises(ValueError, match="place"):
            place("a", {"id": "", "total": 6})
    assert CALLS == [("a", 5), ("b", 5)]
    assert set(rows(app)) == {("tenant:a", "o-1"), ("tenant:b", "o-1")}


class Billing:
    def __init__(self, name: str) -> None:
        self.name = name

    @idem.function(scope="billing.method", key="invoice_id", exclude=("self",))
    def charge(self, invoice_id: str, amount: int) -> str:
        CALLS.append((invoice_id, amount))
        return self.name


def test_a_method_binds_its_instance(app: Flask) -> None:
    with app.app_context():
        assert Billing("first").charge("m-1", 1) == "first"
        # Another instance, same arguments: the stored value (self is excluded).
        outcome = Billing("second").charge.outcome("m-1", 1)
    assert (outcome.value, outcome.replayed) == ("first", True)
    assert CALLS == [("m-1", 1)]


@idem.function(scope="commits", key="key")
def commits(key: str) -> str:
    CALLS.append((key, 0))
    db.session.add(Ledger(route="commits", key=key, amount=1))
    db.session.commit()  # its own commit: the record goes with it, still in progress
    db.session.add(Ledger(route="commits", key=key, amount=2))
    return "both"


def test_a_function_that_commits_then_returns_stores_its_value(app: Flask) -> None:
    with app.app_context():
        assert commits("c-1") == "both"
        assert commits.outcome("c-1").replayed
    assert CALLS == [("c-1", 0)]
    assert ledger_count(app) == 2
    row = rows(app)[("commits", "c-1")]
    assert (row["status"], row["response_code"]) == (COMPLETED, 200)
