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
