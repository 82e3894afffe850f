"""Concurrent duplicates of one key: ``python -m bench.duplicates [--quick] ...``.

A live gunicorn (gthread workers, on 127.0.0.1) serves the test app's
``POST /slow``: ``@idem.idempotent()``, a ledger row, then a sleep of
``--view-ms`` (200) inside its transaction. Each round fires ``--duplicates``
(50) requests with one new key at the same instant (threads released by a
barrier, each on a connection opened beforehand) and notes when each answer
came. The winner is the one answer that ran the view (201, not replayed); the
losers are the others. Two servers, one per variant, in alternating rounds:

* ``wait``: ``IDEMPOTENCY_WAIT`` 10 s (the default): a loser's claim waits on
  the unique index for the winner's transaction, then replays its response;
* ``fail-fast``: ``IDEMPOTENCY_WAIT`` 1 ms: a loser gives up on the wait at once
  and answers 409 (problem+json) for the client to retry later.

Reported: losers' time to their answer over the winner's duration (its own
time to answer), p50/p99/max over all rounds' losers, and the ledger: exactly
one row per round's key (checked: the run fails otherwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import sys
import threading
import time
import typing as t
import uuid

from flask import Flask

from bench import harness
from bench.harness import percentile, say

if t.TYPE_CHECKING:
    from bench.servers import Gunicorn

NAME = "bench.duplicates"
DB_ENV = "BENCH_DUP_DB"
WAIT_ENV = "BENCH_DUP_WAIT_MS"
VARIANTS = {"wait": 10_000, "fail-fast": 1}
WHAT = {
    "wait": "IDEMPOTENCY_WAIT 10 s (default): losers wait for the winner's commit, then replay",
    "fail-fast": "IDEMPOTENCY_WAIT 1 ms: losers stop waiting at once and answer 409",
}


def create_app() -> Flask:
    """The app gunicorn serves (``bench.duplicates:create_app()``)."""
    import datetime as dt

    from tests.support import testapp

    wait = dt.timedelta(milliseconds=int(os.environ[WAIT_ENV]))
    return testapp.create_app(os.environ[DB_ENV], IDEMPOTENCY_WAIT=wait)


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    replayed: bool
    seconds: float
    body: bytes
    content_type: str


def fire(port: int, key: str, n: int, view_ms: int) -> list[Answer]:
    """``n`` duplicates of one request, released together; their answers."""
    body = json.dumps({"delay": view_ms / 1000}).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=60) for _ in range(n)]
    for conn in conns:
        conn.connect()
    barrier = threading.Barrier(n)
    answers: list[Answer | BaseException] = [RuntimeError("not run")] * n

    def one(i: int) -> None:
        try:
            barrier.wait(30)
            start = time.perf_counter()
            conns[i].request("POST", "/slow", body=body, headers=headers)
            response = conns[i].getresponse()
            data = response.read()
            answers[i] = Answer(
                response.status,
                response.getheader("Idempotent-Replayed") == "true",
                time.perf_counter() - start,
                data,
                response.getheader("Content-Type") or "",
            )
        except BaseException as exc:  # shown below
            answers[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    for conn in conns:
        conn.close()
    failed = [a for a in answers if isinstance(a, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} duplicates failed: {failed[:3]!r}")
    return t.cast(list[Answer], answers)


@dataclasses.dataclass
class Round:
    variant: str
    winner: float  # seconds
    losers: list[float]  # seconds
    statuses: dict[str, int]
    ledger_rows: int


def one_round(url: str, server: Gunicorn, variant: str, n: int, view_ms: int) -> Round:
    from tests.conftest import run_sql

    key = str(uuid.uuid4())
    answers = fire(server.port, key, n, view_ms)
    ran = [a for a in answers if a.status == 201 and not a.replayed]
    if len(ran) != 1:
        raise RuntimeError(f"{variant}: {len(ran)} answers ran the view: {answers!r}")
    winner = ran[0]
    losers = [a for a in answers if a is not winner]
    for loser in losers:
        if variant == "wait":
            ok = loser.status == 201 and loser.replayed and loser.body == winner.body
        else:  # a 409 problem, or a replay when the winner was done before it claimed
            ok = (
                loser.status == 409 and loser.content_type.startswith("application/problem+json")
            ) or (loser.status == 201 and loser.replayed)
        if not ok:
            raise RuntimeError(f"{variant}: unexpected answer {loser!r}")
    statuses: dict[str, int] = {}
    for a in answers:
        label = f"{a.status}{' replayed' if a.replayed else ''}"
        statuses[label] = statuses.get(label, 0) + 1
    rows = int(run_sql(url, "SELECT count(*) FROM ledger WHERE key = :k", k=key)[0][0])
    if rows != 1:
        raise RuntimeError(f"{variant}: {rows} ledger rows for one key")
    return Round(variant, winner.seconds, [a.seconds for a in losers], statuses, rows)


def measure(url: str, args: argparse.Namespace) -> dict[str, list[Round]]:
    from bench.servers import Gunicorn  # not in the workers, which import this module
    from tests.conftest import reset_tables
    from tests.support import testapp

    testapp.create_app(url)  # puts the extension's tables on the metadata
    reset_tables(url)
    # gthread workers with a thread per duplicate, so none queues in gunicorn.
    servers = {
        name: Gunicorn(
            url,
            2,
            app=f"{NAME}:create_app()",
            env={DB_ENV: url, WAIT_ENV: str(wait)},
            threads=args.duplicates + 5,
            health=None,
        )
        for name, wait in VARIANTS.items()
    }
    rounds: dict[str, list[Round]] = {name: [] for name in VARIANTS}
    try:
        for server in servers.values():
            server.start()
        for name, server in servers.items():  # open every pooled connection first
            one_round(url, server, name, args.duplicates, args.view_ms)
        for i in range(args.rounds):
            order = list(VARIANTS) if i % 2 == 0 else list(reversed(VARIANTS))
            for name in order:
                result = one_round(url, servers[name], name, args.duplicates, args.view_ms)
                rounds[name].append(result)
                ratios = [s / result.winner for s in result.losers]
                say(
                    f"round {i + 1}/{args.rounds} {name:9} winner {result.winner * 1000:6.0f} ms, "
                    f"losers p50 {percentile(ratios, 0.5):.2f}x max {max(ratios):.2f}x "
                    f"{result.statuses} ledger rows {result.ledger_rows}"
                )
    finally:
        for server in servers.values():
            server.stop()
    return rounds


def section(
    rounds: dict[str, list[Round]], facts: harness.Facts, args: argparse.Namespace
) -> list[str]:
    rows, data = [], {}
    for name, results in rounds.items():
        ratios = [s / r.winner for r in results for s in r.losers]
        waits = [s * 1000 for r in results for s in r.losers]
        winners = [r.winner * 1000 for r in results]
        statuses: dict[str, int] = {}
        for r in results:
            for label, n in r.statuses.items():
                statuses[label] = statuses.get(label, 0) + n
        ledger = sum(r.ledger_rows for r in results)
        rows.append(
            f"| {name} | {percentile(winners, 0.5):,.0f} | {percentile(waits, 0.5):,.0f} | "
            f"{percentile(ratios, 0.5):.2f}x | {percentile(ratios, 0.99):.2f}x | "
            f"{max(ratios):.2f}x | {', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))} | "
            f"{ledger} / {len(results)} |"
        )
        data[name] = {
            "ratios": [round(x, 4) for x in ratios],
            "winner_ms": [round(w, 2) for w in winners],
        }
    return [
        "## Concurrent duplicates of one key (`python -m bench.duplicates`)",
        "",
        *facts.lines(),
        f"* {args.rounds} rounds per variant (alternating), {args.duplicates} duplicates per "
        f"round released together against gunicorn (2 gthread workers); the view writes a "
        f"ledger row and sleeps {args.view_ms} ms in its transaction",
        "",
        "| variant | winner ms (p50) | loser ms (p50) | loser / winner p50 | p99 | max | "
        "answers (all rounds) | ledger rows / rounds |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
        *rows,
        "",
        *(f"* `{name}`: {WHAT[name]}" for name in VARIANTS),
        "",
        "A loser's time runs from its request to its answer; the winner's, from its request",
        "to its answer; all were sent at the same instant. With the default wait a loser",
        "answers right after the winner commits (a ratio a little above 1: the wait on the",
        "unique index, then the replay read); with a 1 ms wait it answers 409 without",
        "waiting for the winner (its time is what the server takes to get through all",
        "the duplicates at once; the client retries later). Either way the view ran once per key:",
        "the ledger has exactly one row per round (checked in the run).",
        "",
        harness.data_comment(NAME, data),
    ]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rounds", type=int, help="rounds per variant (default 10; quick 2)")
    parser.add_argument("--duplicates", type=int, help="duplicates per round (default 50; quick 5)")
    parser.add_argument(
        "--view-ms", type=int, default=200, help="the view's time in its transaction"
    )
    return {"rounds": (2, 10), "duplicates": (5, 50)}


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(NAME, __doc__, argv, options, measure, section)


if __name__ == "__main__":
    sys.exit(main())
