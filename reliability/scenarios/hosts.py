"""Three app hosts in network namespaces against one PostgreSQL; one host faulted per run."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import threading
import time
import typing as t
import uuid

import sqlalchemy as sa

from reliability import _harness as h
from reliability._context import Context
from reliability.gunicorn_ready import READY_HOST_ENV, READY_PORT_ENV

if t.TYPE_CHECKING:
    from bench.netns import Topology

NAME = "hosts"
TITLE = "Three hosts in network namespaces: a host cut off from the database, or killed"
DESCRIPTION = """\
Three app hosts and one PostgreSQL, each in a network namespace of its own (veth pairs into a
switch namespace, `bench/netns.py`; Linux, as root, with `ip`). Each host runs gunicorn (2 sync
workers) serving the reliability app with the README's fail-fast engine settings
(`example_app.app.engine_options`), `IDEMPOTENCY_CLAIM_IDLE_TIMEOUT` 5 s, readiness on a port of
its own in every worker (`idem.serve_readiness`, as docs/outages.md recommends) and the
in-process scheduler in every worker (`IDEMPOTENCY_SCHEDULER`, lease recovery every 2 s, cleanup
every 5 s, job lock 10 s). A load balancer (threads in the switch namespace) checks each host's
readiness every second (deadline 3 s, out after 2 failures, back after 2 successes); clients
send each attempt to the next host in rotation, a retry to another host than the last, half of
the operations to the plain route and half to the leased one (3 s lease). After a warm-up, host
1 gets one fault, then heals: **blackhole** (its packets to and from the database silently
dropped both ways, `Topology.cut`), **link down** (`ip link set back0 down` on its database-side
veth), **latency and loss** (`tc netem delay 300ms loss 20%` on both ends of that veth), or
**host killed** (SIGKILL of gunicorn's master and workers, restarted after the fault's time).
Counted: the faulted host's answers while faulted, the seconds its 503s took (the bound
docs/outages.md documents: about 4.5 s, 6.5 s on a leased route), the seconds until the load
balancer took it out of rotation and back, the runs of the scheduled jobs (from
`idempotency_job_locks`, polled every second) and, afterwards, duplicates, lost operations and
stuck records. A blackholed or unlinked host that answers no 503, or whose workers take longer
than the documented bound for a 503 (4.5 s; 6.5 s on the leased route), or that never leaves
the rotation, fails the run.
"""

APP_PORT = 8000
READY_PORT = 8081
HOSTS = 3
#: The host every fault hits.
FAULTED = 1
#: docs/outages.md, "Fail fast instead of hanging": a 503 within about 4.5 s of the cut, 6.5 s
#: on a leased route (its failed request tries once more, on a new connection, to free its
#: record). Half a second more for a shared machine's scheduling.
BOUNDS = {"/plain": 4.5 + 0.5, "/leased": 6.5 + 0.5}
BOUND = max(BOUNDS.values())
LB_INTERVAL, LB_TIMEOUT, LB_FALL, LB_RISE = 1.0, 3.0, 2, 2
CLIENT_TIMEOUT = 10.0
NETEM = ("netem", "delay", "300ms", "loss", "20%")
#: The app each worker runs: the scheduler in every worker, jobs at short intervals.
JOB_EVERY = {"recover": 2.0, "purge": 5.0}
APP = (
    "reliability.app:create_app({'IDEMPOTENCY_SCHEDULER': True,"
    f" 'IDEMPOTENCY_RECOVER_EVERY': {JOB_EVERY['recover']},"
    f" 'IDEMPOTENCY_PURGE_EVERY': {JOB_EVERY['purge']}, 'IDEMPOTENCY_JOB_LOCK': 10}})"
)

#: (fault, label); the short run takes the first two.
RUNS = [
    ("blackhole", "host 1 blackholed from the database"),
    ("kill", "host 1 killed (SIGKILL) and restarted"),
    ("link", "host 1's database link down"),
    ("netem", "host 1's database link: 300 ms latency, 20% loss"),
]
#: ``blackhole,kill,link,netem``: the runs to make (default: all; --short: the first two).
RUNS_ENV = "RELIABILITY_HOSTS_RUNS"
#: The faults after which the host must have answered 503 fast.
CUT_OFF = {"blackhole", "link"}


@dataclasses.dataclass
class Attempt:
    host: int
    started: float  # time.monotonic()
    took: float
    answer: h.Answer


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def _tc(namespace: str, *args: str) -> None:
    done = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc -n {namespace} {' '.join(args)}: {done.stderr.strip()}")


def netem_missing(namespace: str) -> str | None:
    """Why ``tc netem`` cannot run here (probed on ``namespace``'s loopback), or ``None``."""
    try:
        _tc(namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except FileNotFoundError:
        return "needs tc (iproute2)"
    except RuntimeError as exc:
        return (
            f"this kernel has no netem qdisc ({exc}): run on a kernel with sch_netem "
            "(modprobe sch_netem) for the latency and loss run"
        )
    _tc(namespace, "qdisc", "del", "dev", "lo", "root")
    return None


def _peer(topology: Topology, namespace: str, device: str) -> str:
    """The switch's end of ``device``'s veth pair."""
    [link] = json.loads(_ip("-n", namespace, "-j", "link", "show", device))
    for other in json.loads(_ip("-n", topology.switch, "-j", "link", "show")):
        if other["ifindex"] == link["link_index"]:
            return str(other["ifname"])
    raise RuntimeError(f"no peer of {namespace}/{device} in {topology.switch}")


class Balancer:
    """Health-checks every host's readiness port and keeps the rotation: out after
    ``LB_FALL`` failed checks in a row, back after ``LB_RISE`` good ones."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.healthy = {n: True for n in range(1, HOSTS + 1)}
        #: (time.monotonic(), host, in rotation)
        self.changes: list[tuple[float, int, bool]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._watch, args=(n,), daemon=True)
            for n in range(1, HOSTS + 1)
        ]
        self._next = 0

    def start(self) -> Balancer:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(LB_TIMEOUT + 5)

    def _watch(self, n: int) -> None:
        good = bad = 0
        while not self._stop.is_set():
            started = time.monotonic()
            answer = h.request(
                self.topology.front(n), READY_PORT, "GET", "/readyz", None, {}, LB_TIMEOUT
            )
            with self._lock:
                if answer.status == 200:
                    good, bad = good + 1, 0
                    if not self.healthy[n] and good >= LB_RISE:
                        self.healthy[n] = True
                        self.changes.append((time.monotonic(), n, True))
                else:
                    good, bad = 0, bad + 1
                    if self.healthy[n] and bad >= LB_FALL:
                        self.healthy[n] = False
                        self.changes.append((time.monotonic(), n, False))
            self._stop.wait(max(0.0, LB_INTERVAL - (time.monotonic() - started)))

    def pick(self, avoid: int | None) -> int:
        """The next host in rotation (all of them when none is), another than ``avoid``."""
        with self._lock:
            rotation = [n for n, ok in self.healthy.items() if ok] or list(self.healthy)
            choices = [n for n in rotation if n != avoid] or rotation
            self._next += 1
            return choices[self._next % len(choices)]

    def left(self, host: int, after: float) -> float | None:
        return next(
            (at for at, n, ok in self.changes if n == host and not ok and at >= after), None
        )

    def rejoined(self, host: int, after: float) -> float | None:
        return next((at for at, n, ok in self.changes if n == host and ok and at >= after), None)


class BalancedClient(h.Client):
    """The harness's retrying client, each attempt sent where the balancer says
    (a retry to another host than the last), every attempt timed."""

    def __init__(self, topology: Topology, balancer: Balancer) -> None:
        targets = [(topology.front(n), APP_PORT) for n in range(1, HOSTS + 1)]
        super().__init__(targets, attempts=80, budget=120, timeout=CLIENT_TIMEOUT)
        self.topology, self.balancer = topology, balancer
        self.log: list[Attempt] = []

    def run(self, op: h.Operation) -> h.Operation:
        body = json.dumps(op.payload).encode()
        headers = {"Content-Type": "application/json", "Idempotency-Key": op.key, **op.headers}
        deadline = time.monotonic() + self.budget
        delay, host = self.backoff, None
        for _ in range(self.attempts):
            host = self.balancer.pick(avoid=host)
            started = time.monotonic()
            answer = h.request(
                self.topology.front(host), APP_PORT, "POST", op.path, body, headers, self.timeout
            )
            with self._lock:
                self.log.append(Attempt(host, started, time.monotonic() - started, answer))
            op.answers.append(answer)
            if isinstance(answer.status, int) and answer.status not in h.RETRIED:
                op.settled = answer
                return op
            if time.monotonic() + delay > deadline:
                break
            time.sleep(delay * random.uniform(0.5, 1.5))
            delay = min(delay * 2, 1.0)
        return op


class JobWatch:
    """Polls ``idempotency_job_locks`` every second: each job's runs (distinct start
    times)."""

    def __init__(self, url: str) -> None:
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        self.runs: dict[str, set[t.Any]] = collections.defaultdict(set)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def start(self) -> JobWatch:
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            with contextlib.suppress(sa.exc.SQLAlchemyError), self.engine.connect() as conn:
                for name, started in conn.execute(
                    sa.text("SELECT name, last_started_at FROM idempotency_job_locks")
                ):
                    if started is not None:
                        self.runs[name].add(started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.engine.dispose()

    def check(self, result: h.Result) -> None:
        """Each job's runs and the shortest gap between two (a run the 1 s poll
        missed only makes a gap look longer): never shorter than the interval less
        its slack (a tenth, at most 1 s), which docs/operations.md promises."""
        figures = []
        for name, every in JOB_EVERY.items():
            starts = sorted(self.runs.get(name, ()))
            gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
            figures.append(
                f"{name} (every {every:g} s) ran {len(starts)} times, shortest gap "
                + (f"{min(gaps):.2f} s" if gaps else "-")
            )
            if not starts:
                result.failures.append(f"the {name} job never ran")
            elif gaps and min(gaps) < every - min(every / 10, 1.0):
                result.failures.append(f"the {name} job ran twice within {min(gaps):.2f} s")
        result.extra["scheduled jobs (idempotency_job_locks, polled every second)"] = "; ".join(
            figures
        )


def _seconds(values: t.Sequence[float]) -> str:
    if not values:
        return "none"
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return (
        f"median {statistics.median(ordered):.2f} s, p99 {p99:.2f} s, max {ordered[-1]:.2f} s"
        f" (n={len(ordered)})"
    )


class Hosts:
    """The three gunicorns of one run, on database ``url``."""

    def __init__(self, topology: Topology, url: str) -> None:
        config = str(h.ROOT / "reliability" / "gunicorn_ready.py")
        self.servers = {
            n: h.Gunicorn(
                APP,
                {
                    "RELIABILITY_DATABASE_URL": url,
                    "RELIABILITY_LEASE": "3",
                    READY_PORT_ENV: str(READY_PORT),
                    READY_HOST_ENV: topology.front(n),
                    # The access log gives each answer's time in the worker (%(L)s).
                    "GUNICORN_CMD_ARGS": f"--config {config} --access-logfile -"
                    " --access-logformat 'ACCESS %(s)s %(L)s %(U)s'",
                },
                workers=2,
                timeout=30,
                host=topology.front(n),
                port=APP_PORT,
                prefix=topology.exec_prefix(topology.host(n)),
            )
            for n in range(1, HOSTS + 1)
        }

    def start(self) -> Hosts:
        for server in self.servers.values():
            server.start()
        return self

    def kill(self, n: int) -> None:
        """SIGKILL host ``n``'s master and workers at once (its process group)."""
        server = self.servers[n]
        proc, server.proc = server.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def answered(self, n: int, status: str) -> dict[str, list[float]]:
        """Seconds host ``n``'s workers took for each POST they answered with
        ``status``, by route."""
        found: dict[str, list[float]] = {"/plain": [], "/leased": []}
        for line in self.servers[n].log.read_text(errors="replace").splitlines():
            parts = line.split()
            if parts[:2] == ["ACCESS", status] and len(parts) == 4 and parts[3] in found:
                found[parts[3]].append(float(parts[2]))
        return found

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
            server.log.unlink(missing_ok=True)


class Fault:
    """Applies one fault to host ``FAULTED`` after ``warmup`` s and heals it
    ``duration`` s later, in a thread; times in ``at`` and ``healed``."""

    def __init__(
        self, kind: str, topology: Topology, hosts: Hosts, warmup: float, duration: float
    ) -> None:
        self.kind, self.topology, self.hosts = kind, topology, hosts
        self.warmup, self.duration = warmup, duration
        self.at = self.healed = 0.0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._peer = ""

    def start(self) -> Fault:
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join(self.warmup + self.duration + 120)
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            time.sleep(self.warmup)
            self.at = time.monotonic()
            self.apply()
            time.sleep(self.duration)
            self.heal()
            self.healed = time.monotonic()
        except BaseException as exc:  # re-raised by join()
            self.error = exc
            with contextlib.suppress(BaseException):
                self.heal()

    def apply(self) -> None:
        host = self.topology.host(FAULTED)
        if self.kind == "blackhole":
            self.topology.cut(FAULTED)
        elif self.kind == "link":
            _ip("-n", host, "link", "set", "back0", "down")
        elif self.kind == "netem":
            self._peer = _peer(self.topology, host, "back0")
            _tc(host, "qdisc", "add", "dev", "back0", "root", *NETEM)
            _tc(self.topology.switch, "qdisc", "add", "dev", self._peer, "root", *NETEM)
        elif self.kind == "kill":
            self.hosts.kill(FAULTED)
        else:
            raise ValueError(self.kind)

    def heal(self) -> None:
        host = self.topology.host(FAULTED)
        if self.kind == "blackhole":
            self.topology.heal(FAULTED)
        elif self.kind == "link":
            _ip("-n", host, "link", "set", "back0", "up")
        elif self.kind == "netem":
            with contextlib.suppress(RuntimeError):
                _tc(host, "qdisc", "del", "dev", "back0", "root")
            if self._peer:
                with contextlib.suppress(RuntimeError):
                    _tc(self.topology.switch, "qdisc", "del", "dev", self._peer, "root")
        elif self.kind == "kill" and self.hosts.servers[FAULTED].proc is None:
            self.hosts.servers[FAULTED].start()


def _one(
    ctx: Context, topology: Topology, cluster: t.Any, index: int, kind: str, label: str
) -> h.Result:
    result = h.Result(f"{NAME}: {label}", label)
    if kind == "netem":
        missing = netem_missing(topology.switch)
        if missing:
            result.skipped = missing
            return result
    warmup, duration, after = ctx.scale.pick((5.0, 30.0, 15.0), (3.0, 12.0, 6.0))
    url = h.new_database(cluster, f"hosts_{index}")
    h.reset_tables(url)
    hosts = Hosts(topology, url)
    balancer: Balancer | None = None
    jobs: JobWatch | None = None
    try:
        with h.timed(result):
            hosts.start()
            balancer = Balancer(topology).start()
            jobs = JobWatch(url).start()
            client = BalancedClient(topology, balancer)
            fault = Fault(kind, topology, hosts, warmup, duration).start()

            def make() -> h.Operation:
                return h.new_operation(random.choice(["/plain", "/leased"]))

            ops = h.drive(
                client, make, count=100_000, concurrency=6, seconds=warmup + duration + after
            )
            fault.join()
            balancer.stop()
            jobs.stop()
            jobs.check(result)
        result.faults[kind] += 1
        result.add_operations(ops)
        per_key = h.count_ledger(url, ops, result)
        stray = sorted(set(per_key) - {op.key for op in ops})
        if stray:
            result.failures.append(
                f"{sum(per_key[k] for k in stray)} ledger rows under keys no client sent: "
                + ", ".join(repr(k) for k in stray[:5])
            )
        h.count_stuck(url, result, settle=1.0)
        _figures(result, kind, client.log, balancer, fault, hosts)
    finally:
        if balancer is not None:
            balancer.stop()
        if jobs is not None:
            with contextlib.suppress(Exception):
                jobs.stop()
        hosts.stop()
    return result


def _figures(
    result: h.Result,
    kind: str,
    attempts: list[Attempt],
    balancer: Balancer,
    fault: Fault,
    hosts: Hosts,
) -> None:
    at, healed = fault.at, fault.healed
    faulted = [
        a for a in attempts if a.host == FAULTED and a.started < healed and a.started + a.took > at
    ]
    answers = collections.Counter(str(a.answer.status) for a in faulted)
    result.extra["host 1's answers while faulted (in flight at the fault or sent during it)"] = (
        ", ".join(f"{k}: {v}" for k, v in sorted(answers.items())) or "none"
    )
    unavailable = [a.took for a in faulted if a.answer.status == 503]
    by_route = hosts.answered(FAULTED, "503")
    for route, times in by_route.items():
        result.extra[f"host 1's 503s on {route}, seconds in its workers (access log)"] = _seconds(
            times
        )
    result.extra["host 1's 503s, seconds the clients waited (a queue for a worker included)"] = (
        _seconds(unavailable)
    )
    left, rejoined = balancer.left(FAULTED, at), balancer.rejoined(FAULTED, healed)
    result.extra["seconds from the fault to leaving the rotation"] = (
        f"{left - at:.1f}" if left is not None else "never left"
    )
    result.extra["seconds from healing to rejoining the rotation"] = (
        f"{rejoined - healed:.1f}" if rejoined is not None else "not within the run"
    )
    others = [a.took for a in attempts if a.host != FAULTED and at <= a.started < healed]
    result.extra["the other hosts' answers meanwhile, seconds"] = _seconds(others)
    if kind in CUT_OFF:
        for route, times in by_route.items():
            over = [took for took in times if took > BOUNDS.get(route, BOUND)]
            if over:
                result.failures.append(
                    f"{len(over)} of host 1's {len(times)} 503s on {route} took its workers "
                    f"longer than the documented bound ({BOUNDS.get(route, BOUND):g} s with slack)"
                )
        if not unavailable:
            result.failures.append("the cut-off host answered no 503 while cut off")
        if answers["timeout"]:
            # Not a failure of the bound: a request queued behind sync workers that are each
            # waiting out the bound waits for a worker first (docs/outages.md); readiness
            # takes the host out of rotation before many do.
            result.notes.append(
                f"{answers['timeout']} attempts at the cut-off host got no answer within "
                f"{CLIENT_TIMEOUT:g} s (queued for a worker), and were retried elsewhere"
            )
    if kind in CUT_OFF or kind == "kill":
        if left is None:
            result.failures.append("host 1 never left the rotation")
        elif left - at > LB_FALL * LB_INTERVAL + LB_TIMEOUT + BOUND:
            result.failures.append(f"host 1 left the rotation only after {left - at:.1f} s")


def run(ctx: Context) -> list[h.Result]:
    from bench import netns

    runs = RUNS if not ctx.scale.short else RUNS[:2]
    if os.environ.get(RUNS_ENV):  # the faults named, at the run's size
        runs = [r for r in RUNS if r[0] in os.environ[RUNS_ENV].split(",")]
    reason = netns.available()
    if reason is not None:
        skipped = [h.Result(f"{NAME}: {label}", label, skipped=reason) for _, label in runs]
        for result in skipped:
            ctx.show(result)
        return skipped
    from tests.support.private_servers import PgCluster

    topology = netns.Topology(HOSTS, prefix=f"rel{uuid.uuid4().hex[:6]}")
    cluster: PgCluster | None = None
    results: list[h.Result] = []
    try:
        topology.create()
        with topology.in_switch():  # the clients, the balancer and the counts live here
            cluster = PgCluster.create(
                host=netns.DB_ADDRESS,
                prefix=topology.exec_prefix(topology.database),
                trust="10.231.0.0/16",
            ).start(max_connections=200)
            for index, (kind, label) in enumerate(runs):
                result = _one(ctx, topology, cluster, index, kind, label)
                ctx.show(result)
                results.append(result)
    finally:
        if cluster is not None:
            cluster.stop()
        topology.destroy()
    return results
