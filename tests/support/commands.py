"""``flask idempotency ...`` on ``tests.support.cli_app`` as a child process, for
the live jobs tests and ``bench/maintenance.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import typing as t

from tests.support.live import ROOT


def flask_cmd(
    url: str, *args: str, config: dict[str, t.Any] | None = None, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "flask", "--app", "tests.support.cli_app", "idempotency", *args],
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "IDEMPOTENCY_TEST_APP_DB": url,
            "IDEMPOTENCY_TEST_APP_CONFIG": json.dumps(config or {}),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_running(process: subprocess.Popen[str], timeout: float = 60) -> None:
    """Until ``flask idempotency scheduler`` says it runs (its jobs are scheduled)."""
    assert process.stdout is not None
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        line = process.stdout.readline()
    finally:
        timer.cancel()
    assert "scheduler running" in line, (line, process.communicate(timeout=10))
