"""The issue's check: after traffic whose request and response bodies, headers,
step results and an outbox event's payload and headers all carry a marker, a
dump of the database (``pg_dump``, or the SQLite file itself) shows the marker
nowhere; the same traffic with encryption off shows it (so the check can fail)."""

from __future__ import annotations

import typing as t
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from flask import Flask

from flask_idempotency._storage.schema import outbox_table
from tests.conftest import Clock, recreate_tables, reset_tables
from tests.support import testapp
from tests.support.flow import post
from tests.support.pgdump import pg_dump
from tests.support.sealing import sealed_config


def _routes(app: Flask, runs: list[str]) -> None:
    @app.post("/dump-echo")
    @testapp.idem.idempotent()
    def dump_echo() -> tuple[dict[str, t.Any], int, dict[str, str]]:
        note = testapp.idem.payload["note"]
        testapp.write_ledger("dump-echo")  # business rows carry no marker
        testapp.idem.emit("dump.noted", {"note": note}, {"x-note": note})
        return {"note": note}, 201, {"X-Note": note}

    @app.post("/dump-steps")
    @testapp.idem.idempotent(lease=True, recover=True, ttl=testapp.LEASED_TTL)
    def dump_steps() -> tuple[dict[str, t.Any], int, dict[str, str]]:
        note = testapp.idem.payload["note"]
        saved = testapp.idem.step("charge", lambda: {"charged": note})
        runs.append(testapp.idem.key or "")
        if testapp.idem.key == "kept":
            raise RuntimeError("dies after its step: the operation is kept for its retry")
        return {"saved": saved}, 201, {"X-Note": note}


def _traffic(url: str, clock: Clock, marker: str, **config: t.Any) -> None:
    app = testapp.create_app(url, clock=clock, IDEMPOTENCY_REPLAY_HEADERS=["X-Note"], **config)
    runs: list[str] = []
    _routes(app, runs)
    reset_tables(url)
    recreate_tables(testapp.db.metadata, url, (outbox_table,))
    client = app.test_client()
    body = {"note": marker}
    headers = {"X-Note": marker}  # a request header: never stored
    assert post(client, "/dump-echo", body, key="echo", headers=headers).status_code == 201
    assert post(client, f"/dump-steps?note={marker}", body, key="done").status_code == 201
    assert post(client, f"/dump-steps?note={marker}", body, key="kept").status_code == 500
    # Replays read it all back.
    again = post(client, "/dump-echo", body, key="echo")
    assert again.headers["X-Note"] == marker
    assert post(client, f"/dump-steps?note={marker}", body, key="done").get_json() == {
        "saved": {"charged": marker}
    }
    assert runs == ["done", "kept"]
    with app.app_context():
        testapp.db.engine.dispose()


@pytest.mark.parametrize("fresh_database", ["psycopg2", "sqlite"], indirect=True)
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "clear"])
def test_a_dump_after_traffic_shows_no_marker(
    fresh_database: str, sealed: bool, clock: Clock
) -> None:
    marker = f"MARK{uuid.uuid4().hex}"
    _traffic(fresh_database, clock, marker, **(sealed_config() if sealed else {}))
    if fresh_database.startswith("sqlite"):
        path = Path(sa.make_url(fresh_database).database or "")
        files = [path, *path.parent.glob(path.name + "-*")]  # a journal or WAL, if any
        dump = b"".join(p.read_bytes() for p in files)
    else:
        dump = pg_dump(fresh_database)
    assert b"idempotency_keys" in dump  # the tables are in it
    assert b"idempotency_outbox" in dump
    # A bytea column is dumped in hex: look for the marker that way too.
    shown = [
        needle for needle in (marker.encode(), marker.encode().hex().encode()) if needle in dump
    ]
    if sealed:
        assert shown == []
    else:
        assert shown != []
