"""The helpers a test calls: concurrent duplicates, a reused key, and the
exactly-once assertion that counts side effects, never status codes."""

from __future__ import annotations

import collections
import threading
import typing as t

from .. import models
from ._database import Database
from ._downstream import Downstream
from ._server import Response, ServedApp

#: How long the helpers wait for their threads, at most.
THREAD_LIMIT = 120.0


def concurrent_duplicates(
    api: ServedApp,
    n: int,
    method: str,
    path: str,
    *,
    json: t.Any = None,
    data: bytes | str | None = None,
    key: str | None,
    headers: t.Mapping[str, str] | None = None,
    timeout: float = 60,
) -> list[Response | BaseException]:
    """Send ``n`` identical requests at once (threads released by one barrier)
    and return the answers in order: a :class:`Response`, or the exception a
    request raised (:class:`ConnectionError`, :class:`TimeoutError`)."""
    if n < 1:
        raise ValueError("n must be at least 1")
    barrier = threading.Barrier(n)
    results: list[Response | BaseException] = [
        TimeoutError("the request did not finish") for _ in range(n)
    ]

    def send(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = api.request(
                method, path, json=json, data=data, key=key, headers=headers, timeout=timeout
            )
        except BaseException as exc:  # kept as the answer, for the test to judge
            results[i] = exc

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_LIMIT)
    return results


def reuse_key(
    api: ServedApp,
    path: str,
    key: str,
    json: t.Any,
    other_json: t.Any,
    *,
    headers: t.Mapping[str, str] | None = None,
    method: str = "POST",
) -> tuple[Response, Response]:
    """Send ``json`` with ``key``, then ``other_json`` with the same key; both answers."""
    first = api.request(method, path, json=json, key=key, headers=headers)
    second = api.request(method, path, json=other_json, key=key, headers=headers)
    return first, second


def assert_exactly_one(
    db: Database,
    downstream: Downstream | None,
    key: str,
    *,
    rows: t.Mapping[t.Any, t.Mapping[str, t.Any]] | None = None,
    events: t.Mapping[str, int] | None = None,
) -> None:
    """Assert that the operation of ``key`` took effect exactly once, by counting
    its side effects (never status codes):

    1. exactly one completed idempotency record for ``key``;
    2. exactly one committed execution of the view: the rows the served app's
       requests with ``key`` inserted through the ORM that are in the database
       now all come from one request, and there is at least one; ``rows``
       (``{Model: {column: value}}``) adds explicit counts, each must be 1, for
       writes the trace cannot see (Core inserts);
    3. the outbox events those requests emitted and committed come from that one
       execution (``events``: ``{topic: count}`` to check how many);
    4. at the fake downstream, for every path called for ``key``, exactly one
       effect (one distinct Idempotency-Key; an unkeyed call is an effect each).

    The failure message says what was counted, and where.
    """
    problems: list[str] = []
    counted: list[str] = []

    # 1. The record.
    if not db.has_table(models.TABLE_NAME):
        problems.append(f"no {models.TABLE_NAME} table in the database: no idempotency record")
    else:
        records = db.records(key)
        completed = [r for r in records if r["status"] == models.COMPLETED]
        counted.append(
            f"{models.TABLE_NAME} rows with key {key!r}: {len(records)} "
            f"({len(completed)} completed: "
            + ", ".join(f"scope {r['scope']!r} {r['status']}" for r in records)
            + ")"
        )
        if len(completed) != 1:
            problems.append(f"{len(completed)} completed idempotency records for the key, not 1")

    # 2. The view's rows, by the request that committed them.
    traced = [e for e in db.traced(key, "row") if db.exists(e)]
    executions: dict[str, list[str]] = collections.defaultdict(list)
    for entry in traced:
        executions[entry.request].append(f"{entry.table} {_pk(entry.columns, entry.pk)}")
    counted.append(
        f"rows inserted by requests with the key, in the database now: {len(traced)}, from "
        f"{len(executions)} execution(s): "
        + "; ".join(f"request {rid}: {', '.join(found)}" for rid, found in executions.items())
    )
    if len(executions) > 1:
        problems.append(
            f"the view's rows come from {len(executions)} executions (requests), not 1: "
            "the operation ran more than once"
        )
    elif not executions and not rows:
        problems.append(
            "no committed row inserted through the ORM by a request with this key: "
            "the view did not take effect, or writes with Core (pass rows={Model: {...}})"
        )
    for model, filters in (rows or {}).items():
        n = db.count(model, **filters)
        where = ", ".join(f"{k}={v!r}" for k, v in filters.items())
        name = getattr(model, "__tablename__", None) or getattr(model, "name", repr(model))
        counted.append(f"{name} rows where {where or 'any'}: {n}")
        if n != 1:
            problems.append(f"{n} {name} rows where {where or 'any'}, not 1")

    # 3. Outbox events.
    emitted = [e for e in db.traced(key, "event") if db.exists(e)]
    event_runs = {e.request for e in emitted}
    if emitted or events:
        counted.append(
            f"{models.OUTBOX_TABLE_NAME} events emitted by requests with the key: {len(emitted)} "
            f"from {len(event_runs)} execution(s)"
        )
    if len(event_runs) > 1 or (event_runs and executions and event_runs - set(executions)):
        problems.append(
            f"outbox events come from {len(event_runs | set(executions))} executions, not 1"
        )
    if events:
        by_topic = _event_topics(db, [e.pk[0] for e in emitted])
        for topic, expected in events.items():
            n = by_topic.get(topic, 0)
            counted.append(f"outbox events of topic {topic!r}: {n}")
            if n != expected:
                problems.append(f"{n} outbox events of topic {topic!r}, expected {expected}")

    # 4. The downstream.
    if downstream is not None:
        calls = downstream.calls(origin=key)
        by_path: dict[str, set[int]] = collections.defaultdict(set)
        attempts: collections.Counter[str] = collections.Counter()
        for call in calls:
            attempts[call.path] += 1
            if call.effect is not None:
                by_path[call.path].add(call.effect)
            else:
                by_path.setdefault(call.path, set())
        for path, effects in sorted(by_path.items()):
            counted.append(
                f"downstream {path}: {attempts[path]} call(s) for the key, {len(effects)} effect(s)"
            )
            if len(effects) != 1:
                problems.append(f"downstream {path}: {len(effects)} effects for the key, not 1")

    if problems:
        lines = [f"not exactly one effect for Idempotency-Key {key!r}:"]
        lines += [f"  - {p}" for p in problems]
        lines += ["counted:"] + [f"  {c}" for c in counted]
        raise AssertionError("\n".join(lines))


def _pk(columns: t.Sequence[str], values: t.Sequence[t.Any]) -> str:
    return ", ".join(f"{c}={v!r}" for c, v in zip(columns, values, strict=False))


def _event_topics(db: Database, event_ids: t.Sequence[str]) -> collections.Counter[str]:
    import sqlalchemy as sa

    table = models.outbox_table(sa.MetaData())
    topics: collections.Counter[str] = collections.Counter()
    with db.engine.connect() as conn:
        for event_id in event_ids:
            topic = conn.execute(
                sa.select(table.c.topic).where(
                    table.c.event_id == sa.bindparam("e", event_id, type_=sa.String())
                )
            ).scalar()
            if topic is not None:
                topics[topic] += 1
    return topics
