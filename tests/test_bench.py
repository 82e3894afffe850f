"""The benchmark harness (``python -m bench.run``) runs end to end in a tiny mode.

No figure is checked (timings depend on the machine): only that every variant ran,
answered, and made it into the table, with every answer 2xx.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.app import OPTIMISTIC_MISSING
from bench.variants import VARIANTS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_harness_runs_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    command = [
        sys.executable,
        "-m",
        "bench.run",
        "--quick",
        "--duration",
        "0.5",
        "--rounds",
        "1",
        "--no-memory",
        "--engines",
        "sqlite",
        "--load",
        "python",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "results.png"),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stderr
    text = out.read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    expected = [v.name for v in VARIANTS if not (v.optimistic and OPTIMISTIC_MISSING)]
    for name in expected:
        cells = [cell.strip() for cell in rows[name].split("|")[1:-1]]
        requests = int(cells[6].replace(",", ""))
        assert requests > 0, rows[name]
    assert "no-key / plain" in text
    assert "ext-replay / floor-replay" in text


@pytest.mark.slow
def test_outbox_bench_runs_every_relay_and_broker(pg_url: str, tmp_path: Path) -> None:
    """``python -m bench.outbox`` in a tiny mode: every latency variant and every
    embedded broker has a figure, and the section lands in the output file."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    command = [
        sys.executable,
        "-m",
        "bench.outbox",
        "--quick",
        "--events",
        "5",
        "--backlog",
        "50",
        "--no-rabbitmq",
        "--database-url",
        pg_url,
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for name in ("cli-listen", "cli-poll", "scheduler-wake", "scheduler-poll"):
        assert float(rows[name].split("|")[2].replace(",", "")) > 0, rows[name]
    for broker in ("kombu filesystem", "kombu SQLAlchemy (SQLite)", "none (in-memory list)"):
        assert float(rows[broker].split("|")[2].replace(",", "")) > 0, rows[broker]
    assert "RabbitMQ figures are missing" in text
