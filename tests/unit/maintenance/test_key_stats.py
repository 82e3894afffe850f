"""``idem.stats()``: the record table's figures, the same the gauges report, on
every engine, from rows written to the real database."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._maintenance.gauges import read_figures
from flask_idempotency._telemetry import figures
from flask_idempotency.jobs import KeyStats
from tests.conftest import Clock
from tests.support import testapp
from tests.support.flow import abandon
from tests.support.records import make_records


def test_stats_counts_live_in_progress_past_lease_and_expired(app: Flask, clock: Clock) -> None:
    with app.app_context():
        empty = testapp.idem.stats()
    assert (empty.live, empty.in_progress, empty.past_lease, empty.completed) == (0, 0, 0, 0)
    assert empty.oldest_in_progress is None

    make_records(app, clock, 3, expired=False)
    make_records(app, clock, 2, expired=True, prefix="old")
    abandon(app, clock, key="stuck")
    stuck_at = clock.now
    clock.advance(seconds=61)  # the stuck record's lease (60 s) is over
    abandon(app, clock, key="running")

    with app.app_context():
        found = testapp.idem.stats()
        rows = testapp.db.session.execute(
            sa.text("SELECT status, COUNT(*) FROM idempotency_keys GROUP BY status")
        ).all()
    assert isinstance(found, KeyStats)
    assert dict(rows) == {"completed": 5, "in_progress": 2}  # what the figures are read from
    assert (found.live, found.in_progress, found.past_lease) == (5, 2, 1)
    assert (found.completed, found.expired_awaiting_cleanup) == (3, 2)
    assert found.oldest_in_progress is not None
    assert abs(found.oldest_in_progress - stuck_at) < dt.timedelta(seconds=1)
    assert found.read_at == clock.now  # the app's clock stands in for the database's

    # The same figures the gauges report.
    gauges = read_figures(app)
    assert gauges[figures.RECORDS_LIVE] == found.live
    assert gauges[figures.RECORDS_IN_FLIGHT] == found.in_progress
    assert gauges[figures.RECORDS_PAST_LEASE] == found.past_lease


def test_stats_outside_an_app_context_says_so(app: Flask) -> None:
    with pytest.raises(RuntimeError, match="application context"):
        testapp.idem.stats()
