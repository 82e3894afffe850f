"""The issue's check: after traffic whose request and response bodies, headers,
step results and an outbox event's payload and headers all carry a marker, a
dump of the database (``pg_dump``, or the SQLite file itself) shows the marker
nowhere; the same traffic with encryption off shows it (so the check can fail)."""

from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
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
from tests.support.sealing import sealed_config


def _pg_dumps() -> list[str]:
    """Every pg_dump found, newest first: the embedded server's own (pgserver),
    Debian's per version, the one on the PATH."""
    found = []
    # Found without importing it (its import warns where XDG_RUNTIME_DIR is unset).
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations)))
        bundled = package / "pginstall" / "bin" / "pg_dump"
        if bundled.exists():
            found.append(str(bundled))
    versions = glob.glob("/usr/lib/postgresql/*/bin/pg_dump")
    found += sorted(versions, key=lambda p: int(Path(p).parts[-3]), reverse=True)
    on_path = shutil.which("pg_dump")
    if on_path:
        found.append(on_path)
    return found


def _pg_dump(url: str) -> bytes:
    """The whole database at ``url`` as ``pg_dump`` writes it (the first pg_dump
    that can dump that server)."""
    dumps = _pg_dumps()
    if not dumps:
        pytest.skip("no pg_dump here (/usr/lib/postgresql/*/bin, pgserver, PATH)")
    target = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    errors = []
    for command in dumps:
        done = subprocess.run(
            [command, "--no-owner", f"--dbname={target}"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout
        errors.append(f"{command}: {done.stderr.decode(errors='replace').strip()}")
    raise AssertionError("no pg_dump could dump the database:\n" + "\n".join(errors))


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
        dump = _pg_dump(fresh_database)
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
