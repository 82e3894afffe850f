"""The short phases beside the throughput runs: round trips on the wire, HOT
updates on PostgreSQL, and worker memory.

Round trips and HOT updates are measured on the app in process (Flask's test
client, one request at a time, the same app and engine options gunicorn serves),
so nothing else talks to the database meanwhile; memory is measured on a gunicorn
worker of its own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import typing as t
import uuid

import sqlalchemy as sa

from bench import app as bench_app
from bench import procstats
from bench.load import BODY, KEY_HEADER, PythonLoad, Target
from bench.servers import Gunicorn
from bench.variants import REPLAY_KEY, Variant
from bench.wire import CountingProxy

# The bench app has no caller identity, so the extension warns (once per endpoint
# and app) that every caller shares one scope; the in-process phases make many apps.
logging.getLogger("flask_idempotency").setLevel(logging.ERROR)


def _post(client: t.Any, variant: Variant, key: str | None) -> None:
    headers = {KEY_HEADER: key} if key is not None else {}
    response = client.post(
        variant.path, data=BODY, content_type="application/json", headers=headers
    )
    if not 200 <= response.status_code < 300:
        raise RuntimeError(
            f"POST {variant.path}: {response.status_code} {response.get_data(as_text=True)}"
        )


def _key_of(variant: Variant, prefix: str, i: int) -> str | None:
    if variant.key_mode == "new":
        return f"{prefix}-{i}"
    if variant.key_mode == "fixed":
        return REPLAY_KEY
    return None


@dataclasses.dataclass(frozen=True)
class WireFigure:
    """Database exchanges per request, and the exchanges of one request: the
    statements sent in each, as :class:`~bench.wire.CountingProxy` captured them."""

    per_request: float
    exchanges: list[list[str]]


def round_trips(
    pg_url: str, variants: t.Sequence[Variant], *, requests: int, warmup: int = 20
) -> dict[str, WireFigure]:
    """Exchanges on the wire per request, per variant: the app in process on
    ``pg_url`` through :class:`~bench.wire.CountingProxy`, ``warmup`` requests
    first (the pool connects, the dialect initializes), then counted from zero."""
    figures = {}
    with CountingProxy(pg_url) as proxy:
        app = bench_app.create_app(proxy.url())
        client = app.test_client()
        run = uuid.uuid4().hex[:8]
        try:
            for variant in variants:
                prefix = f"wire-{run}-{variant.name}"
                for i in range(warmup):
                    _post(client, variant, _key_of(variant, prefix + "-warm", i))
                proxy.reset(capture=True)
                _post(client, variant, _key_of(variant, prefix, 0))
                captured = list(proxy.captured)
                first = proxy.exchanges
                proxy.reset()
                for i in range(1, requests):
                    _post(client, variant, _key_of(variant, prefix, i))
                figures[variant.name] = WireFigure((first + proxy.exchanges) / requests, captured)
        finally:
            with app.app_context():
                bench_app.db.engine.dispose()
    return figures


def replay_after_new_keys(pg_url: str, ext: Variant, *, new_keys: int = 10) -> WireFigure:
    """The exchanges of one replay on ``ext``'s route on a connection that served
    ``new_keys`` new keys just before (so psycopg 3 has prepared their statements):
    the case the replay variants, run back to back, do not show."""
    with CountingProxy(pg_url) as proxy:
        app = bench_app.create_app(proxy.url())
        client = app.test_client()
        run = uuid.uuid4().hex[:8]
        try:
            _post(client, ext, REPLAY_KEY)  # completes it, or replays it
            for i in range(new_keys):
                _post(client, ext, f"wire-{run}-before-replay-{i}")
            proxy.reset(capture=True)
            _post(client, ext, REPLAY_KEY)
            return WireFigure(proxy.exchanges, list(proxy.captured))
        finally:
            with app.app_context():
                bench_app.db.engine.dispose()


@dataclasses.dataclass(frozen=True)
class HotFigure:
    """Updates of the key table during a new-key phase, and the share that was HOT."""

    table: str
    requests: int
    inserts: int
    updates: int
    hot_updates: int

    @property
    def hot_share(self) -> float | None:
        return self.hot_updates / self.updates if self.updates else None


_TABLE_STATS = sa.text(
    "SELECT n_tup_ins, n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
    "WHERE relid = to_regclass(:table)"
)


def hot_updates(
    pg_url: str, pg_major: int, variants: t.Sequence[Variant], *, requests: int
) -> dict[str, HotFigure]:
    """``pg_stat_user_tables`` deltas over ``requests`` new-key requests per variant.

    The app's backend reports its counters when its transaction ends after
    ``pg_stat_force_next_flush()`` (PostgreSQL 15+) and when it exits (the engine is
    disposed after each phase); the counters are read until every insert shows.
    """
    figures = {}
    admin = sa.create_engine(pg_url, isolation_level="AUTOCOMMIT")
    run = uuid.uuid4().hex[:8]
    try:
        for variant in variants:
            assert variant.key_table is not None
            app = bench_app.create_app(pg_url)
            client = app.test_client()
            before = _settled_stats(admin, variant.key_table)
            for i in range(requests):
                _post(client, variant, f"hot-{run}-{variant.name}-{i}")
            with app.app_context():
                if pg_major >= 15:
                    bench_app.db.session.execute(sa.text("SELECT pg_stat_force_next_flush()"))
                    bench_app.db.session.commit()
                bench_app.db.engine.dispose()
            after = _wait_for_inserts(admin, variant.key_table, before[0] + requests)
            figures[variant.name] = HotFigure(
                variant.key_table,
                requests,
                after[0] - before[0],
                after[1] - before[1],
                after[2] - before[2],
            )
    finally:
        admin.dispose()
    return figures


def _read_stats(engine: sa.Engine, table: str) -> tuple[int, int, int]:
    with engine.connect() as conn:  # a transaction of its own: a fresh stats snapshot
        row = conn.execute(_TABLE_STATS, {"table": table}).one()
    return int(row[0]), int(row[1]), int(row[2])


def _settled_stats(engine: sa.Engine, table: str, timeout: float = 10) -> tuple[int, int, int]:
    """The counters once they stopped moving (backends that exited report late)."""
    deadline = time.monotonic() + timeout
    stats = _read_stats(engine, table)
    while True:
        time.sleep(0.5)
        again = _read_stats(engine, table)
        if again == stats or time.monotonic() > deadline:
            return again
        stats = again


def _wait_for_inserts(
    engine: sa.Engine, table: str, inserts: int, timeout: float = 15
) -> tuple[int, int, int]:
    deadline = time.monotonic() + timeout
    while True:
        stats = _read_stats(engine, table)
        if stats[0] >= inserts or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


@dataclasses.dataclass(frozen=True)
class MemoryFigure:
    """RSS of one gunicorn worker after ``first`` and ``second`` new-key requests."""

    first: int
    second: int
    rss_first_kib: int
    rss_second_kib: int

    @property
    def ratio(self) -> float:
        return self.rss_second_kib / self.rss_first_kib


def worker_memory(
    database_url: str, load: PythonLoad, *, first: int, second: int, warmup: int = 200
) -> MemoryFigure:
    """``/ext`` new-key requests on a 1-worker gunicorn; the worker's ``VmRSS``
    after ``first`` and after ``second`` requests (the warm-up not counted)."""
    run = uuid.uuid4().hex[:8]
    with Gunicorn(database_url, workers=1) as server:
        (worker,) = server.worker_pids()
        target = Target(server.port, "/ext", "new")
        load.run_count(target, warmup, f"mem-{run}-warm")
        load.run_count(target, first, f"mem-{run}-a")
        rss_first = procstats.rss_kib(worker)
        load.run_count(target, second - first, f"mem-{run}-b")
        rss_second = procstats.rss_kib(worker)
        if server.worker_pids() != [worker]:
            raise RuntimeError("the gunicorn worker was replaced during the memory phase")
    return MemoryFigure(first, second, rss_first, rss_second)
