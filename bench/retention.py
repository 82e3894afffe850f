"""Retention at scale: row deletes against dropped partitions:
``python -m bench.retention [--quick] ...``.

Two tables in one PostgreSQL with the same columns: the record table
(``idempotency_keys``, one table, as the extension makes it) and a copy
partitioned by range of ``expires_at`` (``idempotency_keys_parted``: a partition
for what has expired, one for the rest). PostgreSQL takes a unique key on a
partitioned table only if it holds the partition key, so the copy's primary key
is ``(scope, key, expires_at)``: (scope, key) is unique within a partition only.

1. **Cost of retention.** ``--rows`` (1,000,000) expired records in each; writers
   (``--writers`` processes, a hand-written claim transaction every ``--gap``
   seconds, the same statements on either table) write to one table while its
   expired records go: on the record table by the extension's batched purge
   (:func:`flask_idempotency.jobs.purge_expired`, batches of
   ``IDEMPOTENCY_PURGE_BATCH``), on the copy by ``DETACH PARTITION ...
   CONCURRENTLY`` and ``DROP TABLE``. Reported: time, rows/s, writers' p99
   during against without (before and after), dead tuples, size, and the
   ``VACUUM`` the deletes leave behind.
2. **The boundary.** On the copy a key claimed just before a partition boundary
   and retried just after lands in the next partition: the retry's insert
   succeeds and the operation would run twice. Shown with the claim as is, and
   with a guard (a per-key advisory lock, then a look for an unexpired record in
   every partition), which keeps one record.
3. **The guard's price.** Claims one after the other, alternating: on the
   record table, on the copy without the guard, on the copy with it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import statistics
import sys
import time
import typing as t
import uuid

import sqlalchemy as sa

from bench import harness
from bench.harness import percentile, say

NAME = "bench.retention"
PLAIN = "idempotency_keys"
PARTED = "idempotency_keys_parted"
EXPIRED_PART = "idempotency_keys_p_expired"
PURGER = "bench-retention-purge"

PARTITIONED = f"""
CREATE TABLE {PARTED} (LIKE {PLAIN} INCLUDING DEFAULTS) PARTITION BY RANGE (expires_at);
ALTER TABLE {PARTED} ADD CONSTRAINT {PARTED}_pk PRIMARY KEY (scope, key, expires_at);
CREATE INDEX {PARTED}_expires_at ON {PARTED} (expires_at);
CREATE TABLE {EXPIRED_PART} PARTITION OF {PARTED}
    FOR VALUES FROM (MINVALUE) TO ('{{boundary}}') WITH (fillfactor = 90);
CREATE TABLE idempotency_keys_p_live PARTITION OF {PARTED}
    FOR VALUES FROM ('{{boundary}}') TO (MAXVALUE) WITH (fillfactor = 90)
"""


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url, poolclass=sa.pool.NullPool)


def _autocommit(url: str, *statements: str) -> None:
    engine = _engine(url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for statement in statements:
                conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def _scalar(url: str, sql: str) -> t.Any:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql)).scalar_one()
    finally:
        engine.dispose()


def setup(url: str, rows: int, chunk: int = 250_000) -> None:
    from tests.conftest import reset_tables
    from tests.support import testapp

    testapp.create_app(url)
    _autocommit(url, f"DROP TABLE IF EXISTS {PARTED} CASCADE")
    reset_tables(url)
    engine = _engine(url)
    try:
        with engine.begin() as conn:
            boundary = conn.execute(sa.text("SELECT now()")).scalar_one()
            for statement in PARTITIONED.format(boundary=boundary.isoformat()).split(";"):
                conn.execute(sa.text(statement))
        for table in (PLAIN, PARTED):
            harness.seed_expired(engine, table, rows, chunk)
            say(f"seeded {rows:,} expired records in {table}")
    finally:
        engine.dispose()
    _autocommit(url, f"VACUUM (ANALYZE) {PLAIN}", f"VACUUM (ANALYZE) {PARTED}", "CHECKPOINT")
    left = _scalar(url, f"SELECT count(*) FROM {EXPIRED_PART}")
    if left != rows:
        raise RuntimeError(f"the expired partition holds {left} of {rows}")


# A table and its partitions (pg_partition_tree gives nothing for a plain table).
_TREE = "SELECT relid FROM pg_partition_tree('{table}') UNION SELECT '{table}'::regclass"


def _size(url: str, table: str) -> float:
    """MiB of ``table`` with its indexes (of every partition, for the copy)."""
    return float(
        _scalar(
            url,
            "SELECT sum(pg_total_relation_size(relid)) / 1048576.0 "
            f"FROM ({_TREE.format(table=table)}) AS tree",
        )
    )


def _dead(url: str, table: str) -> int:
    return int(
        _scalar(
            url,
            "SELECT coalesce(sum(n_dead_tup), 0) FROM pg_stat_user_tables "
            f"WHERE relid IN ({_TREE.format(table=table)})",
        )
    )


def row_deletes(url: str, args: argparse.Namespace) -> dict[str, t.Any]:
    from flask_idempotency.jobs import purge_expired
    from tests.support import testapp

    app = testapp.create_app(harness.named(url, PURGER), IDEMPOTENCY_SCOPE=lambda: "purge")
    before = _size(url, PLAIN)

    def purge() -> int:
        deleted = purge_expired(app).deleted
        with app.app_context():
            testapp.db.engine.dispose()
        return deleted

    writers = harness.Writers(
        url, count=args.writers, gap=args.gap, mode=harness.WRITER_SQL, table=PLAIN
    )
    say("row deletes: writers alone, the extension's purge, writers alone")
    phased = harness.under_writers(writers, purge, args.quiet)
    if phased.result != args.rows:
        raise RuntimeError(f"the purge deleted {phased.result} of {args.rows}")
    harness.wait_backends_gone(url, PURGER)
    dead, after = _dead(url, PLAIN), _size(url, PLAIN)
    start = time.perf_counter()
    _autocommit(url, f"VACUUM {PLAIN}")
    vacuum = time.perf_counter() - start
    return {
        **phased.figures(),
        "seconds": phased.seconds,
        "rows_per_s": args.rows / phased.seconds,
        "dead": dead,
        "mib_before": before,
        "mib_after": after,
        "vacuum_s": vacuum,
        "mib_vacuumed": _size(url, PLAIN),
    }


def partition_drop(url: str, args: argparse.Namespace) -> dict[str, t.Any]:
    before = _size(url, PARTED)

    def drop() -> None:
        _autocommit(
            url,
            f"ALTER TABLE {PARTED} DETACH PARTITION {EXPIRED_PART} CONCURRENTLY",
            f"DROP TABLE {EXPIRED_PART}",
        )

    writers = harness.Writers(
        url, count=args.writers, gap=args.gap, mode=harness.WRITER_SQL_GUARDED, table=PARTED
    )
    say("partition drop: writers alone (guarded claims), DETACH CONCURRENTLY + DROP, writers alone")
    phased = harness.under_writers(writers, drop, args.quiet)
    expired = _scalar(url, f"SELECT count(*) FROM {PARTED} WHERE expires_at <= now()")
    if expired:
        raise RuntimeError(f"{expired} expired records left in the partitioned copy")
    return {
        **phased.figures(),
        "seconds": phased.seconds,
        "rows_per_s": args.rows / phased.seconds,
        "dead": _dead(url, PARTED),
        "mib_before": before,
        "mib_after": _size(url, PARTED),
        "vacuum_s": 0.0,
        "mib_vacuumed": _size(url, PARTED),
    }


BOUNDARY_DEMO = """
CREATE TABLE boundary_demo (LIKE {plain} INCLUDING DEFAULTS) PARTITION BY RANGE (expires_at);
ALTER TABLE boundary_demo ADD PRIMARY KEY (scope, key, expires_at);
CREATE TABLE boundary_demo_a PARTITION OF boundary_demo
    FOR VALUES FROM ('{a}') TO ('{b}');
CREATE TABLE boundary_demo_b PARTITION OF boundary_demo
    FOR VALUES FROM ('{b}') TO ('{c}')
"""

_DEMO_CLAIM = """
INSERT INTO boundary_demo (scope, key, request_hash, status, fencing_token, body_omitted,
                           created_at, expires_at)
VALUES ('demo', %(key)s, 'h', 'completed', 1, false, now(), %(expires)s)
ON CONFLICT DO NOTHING
"""


def boundary(url: str) -> dict[str, int]:
    """Records for one key after a claim just before a partition boundary and
    its retry just after, without and with the guard."""
    import psycopg2

    now = dt.datetime.now(dt.timezone.utc)
    edge = now + dt.timedelta(days=1)
    _autocommit(
        url,
        *BOUNDARY_DEMO.format(
            plain=PLAIN,
            a=(now - dt.timedelta(days=1)).isoformat(),
            b=edge.isoformat(),
            c=(edge + dt.timedelta(days=2)).isoformat(),
        ).split(";"),
    )
    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg2.connect(dsn)
    found = {}
    try:
        for guarded in (False, True):
            key = str(uuid.uuid4())
            for expires in (
                edge - dt.timedelta(milliseconds=1),
                edge + dt.timedelta(milliseconds=1),
            ):
                params = {"scope": "demo", "key": key, "expires": expires}
                with conn.cursor() as cur:
                    if guarded:
                        cur.execute(harness.GUARD.format(table="boundary_demo"), params)
                        if cur.fetchone() is not None:
                            conn.rollback()
                            continue
                    cur.execute(_DEMO_CLAIM, params)
                conn.commit()
            with conn.cursor() as cur:
                cur.execute("SELECT count(*) FROM boundary_demo WHERE key = %s", (key,))
                found["guarded" if guarded else "as is"] = int(cur.fetchone()[0])
            conn.commit()
    finally:
        conn.close()
        _autocommit(url, "DROP TABLE boundary_demo")
    return found


def guard_price(url: str, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Claims one after the other, alternating in rounds: p50/p99 (ms) per kind."""
    ops = {
        "record table": harness._sql_op(url, PLAIN),
        "partitioned, as is": harness._sql_op(url, PARTED),
        "partitioned, guarded": harness._sql_op(url, PARTED, guarded=True),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for op in ops.values():
        op()
    for i in range(args.rounds):
        order = list(ops) if i % 2 == 0 else list(reversed(ops))
        for name in order:
            for _ in range(args.claims):
                start = time.perf_counter()
                if not ops[name]():
                    raise RuntimeError(f"{name}: a new key was not claimed")
                times[name].append(time.perf_counter() - start)
    return {
        name: {"p50": percentile(v, 0.5) * 1000, "p99": percentile(v, 0.99) * 1000}
        for name, v in times.items()
    }


def _median_of(values: list[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return statistics.median(known) if known else math.nan


def _median(runs: list[dict[str, t.Any]]) -> dict[str, t.Any]:
    """The median over rounds of each figure the decision and the plot use."""
    return {
        "seconds": statistics.median(f["seconds"] for f in runs),
        "rows_per_s": statistics.median(f["rows_per_s"] for f in runs),
        "p99_ratio": _median_of([f["p99_ratio"] for f in runs]),
        "vacuum_s": statistics.median(f["vacuum_s"] for f in runs),
        "p99": [
            statistics.median(f["baseline"]["p99"] for f in runs),
            statistics.median(f["during"]["p99"] for f in runs),
        ],
    }


def section(r: dict[str, t.Any], facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rows = []
    for label, runs in (
        ("row deletes (`purge_expired`)", r["deletes"]),
        ("partition DETACH + DROP", r["drop"]),
    ):
        for i, f in enumerate(runs, 1):
            base, during = f["baseline"], f["during"]
            rows.append(
                f"| {label} | {i} | {f['seconds']:.2f} | {f['rows_per_s']:,.0f} | "
                f"{harness.cell(base)} | {harness.cell(during)} | "
                f"{harness.times(f['p99_ratio'])} | {f['dead']:,} | "
                f"{f['mib_before']:,.0f} → {f['mib_after']:,.0f} | "
                f"{f['vacuum_s']:.1f} |"
            )
    price = r["price"]
    base = price["record table"]
    price_rows = [
        f"| {name} | {p['p50']:.3f} | {p['p99']:.3f} | {p['p50'] / base['p50']:.2f}x |"
        for name, p in price.items()
    ]
    b = r["boundary"]
    d, p = _median(r["deletes"]), _median(r["drop"])
    data = {
        "deletes": {k: d[k] for k in ("seconds", "rows_per_s", "p99_ratio")},
        "drop": {k: p[k] for k in ("seconds", "rows_per_s", "p99_ratio")},
        "deletes_p99": d["p99"],
        "drop_p99": p["p99"],
        "deletes_ratios": [f["p99_ratio"] for f in r["deletes"] if not math.isnan(f["p99_ratio"])],
        "drop_ratios": [f["p99_ratio"] for f in r["drop"] if not math.isnan(f["p99_ratio"])],
        "price": price,
        "boundary": b,
    }
    return [
        "## Retention at scale: row deletes or dropped partitions (`python -m bench.retention`)",
        "",
        *facts.lines(),
        f"* {args.rows:,} expired records in each table (200-byte bodies); {args.writers} writer "
        f"processes, a claim transaction (insert, completion, commit) every {args.gap * 1000:g} ms "
        f"each, alone for {args.quiet:g} s before and after the cleanup and during it; on the "
        f"partitioned copy with the guard its claims need (below); {args.cleanups} rounds, "
        "each on freshly seeded tables",
        "",
        "| cleanup | round | seconds | rows/s | writers without: p50 / p99 / max ms (ops) | "
        "during: p50 / "
        "p99 / max ms (ops) | p99 during / without | dead tuples after | MiB before → after | "
        "VACUUM after, s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "The boundary: a claim with `expires_at` 1 ms before a partition boundary, its retry",
        "1 ms after (`INSERT ... ON CONFLICT DO NOTHING` on the copy, whose unique key must",
        "hold the partition key):",
        "",
        f"* as is: **{b['as is']} records** for one key: the retry's insert won in the next",
        "  partition, and its operation would run a second time;",
        f"* guarded (a per-key `pg_advisory_xact_lock`, then a look for an unexpired record of the "
        f"key in every partition): {b['guarded']} record.",
        "",
        f"The guard's price: {args.rounds} alternating rounds of {args.claims} claims each, one "
        "after the other on one connection (the writers' statements):",
        "",
        "| claim on | p50 ms | p99 ms | p50 / record table |",
        "|---|---:|---:|---:|",
        *price_rows,
        "",
        "**Decision: one table stays.** "
        f"Medians over {len(r['deletes'])} rounds: row deletes took {d['seconds']:.0f} s "
        f"({d['rows_per_s']:,.0f} rows/s) with the "
        f"writers' p99 at {harness.times(d['p99_ratio'])} its level without them ("
        f"{'within' if d['p99_ratio'] <= 1.5 else 'not within'} the 1.5x cleanup target), then a "
        f"{d['vacuum_s']:.1f} s `VACUUM`; dropping the partition took {p['seconds']:.2f} s, "
        f"writers' p99 {harness.times(p['p99_ratio'])}, and left nothing to vacuum. Cheaper, but a "
        "partitioned table cannot keep (scope, key) unique: the boundary case above runs twice. "
        "The guard that prevents it costs "
        f"{price['partitioned, guarded']['p50'] / base['p50']:.2f}x the record table's claim "
        "(p50) here and adds a lock and a probe of every live partition to every claim, and "
        "its correctness would rest on every writer taking it. See "
        "[docs/performance.md](docs/performance.md#retention-one-table-and-batched-cleanup) "
        "for what to tune at high throughput.",
        "",
        harness.data_comment(NAME, data),
    ]


def measure(url: str, args: argparse.Namespace) -> dict[str, t.Any]:
    """Both cleanups in rounds, the boundary case (checked) and the guard's price."""
    results: dict[str, t.Any] = {"deletes": [], "drop": []}
    for i in range(args.cleanups):
        say(f"round {i + 1}/{args.cleanups}")
        setup(url, args.rows)
        results["deletes"].append(row_deletes(url, args))
        results["drop"].append(partition_drop(url, args))
    results["boundary"] = boundary(url)
    results["price"] = guard_price(url, args)
    if results["boundary"] != {"as is": 2, "guarded": 1}:
        raise RuntimeError(f"unexpected boundary outcome: {results['boundary']}")
    say(f"boundary: {results['boundary']}; guard's price: {results['price']}")
    return results


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rows", type=int, help="expired records per table (default 1,000,000)")
    parser.add_argument("--writers", type=int, default=3, help="writer processes")
    parser.add_argument("--gap", type=float, default=0.05, help="seconds between a writer's claims")
    parser.add_argument("--quiet", type=float, help="seconds of writers alone before and after")
    parser.add_argument("--cleanups", type=int, help="rounds of both cleanups (default 3; quick 1)")
    parser.add_argument("--rounds", type=int, help="rounds of the guard's price (default 5)")
    parser.add_argument("--claims", type=int, help="claims per kind per round (default 300)")
    return {
        "rows": (5_000, 1_000_000),
        "quiet": (1.0, 10.0),
        "cleanups": (1, 3),
        "rounds": (1, 5),
        "claims": (30, 300),
    }


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section)


if __name__ == "__main__":
    sys.exit(main())
