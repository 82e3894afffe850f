"""The outbox test app's side of the outbox and relay tests: fresh tables, its
events, a keyed order, and the ``flask idempotency relay`` command on it."""

from __future__ import annotations

import contextlib
import os
import sys
import typing as t
from pathlib import Path

import sqlalchemy as sa
from flask import Flask

from flask_idempotency._storage.schema import (
    inbox_table,
    job_lock_table,
    outbox_table,
    record_table,
)
from tests.support import outbox_app
from tests.support.live import ROOT
from tests.support.tables import recreate_tables


def reset(url: str) -> None:
    """Drop and create the outbox app's tables, the extension's among them (they
    join the metadata at init_app, which a test may not have run yet)."""
    tables = (record_table, outbox_table, inbox_table, job_lock_table)
    recreate_tables(outbox_app.db.metadata, url, tables)


@contextlib.contextmanager
def fresh_app(url: str, clock: t.Any, **config: t.Any) -> t.Iterator[Flask]:
    """The outbox app on ``url`` (``config`` its settings), its tables fresh; its
    engine's connections closed afterwards: an ``app`` fixture's body."""
    app = outbox_app.create_app(url, clock=clock, **config)
    reset(url)
    yield app
    with app.app_context():
        outbox_app.db.engine.dispose()


def rows(app: Flask) -> list[dict[str, t.Any]]:
    with app.app_context():
        table = outbox_table(outbox_app.db.metadata)
        with outbox_app.db.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.select(table).order_by(table.c.id))]


def post(app: Flask, path: str = "/orders", key: str | None = None, **body: t.Any) -> t.Any:
    headers = {"Idempotency-Key": key} if key else {}
    return app.test_client().post(path, json={"amount": 5, **body}, headers=headers)


def relay_command(url: str, out: Path, *options: str) -> tuple[dict[str, str], list[str]]:
    """The environment and command of ``flask idempotency relay`` on the test
    outbox app, publishing to the file ``out`` (one JSON line per publish)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OUTBOX_TEST_DB": url,
        "OUTBOX_TEST_FILE": str(out),
    }
    app = "tests.support.outbox_app:from_env"
    return env, [sys.executable, "-m", "flask", "--app", app, "idempotency", "relay", *options]
