"""Cleanup under load: ``python -m bench.cleanup [--quick] ...``.

Seeds ``--rows`` (1,000,000) expired records in the record table (SQL
``generate_series``, 200-byte response bodies), vacuums and analyzes it, then
runs the extension's cleanup (:func:`flask_idempotency.jobs.purge_expired`,
what ``flask idempotency purge`` and the scheduler's job call) while writers
claim new keys through the extension (``--writers`` processes, each a
``POST /charges`` of the test app with a new key every ``--gap`` seconds: the
claim, a ledger row, the completion, one commit, in the same table).

Reported per batch size (``--batch-sizes``, default 1000, the default
``IDEMPOTENCY_PURGE_BATCH``, and 10000) and pause after each batch (``--pauses``,
default the cleanup's default and 0, flat out): rows deleted per second, and the
writers' latency (p50, p99, max) while the cleanup runs against the same
writers before it, ``--quiet`` seconds (and, shown apart, as long after it), in the same run
(target: p99 at most 1.5 times at the default batch and pause, reported met or
not); what the writers' backends waited on meanwhile; dead tuples left for vacuum (autovacuum is
on, as in production) and how long a ``VACUUM`` then takes.
"""

from __future__ import annotations

import argparse
import collections
import math
import statistics
import sys
import threading
import time
import typing as t

import sqlalchemy as sa

from bench import harness
from bench.harness import say
from flask_idempotency._maintenance.jobs import PURGE_PAUSE

NAME = "bench.cleanup"
TARGET = 1.5
DEFAULT_BATCH = 1000  # IDEMPOTENCY_PURGE_BATCH's default
PURGER = "bench-purge"


def seed(url: str, rows: int, chunk: int = 250_000) -> None:
    """``rows`` expired records, in statements of ``chunk``, then VACUUM ANALYZE."""
    engine = sa.create_engine(url)
    try:
        harness.seed_expired(engine, "idempotency_keys", rows, chunk)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM (ANALYZE) idempotency_keys"))
            conn.execute(sa.text("CHECKPOINT"))
    finally:
        engine.dispose()


def table_facts(url: str) -> dict[str, float]:
    """Dead tuples, size (heap and indexes, MiB) and expired records left."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            dead, size = conn.execute(
                sa.text(
                    "SELECT n_dead_tup, pg_total_relation_size('idempotency_keys') / 1048576.0 "
                    "FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'"
                )
            ).one()
            expired = conn.execute(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE expires_at <= now()")
            ).scalar_one()
        return {"dead": float(dead), "mib": float(size), "expired": float(expired)}
    finally:
        engine.dispose()


def vacuum_seconds(url: str) -> float:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            start = time.perf_counter()
            conn.execute(sa.text("VACUUM idempotency_keys"))
            return time.perf_counter() - start
    finally:
        engine.dispose()


def purge(url: str, batch: int, pause: float, batch_times: list[float]) -> t.Callable[[], int]:
    """The extension's cleanup on a connection named :data:`PURGER` (so its
    backend's counts can be waited for); each batch's statement time is
    appended to ``batch_times`` (the store's method, timed from outside)."""
    from flask_idempotency._context import app_state
    from flask_idempotency.jobs import purge_expired
    from tests.support import testapp

    app = testapp.create_app(harness.named(url, PURGER), IDEMPOTENCY_SCOPE=lambda: "purge")
    store = app_state(app).store
    purge_batch = store.purge_batch

    def timed(conn: sa.Connection, now: t.Any, limit: int, **bound: t.Any) -> t.Any:
        start = time.perf_counter()
        try:
            return purge_batch(conn, now, limit, **bound)
        finally:
            batch_times.append(time.perf_counter() - start)

    store.purge_batch = timed  # type: ignore[method-assign]

    def run() -> int:
        report = purge_expired(app, batch_size=batch, pause=pause)
        with app.app_context():
            testapp.db.engine.dispose()
        return report.deleted

    return run


class WaitSampler:
    """What the writers' backends were doing while the cleanup ran: every
    ``every`` seconds, the wait event of each active backend other than the
    purger's (``CPU`` when none: running, or waiting for a core), counted. The
    profile the cleanup's pacing acts on (lock waits? WAL? CPU?)."""

    def __init__(self, url: str, every: float = 0.02) -> None:
        self.url, self.every = url, every
        self.writers: collections.Counter[str] = collections.Counter()
        self.purger: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        engine = sa.create_engine(harness.named(self.url, "bench-sampler"))
        query = sa.text(
            "SELECT application_name, coalesce(wait_event_type || ':' || wait_event, 'CPU') "
            "FROM pg_stat_activity WHERE state = 'active' AND backend_type = 'client backend' "
            "AND application_name <> 'bench-sampler'"
        )
        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                while not self._stop.wait(self.every):
                    for name, event in conn.execute(query):
                        (self.purger if name == PURGER else self.writers)[event] += 1
        finally:
            engine.dispose()

    def __enter__(self) -> WaitSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    @staticmethod
    def top(counts: collections.Counter[str], n: int = 5) -> str:
        total = sum(counts.values()) or 1
        return ", ".join(f"{k} {v / total:.0%}" for k, v in counts.most_common(n)) or "-"


def first_and_last(times: t.Sequence[float]) -> tuple[float, float]:
    """Mean ms of the first and of the last tenth of the full batches (the last,
    short one left out)."""
    full = list(times[:-1]) or list(times)
    k = max(1, len(full) // 10)
    return sum(full[:k]) / k * 1000, sum(full[-k:]) / k * 1000


def one_batch_size(
    url: str, batch: int, pause: float, round_no: int, args: argparse.Namespace
) -> dict[str, t.Any]:
    from tests.conftest import reset_tables

    reset_tables(url)
    say(f"round {round_no}, batch {batch}, pause {pause:g}: seeding {args.rows:,} expired records")
    seed(url, args.rows)
    seeded = table_facts(url)
    writers = harness.Writers(url, count=args.writers, gap=args.gap, mode=harness.WRITER_EXT)
    say(f"batch {batch}: writers alone {args.quiet:g} s, the purge, writers alone {args.quiet:g} s")
    batch_times: list[float] = []
    action = purge(url, batch, pause, batch_times)
    sampler = WaitSampler(url)

    def sampled() -> int:
        with sampler:
            return action()

    phased = harness.under_writers(writers, sampled, args.quiet)
    say(
        f"batch {batch}: active writers' backends during it: {sampler.top(sampler.writers)}; "
        f"the purger's: {sampler.top(sampler.purger)}"
    )
    if phased.result != args.rows:
        raise RuntimeError(f"the purge deleted {phased.result} of {args.rows}")
    harness.wait_backends_gone(url, PURGER)
    after = table_facts(url)
    if after["expired"]:
        raise RuntimeError(f"{after['expired']} expired records left")
    vacuum = vacuum_seconds(url)
    # Against the writers before the cleanup only: after it, its aftermath (the
    # dirty pages it left written back, autovacuum of its dead tuples) lands in
    # the writers' latency and is no baseline; shown apart.
    before, during = harness.summary(phased.before), harness.summary(phased.during)
    figures: dict[str, t.Any] = {
        "baseline": before,
        "during": during,
        "after": harness.summary(phased.after),
        "p99_ratio": during["p99"] / before["p99"],
    }
    figures.update(
        batch=batch,
        pause=pause,
        waits=sampler.top(sampler.writers, 3),
        round=round_no,
        rows=args.rows,
        seconds=phased.seconds,
        rows_per_s=args.rows / phased.seconds,
        dead_after=after["dead"],
        mib_seeded=seeded["mib"],
        mib_after=after["mib"],
        vacuum_s=vacuum,
        batches=len(batch_times),
        batch_ms=first_and_last(batch_times),
    )
    say(
        f"batch {batch}, pause {pause:g}: {figures['rows_per_s']:,.0f} rows/s; writers p99 "
        f"{figures['baseline']['p99']:.1f} ms before, {figures['during']['p99']:.1f} ms during "
        f"({harness.times(figures['p99_ratio'])})"
    )
    return figures


def section(
    results: list[dict[str, t.Any]], facts: harness.Facts, args: argparse.Namespace
) -> list[str]:
    rows, verdicts, data = [], [], {}
    for r in results:
        base, during = r["baseline"], r["during"]
        rows.append(
            f"| {r['batch']:,} | {r['round']} | {r['rows']:,} | "
            f"{r['seconds']:.1f} | "
            f"{r['rows_per_s']:,.0f} | {harness.cell(base)} | {harness.cell(during)} | "
            f"{harness.times(r['p99_ratio'])} | {harness.cell(r['after'])} | "
            f"{r['batch_ms'][0]:,.0f} → {r['batch_ms'][1]:,.0f} | "
            f"{r['dead_after']:,.0f} | {r['vacuum_s']:.1f} | {r['pause']:g} | {r['waits']} |"
        )
    for batch, pause in variants(args):
        mine = [r for r in results if (r["batch"], r["pause"]) == (batch, pause)]
        known = [r["p99_ratio"] for r in mine if not math.isnan(r["p99_ratio"])]
        ratio = statistics.median(known) if known else math.nan
        met = "met" if ratio <= TARGET else "NOT met" if known else "not measured"
        each = ", ".join(harness.times(r["p99_ratio"]) for r in mine)
        verdicts.append(
            f"* batch {batch:,}{'' if pause == PURGE_PAUSE else f', pause {pause:g}'}: "
            "writers' p99 during cleanup "
            f"{harness.times(ratio)} their p99 before it "
            f"(median over rounds; rounds: {each}): "
            f"target at most {TARGET}x {met}; "
            f"{statistics.median(r['rows_per_s'] for r in mine):,.0f} rows/s."
        )
        label = str(batch) if pause == PURGE_PAUSE else f"{batch}/pause {pause:g}"
        data[label] = {
            key: statistics.median(pick(r) for r in mine)
            for key, pick in (
                ("rows_per_s", lambda r: r["rows_per_s"]),
                ("baseline_p99", lambda r: r["baseline"]["p99"]),
                ("during_p99", lambda r: r["during"]["p99"]),
                ("baseline_p50", lambda r: r["baseline"]["p50"]),
                ("during_p50", lambda r: r["during"]["p50"]),
                ("after_p99", lambda r: r["after"]["p99"]),
                ("p99_ratio", lambda r: r["p99_ratio"]),
            )
        }
        data[label]["ratios"] = known
        if (batch, pause) == (DEFAULT_BATCH, PURGE_PAUSE):
            verdicts.insert(
                0,
                f"* **target** (the default batch {batch:,} and pause {pause:g}): writers' "
                f"p99 during cleanup at most {TARGET}x their p99 before it: {met} "
                f"({harness.times(ratio)}, "
                f"{statistics.median(r['rows_per_s'] for r in mine):,.0f} rows/s).",
            )
    pauses = ", ".join(f"{pause:g}" for pause in args.pauses)
    return [
        "## Cleanup under load (`python -m bench.cleanup`)",
        "",
        *facts.lines(),
        f"* {args.rows:,} expired records (200-byte bodies, "
        f"{results[0]['mib_seeded']:,.0f} MiB with indexes) deleted by `purge_expired` (the "
        f"`flask idempotency purge` path) per batch size; {args.writers} writer processes, "
        f"each `POST /charges` through the extension with a new key every {args.gap * 1000:g} ms, "
        f"alone for {args.quiet:g} s before the cleanup (the baseline), during it, and alone "
        f"{args.quiet:g} s after it (shown apart); "
        f"{args.rounds} rounds, the batch sizes and the pauses after each batch "
        f"({pauses}: the `pause` column) in alternating order",
        "",
        "| batch | round | rows | seconds | rows/s | writers before cleanup: "
        "p50 / p99 / max ms (ops) | during cleanup: p50 / p99 / max ms (ops) | "
        "p99 during / before | after cleanup: "
        "p50 / p99 / max ms (ops) | ms per batch, first → last tenth | dead tuples after | "
        "VACUUM after, s | pause | writers' backends waited on, during |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        *verdicts,
        "",
        "Each batch is one short transaction (`DELETE ... WHERE (scope, key) IN (SELECT ...",
        "WHERE expires_at >= <the previous batch's latest> ORDER BY expires_at LIMIT n FOR",
        "UPDATE SKIP LOCKED)`), so a writer never waits for more than one batch, and the",
        "writers' keys are never among the rows locked. Each batch starts where the previous",
        "one ended, so it does not walk the index entries of the rows deleted before it",
        "(they stay until vacuum); the first and last tenth of the batches show it. A",
        "writer's latency counts from when its request was due (a stalled writer owes the",
        "requests that fell due meanwhile). The baseline is the writers before the cleanup:",
        "in the seconds after it, what it leaves behind (dirty pages written back, autovacuum",
        "of its dead tuples) lands on the writers, the sooner the faster it went, so the after",
        "column is shown apart rather than counted as the cleanup's absence. The dead tuples",
        "are left for (auto)vacuum, which was on during the run; the last column is a manual",
        "`VACUUM` right after.",
        "",
        "What the writers wait on while the cleanup runs (last column: `pg_stat_activity`",
        "sampled every 20 ms, their active backends) is the WAL: `IO:WALSync` and",
        "`LWLock:WALWrite`, flushes behind the cleanup's; never a lock of the cleanup's. So",
        "each batch commits without waiting for its own flush (`synchronous_commit` off for",
        "its transaction), and the cleanup pauses after each batch `pause` times as long as",
        "the batch took (`purge_expired(pause=...)`, `flask idempotency purge --pause`;",
        "default 1: it works half the time, less when a busy database slows its batches).",
        "`pause 0` is the cleanup flat out, in the same run.",
        "",
        harness.data_comment(NAME, data),
    ]


def measure(url: str, args: argparse.Namespace) -> list[t.Any]:
    """Every batch size, in rounds (the order alternating)."""
    from tests.support import testapp

    testapp.create_app(url)  # the extension's tables on the metadata
    results = []
    for i in range(args.rounds):
        order = variants(args) if i % 2 == 0 else list(reversed(variants(args)))
        results += [one_batch_size(url, batch, pause, i + 1, args) for batch, pause in order]
    return results


def variants(args: argparse.Namespace) -> list[tuple[int, float]]:
    """Every (batch size, pause) measured."""
    return [(batch, pause) for batch in args.batch_sizes for pause in args.pauses]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rows", type=int, help="expired records (default 1,000,000)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument(
        "--pauses",
        type=float,
        nargs="+",
        default=[PURGE_PAUSE, 0.0],
        help="the cleanup's pause after each batch, times the batch's duration",
    )
    parser.add_argument("--writers", type=int, default=3, help="writer processes")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between a writer's claims")
    parser.add_argument("--quiet", type=float, help="seconds of writers alone before and after")
    parser.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    return {"rounds": (1, 3), "rows": (5_000, 1_000_000), "quiet": (1.0, 10.0)}


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section)


if __name__ == "__main__":
    sys.exit(main())
