"""A view's own COMMIT cut on the wire, through the fault suite's proxy
(:mod:`reliability.pgproxy`), on psycopg2 and psycopg 3.

The view commits its charge; the proxy forwards that COMMIT and drops the
connection after the server answered (the commit happened), or withholds it and
drops the connection (it did not): the view's ``commit()`` fails the same way
both times, and the extension must settle which it was on a connection of its
own. The cut request is answered 503 problem+json either way. Landed: the
operation is recorded and every retry replays its answer (the view failed after
committing: 500 ``failed-after-commit``), no second charge. Not landed: nothing
happened, and the retry charges, once. Counted in ledger rows, through real
sockets.
"""

from __future__ import annotations

import uuid

import pytest

from reliability.pgproxy import CommitCutter
from tests.conftest import ledger_count, postgres_url, record_rows, reset_tables
from tests.support import testapp
from tests.support.flow import assert_problem

ROUTES = {"plain": "/commits-then-hangs", "leased": "/leased-commits-then-hangs"}


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("mode", ["answered", "withheld"])
def test_a_views_commit_cut_on_the_wire_is_settled(driver: str, route: str, mode: str) -> None:
    url = postgres_url(driver)
    reset_tables(url)
    # The first COMMIT carrying a ledger row: the view's (a leased route's claim
    # commits before it, carrying the record only).
    cutter = CommitCutter(
        url, rate=1.0, seed=0, modes=(mode,), limit=1, table="ledger", work_only=True
    )
    with cutter as proxy:
        app = testapp.create_app(proxy.url())
        client = app.test_client()
        key = str(uuid.uuid4())
        headers = {"Idempotency-Key": key}
        first = client.post(ROUTES[route], json={"amount": 5}, headers=headers)
        assert len(proxy.cuts) == 1, proxy.cuts
        [cut] = proxy.cuts
        assert cut.keys == {key}
        assert cut.work
        assert cut.mode == mode
        assert_problem(first, 503)  # the database lost mid-request, whichever way
        retry = client.post(ROUTES[route], json={"amount": 5}, headers=headers)
        again = client.post(ROUTES[route], json={"amount": 5}, headers=headers)
        assert ledger_count(app) == 1, (first.get_data(), retry.get_data())
        [record] = record_rows(app)
        assert record["status"] == "completed"
        if mode == "answered":
            for answer in (retry, again):
                assert answer.headers.get("Idempotent-Replayed") == "true"
                assert assert_problem(answer, 500)["type"].endswith("failed-after-commit")
        else:
            assert retry.status_code == 201, retry.get_data()
            assert again.status_code == 201
            assert again.headers.get("Idempotent-Replayed") == "true"
            assert again.get_json() == retry.get_json()
        with app.app_context():
            testapp.db.engine.dispose()
