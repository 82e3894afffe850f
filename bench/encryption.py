"""What encryption at rest costs a request: new key and replay, on against off.

``python -m bench.encryption`` drives the test app in-process (Flask's test
client: no network, so what shows is the request's own work and its database
round trips) on SQLite (a file) and on a private PostgreSQL cluster through
psycopg2 and psycopg 3, with a route answering a 1 KiB and a 64 KiB body. Two
apps on the same database, one with ``IDEMPOTENCY_ENCRYPTION_KEYS`` and one
without, run side by side in each round: new keys, then the same keys again
(replays), off and on alternating request by request, so that the load of a
shared machine falls on both alike. The cost is the ratio of the median requests.

It also times sealing and opening one value alone (the work a new key and a
replay add), to say where the cost goes. It writes its section of
``BENCHMARKS.md`` (between ``<!-- bench.encryption: start -->`` and ``end``).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
import typing as t
import uuid
from pathlib import Path

from flask import Flask, Response

from bench import harness
from flask_idempotency._storage import seal
from tests.conftest import reset_tables
from tests.support import testapp
from tests.support.sealing import sealed_config

NAME = "bench.encryption"
SIZES = {"1 KiB": 1024, "64 KiB": 64 * 1024}
MODES = ("off", "on")


def _body(size: int) -> bytes:
    """A JSON body of ``size`` bytes (what a list endpoint or a receipt answers)."""
    head, tail = b'{"items":"', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _apps(url: str) -> dict[str, Flask]:
    """The two apps on ``url``: encryption off and on, each with the route
    ``/answer/<size>`` (a ledger row written, the body answered)."""
    made = {}
    for mode in MODES:
        config = sealed_config() if mode == "on" else {}
        app = testapp.create_app(url, IDEMPOTENCY_MAX_BODY=1024 * 1024, **config)

        @app.post("/answer/<int:size>")
        @testapp.idem.idempotent()
        def answer(size: int) -> Response:
            testapp.write_ledger("bench-encryption")
            return Response(_body(size), 201, mimetype="application/json")

        made[mode] = app
    reset_tables(url)
    return made


def _one(client: t.Any, size: int, key: str) -> tuple[float, float]:
    """Seconds of one request: wall time, and this process's CPU time."""
    started, cpu = time.perf_counter(), time.process_time()
    response = client.post(f"/answer/{size}", json={"amount": 1}, headers={"Idempotency-Key": key})
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert response.status_code == 201, response.get_data(as_text=True)[:200]
    return wall, cpu


def measure_engine(url: str, rounds: int, n: int) -> dict[str, list[float]]:
    """µs of each request, by ``"size mode new|replay"`` (and ``... cpu``): off and
    on alternate request by request (which goes first alternating too), so the
    load of a shared machine falls on both alike; each round sends ``n`` new keys
    to each app, then the same keys again (replays)."""
    apps = _apps(url)
    clients = {mode: apps[mode].test_client() for mode in MODES}
    figures: dict[str, list[float]] = {}
    for _ in range(rounds):
        for label, size in SIZES.items():
            keys = {mode: [uuid.uuid4().hex for _ in range(n)] for mode in MODES}
            for kind in ("new", "replay"):
                for i in range(n):
                    for mode in MODES if i % 2 else MODES[::-1]:
                        wall, cpu = _one(clients[mode], size, keys[mode][i])
                        figures.setdefault(f"{label} {mode} {kind}", []).append(wall * 1e6)
                        figures.setdefault(f"{label} {mode} {kind} cpu", []).append(cpu * 1e6)
    for app in apps.values():
        with app.app_context():
            testapp.db.engine.dispose()
    return figures


def seal_alone(repeat: int = 2000) -> dict[str, tuple[float, float]]:
    """µs to seal and to open one value of each size (the fastest of 5 loops)."""
    ring = seal.Keyring(keys=(("a", bytes(32)),))
    aad = seal.associated_data("idempotency_keys", "response_body", "scope", "key")
    found = {}
    for label, size in SIZES.items():
        data = _body(size)
        sealed = ring.seal_bytes(data, aad)
        times = []
        calls = (
            functools.partial(ring.seal_bytes, data, aad),
            functools.partial(ring.open_bytes, sealed, aad, ""),
        )
        for fn in calls:
            best = float("inf")
            for _ in range(5):
                started = time.perf_counter()
                for _ in range(repeat):
                    fn()
                best = min(best, (time.perf_counter() - started) / repeat * 1e6)
            times.append(best)
        found[label] = (times[0], times[1])
    return found


def measure(cluster: t.Any, args: argparse.Namespace) -> dict[str, t.Any]:
    results: dict[str, t.Any] = {"engines": {}, "alone": seal_alone(200 if args.quick else 2000)}
    with tempfile.TemporaryDirectory() as folder:
        urls = {
            "sqlite": f"sqlite:///{Path(folder) / 'bench.sqlite3'}",
            "postgresql": cluster.url("psycopg2"),
            "psycopg": cluster.url("psycopg"),
        }
        for engine in args.engines.split(","):
            harness.say(f"{engine}: {args.rounds} rounds")
            results["engines"][engine] = measure_engine(urls[engine], args.rounds, args.requests)
    return results


def _cost(figures: dict[str, list[float]], label: str, kind: str) -> tuple[float, float, float]:
    """Median µs of a request off and on, and the cost: on / off - 1."""
    off = statistics.median(figures[f"{label} off {kind}"])
    on = statistics.median(figures[f"{label} on {kind}"])
    return off, on, on / off - 1


#: What the figures mean, from profiling the same requests (kept with the section).
NOTES = [
    "Where the time goes (the same requests, the seal functions timed inside them): in a",
    "warm loop a request's sealing or opening takes about 15 µs (the table above); inside",
    "a request, the first value it seals or opens takes 60 to 120 µs and the next one 10",
    "to 20 µs (timed at 1 KiB; a dummy seal put first takes the start-up instead, and the",
    "values after it open in 9 to 17 µs); at 64 KiB the CPU added is about the same.",
    "So the cost is a start-up per request, not per byte: OpenSSL's and cryptography's",
    "code and state, cold after the rest of the",
    "request ran (a 2-vCPU machine shared with other work), warmed again each time. No",
    "other function of ours costs more with encryption on (profiled), and the keyed",
    "fingerprint (`IDEMPOTENCY_FINGERPRINT_KEY`, the other line of config) costs nothing",
    "measurable. These requests are the cheapest there are (in-process: no network, no",
    "server, SQLite in the process), 1 to 2 ms for a replay: behind gunicorn and a",
    "network the same added 100 to 200 µs are a smaller share. Against the 5 % target at",
    "1 KiB: a new key on PostgreSQL is within it in wall time; a replay is not, here.",
]


def section(results: dict[str, t.Any], facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rows = []
    data: dict[str, t.Any] = {}
    for engine, figures in results["engines"].items():
        for label in SIZES:
            for kind in ("new", "replay"):
                off, on, cost = _cost(figures, label, kind)
                cpu_off, cpu_on, cpu_cost = _cost(figures, label, f"{kind} cpu")
                rows.append(
                    f"| {engine} | {label} | {'new key' if kind == 'new' else 'replay'} | "
                    f"{off:,.0f} | {on:,.0f} | {cost * 100:+.1f} % | "
                    f"{cpu_off:,.0f} | {cpu_on:,.0f} | {cpu_on - cpu_off:+,.0f} | "
                    f"{cpu_cost * 100:+.1f} % |"
                )
                data[f"{engine} {label} {kind}"] = round(cost, 4)
                data[f"{engine} {label} {kind} cpu"] = round(cpu_cost, 4)
    alone = [
        f"| {label} | {sealed:.1f} | {opened:.1f} |"
        for label, (sealed, opened) in results["alone"].items()
    ]
    return [
        "## Encryption at rest (`python -m bench.encryption`)",
        "",
        *facts.lines(),
        f"* in-process (Flask's test client), {args.rounds} rounds of {args.requests} "
        "requests per case and app; the route writes a ledger row and answers the body "
        "(JSON); off and on are two apps on the same database, their requests alternating "
        "one by one (which goes first alternating too)",
        "",
        "µs per request (the median request) and the cost of encryption (on / off - 1), in",
        "wall time and in the app process's CPU time (SQLite runs in it; PostgreSQL's own",
        "work does not count there):",
        "",
        "| engine | body | request | off µs | on µs | cost | CPU off µs | CPU on µs | "
        "+CPU µs | CPU cost |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "One value sealed and opened alone (µs, the fastest of 5 loops; AES-256-GCM under",
        "a per-value subkey, HMAC-SHA256 of the key and a random salt):",
        "",
        "| body | seal µs | open µs |",
        "|---|---:|---:|",
        *alone,
        "",
        "A new key seals the answer once (its headers and body) at the completion; a replay",
        "opens them once. The claim itself seals nothing on a route that keeps no request.",
        "",
        *NOTES,
        "",
        harness.data_comment(NAME, data),
    ]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rounds", type=int, help="rounds (default 5; quick 1)")
    parser.add_argument(
        "--requests", type=int, help="requests per case, app and round (default 300; quick 5)"
    )
    parser.add_argument(
        "--engines", default="sqlite,postgresql,psycopg", help="any of sqlite,postgresql,psycopg"
    )
    return {"rounds": (1, 5), "requests": (5, 300)}


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section, cluster=True)


if __name__ == "__main__":
    sys.exit(main())
