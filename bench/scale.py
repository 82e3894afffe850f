"""Claim latency against table size: ``python -m bench.scale [--quick] ...``.

Two record tables in one PostgreSQL, each in a schema of its own: ``small``
with ``--small`` (10,000) records and ``large`` with ``--large``
(10,000,000), live (unexpired, completed), keys spread like UUIDs (``md5``),
small bodies; seeded with ``generate_series`` (the large one with its indexes
dropped and built again after, checked identical), vacuumed and analyzed.
Then, in alternating rounds, ``--claims`` new keys per table per round through
the extension's store, as a request does: :meth:`Store.claim` (the one batch
that claims), :meth:`Store.complete`, ``COMMIT``, on one connection per table
(psycopg2). Reported: claim and whole-transaction p50/p99 per table, and large
over small (target: within 1.2x). The large schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import sys
import time
import typing as t
import uuid

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

NAME = "bench.scale"
TARGET = 1.2
WAIT = dt.timedelta(seconds=10)
SCOPE = "bench"

SEED = """
INSERT INTO idempotency_keys
    (scope, key, request_hash, status, fencing_token, response_code, response_body,
     body_omitted, created_at, completed_at, expires_at)
SELECT :scope, md5(i::text), md5((-i)::text), 'completed', i, 201, convert_to('{"id": 1}', 'UTF8'),
       false, now() - (i % 86400) * interval '1 second', now() - (i % 86400) * interval '1 second',
       now() + interval '1 day' - (i % 86400) * interval '1 second'
FROM generate_series(:first, :last) AS i
"""
INDEXES = """
SELECT indexname, indexdef FROM pg_indexes
WHERE schemaname = current_schema() AND tablename = 'idempotency_keys' ORDER BY indexname
"""


def in_schema(url: str, schema: str) -> str:
    return (
        sa.make_url(url)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )


def seed(url: str, rows: int, chunk: int = 1_000_000) -> float:
    """``rows`` records in the schema ``url`` names; MiB of the table with its indexes."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            indexes = list(conn.execute(sa.text(INDEXES)))
            # Built once, after the rows (both tables alike): much faster than row by row.
            conn.execute(
                sa.text("ALTER TABLE idempotency_keys DROP CONSTRAINT idempotency_keys_scope_key")
            )
            conn.execute(sa.text("DROP INDEX idempotency_keys_expires_at"))
        for first in range(1, rows + 1, chunk):
            last = min(rows, first + chunk - 1)
            with engine.begin() as conn:
                conn.execute(sa.text(SEED), {"scope": SCOPE, "first": first, "last": last})
            say(f"  {last:,} of {rows:,}")
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_scope_key "
                    "PRIMARY KEY (scope, key)"
                )
            )
            conn.execute(
                sa.text("CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at)")
            )
            if list(conn.execute(sa.text(INDEXES))) != indexes:
                raise RuntimeError("the rebuilt indexes differ from the table's own")
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(sa.text("VACUUM (ANALYZE) idempotency_keys"))
            conn.execute(sa.text("CHECKPOINT"))
            return float(
                conn.execute(
                    sa.text("SELECT pg_total_relation_size('idempotency_keys') / 1048576.0")
                ).scalar_one()
            )
    finally:
        engine.dispose()


def claims(store: Store, session: Session, n: int) -> tuple[list[float], list[float]]:
    """``n`` new keys claimed and completed, each in its own transaction; the
    claims' times and the transactions' times (seconds)."""
    claim, whole = [], []
    for _ in range(n):
        now = dt.datetime.now(dt.timezone.utc)
        token = new_fencing_token()
        values = {
            "scope": SCOPE,
            "key": str(uuid.uuid4()),
            "fencing_token": token,
            **operation_values(
                request_hash=uuid.uuid4().hex * 2,
                status=IN_PROGRESS,
                locked_until=now + dt.timedelta(seconds=60),
                created_at=now,
                expires_at=now + dt.timedelta(hours=24),
            ),
        }
        start = time.perf_counter()
        inserted, _ = store.claim(session, values, WAIT)
        claimed = time.perf_counter()
        done = store.complete(
            session,
            SCOPE,
            values["key"],
            token,
            response_code=201,
            response_headers=[],
            response_body=b'{"id":1}',
            body_omitted=False,
            now=now,
        )
        session.commit()
        end = time.perf_counter()
        if not (inserted and done):
            raise RuntimeError("a new key was not claimed")
        claim.append(claimed - start)
        whole.append(end - start)
    return claim, whole


def measure(url: str, args: argparse.Namespace) -> dict[str, t.Any]:
    sizes = {"small": args.small, "large": args.large}
    admin = sa.create_engine(url)
    metadata = sa.MetaData()
    table = record_table(metadata)
    engines: dict[str, sa.Engine] = {}
    results: dict[str, t.Any] = {"disk_free_gib": shutil.disk_usage("/").free / 2**30}
    try:
        for schema, rows in sizes.items():
            with admin.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            engines[schema] = sa.create_engine(in_schema(url, schema))
            metadata.create_all(engines[schema])
            say(f"seeding {rows:,} records in {schema}")
            start = time.perf_counter()
            results[f"{schema}_mib"] = seed(in_schema(url, schema), rows)
            say(f"  {time.perf_counter() - start:.0f} s, {results[f'{schema}_mib']:,.0f} MiB")
        store = Store(table)
        times: dict[str, dict[str, list[float]]] = {s: {"claim": [], "whole": []} for s in sizes}
        sessions = {s: Session(engines[s]) for s in sizes}
        try:
            for session in sessions.values():  # connect, compile, warm
                claims(store, session, 20)
            for i in range(args.rounds):
                order = list(sizes) if i % 2 == 0 else list(reversed(sizes))
                for schema in order:
                    claim, whole = claims(store, sessions[schema], args.claims)
                    times[schema]["claim"] += claim
                    times[schema]["whole"] += whole
                say(
                    f"round {i + 1}/{args.rounds}: claim p50 small "
                    f"{percentile(times['small']['claim'], 0.5) * 1000:.3f} ms, large "
                    f"{percentile(times['large']['claim'], 0.5) * 1000:.3f} ms"
                )
        finally:
            for session in sessions.values():
                session.close()
        for schema in sizes:
            for part in ("claim", "whole"):
                values = times[schema][part]
                results[f"{schema}_{part}_p50"] = percentile(values, 0.5) * 1000
                results[f"{schema}_{part}_p99"] = percentile(values, 0.99) * 1000
        results["claims"] = len(times["small"]["claim"])
    finally:
        for engine in engines.values():
            engine.dispose()
        with admin.begin() as conn:  # the disk back
            for schema in sizes:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()
    return results


def section(r: dict[str, t.Any], facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rows, verdicts = [], []
    for part, label in (
        ("claim", "the claim (`Store.claim`, one batch)"),
        ("whole", "claim, completion, COMMIT"),
    ):
        p50 = r[f"large_{part}_p50"] / r[f"small_{part}_p50"]
        p99 = r[f"large_{part}_p99"] / r[f"small_{part}_p99"]
        r[f"{part}_ratio_p50"], r[f"{part}_ratio_p99"] = p50, p99
        rows.append(
            f"| {label} | {r[f'small_{part}_p50']:.3f} / {r[f'small_{part}_p99']:.3f} | "
            f"{r[f'large_{part}_p50']:.3f} / {r[f'large_{part}_p99']:.3f} | "
            f"{p50:.2f}x | {p99:.2f}x |"
        )
        met = "met" if max(p50, p99) <= TARGET else "NOT met"
        verdicts.append(
            f"* {label}: large / small p50 {p50:.2f}x, p99 {p99:.2f}x: "
            f"target within {TARGET}x {met}."
        )
    data = {
        key: r[key]
        for key in (
            "small_claim_p50",
            "small_claim_p99",
            "large_claim_p50",
            "large_claim_p99",
            "small_whole_p50",
            "small_whole_p99",
            "large_whole_p50",
            "large_whole_p99",
        )
    }
    data.update(small=args.small, large=args.large)
    return [
        "## Claim latency against table size (`python -m bench.scale`)",
        "",
        *facts.lines(),
        f"* tables: {args.small:,} records ({r['small_mib']:,.1f} MiB with indexes) and "
        f"{args.large:,} ({r['large_mib']:,.1f} MiB), same schema and indexes, vacuumed and "
        f"analyzed; {r['claims']:,} new keys claimed per table, {args.claims} per table per round "
        f"in {args.rounds} alternating rounds, each its own transaction on one connection "
        "(psycopg2); keys are UUIDs, so each claim lands on a random leaf of the key's index",
        "",
        f"| ms, p50 / p99 | {args.small:,} records | {args.large:,} records | p50 large / small | "
        "p99 large / small |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        *verdicts,
        "",
        "A claim is an index probe and an insert into the primary key's B-tree (and the",
        "`expires_at` index): a thousand times more records add about one level to the tree.",
        "The whole transaction includes the commit's WAL flush (`fsync` on), the same for",
        "both tables. The large table was dropped after the run.",
        "",
        harness.data_comment(NAME, data),
    ]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--small", type=int, help="records in the small table (default 10,000)")
    parser.add_argument("--large", type=int, help="records in the large table (default 10,000,000)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default 10; quick 2)")
    parser.add_argument("--claims", type=int, help="claims per table per round (default 500)")
    return {
        "small": (1_000, 10_000),
        "large": (20_000, 10_000_000),
        "rounds": (2, 10),
        "claims": (50, 500),
    }


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section)


if __name__ == "__main__":
    sys.exit(main())
