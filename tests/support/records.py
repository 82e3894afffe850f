"""Records made in bulk and read back, and the CLI on the test app, for the
cleanup and scheduled-job tests."""

from __future__ import annotations

import datetime as dt
import typing as t

from flask import Flask

from tests.conftest import Clock, insert_records, record_rows
from tests.support import testapp


def make_records(app: Flask, clock: Clock, n: int, *, expired: bool, prefix: str = "k") -> None:
    """Insert ``n`` completed records, expired (or not) by the test clock."""
    expires = clock.now + (dt.timedelta(seconds=-1) if expired else dt.timedelta(hours=1))
    rows = [
        {
            "scope": "bulk",
            "key": f"{prefix}{i}",
            "request_hash": "h",
            "status": "completed",
            "fencing_token": 1,
            "response_code": 201,
            "body_omitted": False,
            "created_at": clock.now - dt.timedelta(days=1),
            "expires_at": expires,
        }
        for i in range(n)
    ]
    with app.app_context(), testapp.db.engine.begin() as conn:
        insert_records(conn, rows)


def keys(app: Flask) -> set[str]:
    return {r["key"] for r in record_rows(app)}


def cli(app: Flask, *args: str, input: str | None = None) -> t.Any:
    return app.test_cli_runner().invoke(args=["idempotency", *args], input=input)
