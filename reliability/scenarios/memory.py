"""A worker's memory after 1,000 requests against after 100,000."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import uuid
from pathlib import Path

import sqlalchemy as sa

from reliability import _harness as h
from reliability._context import Context

NAME = "memory"
TITLE = "Worker memory after 1,000 requests and after 100,000"
DESCRIPTION = """\
One gunicorn sync worker serves the plain route on the scenario's PostgreSQL. Two client threads
send requests with a new key each, every 10th a replay of the previous key; the worker's memory is
read from `/proc/<pid>/status` (`VmRSS`) and `/proc/<pid>/smaps_rollup` (`Pss`) after the first
1,000 requests and again after 100,000 (the short run: 10,000), the worker the same process
throughout (a respawned worker fails the run). **Bound: RSS after the last request at most 1.10x
RSS after 1,000, and at most 8 MiB more.** After 1,000 requests every cache a worker fills once
(imported modules, SQLAlchemy's compiled statements, the connection pool) is full, so what grows
after it grows with the requests: a leak of 100 bytes a request is 9.4 MiB over 99,000 requests and
fails the run; allocator noise (a few MiB at most on a 70-80 MiB worker) passes. Every request must
answer 2xx, and the ledger must hold exactly one row per new key.
"""

#: Every this-many-th request replays the previous key.
REPLAY_EVERY = 10
#: The bound: final RSS at most this many times RSS after 1,000 requests ...
RATIO_BOUND = 1.10
#: ... and at most this many KiB more.
GROWTH_BOUND_KIB = 8 * 1024


@dataclasses.dataclass
class Sent:
    requests: int = 0
    new_keys: int = 0
    replays: int = 0
    not_2xx: int = 0
    first_failure: str = ""

    def add(self, other: Sent) -> None:
        self.requests += other.requests
        self.new_keys += other.new_keys
        self.replays += other.replays
        self.not_2xx += other.not_2xx
        self.first_failure = self.first_failure or other.first_failure


def memory_kib(pid: int) -> tuple[int, int]:
    """``(VmRSS, Pss)`` of ``pid`` in KiB."""
    rss = pss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    rollup = Path(f"/proc/{pid}/smaps_rollup")
    if rollup.exists():
        for line in rollup.read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
    return rss, pss


def send(server: h.Gunicorn, run_id: str, count: int) -> Sent:
    """``count`` requests from 2 threads, each checked for its 2xx. Two: while
    the worker serves one, the other's connection waits, so the worker never
    idles; the worker, not the client, bounds the rate."""

    def one_thread(thread: int, n: int) -> Sent:
        sent = Sent()
        key = ""
        for i in range(1, n + 1):
            if key and i % REPLAY_EVERY == 0:
                sent.replays += 1
            else:
                sent.new_keys += 1
                key = f"{run_id}-{thread}-{sent.new_keys}"
            body = json.dumps({"amount": sent.new_keys % 100_000 + 1, "currency": "EUR"})
            headers = {"Content-Type": "application/json", "Idempotency-Key": key}
            answer = h.request(
                server.host, server.port, "POST", "/plain", body.encode(), headers, 10
            )
            sent.requests += 1
            if not (isinstance(answer.status, int) and 200 <= answer.status < 300):
                sent.not_2xx += 1
                sent.first_failure = sent.first_failure or f"{answer.status}: {answer.body!r}"
        return sent

    total = Sent()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for part in pool.map(one_thread, (1, 2), (count // 2, count - count // 2)):
            total.add(part)
    return total


def run(ctx: Context) -> list[h.Result]:
    final = ctx.scale.pick(100_000, 10_000)
    label = f"1 sync worker, {final:,} requests"
    result = h.Result(f"{NAME}: {label}", label)
    url = ctx.database("memory")
    h.reset_tables(url)
    run_id = uuid.uuid4().hex[:12]
    sent = Sent()
    with (
        h.timed(result),
        h.Gunicorn(
            "reliability.app:create_app()", {"RELIABILITY_DATABASE_URL": url}, workers=1
        ) as server,
    ):
        readings: list[tuple[int, int, int]] = []  # (requests so far, RSS, Pss)
        pids: set[int] = set()
        for phase, count in enumerate((1_000, final - 1_000)):
            phase_id = f"{run_id}-{phase}"
            sent.add(send(server, phase_id, count))
            workers = server.worker_pids()
            pids.update(workers)
            if len(workers) == 1:
                readings.append((sent.requests, *memory_kib(workers[0])))
    result.operations = sent.new_keys
    result.attempts = sent.requests
    result.answers["2xx"] = sent.requests - sent.not_2xx
    if sent.not_2xx:
        result.answers["not 2xx or socket error"] = sent.not_2xx
        result.failures.append(f"{sent.not_2xx} requests not answered 2xx ({sent.first_failure})")
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows, keys = conn.execute(
                sa.text("SELECT count(*), count(DISTINCT key) FROM reliability_ledger")
            ).one()
    finally:
        engine.dispose()
    result.ledger_rows = int(rows)
    result.duplicates = int(rows) - int(keys)
    if not sent.not_2xx:  # every new key answered 2xx: each must have its row
        result.lost = max(0, sent.new_keys - int(keys))
    h.count_stuck(url, result)
    result.extra["requests (new keys / replays)"] = (
        f"{sent.requests:,} ({sent.new_keys:,} / {sent.replays:,})"
    )
    if len(pids) != 1 or len(readings) != 2:
        result.failures.append(f"the worker did not stay one process: pids {sorted(pids)}")
    else:
        (n1, rss1, pss1), (n2, rss2, pss2) = readings
        ratio = rss2 / rss1
        result.extra[f"RSS after {n1:,} requests"] = (
            f"{rss1 / 1024:.1f} MiB (Pss {pss1 / 1024:.1f})"
        )
        result.extra[f"RSS after {n2:,} requests"] = (
            f"{rss2 / 1024:.1f} MiB (Pss {pss2 / 1024:.1f})"
        )
        result.extra["RSS ratio"] = f"{ratio:.3f}x ({(rss2 - rss1) / 1024:+.1f} MiB)"
        result.extra["growth per request after the first 1,000"] = (
            f"{(rss2 - rss1) * 1024 / max(1, n2 - n1):.1f} bytes"
        )
        if ratio > RATIO_BOUND or rss2 - rss1 > GROWTH_BOUND_KIB:
            result.failures.append(
                f"worker memory grew past the bound ({RATIO_BOUND}x and"
                f" +{GROWTH_BOUND_KIB // 1024} MiB): {rss1} KiB -> {rss2} KiB"
            )
    ctx.show(result)
    return [result]
