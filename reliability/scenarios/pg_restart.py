"""PostgreSQL restarted (fast and immediate) under load, and commits put in doubt."""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import random
import threading
import time
import typing as t

import sqlalchemy as sa

from reliability import _harness as h
from reliability._context import Context
from reliability.pgproxy import CommitCutter, Cut

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

A restart rarely catches a COMMIT in flight, so the *commits in doubt* runs make them on purpose,
on psycopg2 and on psycopg 3: a PostgreSQL-aware proxy between the app and the database
(`reliability/pgproxy.py`) reads the app's side of the protocol and, on 7% of the COMMITs of a
transaction carrying a key (the request's), cuts the connection on both sides without passing
the answer on, one of three ways drawn per cut: **after the server answered** (the COMMIT
forwarded, the answer awaited and kept: the commit happened, the app never hears so), **right
after sending** (the database's side reset just after the COMMIT: it may or may not happen) or
**withheld** (the COMMIT never forwarded: it surely did not happen). To the app the three look
alike: its COMMIT went out and the connection dropped. On the leased route that hits
the claim's commit as well as the work's. Counted: commits cut (faults), the app's answers to the
cut attempts, how each cut operation settled (a replay of its stored response, or its work run
once more), and checked against the database: an operation whose commit the server confirmed
must be answered with its replay, never run again; one whose COMMIT was withheld must run again;
every cut operation that succeeded has exactly one ledger row, and its answer names that row.
The last two runs use a route whose view commits its row itself: there the extension settles
a cut COMMIT on a new connection, and when it landed keeps the failure (`failed-after-commit`,
replayed to every retry: the work stays and must not run again).
"""

#: (label, route, halt mode)
RUNS: list[tuple[str, str, str]] = [
    ("plain, fast restarts", "/plain", "fast"),
    ("plain, immediate restarts", "/plain", "immediate"),
    ("leased, fast restarts", "/leased", "fast"),
    ("leased, immediate restarts", "/leased", "immediate"),
]

#: (label, route, SQLAlchemy driver): the commits-in-doubt runs.
DOUBT_RUNS: list[tuple[str, str, str]] = [
    ("plain, commits in doubt, psycopg2", "/plain", "psycopg2"),
    ("leased, commits in doubt, psycopg2", "/leased", "psycopg2"),
    ("plain, commits in doubt, psycopg 3", "/plain", "psycopg"),
    ("leased, commits in doubt, psycopg 3", "/leased", "psycopg"),
    ("view commits itself, commits in doubt, psycopg2", "/committing", "psycopg2"),
    ("view commits itself, commits in doubt, psycopg 3", "/committing", "psycopg"),
]
#: The share of keyed COMMITs the proxy cuts.
CUT_RATE = 0.07
FAULT_NAMES = {
    "answered": "COMMIT cut after the server answered",
    "sent": "COMMIT cut right after sending",
    "withheld": "COMMIT withheld, connection cut",
}


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
    for label, route, mode in RUNS if not ctx.scale.short else RUNS[0::3]:
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
    # The short run (CI) takes each route once, the drivers alternating.
    doubt = DOUBT_RUNS if not ctx.scale.short else DOUBT_RUNS[0::3] + DOUBT_RUNS[5:]
    for label, route, driver in doubt:
        result = run_in_doubt(ctx, label, route, driver, len(results))
        ctx.show(result)
        results.append(result)
    return results


def run_in_doubt(ctx: Context, label: str, route: str, driver: str, index: int) -> h.Result:
    """One commits-in-doubt run: ``route`` served through the proxy on ``driver``."""
    result = h.Result(f"{NAME}: {label}", label)
    if importlib.util.find_spec(driver) is None:
        result.skipped = f"the driver {driver} is not installed (pip install {driver}[binary])"
        return result
    database = sa.make_url(ctx.database(f"pg_restart_{index}"))
    url = database.set(drivername=f"postgresql+{driver}").render_as_string(hide_password=False)
    h.reset_tables(url)
    with (
        h.timed(result),
        CommitCutter(url, rate=CUT_RATE, seed=index) as proxy,
    ):
        env = {"RELIABILITY_DATABASE_URL": proxy.url(), "RELIABILITY_LEASE": "3"}
        with h.Gunicorn("reliability.app:create_app()", env, workers=4) as server:
            client = h.Client([(server.host, server.port)], timeout=15, budget=120)
            make = functools.partial(h.new_operation, route)
            ops = h.drive(
                client,
                make,
                count=ctx.scale.pick(5_000, 1_000),
                concurrency=6,
                seconds=ctx.scale.pick(40.0, 7.0),
            )
        cuts, commits, opaque = list(proxy.cuts), proxy.commits, proxy.opaque
    result.add_operations(ops)
    for cut in cuts:
        result.faults[FAULT_NAMES[cut.mode]] += 1
    h.count_ledger(url, ops, result)
    h.count_stuck(url, result)
    judge_cuts(url, ops, cuts, result)
    result.extra["keyed COMMITs seen / cut"] = f"{commits['keyed']:,} / {len(cuts)}"
    if opaque:
        result.notes.append(f"{opaque} encrypted connections the proxy could not read (never cut)")
    if not cuts:
        result.failures.append("no COMMIT was cut: the run shows nothing about commits in doubt")
    return result


def _ledger(url: str, keys: t.Iterable[str]) -> dict[str, list[int]]:
    """The ledger rows' ids per key, for ``keys``."""
    wanted = list(keys)
    rows: dict[str, list[int]] = collections.defaultdict(list)
    if not wanted:
        return rows
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.text(
                "SELECT key, id FROM reliability_ledger WHERE key IN :keys ORDER BY id"
            ).bindparams(sa.bindparam("keys", expanding=True))
            for key, row_id in conn.execute(query, {"keys": wanted}):
                rows[str(key)].append(int(row_id))
    finally:
        engine.dispose()
    return rows


def _answer_id(answer: h.Answer) -> int | None:
    try:
        body = json.loads(answer.body)
    except ValueError:
        return None
    value = body.get("id") if isinstance(body, dict) else None
    return value if isinstance(value, int) else None


def judge_cuts(
    url: str, ops: t.Sequence[h.Operation], cuts: t.Sequence[Cut], result: h.Result
) -> None:
    """What became of each cut operation, checked against the ledger; figures in
    ``result.extra``, broken promises in ``result.failures``."""
    by_key = {op.key: op for op in ops}
    per_key: dict[str, list[Cut]] = collections.defaultdict(list)
    unmatched = 0
    for cut in cuts:
        (key,) = cut.keys if len(cut.keys) == 1 else (None,)
        if key is None or key not in by_key:
            unmatched += 1
            continue
        per_key[key].append(cut)
    rows = _ledger(url, per_key)
    first_answers: collections.Counter[str] = collections.Counter()
    server_said: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    settled: collections.Counter[str] = collections.Counter()
    answer_409 = 0
    named_row = 0
    succeeded = 0
    for key, key_cuts in per_key.items():
        op = by_key[key]
        for cut in key_cuts:
            kinds[f"{'work' if cut.work else 'record only'}, {cut.mode}"] += 1
            if cut.mode == "answered" and cut.server_said is not None:
                server_said[cut.server_said] += 1
        # Nothing else fails in these runs: the first attempt is the one cut first.
        first_answers[str(op.answers[0].status) if op.answers else "none"] += 1
        answer_409 += sum(a.status == 409 for a in op.answers)
        work_cuts = [c for c in key_cuts if c.work]
        # The work's commit: landed (the server said so; then no later attempt
        # commits work), not landed (withheld), or in doubt (sent), as last cut.
        if any(c.mode == "answered" and c.server_said == "COMMIT" for c in work_cuts):
            fate = "landed"
        elif work_cuts:
            fate = "in doubt" if work_cuts[-1].mode == "sent" else "not landed"
        else:
            fate = ""
        if op.settled is None:
            settled["unsettled"] += 1
            continue
        how = "replayed" if op.settled.replayed else "ran again"
        settled[f"work commit {fate}: {how}" if fate else f"record-only commit: {how}"] += 1
        wrong = {"landed": "ran again", "not landed": "replayed"}.get(fate)
        if fate == "not landed" and len(key_cuts) == 1 and len(op.answers) > 1:
            # A commit that never happened may still end in a replay: a later attempt
            # ran the work and its own answer was lost (a 503, a dropped connection)
            # after storing it. Only the attempt right after the cut must not replay.
            wrong = "replayed" if op.answers[1].replayed else None
        elif fate == "not landed":
            wrong = None  # several cuts: the later ones decide; the ledger check stands
        if wrong == how:
            modes = [(c.mode, c.server_said) for c in work_cuts]
            result.failures.append(
                f"{key}: its work commit {fate} (cuts {modes}),"
                f" yet the retry {how} (answers {[a.status for a in op.answers]},"
                f" ledger rows {rows.get(key)})"
            )
        if op.succeeded:
            succeeded += 1
            ids = rows.get(key, [])
            if len(ids) == 1 and _answer_id(op.settled) == ids[0]:
                named_row += 1
            else:
                result.failures.append(
                    f"{key}: answered {op.settled.status} naming row {_answer_id(op.settled)},"
                    f" ledger rows {ids}"
                )
    result.extra["cut commits by kind and mode"] = dict(sorted(kinds.items()))
    result.extra["server's answer to the COMMITs cut after it answered"] = dict(server_said)
    result.extra["first answer to a cut operation"] = dict(sorted(first_answers.items()))
    result.extra["how the cut operations settled"] = dict(sorted(settled.items()))
    result.extra["409 answers to cut operations (their record in progress)"] = answer_409
    result.extra["cut operations answered with their one ledger row"] = f"{named_row} / {succeeded}"
    if unmatched:
        result.notes.append(f"{unmatched} cut COMMITs named no single operation's key")
