"""PostgreSQL restarted (fast and immediate) under load."""

from __future__ import annotations

import functools
import json
import random
import threading
import time

from reliability import _harness as h
from reliability._context import Context

NAME = "pg_restart"
TITLE = "PostgreSQL restarted under load, fast and immediate"
DESCRIPTION = """\
gunicorn (4 sync workers) serves the reliability app on the scenario's PostgreSQL while 6
clients send operations and retry each failure with the same key. Meanwhile the cluster is
stopped and started again several times: `fast` (SIGINT: every session ended, a clean
checkpoint) or `immediate` (SIGQUIT: no checkpoint, crash recovery at the next start), down 2-5 s
each time, on the plain route (record and row in one transaction) and on the leased route (the
record committed first under a 3 s lease, the row at the end, fenced). While the database is down
the app must answer `503` problem+json (counted), never an HTML 500; afterwards every operation is
settled, and exactly once: a COMMIT in doubt (sent, then the connection dropped, so the client got
a 503 or nothing) is replayed when it landed and run once when it did not, so the ledger holds
exactly one row per succeeded key. *Replayed after a failed attempt* counts the operations whose
work committed on an attempt that failed, as the retry's replay shows.
"""

#: (label, route, halt mode)
RUNS: list[tuple[str, str, str]] = [
    ("plain, fast restarts", "/plain", "fast"),
    ("plain, immediate restarts", "/plain", "immediate"),
    ("leased, fast restarts", "/leased", "fast"),
    ("leased, immediate restarts", "/leased", "immediate"),
]


class Restarter:
    """Stops the cluster ``times`` times (``mode``), each after ``warm`` seconds of
    load, for a random 2-5 s, then starts it again; the cluster is running when
    it ends, whatever happened."""

    def __init__(
        self, ctx: Context, mode: str, times: int, warm: float, rng: random.Random
    ) -> None:
        self.ctx, self.mode, self.times, self.warm = ctx, mode, times, warm
        self.downs = [rng.uniform(2, 5) for _ in range(times)]
        self.restarts = 0
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restarter", daemon=True)

    @property
    def schedule(self) -> float:
        """About how long the restarts take (starting included)."""
        return sum(self.warm + down + 2 for down in self.downs) + self.warm

    def _run(self) -> None:
        try:
            for down in self.downs:
                time.sleep(self.warm)
                self.ctx.cluster.halt(self.mode)
                time.sleep(down)
                self.ctx.cluster.start(**self.ctx.settings)
                self.restarts += 1
        except BaseException as exc:  # reported by the scenario
            self.error = exc
        finally:
            if self.ctx.cluster.proc is None:
                self.ctx.cluster.start(**self.ctx.settings)
            self.done.set()

    def __enter__(self) -> Restarter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(120)


def run(ctx: Context) -> list[h.Result]:
    results: list[h.Result] = []
    times = ctx.scale.pick(3, 2)
    warm = ctx.scale.pick(3.0, 1.5)
    rng = random.Random(5432)
    for label, route, mode in RUNS:
        url = ctx.database(f"pg_restart_{len(results)}")
        h.reset_tables(url)
        result = h.Result(f"{NAME}: {label}", label)
        env = {"RELIABILITY_DATABASE_URL": url, "RELIABILITY_LEASE": "3"}
        with (
            h.timed(result),
            h.Gunicorn("reliability.app:create_app()", env, workers=4) as server,
        ):
            client = h.Client([(server.host, server.port)], timeout=15, budget=120)
            make = functools.partial(h.new_operation, route)
            with Restarter(ctx, mode, times, warm, rng) as restarter:
                ops = h.drive(
                    client, make, count=100_000, concurrency=6, seconds=restarter.schedule
                )
        if restarter.error is not None:
            result.failures.append(f"restarting PostgreSQL failed: {restarter.error!r}")
        result.add_operations(ops)
        result.faults[f"{mode} restart"] += restarter.restarts
        h.count_ledger(url, ops, result)
        h.count_stuck(url, result)
        in_doubt = [
            op
            for op in ops
            if op.settled is not None and op.settled.replayed and len(op.answers) > 1
        ]
        result.extra["503 problem+json answers (database down)"] = result.answers["503"]
        result.extra["replayed after a failed attempt (work committed, answer lost)"] = len(
            in_doubt
        )
        result.extra["seconds down"] = json.dumps([round(d, 1) for d in restarter.downs])
        if not result.answers["503"]:
            result.notes.append("no 503 while the database was down: the outage was not seen")
        ctx.show(result)
        results.append(result)
    return results
