"""Finding a ``pg_dump`` that can dump the test server, and running it."""

from __future__ import annotations

import glob
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa


def pg_dumps() -> list[str]:
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


def pg_dump(url: str, *args: str) -> bytes:
    """The database at ``url`` as ``pg_dump`` writes it, with ``args`` (e.g.
    ``--data-only``, ``-t table``): the first pg_dump that can dump that server
    (Debian's pg_dump refuses a newer server, such as the embedded one)."""
    dumps = pg_dumps()
    if not dumps:
        pytest.skip("no pg_dump here (/usr/lib/postgresql/*/bin, pgserver, PATH)")
    target = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    errors = []
    for command in dumps:
        done = subprocess.run(
            [command, "--no-owner", *args, f"--dbname={target}"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        if done.returncode == 0:
            return done.stdout
        errors.append(f"{command}: {done.stderr.decode(errors='replace').strip()}")
    raise AssertionError("no pg_dump could dump the database:\n" + "\n".join(errors))
