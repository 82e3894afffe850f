"""A database URL whose driver is not installed is refused by ``idem.init_app``
with the extra or URL to use, not Flask-SQLAlchemy's bare ``ModuleNotFoundError``.

Each case runs in a child Python where the driver module really cannot be
imported (a meta-path blocker installed by a ``sitecustomize`` on its path),
through the Quickstart's order (``idem.init_app`` before ``db.init_app``); the
URL the message offers then serves a keyed request on the real database.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.conftest import direct_postgres_url

ROOT = Path(__file__).resolve().parents[3]

BLOCKER = """
import os, sys

_BLOCKED = set(filter(None, os.environ.get("BLOCK_MODULES", "").split(",")))
if "_sqlite3" in _BLOCKED:
    # A working DB-API module kept aside, as pysqlite3's users pass one (module=).
    import sqlite3.dbapi2
    sys.kept_sqlite_module = sqlite3.dbapi2
    for name in ("sqlite3", "sqlite3.dbapi2", "_sqlite3"):
        sys.modules.pop(name, None)


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
"""

CHILD = """
import json, os, sys
from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from flask_idempotency import Idempotency

app = Flask("shop")
app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["URL"]
if os.environ.get("OPTIONS") == "module":
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {"module": sys.kept_sqlite_module}
db = SQLAlchemy()
idem = Idempotency()
try:
    idem.init_app(app, db)
except RuntimeError as exc:
    print(json.dumps({"refused": str(exc)}))
    sys.exit(0)
db.init_app(app)


@app.post("/orders")
@idem.idempotent(scope=lambda: "tenant")
def orders():
    return {"ok": True}, 201


with app.app_context():
    db.create_all()
    client = app.test_client()
    key = {"Idempotency-Key": os.environ["KEY"]}
    codes = [client.post("/orders", json={}, headers=key).status_code for _ in range(2)]
    print(json.dumps({"codes": codes, "driver": db.engine.dialect.driver}))
    db.engine.dispose()
"""


def run_child(
    tmp_path: Path, url: str, blocked: str, key: str = "k1", options: str = ""
) -> dict[str, object]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(BLOCKER))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "BLOCK_MODULES": blocked,
        "URL": url,
        "KEY": key,
        "OPTIONS": options,
    }
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def plain(url: str, drivername: str) -> str:
    return sa.make_url(url).set(drivername=drivername).render_as_string(hide_password=False)


def stored_keys(url: str, key: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(
                    sa.text("SELECT COUNT(*) FROM idempotency_keys WHERE key = :k"), {"k": key}
                ).scalar_one()
            )
    finally:
        engine.dispose()


def test_postgresql_without_psycopg3_names_the_extra_and_the_psycopg2_url(tmp_path: Path) -> None:
    base = direct_postgres_url("psycopg2")
    refused = run_child(tmp_path, plain(base, "postgresql"), "psycopg")["refused"]
    assert isinstance(refused, str)
    assert "SQLALCHEMY_DATABASE_URI" in refused
    assert "psycopg (psycopg 3)" in refused
    assert "No module named 'psycopg'" in refused
    assert "[psycopg] extra" in refused
    assert "postgresql+psycopg2://" in refused
    assert "ModuleNotFoundError" not in refused

    # The URL it offers works, with psycopg 3 still missing.
    key = f"driver-{uuid.uuid4()}"
    done = run_child(tmp_path, plain(base, "postgresql+psycopg2"), "psycopg", key=key)
    assert done == {"codes": [201, 201], "driver": "psycopg2"}
    assert stored_keys(base, key) == 1


def test_a_named_driver_missing_names_its_extra_and_the_other_installed_driver(
    tmp_path: Path,
) -> None:
    base = direct_postgres_url("psycopg2")
    refused = run_child(tmp_path, base, "psycopg2")["refused"]
    assert isinstance(refused, str)
    assert "the URL names the driver psycopg2" in refused
    assert "[postgresql] extra" in refused
    assert "postgresql+psycopg://" in refused


def test_mysql_without_mysqlclient_names_pymysql(tmp_path: Path) -> None:
    refused = run_child(tmp_path, "mysql://root@127.0.0.1/shop", "MySQLdb")["refused"]
    assert isinstance(refused, str)
    assert "mysqlclient (MySQLdb)" in refused
    assert "mysql+pymysql://" in refused
    # Neither driver installed: the extra that brings PyMySQL, with its URL.
    refused = run_child(tmp_path, "mysql://root@127.0.0.1/shop", "MySQLdb,pymysql")["refused"]
    assert isinstance(refused, str)
    assert "[mysql] extra and write mysql+pymysql://" in refused


def test_sqlite_needs_no_extra(tmp_path: Path) -> None:
    assert run_child(tmp_path, "sqlite:///shop.db", "psycopg,psycopg2,pymysql") == {
        "codes": [201, 201],
        "driver": "pysqlite",
    }


def test_a_module_of_the_apps_own_is_not_refused(tmp_path: Path) -> None:
    """``SQLALCHEMY_ENGINE_OPTIONS={'module': ...}`` (pysqlite3's users pass one):
    the URL's own driver is never imported, so its absence is no reason to refuse
    a setup that works; without the option the hint says what is missing."""
    done = run_child(tmp_path, "sqlite:///shop.db", "_sqlite3", options="module")
    assert done == {"codes": [201, 201], "driver": "pysqlite"}
    refused = run_child(tmp_path, "sqlite:///shop.db", "_sqlite3")["refused"]
    assert isinstance(refused, str)
    assert "built without SQLite support" in refused
    assert "'module'" in refused


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgres://u@127.0.0.1/shop", "write postgresql://"),
        ("postgres+psycopg2://u@127.0.0.1/shop", "write postgresql+psycopg2://"),
        ("postgresql+asyncpg://u@127.0.0.1/shop", "needs a synchronous driver"),
        ("sqlite+aiosqlite:///shop.db", "needs a synchronous driver"),
    ],
)
def test_spellings_that_cannot_work_name_the_one_that_does(
    tmp_path: Path, url: str, says: str
) -> None:
    refused = run_child(tmp_path, url, "")["refused"]
    assert isinstance(refused, str)
    assert says in refused


def test_init_app_before_db_init_app_still_watches_a_pooled_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Quickstart's order leaves no check out: under a declared transaction
    pooler, an engine db.init_app creates afterwards is watched from the app's
    first app context (a psycopg 3 engine that prepares statements is logged)."""
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_idempotency import Idempotency

    app = Flask("pooled")
    app.config.update(
        SQLALCHEMY_DATABASE_URI=direct_postgres_url("psycopg"),
        IDEMPOTENCY_DATABASE_POOLER="transaction",
    )
    db, idem = SQLAlchemy(), Idempotency()
    idem.init_app(app, db)
    db.init_app(app)
    with caplog.at_level(logging.WARNING, "flask_idempotency"):
        for _ in range(2):
            with app.app_context(), db.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
    told = [r.getMessage() for r in caplog.records if "prepare" in r.getMessage()]
    assert len(told) == 1, told
    assert "IDEMPOTENCY_DATABASE_POOLER" in told[0]
    with app.app_context():
        db.engine.dispose()
