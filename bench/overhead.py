"""What an idempotent route costs over the same route without it, in one run.

``python -m bench.overhead [--requests N]`` drives the test app in-process (no
network, so the database round trips are what shows) on PostgreSQL (embedded
unless IDEMPOTENCY_TEST_POSTGRES_URL is set) and SQLite, and prints requests/s
and the ratio to the baseline: a plain route doing the same ledger write and
commit. Also the peak Python memory allocated per request (tracemalloc).
Figures are ratios measured side by side; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import tracemalloc
import typing as t
from pathlib import Path

from flask import Flask

from tests.conftest import postgres_url, reset_tables
from tests.support import testapp


def _plain_route(app: Flask) -> None:
    @app.post("/plain")
    def plain() -> tuple[dict[str, t.Any], int]:
        # The same work the protected view does: write, flush for the id, commit.
        row = testapp.Ledger(route="plain", key=None, amount=None)
        testapp.db.session.add(row)
        testapp.db.session.flush()
        row_id = row.id
        testapp.db.session.commit()
        return {"id": row_id}, 201


BODY = json.dumps({"amount": 500, "currency": "EUR", "meta": {"note": "n"}})


def _run(client: t.Any, path: str, n: int, key_of: t.Callable[[int], str | None]) -> float:
    start = time.perf_counter()
    for i in range(n):
        key = key_of(i)
        headers = {"Idempotency-Key": key} if key else {}
        response = client.post(path, data=BODY, content_type="application/json", headers=headers)
        assert response.status_code in (200, 201), response.get_data(as_text=True)
    return n / (time.perf_counter() - start)


def _peak_kib(client: t.Any, path: str, n: int, key_of: t.Callable[[int], str | None]) -> float:
    tracemalloc.start()
    _run(client, path, n, key_of)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak / 1024


def measure(url: str, n: int, rounds: int) -> dict[str, tuple[float, float]]:
    app = testapp.create_app(url)
    _plain_route(app)
    reset_tables(url)
    client = app.test_client()
    unbounded = testapp.create_app(url, IDEMPOTENCY_WAIT=None).test_client()
    cases: dict[str, tuple[str, t.Callable[[int], str | None]]] = {
        "plain route (baseline)": ("/plain", lambda i: None),
        "idempotent, no key": ("/charges", lambda i: None),
        "idempotent, new key": ("/charges", lambda i: f"new-{time.perf_counter_ns()}-{i}"),
        "idempotent, replay": ("/charges", lambda i: "same-key"),
        "new key, WAIT=None": ("/charges", lambda i: f"unb-{time.perf_counter_ns()}-{i}"),
    }
    clients = {name: client for name in cases}
    clients["new key, WAIT=None"] = unbounded
    _run(client, "/charges", 1, lambda i: "same-key")  # the record the replays hit
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):  # interleaved, so drift on a shared machine hits all alike
        for name, (path, key_of) in cases.items():
            rates[name].append(_run(clients[name], path, n, key_of))
    result = {}
    for name, (path, key_of) in cases.items():
        peak = _peak_kib(clients[name], path, 200, key_of)
        result[name] = (statistics.median(rates[name]), peak)
    with app.app_context():
        testapp.db.engine.dispose()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sqlite_url = f"sqlite:///{Path(tempfile.mkdtemp()) / 'bench.sqlite3'}"
    for engine, url in (("postgresql", postgres_url()), ("sqlite", sqlite_url)):
        result = measure(url, args.requests, args.rounds)
        base = result["plain route (baseline)"][0]
        print(f"\n{engine}: {args.requests} requests x {args.rounds} rounds, median")
        print(f"{'case':26} {'req/s':>8} {'vs baseline':>12} {'peak KiB/200 req':>17}")
        for name, (rate, peak) in result.items():
            print(f"{name:26} {rate:8.0f} {rate / base:11.2f}x {peak:17.0f}")


if __name__ == "__main__":
    main()
