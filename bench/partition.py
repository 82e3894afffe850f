"""A host cut off from its database, under load: ``python -m bench.partition``.

Three app hosts and one PostgreSQL, each in a network namespace of its own
(:mod:`bench.netns`; Linux, as root). Each host runs gunicorn (sync workers)
serving the example's payments service with the README's fail-fast engine
settings. Eight client threads charge through a simulated load balancer that
health-checks every host's readiness; each charge has one key, kept across its
retries, and a retry goes to another host. After a warm-up, host 1 is
partitioned from the database (silently, both ways) for ``--cut`` seconds, then
healed; the load goes on, and every key is then retried until it succeeds.

What it measures (and prints as a Markdown report):

* **the cut host's answers**: of the attempts sent there during the cut, how many
  the client (timeout ``--client-timeout``, 5 s) saw as 503 and how many as
  timeouts; and, from gunicorn's access log, how long the host took to answer
  each 503 (the bound a client can rely on);
* **readiness**: the load balancer's checks of the cut host (every
  ``--lb-interval`` s, deadline ``--lb-timeout`` s): answered in time, and how
  long until the host left the rotation;
* **the healthy hosts**: attempts there for keys whose earlier attempt went to
  the cut host (their claims may still be held): latency and timeouts;
* **the server's view**: how long the cut host's transactions stayed "idle in
  transaction" in ``pg_stat_activity``, counted from the cut;
* **correctness**: one ledger row per key that succeeded, no key left without a
  success, no record left in progress.

``--ready-port 8081`` has each gunicorn worker serve readiness on a port of its
own (``idem.serve_readiness``), which the load balancer then checks instead of
``/readyz`` on the app's port. ``--config`` adds app config as JSON (the
``IDEMPOTENCY_*`` settings under test).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import http.client
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import typing as t
import uuid
from pathlib import Path

import sqlalchemy as sa

from bench import netns
from bench.harness import percentile
from bench.partition_app import CONFIG_ENV, WORK_ENV
from bench.partition_gunicorn import READY_HOST_ENV, READY_PORT_ENV
from bench.servers import _quiet_options

ROOT = Path(__file__).resolve().parent.parent
APP_PORT = 8000
CHARGE = {"customer_id": "cus_bench", "amount": 1250, "currency": "EUR"}
_ACCESS = re.compile(r"^ACCESS (\d+) (\S+) (\d+\.\d+) (\S+)$")


@dataclasses.dataclass
class Attempt:
    key: str
    host: int
    started: float  # seconds since the run's start
    took: float
    outcome: str  # "201", "503", "409", "timeout", "error: ..."
    retry: bool  # an earlier attempt of this key failed


@dataclasses.dataclass
class Check:
    host: int
    started: float
    took: float
    outcome: str  # "200", "503", "timeout", "error"


@dataclasses.dataclass
class Options:
    hosts: int = 3
    workers: int = 4
    clients: int = 8
    warmup: float = 5.0
    cut: float = 40.0
    after: float = 20.0
    client_timeout: float = 5.0
    lb_interval: float = 2.0
    lb_timeout: float = 3.0
    lb_fall: int = 2
    lb_rise: int = 2
    ready_port: int | None = None
    config: dict[str, t.Any] = dataclasses.field(default_factory=dict)
    gunicorn_timeout: int = 30
    work: float = 0.05
    driver: str = "psycopg2"


class Clock:
    def __init__(self) -> None:
        self.zero = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.zero


def _post(host: str, key: str, timeout: float) -> tuple[str, float]:
    """POST /charge once; (outcome, Retry-After seconds)."""
    conn = http.client.HTTPConnection(host, APP_PORT, timeout=timeout)
    try:
        body = json.dumps({**CHARGE, "description": key})
        conn.request(
            "POST",
            "/charge",
            body=body,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        response = conn.getresponse()
        response.read()
        retry_after = float(response.getheader("Retry-After") or 0)
        return str(response.status), retry_after
    except TimeoutError:
        return "timeout", 0.0
    except OSError as exc:
        return f"error: {type(exc).__name__}", 0.0
    finally:
        conn.close()


def _get(host: str, port: int, path: str, timeout: float) -> str:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return str(response.status)
    except TimeoutError:
        return "timeout"
    except OSError:
        return "error"
    finally:
        conn.close()


class LoadBalancer:
    """Health-checks each host's readiness and keeps the rotation, as an LB does:
    out after ``fall`` failed checks in a row, back after ``rise`` good ones."""

    def __init__(self, topology: netns.Topology, options: Options, clock: Clock) -> None:
        self.topology, self.options, self.clock = topology, options, clock
        self.healthy = {n: True for n in range(1, options.hosts + 1)}
        self.checks: list[Check] = []
        self.changes: list[tuple[float, int, bool]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=(n,), daemon=True)
            for n in range(1, options.hosts + 1)
        ]
        self._next = itertools.count()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _watch(self, n: int) -> None:
        port = self.options.ready_port or APP_PORT
        streak_bad = streak_good = 0
        while not self._stop.is_set():
            started = self.clock()
            outcome = _get(self.topology.front(n), port, "/readyz", self.options.lb_timeout)
            took = self.clock() - started
            with self._lock:
                self.checks.append(Check(n, started, took, outcome))
                if outcome == "200":
                    streak_good, streak_bad = streak_good + 1, 0
                    if not self.healthy[n] and streak_good >= self.options.lb_rise:
                        self.healthy[n] = True
                        self.changes.append((self.clock(), n, True))
                else:
                    streak_bad, streak_good = streak_bad + 1, 0
                    if self.healthy[n] and streak_bad >= self.options.lb_fall:
                        self.healthy[n] = False
                        self.changes.append((self.clock(), n, False))
            self._stop.wait(max(0.0, self.options.lb_interval - took))

    def pick(self, avoid: int | None = None) -> int:
        """The next host in rotation (round robin), another than ``avoid`` when it can."""
        with self._lock:
            rotation = [n for n, ok in self.healthy.items() if ok] or list(self.healthy)
        choices = [n for n in rotation if n != avoid] or rotation
        return choices[next(self._next) % len(choices)]


class Monitor:
    """The server's view: the cut host's transactions idle in ``pg_stat_activity``,
    each (backend, transaction start) with when it was first and last seen, and
    its last statement."""

    def __init__(self, url: str, address: str, clock: Clock) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.address, self.clock = address, clock
        self.seen: dict[tuple[int, t.Any], list[float]] = {}
        self.last_statement: dict[tuple[int, t.Any], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.engine.dispose()

    def _run(self) -> None:
        query = sa.text(
            "SELECT pid, xact_start, left(query, 60) FROM pg_stat_activity "
            "WHERE client_addr = CAST(:addr AS inet) AND state LIKE 'idle in transaction%'"
        )
        with self.engine.connect() as conn:
            while not self._stop.is_set():
                now = self.clock()
                for pid, started, last in conn.execute(query, {"addr": self.address}):
                    span = self.seen.setdefault((pid, started), [now, now])
                    span[1] = now
                    self.last_statement[(pid, started)] = last
                conn.rollback()
                self._stop.wait(0.25)

    def stranded(self, cut_at: float) -> list[tuple[float, bool]]:
        """Transactions idle across the cut's start: (seconds after the cut they
        were last seen, whether they held a claim: anything past a bare BEGIN)."""
        found = []
        for key, (first, last) in self.seen.items():
            if first <= cut_at + 0.5 and last > cut_at + 0.5:
                claim = not self.last_statement[key].strip().upper().startswith("BEGIN")
                found.append((last - cut_at, claim))
        return found


class Host:
    """gunicorn in host ``n``'s namespace."""

    def __init__(self, topology: netns.Topology, n: int, url: str, options: Options) -> None:
        self.n = n
        self.log = Path(tempfile.mkstemp(prefix=f"bench-partition-h{n}-", suffix=".log")[1])
        env = {
            **os.environ,
            "EXAMPLE_DATABASE_URL": url,
            CONFIG_ENV: json.dumps(options.config),
            WORK_ENV: str(options.work),
            "PYTHONPATH": str(ROOT),
        }
        if options.ready_port is not None:
            env[READY_PORT_ENV] = str(options.ready_port)
            env[READY_HOST_ENV] = topology.front(n)
        command = [
            *topology.exec_prefix(topology.host(n)),
            sys.executable,
            "-m",
            "gunicorn",
            "--workers",
            str(options.workers),
            "--worker-class",
            "sync",
            "--bind",
            f"{topology.front(n)}:{APP_PORT}",
            "--timeout",
            str(options.gunicorn_timeout),
            "--config",
            str(ROOT / "bench" / "partition_gunicorn.py"),
            "--access-logfile",
            "-",
            # status, pid, seconds taken, path: what the report reads back
            "--access-logformat",
            "ACCESS %(s)s %(p)s %(L)s %(U)s",
            *_quiet_options(),
            "bench.partition_app:create_app()",
        ]
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )

    def wait_serving(self, topology: netns.Topology, within: float = 60) -> None:
        deadline = time.monotonic() + within
        while _get(topology.front(self.n), APP_PORT, "/healthz", 2) != "200":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {self.n} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    def answers(self) -> list[tuple[str, float, str]]:
        """(status, seconds, path) of each request gunicorn logged."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            match = _ACCESS.match(line.strip())
            if match:
                found.append((match.group(1), float(match.group(3)), match.group(4)))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Clients:
    """``clients`` threads, each charging one key at a time until told to stop, then
    finishing its key (retrying until it succeeds)."""

    def __init__(self, topology: netns.Topology, lb: LoadBalancer, options: Options, clock: Clock):
        self.topology, self.lb, self.options, self.clock = topology, lb, options, clock
        self.attempts: list[Attempt] = []
        self.succeeded: set[str] = set()
        self.unfinished: set[str] = set()
        self._lock = threading.Lock()
        self.stop_new = threading.Event()
        self.give_up = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(options.clients)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        while not self.stop_new.is_set():
            key = str(uuid.uuid4())
            host, retry = self.lb.pick(), False
            while True:
                started = self.clock()
                outcome, retry_after = _post(
                    self.topology.front(host), key, self.options.client_timeout
                )
                with self._lock:
                    self.attempts.append(
                        Attempt(key, host, started, self.clock() - started, outcome, retry)
                    )
                if outcome in ("200", "201"):
                    with self._lock:
                        self.succeeded.add(key)
                    break
                if self.give_up.is_set():
                    with self._lock:
                        self.unfinished.add(key)
                    break
                retry = True
                time.sleep(min(retry_after, 1.0) if retry_after else 0.05)
                host = self.lb.pick(avoid=host)


def _seconds(values: list[float]) -> str:
    if not values:
        return "none"
    return (
        f"median {statistics.median(values):.1f} s, p90 {percentile(values, 0.9):.1f} s, "
        f"max {max(values):.1f} s (n={len(values)})"
    )


def run(options: Options) -> str:
    """Run the scenario; the Markdown report."""
    from tests.support.private_servers import PgCluster

    reason = netns.available()
    if reason is not None:
        raise SystemExit(f"bench.partition {reason}")
    clock = Clock()
    topology = netns.Topology(options.hosts).create()
    cluster: PgCluster | None = None
    hosts: list[Host] = []
    try:
        topology.enter_switch()  # this process's threads reach hosts and database from here
        cluster = PgCluster.create(
            host=netns.DB_ADDRESS,
            prefix=topology.exec_prefix(topology.database),
            trust="10.231.0.0/16",
        ).start(max_connections=200)
        url = cluster.url(options.driver)
        _create_tables(url)
        hosts = [Host(topology, n, url, options) for n in range(1, options.hosts + 1)]
        for host in hosts:
            host.wait_serving(topology)
        lb = LoadBalancer(topology, options, clock)
        monitor = Monitor(url, topology.back(1), clock)
        clients = Clients(topology, lb, options, clock)
        lb.start()
        monitor.start()
        clients.start()
        time.sleep(options.warmup)
        cut_at = clock()
        topology.cut(1)
        time.sleep(options.cut)
        topology.heal(1)
        healed_at = clock()
        time.sleep(options.after)
        clients.stop_new.set()
        finish = threading.Timer(120, clients.give_up.set)
        finish.start()
        clients.join()
        finish.cancel()
        lb.stop()
        end_at = clock()
        monitor.stop()
        ledger = _ledger(url)
        for host in hosts:
            host.stop()
        return _report(options, clients, lb, monitor, hosts, ledger, cut_at, healed_at, end_at)
    finally:
        for host in hosts:
            with contextlib.suppress(Exception):
                host.stop()
            host.log.unlink(missing_ok=True)
        if cluster is not None:
            cluster.stop()
        topology.destroy()


def _create_tables(url: str) -> None:
    from example_app import app as example

    app = example.create_app({"SQLALCHEMY_DATABASE_URI": url})
    with app.app_context():
        example.db.engine.dispose()


def _ledger(url: str) -> dict[str, t.Any]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            per_key = dict(
                conn.execute(
                    sa.text("SELECT description, count(*) FROM ledger GROUP BY description")
                ).all()
            )
            in_progress = conn.execute(
                sa.text("SELECT count(*) FROM idempotency_keys WHERE status = 'in_progress'")
            ).scalar_one()
        return {"per_key": per_key, "in_progress": int(in_progress)}
    finally:
        engine.dispose()


def _report(
    options: Options,
    clients: Clients,
    lb: LoadBalancer,
    monitor: Monitor,
    hosts: list[Host],
    ledger: dict[str, t.Any],
    cut_at: float,
    healed_at: float,
    end_at: float,
) -> str:
    # In flight when the cut began, or sent during it.
    cut_host = [
        a
        for a in clients.attempts
        if a.host == 1 and a.started < healed_at and a.started + a.took > cut_at
    ]
    kinds = collections.Counter(a.outcome for a in cut_host)
    # Keys that met the cut host during the cut: their retries elsewhere may wait
    # behind the claim the cut host still holds on the server.
    met_cut = {a.key for a in cut_host}
    healthy_retries = [a for a in clients.attempts if a.key in met_cut and a.host != 1 and a.retry]
    retry_kinds = collections.Counter(a.outcome for a in healthy_retries)
    by_key: dict[str, list[Attempt]] = collections.defaultdict(list)
    for a in clients.attempts:
        if a.key in met_cut:
            by_key[a.key].append(a)
    to_success = [
        max(a.started + a.took for a in tries) - min(a.started for a in tries)
        for key, tries in by_key.items()
        if key in clients.succeeded
    ]
    answered_503 = [took for status, took, path in hosts[0].answers() if status == "503"
                    and path == "/charge"]  # fmt: skip
    checks = [c for c in lb.checks if c.host == 1 and cut_at <= c.started < healed_at]
    in_time = [c for c in checks if c.outcome in ("200", "503")]
    out_at = next((at for at, n, ok in lb.changes if n == 1 and not ok and at >= cut_at), None)
    back_at = next((at for at, n, ok in lb.changes if n == 1 and ok and at >= healed_at), None)
    stranded = monitor.stranded(cut_at)
    held_claims = [after for after, claim in stranded if claim]
    still_held = sum(1 for after in held_claims if after >= end_at - cut_at - 1)
    bare = [after for after, claim in stranded if not claim]
    duplicates = {k: n for k, n in ledger["per_key"].items() if n != 1}
    missing = [k for k in clients.succeeded if k not in ledger["per_key"]]
    lines = [
        "## A host cut off from its database, under load",
        "",
        f"{options.hosts} hosts x {options.workers} sync workers on {options.driver} (views work "
        f"{options.work * 1000:g} ms in their transaction), {options.clients} clients "
        f"(timeout {options.client_timeout:g} s), host 1 cut for {options.cut:g} s; load balancer "
        f"checks every {options.lb_interval:g} s, deadline {options.lb_timeout:g} s, out after "
        f"{options.lb_fall}, back after {options.lb_rise}; readiness on "
        + (f"port {options.ready_port}" if options.ready_port else "the app's port (/readyz)")
        + (f"; config {json.dumps(options.config)}" if options.config else ""),
        "",
        "| what | figure |",
        "|---|---|",
        f"| attempts at the cut host, in flight at the cut or sent during it | {len(cut_host)}: "
        + ", ".join(f"{k} x{v}" for k, v in kinds.most_common())
        + " |",
        f"| the cut host's 503s, time to answer (gunicorn) | {_seconds(answered_503)} |",
        f"| LB checks of the cut host during the cut answered within {options.lb_timeout:g} s | "
        f"{len(in_time)} of {len(checks)} ("
        + ", ".join(f"{k} x{v}" for k, v in collections.Counter(c.outcome for c in checks).items())
        + ") |",
        "| cut host out of rotation after | "
        + (f"{out_at - cut_at:.1f} s" if out_at is not None else "never")
        + " |",
        "| back in rotation after healing | "
        + (f"{back_at - healed_at:.1f} s" if back_at is not None else "never")
        + " |",
        f"| their retries on the healthy hosts | {len(healthy_retries)}: "
        + ", ".join(f"{k} x{v}" for k, v in retry_kinds.most_common())
        + f"; latency {_seconds([a.took for a in healthy_retries])} |",
        f"| keys that met the cut host: first attempt to success | {_seconds(to_success)} |",
        f"| the cut host's transactions left holding a claim, idle on the server: "
        f"gone after (from the cut; heal at {healed_at - cut_at:.0f} s, run end at "
        f"{end_at - cut_at:.0f} s) | {_seconds(held_claims)}; still held at the end: "
        f"{still_held} |",
        f"| ... and left idle without a claim (a bare BEGIN) | {_seconds(bare)} |",
        f"| keys: succeeded / unfinished | {len(clients.succeeded)} / {len(clients.unfinished)} |",
        f"| ledger rows per key != 1 | {len(duplicates)} |",
        f"| succeeded without a ledger row | {len(missing)} |",
        f"| records left in progress | {ledger['in_progress']} |",
        "",
    ]
    return "\n".join(lines)


#: The command's options: fields of :class:`Options` (``--client-timeout`` for
#: ``client_timeout``), each defaulting to the field's default.
_COMMAND = (
    "hosts",
    "workers",
    "clients",
    "warmup",
    "cut",
    "after",
    "client_timeout",
    "lb_interval",
    "lb_timeout",
    "ready_port",
    "work",
    "config",
    "driver",
)
_KIND: dict[str, t.Any] = {"ready_port": int, "config": json.loads}
_HELP = {"work": "seconds each view works in its transaction", "config": "app config, JSON"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.partition", description=__doc__)
    defaults = Options()
    for name in _COMMAND:
        default = getattr(defaults, name)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_KIND.get(name, type(default)),
            default=default,
            help=_HELP.get(name),
            **({"choices": ["psycopg2", "psycopg"]} if name == "driver" else {}),
        )
    parser.add_argument("--out", type=Path, default=None, help="append the report here")
    args = parser.parse_args(argv)
    options = Options(**{name: getattr(args, name) for name in _COMMAND})
    report = run(options)
    print(report)
    if args.out is not None:
        with args.out.open("a") as out:
            out.write(report + "\n")


if __name__ == "__main__":
    main()
