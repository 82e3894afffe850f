"""``flask idempotency reconcile`` and the lease recovery job with a reconcile
hook, end to end (click's runner, the real database on every engine): the
records whose view committed and whose request never answered are listed,
rebuilt by the hook, and the exit code says whether all were."""

from __future__ import annotations

import datetime as dt
import typing as t

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance import reconcile as maintenance_reconcile
from flask_idempotency._maintenance.jobs import recover_abandoned
from tests.conftest import Clock
from tests.support.flow import assert_problem, post
from tests.support.reconcile_shop import (
    LEASE,
    Hook,
    Order,
    assert_rebuilt,
    db,
    fail_after_commit,
    make_app,
    orders,
    raw_record,
    refuse_completions,
)


@pytest.fixture
def hook() -> Hook:
    return Hook()


@pytest.fixture
def shop(database_url: str, clock: Clock, hook: Hook) -> t.Iterator[Flask]:
    app = make_app(database_url, clock, hook)
    yield app
    with app.app_context():
        db.engine.dispose()


def cli(app: Flask, *args: str) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", "reconcile", *args])


def test_list_then_reconcile_rebuilds_and_exits_0(shop: Flask, hook: Hook) -> None:
    fail_after_commit(shop, "/orders", "exception", key="k1")
    fail_after_commit(shop, "/orders", "systemexit", key="k2")
    listed = cli(shop, "--list")
    assert listed.exit_code == 0, listed.output
    lines = [line.split("\t") for line in listed.output.splitlines() if "\t" in line]
    assert sorted((scope, key) for scope, key, *_ in lines) == [
        ("tenant-1", "k1"),
        ("tenant-1", "k2"),
    ]
    assert hook.calls == []  # listing asks nothing
    done = cli(shop, "--yes")
    assert done.exit_code == 0, done.output
    assert done.output.count("rebuilt\t") == 2
    assert [attempt.from_client for attempt in hook.calls] == [False, False]
    assert cli(shop, "--list").output.strip().endswith("0 record(s) failed after commit")
    # The clients' retries get the rebuilt answers without asking again.
    ids = orders(shop)
    for key, order_id in zip(("k1", "k2"), ids, strict=True):
        assert_rebuilt(post(shop.test_client(), "/orders", {}, key=key), order_id)
    assert len(hook.calls) == 2
    again = cli(shop, "--yes")
    assert (again.exit_code, again.output.strip()) == (0, "nothing to reconcile")


def test_a_record_not_rebuilt_exits_1_and_stays(shop: Flask, hook: Hook) -> None:
    fail_after_commit(shop, "/orders", "exception")
    before = raw_record(shop)
    hook.mode = "none"
    done = cli(shop, "--yes", "--scope", "tenant-1", "--key", "k1")
    assert done.exit_code == 1, done.output
    assert "not rebuilt\ttenant-1\tk1\tthe hook returned None" in done.output
    assert raw_record(shop) == before
    doc = assert_problem(post(shop.test_client(), "/orders", {}), 500)
    assert doc["reconciled"] is False


def test_a_live_lease_is_never_reconciled(shop: Flask, hook: Hook, clock: Clock) -> None:
    undo = refuse_completions(shop)
    try:
        post(shop.test_client(), "/orders", {})
    finally:
        undo()
    assert raw_record(shop)["status"] == "in_progress"
    listed = cli(shop, "--list")
    assert "0 record(s)" in listed.output  # running, as far as anyone knows
    clock.advance(seconds=LEASE + 1)
    assert "1 record(s)" in cli(shop, "--list").output
    done = cli(shop, "--yes")
    assert done.exit_code == 0, done.output
    [order_id] = orders(shop)
    assert_rebuilt(post(shop.test_client(), "/orders", {}), order_id)


def test_the_recovery_job_asks_the_hook_before_settling(
    shop: Flask, hook: Hook, clock: Clock
) -> None:
    undo = refuse_completions(shop)
    try:
        post(shop.test_client(), "/orders", {})
    finally:
        undo()
    clock.advance(seconds=LEASE + 1)
    report = recover_abandoned(shop)
    assert (report.completed, report.released) == (1, 0)
    [attempt] = hook.calls
    assert not attempt.from_client
    [order_id] = orders(shop)
    record = raw_record(shop)
    assert (record["status"], record["response_code"]) == ("completed", 201)
    assert_rebuilt(post(shop.test_client(), "/orders", {}), order_id)
    assert len(hook.calls) == 1


def test_the_recovery_job_s_re_run_of_a_leased_route_asks_the_hook(
    shop: Flask, hook: Hook, clock: Clock
) -> None:
    undo = refuse_completions(shop)
    try:
        post(shop.test_client(), "/recoverable-orders", {})
    finally:
        undo()
    [order_id] = orders(shop)
    clock.advance(seconds=LEASE + 1)
    report = recover_abandoned(shop)
    assert (report.completed, report.skipped, report.released) == (1, 0, 0)
    [attempt] = hook.calls
    assert (attempt.why, attempt.from_client) == ("lease-ended", False)
    record = raw_record(shop)
    assert (record["status"], record["response_code"]) == ("completed", 201)
    assert orders(shop) == [order_id]  # the view did not run again
    assert_rebuilt(post(shop.test_client(), "/recoverable-orders", {}), order_id)


@pytest.mark.parametrize("endpoint", ["shop.place_giftt", "static"])
def test_an_endpoint_of_no_idempotent_route_is_refused(
    shop: Flask, hook: Hook, endpoint: str
) -> None:
    # The record kept no request, so --endpoint would pick the hook: a typo
    # must not fall back to IDEMPOTENCY_RECONCILE's answer.
    fail_after_commit(shop, "/gift-orders", "exception")
    before = raw_record(shop)
    done = cli(shop, "--yes", "--endpoint", endpoint)
    assert done.exit_code == 2, done.output
    assert repr(endpoint) in done.output
    if endpoint != "static":
        assert "did you mean shop.place_gift?" in done.output
    assert hook.calls == []
    assert raw_record(shop) == before
    done = cli(shop, "--yes", "--endpoint", "shop.place_gift")
    assert done.exit_code == 0, done.output
    assert "rebuilt\ttenant-1\tk1\t200" in done.output  # the gift route's own hook


def test_every_record_is_reached_past_the_first_page(
    shop: Flask, hook: Hook, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(maintenance_reconcile, "PAGE", 2)
    for key in ("k1", "k2", "k3"):  # their orders are gone: the hook cannot tell
        fail_after_commit(shop, "/orders", "exception", key=key)
    with shop.app_context():
        db.session.execute(sa.delete(Order))
        db.session.commit()
    clock.advance(seconds=1)
    fail_after_commit(shop, "/orders", "exception", key="k4")
    [order_id] = orders(shop)
    listed = cli(shop, "--list")
    keys = [line.split("\t")[1] for line in listed.output.splitlines() if "\t" in line]
    assert keys == ["k1", "k2", "k3", "k4"]
    assert "4 record(s) failed after commit" in listed.output
    for _ in range(2):  # the ones it cannot rebuild never hide the newer one
        done = cli(shop, "--yes")
        assert done.exit_code == 1, done.output
    assert done.output.count("not rebuilt\t") == 3
    assert [attempt.key for attempt in hook.calls] == ["k1", "k2", "k3", "k4", "k1", "k2", "k3"]
    assert_rebuilt(post(shop.test_client(), "/orders", {}, key="k4"), order_id)


def test_a_manual_routes_record_is_never_reconciled(shop: Flask, hook: Hook) -> None:
    # Its stored request names its route: in manual mode the view decides.
    fail_after_commit(shop, "/manual-orders", "exception")
    before = raw_record(shop)
    done = cli(shop, "--yes")
    assert done.exit_code == 1, done.output
    assert "not rebuilt\ttenant-1\tk1\tshop.place_manual is in manual mode" in done.output
    assert hook.calls == []
    assert raw_record(shop) == before
    answer = post(shop.test_client(), "/manual-orders", {})
    assert (answer.status_code, answer.get_json()) == (200, {"previous": 500})


def test_a_record_of_an_unknown_route_keeps_its_own_retention(
    database_url: str, clock: Clock, hook: Hook
) -> None:
    # /leased-orders keeps no request and has ttl=3600; the app's is a day.
    app = make_app(database_url, clock, hook, IDEMPOTENCY_TTL=24 * 3600)
    fail_after_commit(app, "/leased-orders", "exception")
    clock.advance(minutes=30)
    done = cli(app, "--yes")
    assert done.exit_code == 0, done.output
    expires = raw_record(app)["expires_at"]
    if isinstance(expires, str):  # SQLite
        expires = dt.datetime.fromisoformat(expires)
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=dt.timezone.utc)
    assert expires - clock.now <= dt.timedelta(hours=1, seconds=1)  # not the app's day
    assert expires - clock.now >= dt.timedelta(minutes=59)
    with app.app_context():
        db.engine.dispose()
