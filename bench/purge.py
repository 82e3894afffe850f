"""Cleanup throughput: batched purge against one big DELETE, in the same run.

``python -m bench.purge [--rows N]`` seeds N expired records on PostgreSQL
(embedded unless IDEMPOTENCY_TEST_POSTGRES_URL is set) and deletes them three
ways: one ``DELETE ... WHERE expires_at <= now()`` (the baseline: fastest, but
one long transaction that holds every row lock until it ends), then
``purge_expired`` with batches of 1000 and 10000. Prints rows/s and the ratio
to the baseline.
"""

from __future__ import annotations

import argparse
import time
import typing as t

from flask_idempotency._maintenance.jobs import purge_expired
from tests.conftest import postgres_url, reset_tables, run_sql
from tests.support import testapp

SEED = """
INSERT INTO idempotency_keys
    (scope, key, request_hash, status, fencing_token, response_code, response_body,
     body_omitted, created_at, expires_at)
SELECT 'bulk', 'k' || i, 'h', 'completed', 1, 201, convert_to(repeat('x', 200), 'UTF8'), false,
       now() - interval '2 days', now() - interval '1 hour'
FROM generate_series(1, :n) AS i
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    url = postgres_url()
    app = testapp.create_app(url)
    reset_tables(url)

    def timed(run: t.Callable[[], object]) -> float:
        run_sql(url, SEED, n=args.rows)
        start = time.perf_counter()
        run()
        rate = args.rows / (time.perf_counter() - start)
        left = run_sql(url, "SELECT count(*) FROM idempotency_keys")[0][0]
        assert left == 0, left
        return rate

    results = {
        "one DELETE (baseline)": timed(
            lambda: run_sql(url, "DELETE FROM idempotency_keys WHERE expires_at <= now()"),
        ),
        "purge, batch 1000": timed(lambda: purge_expired(app, batch_size=1000)),
        "purge, batch 10000": timed(lambda: purge_expired(app, batch_size=10000)),
    }
    base = results["one DELETE (baseline)"]
    print(f"\n{args.rows} expired records on PostgreSQL")
    print(f"{'case':24} {'rows/s':>10} {'vs baseline':>12}")
    for name, rate in results.items():
        print(f"{name:24} {rate:10.0f} {rate / base:11.2f}x")


if __name__ == "__main__":
    main()
