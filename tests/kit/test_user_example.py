"""The documented example (docs/examples/test_idempotency_kit.py) run as a user
runs it: copied into a fresh project (a temporary folder with a minimal
``pytest.ini``), ``python -m pytest`` in a subprocess with the kit's plugin, on
the suite's PostgreSQL (both drivers), MariaDB and SQLite. Against the example
app it passes; against a route with a response cache written after the commit
(tests/kit/broken_app.py) the kit's crash-after-commit test fails, on the
exactly-once assertion: two executions.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import mysql_url, postgres_url
from tests.support import pgbouncer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "test_idempotency_kit.py"

pytestmark = pytest.mark.slow


def run_example(
    project: Path, app: str, database: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """The example file in ``project`` (a fresh folder), run by pytest against ``app``."""
    project.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE, project / EXAMPLE.name)
    (project / "pytest.ini").write_text(
        "[pytest]\n"
        f"idempotency_app = {app}\n"
        f"idempotency_database = {database}\n"
        "filterwarnings = error\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "IDEMPOTENCY_KIT"))}
    # The project imports the app (the example's, or the broken one) from this
    # repository, as a user's tests import theirs from their own.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(project)])
    if pgbouncer.is_pooled(database):  # the example app's setting behind a pooler
        env["EXAMPLE_DATABASE_POOLER"] = "transaction"
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "flask_idempotency.testing.plugin",
            "-p",
            "no:cacheprovider",
            "-q",
            *args,
        ],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("driver", ["psycopg2", "psycopg"])
def test_the_documented_example_passes_on_the_example_app(tmp_path: Path, driver: str) -> None:
    done = run_example(tmp_path / "shop", "example_app.app:create_app", postgres_url(driver))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout, done.stdout


def test_the_documented_example_passes_on_mariadb(tmp_path: Path) -> None:
    url = mysql_url()
    if url is None:
        pytest.skip("no MariaDB/MySQL reachable (see the report header)")
    done = run_example(tmp_path / "shop", "example_app.app:create_app", url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 passed" in done.stdout, done.stdout


def test_the_documented_example_passes_on_sqlite(tmp_path: Path) -> None:
    done = run_example(tmp_path / "shop", "example_app.app:create_app", "sqlite://")
    assert done.returncode == 0, done.stdout + done.stderr
    # Everything but the database outage, which a local file cannot have.
    assert "5 passed, 1 skipped" in done.stdout, done.stdout


def test_a_response_cache_after_the_commit_fails_the_crash_test(tmp_path: Path) -> None:
    done = run_example(
        tmp_path / "broken",
        "tests.kit.broken_app:create_app",
        postgres_url("psycopg2"),
        "-k",
        "test_crash_after_commit_then_retry",
    )
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "1 failed" in out, out
    # It fails on the count, not on a status: the retry got its 201.
    assert "AssertionError: not exactly one effect for Idempotency-Key" in out, out
    assert "the view's rows come from 2 executions (requests), not 1" in out, out
    assert "charges id=1" in out, out
    assert "charges id=2" in out, out
    # The server's logs are attached to the failure.
    assert "idempotency kit: gunicorn logs" in out, out
    assert "fault kill_after_commit fired" in out, out
