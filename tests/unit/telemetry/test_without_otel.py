"""Without the ``otel`` extra the extension works as before, imports nothing
of OpenTelemetry, and still writes the request's log line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import json
    import logging
    import sys

    class NoOpenTelemetry(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, NoOpenTelemetry())

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            if record.msg == "idempotency request":
                self.lines.append([record.idempotency_outcome, record.trace_id])

    lines = Lines()
    logger = logging.getLogger("flask_idempotency")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)

    from flask_idempotency import _telemetry
    from tests.support import testapp

    app = testapp.create_app(sys.argv[1])
    with app.app_context():
        testapp.db.create_all()
    client = app.test_client()
    body = {"amount": 5, "currency": "EUR"}
    answers = [
        client.post("/charges", json=body, headers={"Idempotency-Key": "k"}) for _ in range(2)
    ]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry")
    print(json.dumps({
        "available": _telemetry.AVAILABLE,
        "codes": [a.status_code for a in answers],
        "replayed": answers[1].headers.get("Idempotent-Replayed"),
        "loaded": loaded,
        "lines": lines.lines,
    }))
    """
)


def test_the_extension_works_and_imports_no_opentelemetry_without_the_extra(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "available": False,
        "codes": [201, 201],
        "replayed": "true",
        "loaded": [],
        "lines": [["executed", None], ["replayed", None]],
    }
