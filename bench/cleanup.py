"""Cleanup under load: ``python -m bench.cleanup [--quick] ...``.

Seeds ``--rows`` (1,000,000) expired records in the record table (SQL
``generate_series``, 200-byte response bodies), vacuums and analyzes it, then
runs the extension's cleanup (:func:`flask_idempotency.jobs.purge_expired`,
what ``flask idempotency purge`` and the scheduler's job call) while writers
claim new keys through the extension (``--writers`` processes, each a
``POST /charges`` of the test app with a new key every ``--gap`` seconds: the
claim, a ledger row, the completion, one commit, in the same table).

Reported per batch size (``--batch-sizes``, default 1000, the default
``IDEMPOTENCY_PURGE_BATCH``, and 10000): rows deleted per second, and the
writers' latency (p50, p99, max) while the cleanup runs against the same
writers before it, ``--quiet`` seconds (and, shown apart, as long after it), in the same run
(target: p99 at most 1.5 times); dead tuples left for vacuum (autovacuum is
on, as in production) and how long a ``VACUUM`` then takes.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import typing as t

import sqlalchemy as sa

from bench import harness
from bench.harness import say

NAME = "bench.cleanup"
TARGET = 1.5
PURGER = "bench-purge"

SEED = """
INSERT INTO idempotency_keys
    (scope, key, request_hash, status, fencing_token, response_code, response_body,
     body_omitted, created_at, completed_at, expires_at)
SELECT 'bulk', md5(i::text), md5((-i)::text), 'completed', i, 201,
       convert_to(repeat('x', 200), 'UTF8'), false,
       now() - interval '2 days', now() - interval '2 days',
       now() - interval '1 hour' - i * interval '1 millisecond'
FROM generate_series(:first, :last) AS i
"""


def seed(url: str, rows: int, chunk: int = 250_000) -> None:
    """``rows`` expired records, in statements of ``chunk``, then VACUUM ANALYZE."""
    engine = sa.create_engine(url)
    try:
        for first in range(1, rows + 1, chunk):
            with engine.begin() as conn:
                conn.execute(sa.text(SEED), {"first": first, "last": min(rows, first + chunk - 1)})
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


def purge(url: str, batch: int, batch_times: list[float]) -> t.Callable[[], int]:
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
        report = purge_expired(app, batch_size=batch)
        with app.app_context():
            testapp.db.engine.dispose()
        return report.deleted

    return run


def first_and_last(times: t.Sequence[float]) -> tuple[float, float]:
    """Mean ms of the first and of the last tenth of the full batches (the last,
    short one left out)."""
    full = list(times[:-1]) or list(times)
    k = max(1, len(full) // 10)
    return sum(full[:k]) / k * 1000, sum(full[-k:]) / k * 1000


def one_batch_size(
    url: str, batch: int, round_no: int, args: argparse.Namespace
) -> dict[str, t.Any]:
    from tests.conftest import reset_tables

    reset_tables(url)
    say(f"round {round_no}, batch {batch}: seeding {args.rows:,} expired records")
    seed(url, args.rows)
    seeded = table_facts(url)
    writers = harness.Writers(url, count=args.writers, gap=args.gap, mode=harness.WRITER_EXT)
    say(f"batch {batch}: writers alone {args.quiet:g} s, the purge, writers alone {args.quiet:g} s")
    batch_times: list[float] = []
    action = purge(url, batch, batch_times)
    phased = harness.under_writers(writers, action, args.quiet)
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
        f"batch {batch}: {figures['rows_per_s']:,.0f} rows/s; writers p99 "
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
            f"| {r['batch']:,} | {r['round']} | {r['rows']:,} | {r['seconds']:.1f} | "
            f"{r['rows_per_s']:,.0f} | {harness.cell(base)} | {harness.cell(during)} | "
            f"{harness.times(r['p99_ratio'])} | {harness.cell(r['after'])} | "
            f"{r['batch_ms'][0]:,.0f} → {r['batch_ms'][1]:,.0f} | "
            f"{r['dead_after']:,.0f} | {r['vacuum_s']:.1f} |"
        )
    for batch in args.batch_sizes:
        mine = [r for r in results if r["batch"] == batch]
        known = [r["p99_ratio"] for r in mine if not math.isnan(r["p99_ratio"])]
        ratio = statistics.median(known) if known else math.nan
        met = "met" if ratio <= TARGET else "NOT met" if known else "not measured"
        each = ", ".join(harness.times(r["p99_ratio"]) for r in mine)
        verdicts.append(
            f"* batch {batch:,}: writers' p99 during cleanup {harness.times(ratio)} their p99 "
            "before it "
            f"(median over rounds; rounds: {each}): "
            f"target at most {TARGET}x {met}; "
            f"{statistics.median(r['rows_per_s'] for r in mine):,.0f} rows/s."
        )
        data[str(batch)] = {
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
        data[str(batch)]["ratios"] = known
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
        f"{args.rounds} rounds, the batch sizes in alternating order",
        "",
        "| batch | round | rows | seconds | rows/s | writers before cleanup: p50 / p99 / max ms "
        "(ops) | during cleanup: p50 / p99 / max ms (ops) | p99 during / before | after cleanup: "
        "p50 / p99 / max ms (ops) | ms per batch, first → last tenth | dead tuples after | "
        "VACUUM after, s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
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
        harness.data_comment(NAME, data),
    ]


def measure(url: str, args: argparse.Namespace) -> list[t.Any]:
    """Every batch size, in rounds (the order alternating)."""
    from tests.support import testapp

    testapp.create_app(url)  # the extension's tables on the metadata
    results = []
    for i in range(args.rounds):
        order = args.batch_sizes if i % 2 == 0 else list(reversed(args.batch_sizes))
        results += [one_batch_size(url, batch, i + 1, args) for batch in order]
    return results


def main(argv: t.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {NAME}", description=__doc__.split("\n\n")[0])
    harness.common_options(parser)
    parser.add_argument("--rows", type=int, help="expired records (default 1,000,000)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--writers", type=int, default=3, help="writer processes")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between a writer's claims")
    parser.add_argument("--quiet", type=float, help="seconds of writers alone before and after")
    parser.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.rows = args.rows or (5_000 if args.quick else 1_000_000)
    args.quiet = args.quiet or (1.0 if args.quick else 10.0)
    return harness.run_section(
        NAME, argv, args, lambda cluster: measure(cluster.url(), args), section
    )


if __name__ == "__main__":
    sys.exit(main())
