"""A flood of unique keys: what each one costs in storage, and how fast cleanup removes them.

``python -m bench.flood [--records N]`` sends N requests, each with a fresh key, through
the extension (Flask's test client, no network) to a typical small route: ``POST
/payments`` with ``{"amount": 1250, "currency": "EUR"}``, a UUID4 key and a bearer token
(the default scope, ``create_payment|bearer:<sha256>``), answering 201
``{"charge_id": n}`` with a ``Location``. The view writes nothing of its own, so the
database grows by the records alone. On PostgreSQL (embedded unless
IDEMPOTENCY_TEST_POSTGRES_URL is set) it prints ``pg_total_relation_size`` of the record
table (heap, TOAST and indexes) per record, as the flood left it and after ``VACUUM``;
on SQLite the database file's growth per record. Then it moves the clock past the
retention and times ``purge_expired`` at the default ``IDEMPOTENCY_PURGE_BATCH`` (1000):
rows per second, and that no record is left. docs/security.md quotes the figures.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import tempfile
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa
from flask import Blueprint, Flask
from flask_sqlalchemy import SQLAlchemy

from flask_idempotency import Idempotency
from flask_idempotency._maintenance.jobs import purge_expired
from tests.conftest import postgres_url, pytest_sessionfinish, run_sql

BODY = {"amount": 1250, "currency": "EUR"}


class Clock:
    """The app's clock, moved past the retention before the cleanup."""

    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.timezone.utc)

    def __call__(self) -> dt.datetime:
        return self.now


def flood_app(url: str, clock: Clock) -> tuple[Flask, SQLAlchemy]:
    """A fresh app (its own SQLAlchemy, its own tables) with the one small route."""
    db = SQLAlchemy()
    idem = Idempotency()
    bp = Blueprint("payments", __name__)
    served = iter(range(1, 1 << 62))

    @bp.post("/payments")
    @idem.idempotent
    def create_payment() -> tuple[dict[str, int], int, dict[str, str]]:
        charge_id = next(served)
        return {"charge_id": charge_id}, 201, {"Location": f"/payments/{charge_id}"}

    app = Flask("flood")
    app.config["SQLALCHEMY_DATABASE_URI"] = url
    idem.init_app(app, db, clock=clock)
    db.init_app(app)
    app.register_blueprint(bp)
    with app.app_context():
        db.drop_all()
        db.create_all()
    return app, db


def flood(app: Flask, records: int) -> float:
    """Send ``records`` requests with fresh keys; requests per second."""
    client = app.test_client()
    headers = {"Authorization": "Bearer " + "t" * 40}
    start = time.perf_counter()
    for _ in range(records):
        answer = client.post(
            "/payments", json=BODY, headers={**headers, "Idempotency-Key": str(uuid.uuid4())}
        )
        assert answer.status_code == 201, answer.get_data(as_text=True)
    return records / (time.perf_counter() - start)


def count(app: Flask, db: SQLAlchemy) -> int:
    with app.app_context(), db.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM idempotency_keys")).scalar_one())


def cleanup(app: Flask, db: SQLAlchemy, clock: Clock, records: int) -> float:
    """Move past the retention, purge at the default batch; rows per second."""
    clock.now += dt.timedelta(days=2)
    start = time.perf_counter()
    report = purge_expired(app)
    rate = report.deleted / (time.perf_counter() - start)
    assert report.deleted == records, report
    assert count(app, db) == 0
    return rate


def on_postgres(records: int) -> dict[str, float]:
    url = postgres_url()
    clock = Clock()
    app, db = flood_app(url, clock)
    size = "SELECT pg_total_relation_size('idempotency_keys')"
    empty = run_sql(url, size)[0][0]
    rate = flood(app, records)
    assert count(app, db) == records
    flooded = run_sql(url, size)[0][0]
    with app.app_context(), db.engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            sa.text("VACUUM idempotency_keys")
        )
    vacuumed = run_sql(url, size)[0][0]
    purge = cleanup(app, db, clock, records)
    with app.app_context():
        db.engine.dispose()
    return {
        "requests/s": rate,
        "bytes/record": (flooded - empty) / records,
        "bytes/record after VACUUM": (vacuumed - empty) / records,
        "cleanup rows/s": purge,
    }


def on_sqlite(records: int) -> dict[str, float]:
    path = Path(tempfile.mkdtemp(prefix="flood-")) / "flood.sqlite3"
    clock = Clock()
    app, db = flood_app(f"sqlite:///{path}", clock)
    empty = os.path.getsize(path)
    rate = flood(app, records)
    assert count(app, db) == records
    flooded = os.path.getsize(path)
    purge = cleanup(app, db, clock, records)
    with app.app_context():
        db.engine.dispose()
    path.unlink()
    return {
        "requests/s": rate,
        "bytes/record": (flooded - empty) / records,
        "cleanup rows/s": purge,
    }


def main(argv: t.Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=10_000)
    args = parser.parse_args(argv)
    for engine, measure in (("PostgreSQL", on_postgres), ("SQLite", on_sqlite)):
        figures = measure(args.records)
        print(f"{engine}, {args.records} records of a small request (batch 1000):")
        for name, value in figures.items():
            print(f"  {name:28} {value:10.0f}")


if __name__ == "__main__":
    try:
        main()
    finally:  # the schema made in a configured PostgreSQL goes, as after a test run
        pytest_sessionfinish(t.cast(t.Any, None), 0)
