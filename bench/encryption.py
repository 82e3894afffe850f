"""What encryption at rest costs a request: new key and replay, on against off.

``python -m bench.encryption`` drives the test app in-process (Flask's test
client: no network, so what shows is the request's own work and its database
round trips) on SQLite (a file) and on a private PostgreSQL cluster through
psycopg2 and psycopg 3, with a route answering a 1 KiB and a 64 KiB body. Two
apps on the same database, one with ``IDEMPOTENCY_ENCRYPTION_KEYS`` and one
without, run side by side in each round (their order alternating): a block of
new keys, then the same keys again (replays). Per round the fastest of its
blocks; the figures are medians over the rounds, and each ratio is taken within
a round, so drift on a shared machine hits both sides alike.

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


def _block(client: t.Any, size: int, keys: list[str]) -> float:
    started = time.perf_counter()
    for key in keys:
        response = client.post(
            f"/answer/{size}", json={"amount": 1}, headers={"Idempotency-Key": key}
        )
        assert response.status_code == 201, response.get_data(as_text=True)[:200]
    return (time.perf_counter() - started) / len(keys)


def measure_engine(url: str, rounds: int, n: int, blocks: int) -> dict[str, list[float]]:
    """µs per request, fastest block of each round, by ``"size mode new|replay"``."""
    apps = _apps(url)
    clients = {mode: apps[mode].test_client() for mode in MODES}
    figures: dict[str, list[float]] = {}
    for round_ in range(rounds):
        order = MODES if round_ % 2 == 0 else MODES[::-1]
        best: dict[str, float] = {}
        for label, size in SIZES.items():
            for _ in range(blocks):
                for mode in order:
                    keys = [uuid.uuid4().hex for _ in range(n)]
                    for kind in ("new", "replay"):
                        spent = _block(clients[mode], size, keys) * 1e6
                        name = f"{label} {mode} {kind}"
                        best[name] = min(best.get(name, spent), spent)
        for name, value in best.items():
            figures.setdefault(name, []).append(value)
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
            results["engines"][engine] = measure_engine(
                urls[engine], args.rounds, args.requests, args.blocks
            )
    return results


def _cost(figures: dict[str, list[float]], label: str, kind: str) -> tuple[float, float, float]:
    """Median µs off, on, and the median of the per-round cost (on / off - 1)."""
    off, on = figures[f"{label} off {kind}"], figures[f"{label} on {kind}"]
    cost = statistics.median(b / a - 1 for a, b in zip(off, on, strict=True))
    return statistics.median(off), statistics.median(on), cost


def section(results: dict[str, t.Any], facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rows = []
    data: dict[str, t.Any] = {}
    for engine, figures in results["engines"].items():
        for label in SIZES:
            for kind in ("new", "replay"):
                off, on, cost = _cost(figures, label, kind)
                rows.append(
                    f"| {engine} | {label} | {'new key' if kind == 'new' else 'replay'} | "
                    f"{off:,.0f} | {on:,.0f} | {cost * 100:+.1f} % |"
                )
                data[f"{engine} {label} {kind}"] = round(cost, 4)
    alone = [
        f"| {label} | {sealed:.1f} | {opened:.1f} |"
        for label, (sealed, opened) in results["alone"].items()
    ]
    return [
        "## Encryption at rest (`python -m bench.encryption`)",
        "",
        *facts.lines(),
        f"* in-process (Flask's test client), {args.rounds} rounds; per round and case the "
        f"fastest of {args.blocks} blocks of {args.requests} requests; the route writes a "
        "ledger row and answers the body (JSON); off and on are two apps on the same "
        "database, alternating",
        "",
        "µs per request (median of the rounds) and the cost of encryption (median of the",
        "per-round ratios, on / off - 1):",
        "",
        "| engine | body | request | off µs | on µs | cost |",
        "|---|---|---|---:|---:|---:|",
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
        harness.data_comment(NAME, data),
    ]


def main(argv: t.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {NAME}", description=__doc__.split("\n\n")[0])
    harness.common_options(parser)
    parser.add_argument("--rounds", type=int, help="rounds (default 7; quick 1)")
    parser.add_argument("--requests", type=int, help="requests per block (default 100; quick 5)")
    parser.add_argument("--blocks", type=int, help="blocks per case and round (default 3; quick 1)")
    parser.add_argument(
        "--engines", default="sqlite,postgresql,psycopg", help="any of sqlite,postgresql,psycopg"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 7)
    args.requests = args.requests or (5 if args.quick else 100)
    args.blocks = args.blocks or (1 if args.quick else 3)
    return harness.run_section(NAME, argv, args, lambda cluster: measure(cluster, args), section)


if __name__ == "__main__":
    sys.exit(main())
