"""The ``impl`` fixture: each storage implementation in turn, on an empty table."""

from __future__ import annotations

import typing as t
from pathlib import Path

import pytest

from flask_idempotency._storage import Store, dialects, drivers
from tests.conftest import mysql_url, postgres_url, reset_tables
from tests.support import testapp
from tests.support.storage import IMPLEMENTATIONS, Impl, engine_for


@pytest.fixture(params=list(IMPLEMENTATIONS))
def impl(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> t.Iterator[Impl]:
    database, dialect, fast_path = IMPLEMENTATIONS[request.param]
    if database == "sqlite":
        url = f"sqlite:///{tmp_path / 'conformance.sqlite3'}"
    elif database == "mysql":
        found = mysql_url()
        if found is None:
            pytest.skip("no MariaDB/MySQL reachable (see the report header)")
        url = found
    else:
        url = postgres_url(database)
    if request.param == "postgresql-one-by-one":
        monkeypatch.setattr(drivers, "_PATHS", {})
    if request.param == "generic":
        monkeypatch.delitem(dialects.DIALECTS, "sqlite")
    reset_tables(url)
    engine = engine_for(request.param, url)
    store = Store(testapp.db.metadata.tables["idempotency_keys"])
    try:
        yield Impl(request.param, url, engine, store, dialect, fast_path)
    finally:
        engine.dispose()
