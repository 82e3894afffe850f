"""The helpers a test calls: concurrent duplicates, a reused key, and the
exactly-once assertion that counts side effects, never status codes."""

from __future__ import annotations

import collections
import threading
import typing as t

from .. import models
from ._control import ORIGIN_HEADER
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
    unattributed_ok: bool = False,
) -> None:
    """Assert that the operation of ``key`` took effect exactly once, by counting
    its side effects (never status codes):

    1. exactly one completed idempotency record for ``key``;
    2. exactly one committed execution of the view: what the served app's
       requests with ``key`` committed to the app's tables comes from one
       request, and there is something. Rows inserted (through the ORM, or by a
       Core insert whose primary key SQLAlchemy reports) count if they are in
       the database now; other writes (UPDATE, DELETE, SQL text, inserts of
       unknown key) count when their commit went through. ``rows``
       (``{Model: {column: value}}``) adds explicit counts, each must be 1;
    3. the outbox events those requests emitted and committed come from that one
       execution (``events``: ``{topic: count}`` to check how many);
    4. at the fake downstream, for every path called for ``key``, exactly one
       effect (one distinct key, read from the app's key header; an unkeyed
       call is an effect each).

    What the kit cannot attribute to a key fails the assertion, since it may be
    this operation's second effect: calls the downstream received without the
    kit's origin header (made off the request's thread, or by a client not over
    ``http.client``, such as httpx), and database writes made outside any
    request while requests were in flight (a thread the view started).
    ``unattributed_ok=True`` says they are none of this operation's (say, the
    test called the downstream itself).

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

    # 2. The view's writes, by the request that committed them.
    executions: dict[str, list[str]] = collections.defaultdict(list)
    seen_rows: set[tuple[str, str, tuple[t.Any, ...]]] = set()
    n_rows = 0
    for entry in db.traced(key, "row"):
        # A flush's insert is traced by the mapper and by the engine: one row.
        identity = (entry.request, entry.table, entry.pk)
        if identity in seen_rows or not db.exists(entry):
            continue
        seen_rows.add(identity)
        n_rows += 1
        executions[entry.request].append(f"{entry.table} {_pk(entry.columns, entry.pk)}")
    writes = db.traced(key, "write")
    for entry in writes:
        executions[entry.request].append(
            f"{entry.verb} {entry.table} ({_rowcount(entry.rowcount)})"
        )
    counted.append(
        f"rows inserted by requests with the key, in the database now: {n_rows}; other "
        f"committed writes: {len(writes)}; from {len(executions)} execution(s): "
        + "; ".join(f"request {rid}: {', '.join(found)}" for rid, found in executions.items())
    )
    if len(executions) > 1:
        problems.append(
            f"the view's rows come from {len(executions)} executions (requests), not 1: "
            "the operation ran more than once"
        )
    elif not executions and not rows:
        problems.append(
            "no committed write by a request with this key: the view did not take "
            "effect (or pass rows={Model: {...}} for what it writes)"
        )
    for model, filters in (rows or {}).items():
        n = db.count(model, **filters)
        where = ", ".join(f"{k}={v!r}" for k, v in filters.items())
        name = getattr(model, "__tablename__", None) or getattr(model, "name", repr(model))
        counted.append(f"{name} rows where {where or 'any'}: {n}")
        if n != 1:
            problems.append(f"{n} {name} rows where {where or 'any'}, not 1")
    stray = [e for e in db.unattributed() if e.kind != "row" or db.exists(e)]
    if stray:
        found = ", ".join(
            f"{e.verb} {e.table}" + (f" {_pk(e.columns, e.pk)}" if e.pk else "") for e in stray
        )
        counted.append(f"writes outside any request, while requests were served: {found}")
        if not unattributed_ok:
            problems.append(
                f"{len(stray)} committed write(s) made outside any request while requests "
                "were in flight (a thread the view started?): the kit cannot tell which key "
                "they were for, so it cannot say the operation took effect once (pass "
                "unattributed_ok=True if they are not this operation's)"
            )

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
        header = downstream.key_header
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
                f"downstream {path}: {attempts[path]} call(s) for the key, {len(effects)} "
                f"effect(s) (one per distinct {header} value; a call without one is an effect)"
            )
            if len(effects) != 1:
                problems.append(
                    f"downstream {path}: {len(effects)} effects for the key (distinct {header} "
                    "values), not 1"
                )
        orphans = [c for c in downstream.calls() if c.origin is None]
        if orphans:
            paths = collections.Counter(c.path for c in orphans)
            counted.append(
                "downstream calls without an origin: "
                + ", ".join(f"{path}: {n}" for path, n in sorted(paths.items()))
            )
            if not unattributed_ok:
                problems.append(
                    f"the downstream received {len(orphans)} call(s) without {ORIGIN_HEADER} "
                    "(made off the request's thread, or by a client not over http.client, "
                    "such as httpx): the kit cannot tell which key they were for, so it "
                    "cannot say the operation took effect once (pass unattributed_ok=True "
                    "if they are not this operation's)"
                )

    if problems:
        lines = [f"not exactly one effect for Idempotency-Key {key!r}:"]
        lines += [f"  - {p}" for p in problems]
        lines += ["counted:"] + [f"  {c}" for c in counted]
        raise AssertionError("\n".join(lines))


def _rowcount(n: int) -> str:
    return "rows: unknown" if n < 0 else f"{n} row" + ("" if n == 1 else "s")


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
