"""What every scenario shares: the retrying client, the counts, the servers and the report.

A scenario drives *logical operations*: one key and one payload each, retried by
its client with the same key and payload until an answer settles it (2xx, or a
4xx other than 409 and 429) or its bounds run out. Every attempt's answer is
counted by status (``conn`` for a connection that failed or dropped, ``timeout``
for no answer in time), and every 5xx (or anything not JSON) that is not
``application/problem+json`` counts as an *HTML 500*. After the scenario, the
database is read:

* **ledger rows**: executions of the work (one row each, carrying the key);
* **duplicates**: rows beyond the first, per key;
* **lost**: operations whose client saw a 2xx, with no row;
* **unsettled**: operations whose bounds ran out with no settling answer;
* **stuck**: idempotency records still in progress once their lease (or claim)
  has ended, after the scenario's settle time.

A scenario passes when duplicates, lost, unsettled, stuck and HTML 500s are all
zero, except where it says it measures a route without the extension (then it
shows the duplicates it made, and passes when it made them as expected).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import http.client
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

from flask_idempotency.testing._server import free_port as free_port

ROOT = Path(__file__).resolve().parent.parent

#: Answers a client retries with the same key: the first attempt may still run
#: (409), the server is overloaded or its database down (429, 5xx).
RETRIED = {409, 425, 429, 500, 502, 503, 504}


@dataclasses.dataclass
class Answer:
    status: int | str  # an HTTP status, or "conn" / "timeout"
    content_type: str = ""
    body: bytes = b""
    replayed: bool = False

    @property
    def html_500(self) -> bool:
        """A server error (or a non-JSON error) that is not problem+json."""
        if not isinstance(self.status, int) or self.status < 400:
            return False
        return not self.content_type.startswith(("application/problem+json", "application/json"))


def request(
    host: str,
    port: int,
    method: str,
    path: str,
    body: bytes | None,
    headers: t.Mapping[str, str],
    timeout: float,
) -> Answer:
    """One HTTP request on a new connection; every failure is an :class:`Answer`."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=dict(headers))
        response = conn.getresponse()
        data = response.read()
        return Answer(
            response.status,
            response.getheader("Content-Type", ""),
            data,
            response.getheader("Idempotent-Replayed") == "true",
        )
    except TimeoutError:
        return Answer("timeout")
    except (OSError, http.client.HTTPException):
        return Answer("conn")
    finally:
        conn.close()


@dataclasses.dataclass
class Operation:
    """One logical operation: a key, a payload, and what its attempts got."""

    key: str
    path: str
    payload: dict[str, t.Any]
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    answers: list[Answer] = dataclasses.field(default_factory=list)
    #: Set when an answer settled it: 2xx, or a final 4xx.
    settled: Answer | None = None

    @property
    def succeeded(self) -> bool:
        return (
            self.settled is not None
            and isinstance(self.settled.status, int)
            and 200 <= self.settled.status < 300
        )


class Client:
    """Retries one operation with its key until an answer settles it.

    ``targets`` are ``(host, port)`` pairs; each attempt picks the next one (a
    client-side load balancer: a retry goes elsewhere). Backoff doubles from
    ``backoff`` up to 1 s, with jitter; at most ``attempts`` tries within
    ``budget`` seconds.
    """

    def __init__(
        self,
        targets: t.Sequence[tuple[str, int]],
        *,
        attempts: int = 60,
        budget: float = 90.0,
        timeout: float = 10.0,
        backoff: float = 0.05,
    ) -> None:
        self.targets = list(targets)
        self.attempts, self.budget, self.timeout, self.backoff = attempts, budget, timeout, backoff
        self._next = 0
        self._lock = threading.Lock()

    def _target(self) -> tuple[str, int]:
        with self._lock:
            self._next += 1
            return self.targets[self._next % len(self.targets)]

    def run(self, op: Operation) -> Operation:
        body = json.dumps(op.payload).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": op.key, **op.headers}
        deadline = time.monotonic() + self.budget
        delay = self.backoff
        for _ in range(self.attempts):
            host, port = self._target()
            answer = request(host, port, "POST", op.path, body, headers, self.timeout)
            op.answers.append(answer)
            # A replay is the operation's stored outcome, whatever its status: final.
            if isinstance(answer.status, int) and (answer.status not in RETRIED or answer.replayed):
                op.settled = answer
                return op
            if time.monotonic() + delay > deadline:
                break
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)
        return op


def new_operation(path: str, headers: dict[str, str] | None = None) -> Operation:
    amount = random.randint(1, 100_000)
    return Operation(
        str(uuid.uuid4()), path, {"amount": amount, "currency": "EUR"}, dict(headers or {})
    )


def drive(
    client: Client,
    make: t.Callable[[], Operation],
    *,
    count: int,
    concurrency: int,
    seconds: float | None = None,
) -> list[Operation]:
    """Run up to ``count`` operations, ``concurrency`` at a time, stopping new ones
    after ``seconds`` (those started finish)."""
    ops: list[Operation] = []
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        pending: set[concurrent.futures.Future[Operation]] = set()
        for _ in range(count):
            if seconds is not None and time.monotonic() - start > seconds:
                break
            op = make()
            ops.append(op)
            pending.add(pool.submit(client.run, op))
            if len(pending) >= concurrency * 2:
                _, pending = concurrent.futures.wait(
                    pending, return_when=concurrent.futures.FIRST_COMPLETED
                )
        concurrent.futures.wait(pending)
    return ops


@dataclasses.dataclass
class Result:
    """What a scenario saw, in the report's terms."""

    name: str
    title: str
    operations: int = 0
    attempts: int = 0
    answers: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    faults: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    ledger_rows: int = 0
    duplicates: int = 0
    lost: int = 0
    unsettled: int = 0
    stuck: int = 0
    html_500: int = 0
    seconds: float = 0.0
    #: Duplicates this scenario expects and shows (a route without the extension).
    expect_duplicates: bool = False
    skipped: str | None = None
    #: Checks of the scenario's own that failed (a bound exceeded, a refused
    #: request that left something stored): any one fails the run.
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, t.Any] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        if self.skipped:
            return True
        clean = (
            self.lost == 0
            and self.unsettled == 0
            and self.stuck == 0
            and self.html_500 == 0
            and not self.failures
        )
        if self.expect_duplicates:
            return clean
        return clean and self.duplicates == 0 and self.operations > 0

    def add_operations(self, ops: t.Iterable[Operation]) -> None:
        for op in ops:
            self.operations += 1
            self.attempts += len(op.answers)
            for answer in op.answers:
                self.answers[str(answer.status)] += 1
                self.html_500 += answer.html_500
            self.unsettled += op.settled is None

    def line(self) -> str:
        status = "SKIPPED" if self.skipped else ("PASS" if self.passed else "FAIL")
        return (
            f"{status} {self.name}: {self.operations} operations, {self.attempts} attempts, "
            f"faults {dict(self.faults)}, ledger rows {self.ledger_rows}, duplicates "
            f"{self.duplicates}, lost {self.lost}, unsettled {self.unsettled}, stuck {self.stuck}, "
            f"HTML 500s {self.html_500}"
            + (f" ({self.skipped})" if self.skipped else "")
            + "".join(f"; FAILED CHECK: {f}" for f in self.failures)
        )


def count_ledger(
    url: str, ops: t.Sequence[Operation], result: Result, table: str = "reliability_ledger"
) -> dict[str, int]:
    """Ledger rows per key for ``ops``; adds rows, duplicates and lost to ``result``."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT key, count(*) FROM {table} GROUP BY key")).all()
    finally:
        engine.dispose()
    per_key = {str(k): int(n) for k, n in rows}
    for op in ops:
        n = per_key.get(op.key, 0)
        result.ledger_rows += n
        result.duplicates += max(0, n - 1)
        result.lost += op.succeeded and n == 0
    return per_key


def count_stuck(url: str, result: Result, settle: float = 0.0) -> None:
    """Records in progress whose lease or claim has ended, after ``settle`` seconds."""
    time.sleep(settle)
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            result.stuck += int(
                conn.execute(
                    sa.text(
                        "SELECT count(*) FROM idempotency_keys WHERE status <> 'completed'"
                        " AND (locked_until IS NULL OR locked_until < CURRENT_TIMESTAMP)"
                    )
                ).scalar_one()
            )
    finally:
        engine.dispose()


def count_faults(path: Path, result: Result) -> None:
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                result.faults[json.loads(line)["point"]] += 1


def reset_tables(url: str) -> None:
    """Drop and create the reliability app's tables (and the extension's)."""
    os.environ["RELIABILITY_DATABASE_URL"] = url
    from reliability import app as app_module

    flask_app = app_module.create_app()
    with flask_app.app_context():
        app_module.db.drop_all()
        app_module.db.create_all()
        app_module.db.engine.dispose()


def new_database(cluster: t.Any, name: str, driver: str = "psycopg2") -> str:
    """A new database ``name`` in ``cluster`` (a ``PgCluster``; dropped first if
    there); its URL through ``driver``."""
    admin = sa.create_engine(cluster.url(), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return str(cluster.url(driver, name))


def gunicorn_options() -> list[str]:
    settings = importlib.import_module("gunicorn.config").Config().settings
    return ["--no-control-socket"] if "control_socket_disable" in settings else []


def stop_group(proc: subprocess.Popen[bytes], within: float = 10) -> None:
    """SIGTERM to the process group ``proc`` leads (started with
    ``start_new_session``), SIGKILL to what is left of it after ``within`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(within)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Gunicorn:
    """gunicorn serving ``app`` (an import string) on ``host:port``, in its own
    process group, stopped (and every worker killed) by :meth:`stop`."""

    def __init__(
        self,
        app: str,
        env: t.Mapping[str, str],
        *,
        workers: int = 2,
        threads: int = 1,
        timeout: float = 30,
        host: str = "127.0.0.1",
        port: int | None = None,
        prefix: t.Sequence[str] = (),
        options: t.Sequence[str] = (),
    ) -> None:
        self.app, self.env = app, dict(env)
        self.options = list(options)  # more command-line options, such as --preload
        self.workers, self.threads, self.timeout = workers, threads, timeout
        self.host, self.port = host, port or free_port()
        self.prefix = list(prefix)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = Path(tempfile.mkstemp(prefix="reliability-gunicorn-", suffix=".log")[1])

    def start(self, wait: float = 60) -> Gunicorn:
        env = {
            **os.environ,
            **self.env,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        worker_class = "gthread" if self.threads > 1 else "sync"
        command = [
            *self.prefix,
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            str(self.workers),
            "--threads",
            str(self.threads),
            "--worker-class",
            worker_class,
            "--bind",
            f"{self.host}:{self.port}",
            "--timeout",
            str(self.timeout),
            "--graceful-timeout",
            "2",
            "--log-level",
            "warning",
            *gunicorn_options(),
            *self.options,
            self.app,
        ]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gunicorn exited at start:\n{self.log.read_text(errors='replace')}"
                )
            answer = request(self.host, self.port, "GET", "/healthz", None, {}, 2)
            if answer.status == 200:
                return self
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(
            f"gunicorn did not answer in {wait} s:\n{self.log.read_text(errors='replace')}"
        )

    def worker_pids(self) -> list[int]:
        if self.proc is None:
            return []
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill_worker(self) -> bool:
        pids = self.worker_pids()
        if not pids:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(random.choice(pids), signal.SIGKILL)
        return True

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc)

    def __enter__(self) -> Gunicorn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Scale:
    """Sizes for the full run and the short one (``--short``, what CI runs)."""

    def __init__(self, short: bool) -> None:
        self.short = short

    def pick(self, full: t.Any, short: t.Any) -> t.Any:
        return short if self.short else full


@contextlib.contextmanager
def postgres(settings: t.Mapping[str, t.Any]) -> t.Iterator[t.Any]:
    """A PostgreSQL cluster of the run's own (pgserver's binaries), which a
    scenario may restart; stopped and deleted on the way out."""
    from tests.support.private_servers import PgCluster

    cluster = PgCluster.create()
    try:
        cluster.start(**settings)
        yield cluster
    finally:
        cluster.stop()


def timed(result: Result) -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def manager() -> t.Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            result.seconds = time.monotonic() - start

    return manager()
