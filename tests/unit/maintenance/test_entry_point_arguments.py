"""Values a user would plausibly write, given to the public jobs and the command
line: refused with a clear error before anything changes, never a hang, a
traceback, or a batch an engine reads as "no limit"."""

from __future__ import annotations

import datetime as dt
import threading
import typing as t

import pytest
from flask import Flask

from flask_idempotency.jobs import purge_expired, recover_abandoned
from flask_idempotency.relay import purge_published
from tests.conftest import Clock, record_rows
from tests.support.flow import abandon


def bounded(fn: t.Callable[[], t.Any]) -> t.Any:
    """Run ``fn`` in a thread; fail (not hang the suite) if it does not return."""
    out: list[t.Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed back to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the call never returned"
    return out[0]


CALLS: dict[str, t.Callable[[Flask], t.Any]] = {
    "purge_expired batch_size=-1": lambda app: purge_expired(app, batch_size=-1),
    "purge_expired batch_size=0": lambda app: purge_expired(app, batch_size=0),
    "purge_expired pause=-1": lambda app: purge_expired(app, pause=-1),
    "purge_expired pause=nan": lambda app: purge_expired(app, pause=float("nan")),
    "purge_expired pause=inf": lambda app: purge_expired(app, pause=float("inf")),
    "recover_abandoned limit=-1": lambda app: recover_abandoned(app, limit=-1),
    "recover_abandoned limit=0": lambda app: recover_abandoned(app, limit=0),
    "purge_published batch=0": lambda app: purge_published(app, batch=0),
    "purge_published batch=-5": lambda app: purge_published(app, batch=-5),
    "purge_published older_than<0": lambda app: purge_published(app, dt.timedelta(hours=-1)),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_count_below_one_is_a_value_error_and_changes_nothing(
    app: Flask, clock: Clock, call: str
) -> None:
    abandon(app, clock, key="stuck")
    clock.advance(days=2)  # expired and abandoned: what every job would act on

    outcome = bounded(lambda: CALLS[call](app))

    assert isinstance(outcome, ValueError), outcome
    assert len(record_rows(app)) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["show", "\udcff", "k"],
        ["release", "tenant\udcff", "k", "--yes"],
        ["list", "--scope-prefix", "\udcff"],
    ],
)
def test_a_scope_that_is_not_utf8_is_a_usage_error(app: Flask, args: list[str]) -> None:
    """Bytes of the command line that are not UTF-8 reach Python as lone
    surrogates: a usage error (2), not a UnicodeEncodeError from the driver."""
    result = app.test_cli_runner().invoke(args=["idempotency", *args])
    assert result.exit_code == 2, (result.output, result.exception)
    assert "must be UTF-8 text" in result.output


def test_a_unicode_scope_is_found(app: Flask, client: t.Any) -> None:
    result = app.test_cli_runner().invoke(args=["idempotency", "show", "tenant:Zürich-東京", "k"])
    assert result.exit_code == 1
    assert result.output == "Error: no record for scope 'tenant:Zürich-東京' and key 'k'\n"
