"""The conflict path: ``python -m bench.conflict [--quick] ...``.

A duplicate's claim meets a record that exists. The extension's insert on
PostgreSQL is conflict-tolerant (``INSERT ... ON CONFLICT DO NOTHING``,
:meth:`flask_idempotency._storage.Store.try_insert`); the common alternative
inserts plainly inside a savepoint and catches the unique violation (what the
store itself does on engines without a conflict-tolerant insert: measured here
through that very code, the store with its conflict-tolerant insert switched
off). Each duplicate is one transaction on one connection (psycopg2): the
insert, the read of the record that holds the key, the commit. Variants:

* ``store.claim``: the extension's claim as a request sends it (one batch: the
  wait's bound, the conflict-tolerant insert, the bound restored, the read);
* ``on-conflict``: the conflict-tolerant insert, then the read;
* ``savepoint``: ``SAVEPOINT``, a plain ``INSERT`` that fails on the unique
  index, ``ROLLBACK TO SAVEPOINT``, then the read.

Per variant and round, ``--duplicates`` (10,000) duplicates of as many records,
on a table vacuumed before and with autovacuum off during the variant: the
latency per duplicate (p50/p99), and per 10,000 duplicates the dead tuples
(``n_dead_tup`` of ``pg_stat_user_tables``), the heap's growth in pages and
the WAL written.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import time
import typing as t

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench import harness
from bench.harness import percentile, say
from flask_idempotency._storage import (
    IN_PROGRESS,
    Store,
    new_fencing_token,
    operation_values,
    record_table,
)

NAME = "bench.conflict"
SCOPE = "dup"
WAIT = dt.timedelta(seconds=10)  # IDEMPOTENCY_WAIT's default


class SavepointStore(Store):
    """The store without a conflict-tolerant insert: its savepoint path."""

    def _insert_for(self, name: str) -> t.Any | None:
        return None


SEED = """
INSERT INTO idempotency_keys
    (scope, key, request_hash, status, fencing_token, response_code, response_body,
     body_omitted, created_at, completed_at, expires_at)
SELECT :scope, 'k' || i, md5(i::text), 'completed', i, 201, convert_to('{"id": 1}', 'UTF8'),
       false, now(), now(), now() + interval '1 day'
FROM generate_series(1, :n) AS i
"""

STATS = """
SELECT n_dead_tup, n_tup_ins,
       pg_relation_size('idempotency_keys') / current_setting('block_size')::int,
       pg_current_wal_lsn()
FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'
"""


def _values(key: str) -> dict[str, t.Any]:
    now = dt.datetime.now(dt.timezone.utc)
    return {
        "scope": SCOPE,
        "key": key,
        "fencing_token": new_fencing_token(),
        **operation_values(
            request_hash="0" * 64,
            status=IN_PROGRESS,
            locked_until=now + dt.timedelta(seconds=60),
            created_at=now,
            expires_at=now + dt.timedelta(hours=24),
        ),
    }


def variants(table: sa.Table) -> dict[str, t.Callable[[Session, dict[str, t.Any]], bool]]:
    store, savepoint = Store(table), SavepointStore(table)

    def claim(session: Session, values: dict[str, t.Any]) -> bool:
        inserted, record = store.claim(session, values, WAIT)
        return inserted or record is None

    def insert_then_read(chosen: Store) -> t.Callable[[Session, dict[str, t.Any]], bool]:
        def run(session: Session, values: dict[str, t.Any]) -> bool:
            inserted = chosen.try_insert(session, values)
            record = chosen.load(session, SCOPE, values["key"], stored_request=False)
            return inserted or record is None

        return run

    return {
        "store.claim": claim,
        "on-conflict": insert_then_read(store),
        "savepoint": insert_then_read(savepoint),
    }


WHAT = {
    "store.claim": "the extension's claim: one batch (bound, INSERT ... ON CONFLICT DO NOTHING, "
    "restore, read)",
    "on-conflict": "INSERT ... ON CONFLICT DO NOTHING RETURNING, then the read",
    "savepoint": "SAVEPOINT, plain INSERT, unique violation caught, ROLLBACK TO SAVEPOINT, "
    "then the read",
}


def _stats(admin: sa.Engine, backend: int | None = None) -> tuple[int, int, int, str]:
    """Dead tuples, tuples inserted, heap pages, WAL position; after ``backend``
    has ended (a backend reports its counts on its way out, before it leaves
    ``pg_stat_activity``)."""
    for _ in range(100):  # at most 10 s
        with admin.connect() as conn:
            gone = (
                backend is None
                or not conn.execute(
                    sa.text("SELECT 1 FROM pg_stat_activity WHERE pid = :p"), {"p": backend}
                ).first()
            )
        if gone:
            break
        time.sleep(0.1)
    else:
        raise RuntimeError(f"backend {backend} did not end")
    with admin.connect() as conn:
        return t.cast(tuple[int, int, int, str], tuple(conn.execute(sa.text(STATS)).one()))


def _wal_bytes(admin: sa.Engine, start: str, end: str) -> int:
    with admin.connect() as conn:
        return int(
            conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(CAST(:e AS pg_lsn), CAST(:s AS pg_lsn))"),
                {"s": start, "e": end},
            ).scalar_one()
        )


def run_variant(
    url: str, admin: sa.Engine, run: t.Callable[[Session, dict[str, t.Any]], bool], n: int
) -> dict[str, float]:
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("VACUUM idempotency_keys"))
    before = _stats(admin)
    engine = sa.create_engine(url)
    latencies = []
    try:
        keys = [f"k{i}" for i in range(1, n + 1)]
        random.shuffle(keys)
        with Session(engine) as session:
            backend = int(session.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
            session.commit()
            for key in keys:
                values = _values(key)
                start = time.perf_counter()
                won = run(session, values)
                session.commit()
                latencies.append(time.perf_counter() - start)
                if won:
                    raise RuntimeError(f"a duplicate of {key} was inserted")
    finally:
        engine.dispose()  # its backend ends and reports its counts
    after = _stats(admin, backend)
    per = 10_000 / n
    return {
        "p50": percentile(latencies, 0.5) * 1000,
        "p99": percentile(latencies, 0.99) * 1000,
        "per_s": n / sum(latencies),
        "dead": (after[0] - before[0]) * per,
        "pages": (after[2] - before[2]) * per,
        "wal": _wal_bytes(admin, before[3], after[3]) * per,
    }


def measure(url: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    metadata = sa.MetaData()
    table = record_table(metadata)
    admin = sa.create_engine(url)
    try:
        metadata.drop_all(admin)
        metadata.create_all(admin)
        with admin.begin() as conn:
            conn.execute(sa.text(SEED), {"scope": SCOPE, "n": args.duplicates})
            conn.execute(sa.text("ALTER TABLE idempotency_keys SET (autovacuum_enabled = off)"))
        runs = variants(table)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
        rng = random.Random(args.seed)
        for i in range(args.rounds):
            order = list(runs)
            rng.shuffle(order)
            for name in order:
                result = run_variant(url, admin, runs[name], args.duplicates)
                results[name].append(result)
                say(
                    f"round {i + 1}/{args.rounds} {name:12} p50 {result['p50']:.3f} ms "
                    f"p99 {result['p99']:.3f} ms, per 10,000: dead {result['dead']:,.0f} "
                    f"pages {result['pages']:,.0f} WAL {result['wal'] / 1024:,.0f} KiB"
                )
        metadata.drop_all(admin)
    finally:
        admin.dispose()
    return results


def section(
    results: dict[str, list[dict[str, float]]], facts: harness.Facts, args: argparse.Namespace
) -> list[str]:
    def med(name: str, field: str) -> float:
        return statistics.median(r[field] for r in results[name])

    rows = [
        f"| {name} | {med(name, 'p50'):.3f} | {med(name, 'p99'):.3f} | {med(name, 'per_s'):,.0f} | "
        f"{med(name, 'dead'):,.0f} | {med(name, 'pages'):,.0f} | "
        f"{med(name, 'wal') / 1024:,.0f} | {WHAT[name]} |"
        for name in results
    ]
    base = "on-conflict"
    ratios = [
        f"* savepoint / on-conflict: p50 {med('savepoint', 'p50') / med(base, 'p50'):.2f}x, "
        f"p99 {med('savepoint', 'p99') / med(base, 'p99'):.2f}x; dead tuples "
        f"{med('savepoint', 'dead'):,.0f} against {med(base, 'dead'):,.0f} per 10,000 duplicates",
        f"* store.claim / on-conflict: p50 {med('store.claim', 'p50') / med(base, 'p50'):.2f}x "
        "(one round trip for the claim's statements instead of two)",
    ]
    data = {
        name: {k: med(name, k) for k in ("p50", "p99", "dead", "pages", "wal")} for name in results
    }
    return [
        "## The conflict path (`python -m bench.conflict`)",
        "",
        *facts.lines(),
        f"* {args.rounds} rounds, variants in a shuffled order each round; {args.duplicates:,} "
        "duplicates per variant per round (each its own transaction: insert, read, commit; one "
        "connection through psycopg2); the table vacuumed before each variant, autovacuum off",
        "",
        "Per duplicate (median over rounds), and per 10,000 duplicates:",
        "",
        "| variant | p50 ms | p99 ms | duplicates/s | dead tuples | heap pages "
        "added | WAL KiB | what |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        *ratios,
        "",
        "A plain insert writes its heap tuple before the unique index refuses it: the",
        "tuple stays behind, dead, in a page of the table, until vacuum removes it, and",
        "the subtransaction gives the duplicate's transaction an id to commit (a WAL flush).",
        "`ON CONFLICT DO NOTHING` checks the index first and writes nothing for a",
        "duplicate: no dead tuple, no WAL of its own. The extension's claim does the",
        "latter, in one round trip.",
        "",
        harness.data_comment(NAME, data),
    ]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rounds", type=int, help="rounds (default 3; quick 1)")
    parser.add_argument("--duplicates", type=int, help="per variant per round (default 10,000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the variant order")
    return {"rounds": (1, 3), "duplicates": (300, 10_000)}


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section)


if __name__ == "__main__":
    sys.exit(main())
