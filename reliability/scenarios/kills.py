"""Processes killed right after the commit and right before it, at random."""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from reliability import _harness as h
from reliability._context import Context

NAME = "kills"
TITLE = "Kills after and before the commit, and worker timeouts after it"
DESCRIPTION = """\
gunicorn (2 sync workers) serves the reliability app on the scenario's PostgreSQL. Each worker
kills itself with SIGKILL at random on 10% of requests, right **after** the COMMIT that carries
the work (the response never leaves) or right **before** it (inside the transaction), on the
plain route (record and row in one transaction) and on the leased route (the record committed
first under a 3 s lease, the row at the end, fenced). The worker-timeout runs sleep 4 s after the
commit on 5% of requests, past gunicorn's `--timeout 2`: the master aborts the worker
(`SystemExit` inside it) with the work committed and no answer sent. Clients retry every failure
with the same key. The last row is the same kills after the commit on a route without the
extension: the duplicates a retrying client makes there.
"""

#: (label, route, faults, gunicorn timeout, expect duplicates)
RUNS: list[tuple[str, str, dict[str, float], float, bool]] = [
    ("plain, kill after commit", "/plain", {"after_commit": 0.1}, 30, False),
    ("plain, kill before commit", "/plain", {"before_commit": 0.1}, 30, False),
    ("leased, kill after commit", "/leased", {"after_commit": 0.1}, 30, False),
    ("leased, kill before commit", "/leased", {"before_commit": 0.1}, 30, False),
    ("plain, worker timeout after commit", "/plain", {"hang_after_commit": 0.05}, 2, False),
    ("leased, worker timeout after commit", "/leased", {"hang_after_commit": 0.05}, 2, False),
    ("no extension, kill after commit", "/unprotected", {"after_commit": 0.1}, 30, True),
]


def run(ctx: Context) -> list[h.Result]:
    results: list[h.Result] = []
    operations = ctx.scale.pick(1500, 200)
    for label, route, faults, timeout, expect_duplicates in RUNS:
        url = ctx.database(f"kills_{len(results)}")
        h.reset_tables(url)
        result = h.Result(f"{NAME}: {label}", label, expect_duplicates=expect_duplicates)
        log = Path(tempfile.mkstemp(prefix="reliability-faults-")[1])
        env = {
            "RELIABILITY_DATABASE_URL": url,
            "RELIABILITY_FAULTS": json.dumps(faults),
            "RELIABILITY_FAULT_LOG": str(log),
            "RELIABILITY_HANG": "4",
            "RELIABILITY_LEASE": "3",
        }
        with (
            h.timed(result),
            h.Gunicorn("reliability.app:create_app()", env, workers=2, timeout=timeout) as server,
        ):
            client = h.Client([(server.host, server.port)], timeout=10, budget=120)
            make = functools.partial(h.new_operation, route)
            ops = h.drive(client, make, count=operations, concurrency=6)
        result.add_operations(ops)
        h.count_faults(log, result)
        h.count_ledger(url, ops, result)
        if route != "/unprotected":
            h.count_stuck(url, result)
        if expect_duplicates:
            result.notes.append(
                f"without the extension the retries made {result.duplicates} duplicate "
                f"executions from {result.faults['after_commit']} kills after the commit"
            )
            if result.faults["after_commit"] and not result.duplicates:
                result.notes.append("expected duplicates here and saw none: the fault did not bite")
        ctx.show(result)
        results.append(result)
        log.unlink(missing_ok=True)
    return results
