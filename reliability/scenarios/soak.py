"""Mixed traffic for minutes: retries, reused keys, bursts of duplicates and kills."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import random
import tempfile
import threading
import time
from pathlib import Path

from reliability import _harness as h
from reliability._context import Context

NAME = "soak"
TITLE = "Soak: retries, reused keys, bursts of duplicates and kills, for minutes"
DESCRIPTION = """\
gunicorn (3 sync workers) serves the reliability app for 10 minutes (the short run: 1) while
6 clients start operations on the plain and leased routes (3 to 2), each retried with its key
until settled. Each worker kills itself at random right after 3% of commits and right before
another 3%. On top: **30%** of operations are sent again after they settled (the answer must
be the same status and body, marked `Idempotent-Replayed`), 10% have their key reused with
another amount (the answer must be 422 problem+json, and the ledger keeps the first amount),
and 10% start with a burst of 5 concurrent copies. Any replay that differs, mismatch accepted
or ledger row with another amount is a violation.
"""

ROUTES = ["/plain"] * 3 + ["/leased"] * 2


@dataclasses.dataclass
class Tally:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    counts: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    violations: list[str] = dataclasses.field(default_factory=list)
    extra_answers: list[h.Answer] = dataclasses.field(default_factory=list)

    def count(self, what: str, answer: h.Answer | None = None) -> None:
        with self.lock:
            self.counts[what] += 1
            if answer is not None:
                self.extra_answers.append(answer)

    def violation(self, text: str) -> None:
        with self.lock:
            self.violations.append(text)


def _one(client: h.Client, tally: Tally, rng: random.Random) -> h.Operation:
    op = h.new_operation(rng.choice(ROUTES))
    target = client.targets[0]
    body = json.dumps(op.payload).encode()
    headers = {"Content-Type": "application/json", "Idempotency-Key": op.key}
    if rng.random() < 0.10:  # a burst of concurrent duplicates before the client's own tries
        tally.count("bursts")
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            burst = list(
                pool.map(lambda _: h.request(*target, "POST", op.path, body, headers, 10), range(5))
            )
        for answer in burst:
            tally.count("burst requests", answer)
    client.run(op)
    settled = op.settled
    if not op.succeeded or settled is None:
        return op
    if rng.random() < 0.30:  # the same request again, after it settled: a replay
        again = h.request(*target, "POST", op.path, body, headers, 10)
        tally.count("resent after settling", again)
        if not isinstance(again.status, int) or again.status >= 500:
            tally.count("resent: no answer (a worker was killed)")
        elif (again.status, again.body) != (settled.status, settled.body) or not again.replayed:
            tally.violation(
                f"{op.key}: resent, got {again.status} replayed={again.replayed} "
                f"{again.body[:120]!r}; first {settled.status} {settled.body[:120]!r}"
            )
        else:
            tally.count("replays identical")
    if rng.random() < 0.10:  # the key reused with another amount
        other = json.dumps({**op.payload, "amount": op.payload["amount"] + 1}).encode()
        answer = h.request(*target, "POST", op.path, other, headers, 10)
        tally.count("reused with another payload", answer)
        if answer.status == 422 and answer.content_type.startswith("application/problem+json"):
            tally.count("mismatches refused")
        elif isinstance(answer.status, int) and 200 <= answer.status < 300:
            tally.violation(f"{op.key}: another payload accepted: {answer.status}")
    return op


def run(ctx: Context) -> list[h.Result]:
    seconds = ctx.scale.pick(600.0, 60.0)
    url = ctx.database("soak")
    h.reset_tables(url)
    result = h.Result(f"{NAME}: mixed", f"{seconds / 60:.0f} min of mixed traffic")
    log = Path(tempfile.mkstemp(prefix="reliability-faults-")[1])
    env = {
        "RELIABILITY_DATABASE_URL": url,
        "RELIABILITY_FAULTS": json.dumps({"after_commit": 0.03, "before_commit": 0.03}),
        "RELIABILITY_FAULT_LOG": str(log),
        "RELIABILITY_LEASE": "3",
    }
    tally = Tally()
    ops: list[h.Operation] = []
    ops_lock = threading.Lock()
    with h.timed(result), h.Gunicorn("reliability.app:create_app()", env, workers=3) as server:
        client = h.Client([(server.host, server.port)], timeout=10, budget=120)
        deadline = time.monotonic() + seconds

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                op = _one(client, tally, rng)
                with ops_lock:
                    ops.append(op)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 300)
    result.add_operations(ops)
    for answer in tally.extra_answers:
        result.attempts += 1
        result.answers[str(answer.status)] += 1
        result.html_500 += answer.html_500
    h.count_faults(log, result)
    h.count_ledger(url, ops, result)
    h.count_stuck(url, result)
    _check_amounts(url, ops, tally)
    result.failures += tally.violations
    result.extra.update({k: f"{v:,}" for k, v in sorted(tally.counts.items())})
    ctx.show(result)
    log.unlink(missing_ok=True)
    return [result]


def _check_amounts(url: str, ops: list[h.Operation], tally: Tally) -> None:
    """Each key's row keeps the amount of its first payload, never the reused one's."""
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = sa.text("SELECT key, amount FROM reliability_ledger")
            rows: dict[str, int] = {str(k): int(a) for k, a in conn.execute(query).all()}
    finally:
        engine.dispose()
    for op in ops:
        amount = rows.get(op.key)
        if amount is not None and amount != op.payload["amount"]:
            tally.violation(f"{op.key}: ledger amount {amount}, sent {op.payload['amount']}")
