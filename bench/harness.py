"""What the benchmarks of issue 17 share: a PostgreSQL of their own, the run's
facts, percentiles, their sections of ``BENCHMARKS.md``, and paced writers.

* :func:`private_postgres`: a PostgreSQL cluster of the run's own
  (:class:`tests.support.private_servers.PgCluster`, pgserver's binaries),
  with ``fsync`` on as in production, stopped and deleted on every way out.
  Server settings are the run's to choose and ``pg_stat_*`` counts only the
  run's own work. A section may run on the tests' PostgreSQL instead
  (:func:`shared_server`: what ``bench.run`` uses, or ``--database-url``'s).
* Each benchmark writes one section, between ``<!-- bench.NAME: start -->``
  and ``<!-- bench.NAME: end -->``: a rerun replaces only its own, and
  ``python -m bench.run`` (which rewrites the file) keeps them all
  (:func:`kept_sections`). A section carries its figures as JSON in an HTML
  comment (:func:`data_comment`), which ``python -m bench.plot_more`` draws.
* :class:`Writers`: processes that each make one claim every ``gap`` seconds
  (through the extension's route, or one hand-written transaction on a named
  table) and report, per operation, its scheduled start and its latency, so a
  stream's tail can be cut into windows afterwards (with cleanup, without).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "BENCHMARKS.md"

#: Settings of every private cluster: production's durability (``fsync``), room
#: for the duplicates' connections, and index builds that fit in memory.
SERVER_SETTINGS: dict[str, str | int] = {
    "fsync": "on",
    "max_connections": 200,
    "maintenance_work_mem": "512MB",
    "max_wal_size": "4GB",
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def exit_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` stops what it started."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@contextlib.contextmanager
def private_postgres(**settings: str | int) -> t.Iterator[t.Any]:
    """A PostgreSQL cluster of the run's own, started with :data:`SERVER_SETTINGS`
    and ``settings``; stopped and its directory deleted at the end."""
    from tests.support.private_servers import PgCluster

    cluster = PgCluster.create()
    try:
        cluster.start(**{**SERVER_SETTINGS, **settings})
        yield cluster
    finally:
        cluster.stop()


def server_version(url: str) -> str:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return str(conn.execute(sa.text("SHOW server_version")).scalar_one())
    finally:
        engine.dispose()


def load_average() -> float:
    return os.getloadavg()[0]


@dataclasses.dataclass
class Facts:
    """Where and when a section's figures were taken."""

    command: str
    postgresql: str
    load_start: float
    #: Which PostgreSQL: :func:`private_server`'s or :func:`shared_server`'s words.
    server: str = ""
    load_end: float = math.nan
    date: str = dataclasses.field(
        default_factory=lambda: dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    )

    def end(self) -> None:
        self.load_end = load_average()

    def lines(self) -> list[str]:
        return [
            f"* command: `{self.command}`",
            f"* date: {self.date}; commit {git_commit()}",
            f"* CPUs: {os.cpu_count()} ({cpu_model()}); Python {platform.python_version()}"
            # A section that uses no PostgreSQL (bench.compiled) names none.
            + (f"; PostgreSQL {self.postgresql} ({self.server})" if self.postgresql else ""),
            f"* load average (1 min) at the start {self.load_start:.2f}, at the end "
            f"{self.load_end:.2f} (a machine shared with other work: compare the ratios "
            "measured side by side in this run, not absolute figures)",
        ]


def cpu_model() -> str:
    """The CPU's model name, for a run's facts."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


#: What runs in a benchmark: a change elsewhere (the results it writes, the docs)
#: does not make a run's commit "with uncommitted changes".
CODE = ("bench", "flask_idempotency", "tests", "example_app", "setup.py", "pyproject.toml")


def git_commit() -> str:
    """The commit checked out, marked when the code that runs differs from it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                *CODE,
                ":!bench/*.png",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + (" (with uncommitted changes)" if dirty else "")


def facts(module: str, argv: t.Sequence[str], url: str, server: str) -> Facts:
    return Facts(
        command=" ".join([f"python -m {module}", *argv]),
        postgresql=server_version(url),
        load_start=load_average(),
        server=server,
    )


def percentile(values: t.Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- sections of BENCHMARKS.md ---------------------------------------------------


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}: start -->", f"<!-- {name}: end -->"


_DATA = re.compile(r"<!-- (bench\.[a-z_]+) data: (.*?) -->")


def times(ratio: float) -> str:
    """``1.23x``, or ``n/a`` for a ratio without figures (NaN: say, no writer's
    operation overlapped a cleanup shorter than the gap between them)."""
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"


def _no_nan(value: t.Any) -> t.Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_no_nan(v) for v in value]
    return value


def data_comment(name: str, data: dict[str, t.Any]) -> str:
    """The section's figures, for the plot: JSON in an HTML comment (no ``--``;
    a figure that could not be had, NaN, is ``null``)."""
    text = json.dumps(_no_nan(data), separators=(",", ":"), allow_nan=False)
    assert "--" not in text
    return f"<!-- {name} data: {text} -->"


def read_data(text: str) -> dict[str, dict[str, t.Any]]:
    """Every section's figures in ``text``, by section name."""
    return {match[1]: json.loads(match[2]) for match in _DATA.finditer(text)}


def splice(existing: str, name: str, section: str) -> str:
    """``existing`` with section ``name`` replaced by ``section`` (or it appended)."""
    start, end = markers(name)
    if start in existing and end in existing:
        head, rest = existing.split(start, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        return head + section + tail
    return existing.rstrip("\n") + "\n\n" + section


def write_section(out: Path, name: str, body: t.Sequence[str]) -> str:
    """Write ``body`` (lines) as section ``name`` of ``out``; the section's text."""
    start, end = markers(name)
    section = "\n".join([start, *body, end]) + "\n"
    existing = out.read_text() if out.exists() else ""
    out.write_text(splice(existing, name, section))
    return section


_SECTION = re.compile(r"<!-- (bench\.[a-z_]+): start -->.*?<!-- \1: end -->\n?", re.S)


def kept_sections(path: Path) -> str:
    """Every ``bench.*`` section of ``path``, in order (for ``bench.run``, which
    rewrites the file)."""
    with contextlib.suppress(OSError):
        return "\n".join(
            match[0].rstrip("\n") + "\n" for match in _SECTION.finditer(path.read_text())
        )
    return ""


#: Where a section's PostgreSQL comes from, given the parsed options: a
#: context manager for the cluster (``url(driver)``) and what the facts call it.
Server = t.Callable[[argparse.Namespace], t.ContextManager[tuple[t.Any, str]]]


@contextlib.contextmanager
def private_server(args: argparse.Namespace) -> t.Iterator[tuple[t.Any, str]]:
    """A cluster of the run's own (:func:`private_postgres`): the default."""
    settings = ", ".join(f"{k}={v}" for k, v in SERVER_SETTINGS.items())
    where = f"a private cluster from pgserver's binaries: {settings}, other settings default"
    with private_postgres() as cluster:
        yield cluster, where


@dataclasses.dataclass(frozen=True)
class SharedPostgres:
    """A PostgreSQL the run does not own, as a cluster: :meth:`url` through a driver."""

    base: str

    def url(self, driver: str | None = None) -> str:
        """The URL as given (``driver`` ``None``), or through ``"psycopg2"`` or
        ``"psycopg"`` (psycopg 3)."""
        if driver is None:
            return self.base
        from tests.conftest import PG_DRIVERS

        url = sa.make_url(self.base).set(drivername=PG_DRIVERS[driver])
        return url.render_as_string(hide_password=False)


@contextlib.contextmanager
def shared_server(args: argparse.Namespace) -> t.Iterator[tuple[SharedPostgres, str]]:
    """The PostgreSQL the tests use, as ``bench.run`` does (embedded, or
    ``IDEMPOTENCY_TEST_POSTGRES_URL`` in a schema of its own, dropped at the
    end), or the one ``args.database_url`` names where the benchmark has that
    option and it is given."""
    if getattr(args, "database_url", None):
        yield SharedPostgres(args.database_url), "--database-url"
        return
    from bench.servers import Postgres, stop_postgres

    try:
        server = Postgres.start()
        yield SharedPostgres(server.url), server.source
    finally:
        stop_postgres()


def run_section(
    name: str,
    argv: t.Sequence[str],
    args: argparse.Namespace,
    measure: t.Callable[[t.Any], t.Any],
    section: t.Callable[[t.Any, Facts, argparse.Namespace], t.Sequence[str]],
    server: Server = private_server,
) -> int:
    """A benchmark's whole run, after its options: ``measure(cluster)`` on
    ``server``'s PostgreSQL (a private cluster unless said) between the run's
    facts, then section ``name`` of ``args.out`` written from ``section(results,
    facts, args)`` and printed. SIGTERM stops everything started, as Ctrl-C does."""
    exit_on_sigterm()
    with server(args) as (cluster, where):
        run_facts = facts(name, argv, cluster.url(), where)
        results = measure(cluster)
        run_facts.end()
    text = write_section(args.out, name, section(results, run_facts, args))
    print(text)
    say(f"wrote {args.out}")
    return 0


def common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check the harness")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the file to write")


#: Options whose default depends on ``--quick``: each option's (quick, full) default.
Sizes = t.Mapping[str, tuple[t.Any, t.Any]]


def main(
    name: str,
    doc: str,
    argv: t.Sequence[str] | None,
    options: t.Callable[[argparse.ArgumentParser], Sizes],
    measure: t.Callable[[t.Any, argparse.Namespace], t.Any],
    section: t.Callable[[t.Any, Facts, argparse.Namespace], t.Sequence[str]],
    *,
    cluster: bool = False,
    check: t.Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
    server: Server = private_server,
) -> int:
    """A benchmark's command, ``python -m NAME``: ``--quick``, ``--out`` and
    what ``options`` adds to the parser (an option it names in its
    :data:`Sizes` and not given takes its quick or full default); ``check``
    may refuse or complete the options; then :func:`run_section` on
    ``server`` (:func:`private_server` or :func:`shared_server`), with
    ``measure(url, args)`` given its URL (``cluster``: the cluster itself,
    whose ``url(driver)`` names a driver)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {name}", description=doc.split("\n\n")[0])
    common_options(parser)
    sizes = options(parser)
    args = parser.parse_args(argv)
    for option, (quick, full) in sizes.items():
        setattr(args, option, getattr(args, option) or (quick if args.quick else full))
    if check is not None:
        check(parser, args)
    return run_section(
        name, argv, args, lambda c: measure(c if cluster else c.url(), args), section, server
    )


# -- expired records ---------------------------------------------------------------

#: Expired records ``:first`` to ``:last`` in ``{table}`` (the record table, or a
#: copy with its columns): 200-byte response bodies, expired an hour and more ago,
#: oldest last (one millisecond apart), so a cleanup in order of expiry has work.
_EXPIRED = """
INSERT INTO {table}
    (scope, key, request_hash, status, fencing_token, response_code, response_body,
     body_omitted, created_at, completed_at, expires_at)
SELECT 'bulk', md5(i::text), md5((-i)::text), 'completed', i, 201,
       convert_to(repeat('x', 200), 'UTF8'), false,
       now() - interval '2 days', now() - interval '2 days',
       now() - interval '1 hour' - i * interval '1 millisecond'
FROM generate_series(:first, :last) AS i
"""


def seed_expired(engine: sa.Engine, table: str, rows: int, chunk: int = 250_000) -> None:
    """``rows`` expired records in ``table``, one transaction per ``chunk``."""
    for first in range(1, rows + 1, chunk):
        with engine.begin() as conn:
            conn.execute(
                sa.text(_EXPIRED.format(table=table)),
                {"first": first, "last": min(rows, first + chunk - 1)},
            )


# -- writers -----------------------------------------------------------------------

WRITER_EXT = "ext"  # POST /charges of the test app (the extension's whole request)
WRITER_SQL = "sql"  # one hand-written claim transaction on a named table
#: The same, first taking a lock on the key and looking for an unexpired record of
#: it in every partition: what a claim on a table partitioned by time must do to
#: keep (scope, key) unique across partitions.
WRITER_SQL_GUARDED = "sql-guarded"


@dataclasses.dataclass(frozen=True)
class Op:
    """One writer's operation: when it was due (wall clock) and how long it
    took from then (its wait behind earlier ones included), or ``None`` when it
    failed."""

    due: float
    latency: float | None


class Writers:
    """``count`` writer processes, each one operation every ``gap`` seconds.

    Latency is measured from when an operation was due, not from when it
    started: a writer held up by a stall still owes the operations that fell
    due meanwhile, so the stall is counted in every one of them (no
    coordinated omission). Every writer stops at :meth:`stop` or after
    ``limit`` seconds, whichever comes first.
    """

    def __init__(
        self,
        url: str,
        *,
        count: int,
        gap: float,
        mode: str,
        table: str = "idempotency_keys",
        limit: float = 900,
    ) -> None:
        self.url, self.count, self.gap, self.mode, self.table = url, count, gap, mode, table
        self.limit = limit
        self._dir = Path(tempfile.mkdtemp(prefix="bench-writers-"))
        self._procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> Writers:
        stop = self._dir / "stop"
        for i in range(self.count):
            out = self._dir / f"writer-{i}.json"
            self._procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.harness",
                        self.url,
                        self.mode,
                        self.table,
                        str(self.gap),
                        str(self.limit),
                        str(stop),
                        str(out),
                    ],
                    cwd=ROOT,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                    stdin=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 60
        while not all((self._dir / f"writer-{i}.json.ready").exists() for i in range(self.count)):
            if any(p.poll() is not None for p in self._procs):
                raise RuntimeError("a writer exited at start")
            if time.monotonic() > deadline:
                raise RuntimeError("the writers did not start within 60 s")
            time.sleep(0.05)
        return self

    def stop(self) -> list[Op]:
        """Stop every writer; their operations, in order of when they were due."""
        (self._dir / "stop").touch()
        ops: list[Op] = []
        for i, proc in enumerate(self._procs):
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            out = self._dir / f"writer-{i}.json"
            if proc.returncode != 0 or not out.exists():
                raise RuntimeError(f"writer {i} failed (exit {proc.returncode})")
            ops += [Op(due, latency) for due, latency in json.loads(out.read_text())]
        self._procs = []
        return sorted(ops, key=lambda op: op.due)

    def kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._procs = []

    def __enter__(self) -> Writers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
        for path in self._dir.iterdir():
            path.unlink()
        self._dir.rmdir()


@dataclasses.dataclass
class Window:
    """The operations that overlapped ``[start, end]`` (wall clock)."""

    start: float
    end: float

    def ops(self, ops: t.Iterable[Op]) -> list[Op]:
        return [
            op for op in ops if op.due <= self.end and op.due + (op.latency or 0.0) >= self.start
        ]


@dataclasses.dataclass
class Phased:
    """A writers' stream cut in windows: without the action (before and after
    it) and during it."""

    baseline: list[Op]
    during: list[Op]
    seconds: float  # the action's time
    result: t.Any  # what the action returned
    #: The baseline's two halves: before the action, and after it (where its
    #: aftermath, say vacuum of what it deleted, lands).
    before: list[Op] = dataclasses.field(default_factory=list)
    after: list[Op] = dataclasses.field(default_factory=list)

    def figures(self) -> dict[str, t.Any]:
        base, during = summary(self.baseline), summary(self.during)
        # NaN when no operation overlapped the action (one shorter than the gap).
        return {"baseline": base, "during": during, "p99_ratio": during["p99"] / base["p99"]}


def under_writers(writers: Writers, action: t.Callable[[], t.Any], quiet: float) -> Phased:
    """Run ``action`` while ``writers`` write: ``quiet`` seconds of writers alone,
    the action, ``quiet`` seconds more. Every writer's operation that failed
    fails the run."""
    with writers:
        before = Window(time.time(), 0.0)
        time.sleep(quiet)
        before.end = time.time()
        during = Window(time.time(), 0.0)
        result = action()
        during.end = time.time()
        after = Window(time.time(), 0.0)
        time.sleep(quiet)
        after.end = time.time()
        ops = writers.stop()
    failed = [op for op in ops if op.latency is None]
    if failed:
        raise RuntimeError(f"{len(failed)} writers' operations failed")
    hit = during.ops(ops)
    hit_ids = {id(op) for op in hit}
    first = [op for op in before.ops(ops) if id(op) not in hit_ids]
    last = [op for op in after.ops(ops) if id(op) not in hit_ids]
    return Phased(first + last, hit, during.end - during.start, result, first, last)


def wait_backends_gone(url: str, application_name: str, within: float = 30) -> None:
    """Until no backend of ``application_name`` is left: a backend reports its
    table counts (``pg_stat_user_tables``) on its way out, before it leaves
    ``pg_stat_activity``."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    deadline = time.monotonic() + within
    try:
        while True:
            with engine.connect() as conn:
                left = conn.execute(
                    sa.text("SELECT count(*) FROM pg_stat_activity WHERE application_name = :a"),
                    {"a": application_name},
                ).scalar_one()
            if not left or time.monotonic() > deadline:
                return
            time.sleep(0.1)
    finally:
        engine.dispose()


def named(url: str, application_name: str) -> str:
    """``url`` whose connections carry ``application_name``."""
    return (
        sa.make_url(url)
        .update_query_dict({"application_name": application_name})
        .render_as_string(hide_password=False)
    )


def summary(ops: t.Sequence[Op]) -> dict[str, float]:
    """Count, failures, p50, p99 and max (ms) of ``ops``."""
    done = [op.latency * 1000 for op in ops if op.latency is not None]
    return {
        "ops": len(ops),
        "failed": len(ops) - len(done),
        "p50": percentile(done, 0.5),
        "p99": percentile(done, 0.99),
        "max": max(done) if done else math.nan,
    }


def cell(figures: dict[str, float]) -> str:
    """A table cell of :func:`summary`'s figures: ``p50 / p99 / max (ops)``."""
    return (
        f"{figures['p50']:.1f} / {figures['p99']:.1f} / {figures['max']:.0f} "
        f"({figures['ops']:,.0f})"
    )


def _ext_op(url: str) -> t.Callable[[], bool]:
    from tests.support import testapp

    app = testapp.create_app(url, IDEMPOTENCY_SCOPE=lambda: "writers")
    client = app.test_client()
    body = {"amount": 1, "currency": "EUR"}

    def op() -> bool:
        response = client.post(
            "/charges", json=body, headers={"Idempotency-Key": str(uuid.uuid4())}
        )
        return response.status_code == 201

    return op


# A hand-written claim on ``table``: what the extension's claim and completion do,
# in one transaction, through the same statements whatever the table (a plain one or
# a partitioned copy); ``ON CONFLICT DO NOTHING`` names no target, so it holds for
# any unique index the table has.
_SQL_CLAIM = """
INSERT INTO {table} (scope, key, request_hash, status, fencing_token, body_omitted,
                     locked_until, created_at, expires_at)
VALUES (%(scope)s, %(key)s, %(hash)s, 'in_progress', %(token)s, false,
        now() + interval '60 seconds', now(), now() + interval '1 day')
ON CONFLICT DO NOTHING
"""
_SQL_COMPLETE = """
UPDATE {table} SET status = 'completed', locked_until = NULL, response_code = 201,
       response_body = %(body)s, completed_at = now()
WHERE scope = %(scope)s AND key = %(key)s AND fencing_token = %(token)s
"""


#: The guard of :data:`WRITER_SQL_GUARDED`: one lock per key for the rest of the
#: transaction (two claims of a key queue here), then a look in every partition
#: that may hold an unexpired record (``now()`` prunes the expired ones).
GUARD = """
SELECT pg_advisory_xact_lock(hashtextextended(%(scope)s || chr(1) || %(key)s, 0));
SELECT 1 FROM {table} WHERE scope = %(scope)s AND key = %(key)s AND expires_at > now()
"""


def _sql_op(url: str, table: str, guarded: bool = False) -> t.Callable[[], bool]:
    import psycopg2

    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg2.connect(dsn)
    claim, complete = _SQL_CLAIM.format(table=table), _SQL_COMPLETE.format(table=table)
    guard = GUARD.format(table=table)

    def op() -> bool:
        params = {
            "scope": "writers",
            "key": str(uuid.uuid4()),
            "hash": uuid.uuid4().hex * 2,
            "token": int.from_bytes(os.urandom(7), "big"),
            "body": b'{"id": 1}',
        }
        with conn.cursor() as cur:
            if guarded:
                cur.execute(guard, params)
                if cur.fetchone() is not None:
                    conn.rollback()
                    return False
            cur.execute(claim, params)
            inserted = cur.rowcount == 1
            cur.execute(complete, params)
        conn.commit()
        return inserted

    return op


def writer_main(argv: t.Sequence[str]) -> None:
    """One writer process (see :class:`Writers`)."""
    url, mode, table, gap_text, limit_text, stop_text, out_text = argv
    gap, stop, out = float(gap_text), Path(stop_text), Path(out_text)
    if mode == WRITER_EXT:
        op = _ext_op(url)
    else:
        op = _sql_op(url, table, guarded=mode == WRITER_SQL_GUARDED)
    op()  # connect, warm the statement caches
    Path(f"{out}.ready").touch()
    ops: list[tuple[float, float | None]] = []
    start = time.time()
    due = start
    while not stop.exists() and time.time() - start < float(limit_text):
        now = time.time()
        if now < due:
            time.sleep(due - now)
        try:
            ok = op()
        except Exception as exc:  # counted as failed, and shown
            say(f"writer: {type(exc).__name__}: {exc}")
            ok = False
        ops.append((due, time.time() - due if ok else None))
        due += gap
    out.write_text(json.dumps(ops))


if __name__ == "__main__":
    writer_main(sys.argv[1:])
