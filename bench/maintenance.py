"""Maintenance runs per interval as scheduler processes are added.

``python -m bench.maintenance [--processes 1 3 9] [--seconds 20]`` starts that
many ``flask idempotency scheduler`` processes on PostgreSQL (embedded unless
IDEMPOTENCY_TEST_POSTGRES_URL is set), with ``recover`` every 1 s and ``purge``
every 1.4 s (the defaults' 5 s and 7 s of the issue, scaled down), lets them
run, and counts the runs that started in the measured window, across all
processes. Columns: ``runs`` in the window; ``once/interval``, the runs that
one run per interval gives in that window; ``runs/interval``, the interval over
the mean gap between runs (1.0 is exactly once per interval; at most
1 / (1 - slack) = 1.11 with the slack of a tenth of the interval; one run per
tick per process would give the number of processes); the smallest and largest
gap; ``runners``, how many processes ran the job at least once.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import time
import typing as t

import sqlalchemy as sa

from tests import conftest
from tests.conftest import postgres_url, reset_tables, run_sql
from tests.support import cli_app, testapp
from tests.support.commands import flask_cmd, wait_running

EVERY = {"recover": 1.0, "purge": 1.4}


def measure(url: str, processes: int, seconds: float) -> list[dict[str, t.Any]]:
    run_sql(url, "DELETE FROM job_runs")
    config = {
        "IDEMPOTENCY_RECOVER_EVERY": EVERY["recover"],
        "IDEMPOTENCY_PURGE_EVERY": EVERY["purge"],
    }
    schedulers = [
        flask_cmd(url, "scheduler", config=config, IDEMPOTENCY_TEST_JOB_RUNS="0")
        for _ in range(processes)
    ]
    try:
        for process in schedulers:
            wait_running(process)
        start = time.time()
        time.sleep(seconds)
        end = time.time()
    finally:
        for process in schedulers:
            process.send_signal(signal.SIGTERM)
        for process in schedulers:
            process.communicate(timeout=60)
    runs = run_sql(url, "SELECT job, pid, started FROM job_runs ORDER BY started")
    rows = []
    for job, every in EVERY.items():
        mine = [r for r in runs if r.job == job and start <= r.started <= end]
        gaps = [b.started - a.started for a, b in itertools.pairwise(mine)]
        rows.append(
            {
                "processes": processes,
                "job": job,
                "every": every,
                "runs": len(mine),
                "expected": (end - start) / every,
                # The mean gap between runs, in intervals: free of the window's edges.
                "per_interval": every * len(gaps) / sum(gaps) if gaps else float("nan"),
                "runners": len({r.pid for r in mine}),
                "min_gap": min(gaps) if gaps else float("nan"),
                "max_gap": max(gaps) if gaps else float("nan"),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 3, 9])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    url = postgres_url()
    try:
        testapp.create_app(url)
        reset_tables(url)
        cli_app.job_runs.create(sa.create_engine(url), checkfirst=True)
        rows = [row for n in args.processes for row in measure(url, n, args.seconds)]
        run_sql(url, "DROP TABLE job_runs")
    finally:
        # A configured PostgreSQL: drop the schema of the run's own, as the suite does.
        conftest.pytest_sessionfinish(t.cast(t.Any, None), 0)
    print(f"\n{args.seconds:g} s per row on PostgreSQL; runs counted across all processes")
    header = (
        f"{'processes':>9} {'job':8} {'every':>6} {'runs':>5} {'once/interval':>13} "
        f"{'runs/interval':>13} {'min gap':>8} {'max gap':>8} {'runners':>7}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['processes']:9d} {r['job']:8} {r['every']:5.1f}s {r['runs']:5d} "
            f"{r['expected']:13.1f} {r['per_interval']:13.2f} {r['min_gap']:7.2f}s "
            f"{r['max_gap']:7.2f}s {r['runners']:7d}"
        )


if __name__ == "__main__":
    main()
