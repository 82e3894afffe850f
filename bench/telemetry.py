"""The cost of the extension's OpenTelemetry instrumentation:
``python -m bench.telemetry [--quick] ...``.

New-key and replay throughput of ``bench/app.py``'s ``/ext`` route under
gunicorn (3 sync workers per variant, all started before the rounds), one
OpenTelemetry set-up per variant (``bench/telemetry_app.py``): no API at all,
the API without an SDK (the baseline), the SDK with an in-memory reader and
span processor, the same under the Flask instrumentation (against the same
set-up without the extension's figures), and the Prometheus exporter scraped
once a second. Every variant's requests/s over the baseline's in the same
round, median over the rounds, with the CPU per request of the server's
processes; on PostgreSQL through psycopg2 and psycopg 3 (a private cluster) and
on SQLite. Writes its section of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import importlib.metadata
import importlib.util
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import typing as t
import uuid
from pathlib import Path

from bench import harness, report
from bench.harness import say
from bench.load import Generator, KeyMode, LoadError, Target, send_once
from bench.procstats import CpuMeter
from bench.run import make_generator, measure
from bench.servers import Gunicorn
from bench.telemetry_app import (
    API,
    DIR_ENV,
    FLASK_ONLY,
    NEEDS,
    NO_API,
    PROMETHEUS,
    SDK,
    SDK_FLASK,
    VARIANT_ENV,
    VARIANTS,
)
from bench.variants import ENGINES, REPLAY_KEY, Variant

NAME = "bench.telemetry"
APP = "bench.telemetry_app:create_app()"
WORKERS = 3
#: The issue's target: with the SDK, the new-key path keeps at least this share
#: of the baseline's throughput (at most 3% less).
TARGET = 0.97
#: Seconds between two scrapes of every worker's ``/metrics``.
SCRAPE_EVERY = 1.0
#: The mode of each case: a new key per request, or a replay of one completed key.
NEW, REPLAY = "new key", "replay"
#: The benchmark's own requests to the workers (their server spans are not counted).
OUR_GETS = ("GET /healthz", "GET /telemetry-state")
#: Ratios with the issue's target: (numerator, denominator) on the new-key path.
CHECKED = ((SDK, API), (SDK_FLASK, FLASK_ONLY))


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured thing: a variant's server, a route, a key mode."""

    name: str
    server: str
    path: str
    key_mode: KeyMode
    mode: str

    def as_variant(self) -> Variant:
        return Variant(self.name, self.path, self.key_mode, f"{self.server}, {self.mode}")


def cases(servers: t.Sequence[str], floor: bool) -> list[Case]:
    """Each server's new-key and replay cases; the hand-written floor (new key,
    on the ``api`` server) when ``floor``."""
    found = []
    for server in servers:
        found.append(Case(server, server, "/ext", "new", NEW))
        found.append(Case(f"{server} replay", server, "/ext", "fixed", REPLAY))
    if floor and API in servers:
        found.append(Case("floor", API, "/floor", "new", NEW))
    return found


def missing(variant: str) -> str | None:
    """Why ``variant`` cannot run here (a package it needs is not installed), or None."""
    needed = ("opentelemetry",) if variant != NO_API else ()
    for module in (*needed, *NEEDS.get(variant, ())):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return f"`{module}` is not installed"
    return None


# -- the servers --------------------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def worker_states(server: Gunicorn, tries: int = 30) -> dict[int, dict[str, t.Any]]:
    """``/telemetry-state`` of the workers that answered ``tries`` requests
    (each on a new connection, so that most workers answer one), by pid."""
    states = {}
    for _ in range(tries):
        status, body = _get(server.port, "/telemetry-state")
        if status != 200:
            raise LoadError(f"GET /telemetry-state: {status} {body[:500]!r}")
        state = json.loads(body)
        states[state["pid"]] = state
    return states


def check_set_up(variant: str, states: dict[int, dict[str, t.Any]]) -> list[str]:
    """Fail when a worker did not set up what ``variant`` says; what was seen, in words."""
    seen = []
    for state in states.values():
        if state["variant"] != variant:
            raise RuntimeError(f"{variant}: a worker runs {state['variant']}")
        loaded = state["opentelemetry_modules"]
        if variant == NO_API and loaded:
            raise RuntimeError(f"{variant}: opentelemetry was imported in worker {state['pid']}")
        if variant == API and state.get("meter_provider", "_ProxyMeterProvider") not in (
            "_ProxyMeterProvider",
            "NoOpMeterProvider",
        ):
            raise RuntimeError(f"{variant}: an SDK is configured: {state}")
        if variant != NO_API and state["extension_telemetry"] and not loaded:
            raise RuntimeError(f"{variant}: the extension's telemetry did not import opentelemetry")
        sees = state.get("extension_sees_api")
        if sees is not None and sees != (variant != NO_API):
            raise RuntimeError(f"{variant}: the extension's telemetry found the API: {sees}")
        words = f"{loaded} opentelemetry modules"
        if "meter_provider" in state:
            words += f", {state['meter_provider']}"
        if sees is not None:
            words += ", the extension " + ("found the API" if sees else "found no API")
        seen.append(words)
    return sorted(set(seen))


class Scraper:
    """Scrapes every worker's ``/metrics`` of a Prometheus server once a second
    (the ports its workers wrote), from a thread of the benchmark, while on."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.scrapes = 0
        self.failures: list[str] = []
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scraper", daemon=True)
        self._thread.start()

    def ports(self) -> list[int]:
        return [int(path.read_text()) for path in sorted(self.folder.glob("port-*"))]

    def scrape_all(self) -> list[bytes]:
        bodies = []
        for port in self.ports():
            status, body = _get(port, "/metrics")
            if status != 200:
                raise LoadError(f"GET :{port}/metrics: {status}")
            bodies.append(body)
        return bodies

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._on.wait(0.2):
                due = time.monotonic() + SCRAPE_EVERY
                try:
                    self.scrape_all()
                    self.scrapes += 1
                except (OSError, LoadError) as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(max(0.0, due - time.monotonic()))

    @contextlib.contextmanager
    def scraping(self) -> t.Iterator[None]:
        self._on.set()
        try:
            yield
        finally:
            self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


_SAMPLE = re.compile(r"^idempotency_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.M)
_OUTCOME = re.compile(r'idempotency_outcome="([^"]*)"')


def prometheus_totals(bodies: t.Sequence[bytes]) -> dict[str, float]:
    """``idempotency_requests_total`` summed over the workers, by outcome."""
    totals: dict[str, float] = {}
    for body in bodies:
        for labels, value in _SAMPLE.findall(body.decode()):
            outcome = _OUTCOME.search(labels)
            key = outcome.group(1) if outcome else "?"
            totals[key] = totals.get(key, 0) + float(value)
    return totals


def sdk_figures(folder: Path, variant: str) -> dict[str, t.Any]:
    """What the SDK variants' workers last wrote: the extension's request counts
    by outcome and instruments (summed over workers), spans by scope and name."""
    requests: dict[str, float] = {}
    instruments: dict[str, int] = {}
    spans: dict[str, int] = {}
    workers = 0
    for path in sorted(folder.glob(f"{variant}-*.json")):
        figures = json.loads(path.read_text())
        workers += 1
        for key, value in figures["requests"].items():
            requests[key] = requests.get(key, 0) + value
        for key, value in figures["instruments"].items():
            instruments[key] = max(instruments.get(key, 0), value)
        for key, value in figures["spans"].items():
            if not key.endswith(OUR_GETS):  # the benchmark's own look at the workers
                spans[key] = spans.get(key, 0) + value
    return {"workers": workers, "requests": requests, "instruments": instruments, "spans": spans}


# -- the run --------------------------------------------------------------------------------


@dataclasses.dataclass
class EngineRun:
    result: report.EngineResult
    cases: list[Case]
    #: Requests answered per server (warm-up and rounds), for the recorded counts.
    answered: dict[str, int]
    recorded: dict[str, dict[str, t.Any]]
    set_up: dict[str, list[str]]
    scrapes: int = 0


def run_engine(
    engine: str,
    url: str,
    postmaster: int | None,
    servers: list[str],
    load: Generator,
    args: argparse.Namespace,
) -> EngineRun:
    from bench.app import reset_database

    reset_database(url)
    chosen = cases(servers, args.floor)
    result = report.EngineResult(
        engine, [c.as_variant() for c in chosen], {c.name: [] for c in chosen}
    )
    answered = dict.fromkeys(servers, 0)
    set_up: dict[str, list[str]] = {}
    run = uuid.uuid4().hex[:8]
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-telemetry-")))
        started: dict[str, Gunicorn] = {}
        for variant in servers:
            folder = base / variant
            folder.mkdir()
            env = {VARIANT_ENV: variant, DIR_ENV: str(folder)}
            started[variant] = stack.enter_context(Gunicorn(url, WORKERS, app=APP, env=env))
            say(
                f"[{engine}] {variant}: gunicorn {started[variant].pid} on :{started[variant].port}"
            )
        scraper = None
        if PROMETHEUS in started:
            scraper = Scraper(base / PROMETHEUS)
            stack.callback(scraper.close)
        for variant, server in started.items():  # the record every replay finds
            status, body = send_once(Target(server.port, "/ext", "fixed", REPLAY_KEY), REPLAY_KEY)
            if not 200 <= status < 300:
                raise LoadError(f"{variant}: POST /ext (replay key): {status} {body!r}")
            answered[variant] += 1

        def run_case(case: Case, seconds: float, run_id: str) -> report.Sample:
            server = started[case.server]
            target = Target(server.port, case.path, case.key_mode, REPLAY_KEY)
            meter = CpuMeter({server.pid} | ({postmaster} if postmaster else set()))
            scraping = scraper.scraping() if case.server == PROMETHEUS and scraper else None
            with scraping or contextlib.nullcontext():
                sample = measure(load, target, meter, seconds, run_id)
            if case.path == "/ext":
                answered[case.server] += sample.requests
            return sample

        for case in chosen:  # workers import, pools connect, instruments are made
            run_case(case, args.warm, f"{run}-warm-{case.name}")
        for variant, server in started.items():
            states = worker_states(server)
            seen = check_set_up(variant, states)
            set_up[variant] = [*seen, f"{len(states)} of {WORKERS} workers looked at"]
        rng = random.Random(args.seed)
        for round_no in range(1, args.rounds + 1):
            # A mode's cases one after the other, so that each runs within seconds
            # of the baseline it is compared with; the modes' order alternates.
            order = []
            for mode in (NEW, REPLAY) if round_no % 2 else (REPLAY, NEW):
                group = [case for case in chosen if case.mode == mode]
                rng.shuffle(group)
                order += group
            for case in order:
                sample = run_case(case, args.duration, f"{run}-{round_no}-{case.name}")
                result.samples[case.name].append(sample)
                say(
                    f"[{engine}] round {round_no}/{args.rounds} {case.name:18} "
                    f"{sample.rate:8.0f} req/s  p50 {sample.p50_ms:6.2f} ms  "
                    f"CPU {sample.cpu_ms:5.2f} ms/req"
                )
        recorded: dict[str, dict[str, t.Any]] = {}
        # Every worker's last collection (once a second) written, and its last spans
        # exported (the batch span processor's delay is 5 s).
        time.sleep(6.5)
        for variant in (SDK, SDK_FLASK, FLASK_ONLY):
            if variant in started:
                recorded[variant] = sdk_figures(base / variant, variant)
        if scraper is not None:
            recorded[PROMETHEUS] = {
                "workers": len(scraper.ports()),
                "requests": prometheus_totals(scraper.scrape_all()),
            }
            if scraper.failures:
                raise LoadError(f"scrapes failed: {scraper.failures[:3]}")
        return EngineRun(
            result, chosen, answered, recorded, set_up, scraper.scrapes if scraper else 0
        )


# -- the section ------------------------------------------------------------------------------


def _ratio(run: EngineRun, case: Case, baseline: str, field: str) -> float | None:
    if field == "cpu_ms":  # the baseline's CPU per request over the case's: < 1 costs more
        return run.result.field_ratio(baseline, case.name, field)
    return run.result.field_ratio(case.name, baseline, field)


def _baseline(case: Case) -> str:
    return API if case.mode == NEW else f"{API} replay"


def _x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def ratio_rows(runs: dict[str, EngineRun]) -> list[str]:
    """Every case's ratio to ``api`` of its mode, per engine (by CPU in brackets)."""
    engines = list(runs)
    head = "| variant | mode | " + " | ".join(engines) + " |"
    rows = [head, "|---|---|" + "---:|" * len(engines)]
    names: list[Case] = []
    for run in runs.values():
        names += [c for c in run.cases if c.name not in {n.name for n in names}]
    for case in names:
        cells = []
        for engine in engines:
            run = runs[engine]
            if case.name not in run.result.samples:
                cells.append("")
                continue
            rate = _ratio(run, case, _baseline(case), "rate")
            cpu = _ratio(run, case, _baseline(case), "cpu_ms")
            cells.append(f"{_x(rate)} ({_x(cpu)})")
        rows.append(
            f"| {case.server if case.name != 'floor' else 'floor'} | {case.mode} | "
            + " | ".join(cells)
            + " |"
        )
    return rows


def verdicts(runs: dict[str, EngineRun]) -> list[str]:
    lines = []
    for numerator, denominator in CHECKED:
        parts = []
        for engine, run in runs.items():
            value = run.result.field_ratio(numerator, denominator, "rate")
            if value is None:
                continue
            by_cpu = run.result.field_ratio(denominator, numerator, "cpu_ms")
            verdict = "meets" if value >= TARGET else "**below**"
            parts.append(f"{engine} {value:.3f} {verdict} (by CPU/req {_x(by_cpu)})")
        if parts:
            lines.append(
                f"* `{numerator}` / `{denominator}`, new key (target at least {TARGET:.2f}, "
                f"at most 3% less): " + "; ".join(parts)
            )
    return lines


def cpu_added_us(run: EngineRun, case: Case) -> float | None:
    """Median over the rounds of the case's CPU time per request minus its
    baseline's in the same round, in microseconds."""
    pairs = zip(run.result.samples[case.name], run.result.samples[_baseline(case)], strict=True)
    added = [(a.cpu_ms - b.cpu_ms) * 1000 for a, b in pairs]
    return statistics.median(added) if added else None


def engine_rows(run: EngineRun) -> list[str]:
    rows = [
        "| case | req/s | p50 ms | p99 ms | CPU ms/req | CPU µs/req over `api` | requests |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case in run.cases:
        med = {f: run.result.median(case.name, f) for f in ("rate", "p50_ms", "p99_ms", "cpu_ms")}
        total = sum(s.requests for s in run.result.samples[case.name])
        added = cpu_added_us(run, case)
        rows.append(
            f"| {case.name} | {med['rate']:,.0f} | {med['p50_ms']:.2f} | {med['p99_ms']:.2f} "
            f"| {med['cpu_ms']:.2f} | {'n/a' if added is None else f'{added:+,.0f}'} "
            f"| {total:,} |"
        )
    return rows


def _counts(requests: dict[str, float]) -> str:
    if not requests:
        return "nothing"
    return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(requests.items()))


def recorded_lines(run: EngineRun) -> list[str]:
    """What the extension's instruments recorded, against what was answered."""
    lines = []
    for variant, figures in run.recorded.items():
        sent = run.answered.get(variant, 0)
        what = f"`idempotency.requests` by outcome: {_counts(figures['requests'])}"
        if variant == PROMETHEUS:
            what = (
                f"`idempotency_requests_total` summed over its {figures['workers']} workers' "
                f"`/metrics` at the end: {_counts(figures['requests'])} ({run.scrapes} scrapes "
                "of every worker during its rounds)"
            )
        extra = ""
        if figures.get("spans"):
            spans = ", ".join(f"{k} {v:,}" for k, v in sorted(figures["spans"].items()))
            extra = f"; spans exported: {spans}"
        lines.append(f"  * `{variant}` ({sent:,} answered on `/ext`): {what}{extra}")
    return lines


def _versions() -> str:
    found = []
    for dist in (
        "opentelemetry-api",
        "opentelemetry-sdk",
        "opentelemetry-exporter-prometheus",
        "opentelemetry-instrumentation-flask",
        "prometheus_client",
        "gunicorn",
    ):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found.append(f"{dist} {importlib.metadata.version(dist)}")
    return ", ".join(found)


def instrumented() -> str:
    if importlib.util.find_spec("flask_idempotency._telemetry") is not None:
        return "the extension's instrumentation (`flask_idempotency._telemetry`) is in this commit"
    return (
        "**the extension has no instrumentation in this commit** (no "
        "`flask_idempotency._telemetry`): every variant runs the same extension code, so the "
        "ratios show the set-ups' own cost and the noise"
    )


@dataclasses.dataclass
class Results:
    runs: dict[str, EngineRun]
    load: str
    notes: list[str]


def section(results: Results, facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    runs = results.runs
    data = {
        engine: {
            "cases": {
                case.name: {
                    "rate": run.result.median(case.name, "rate"),
                    "cpu_ms": run.result.median(case.name, "cpu_ms"),
                    "ratio": _ratio(run, case, _baseline(case), "rate"),
                    "cpu_ratio": _ratio(run, case, _baseline(case), "cpu_ms"),
                    "cpu_added_us": cpu_added_us(run, case),
                }
                for case in run.cases
            },
            "recorded": {variant: f["requests"] for variant, f in run.recorded.items()},
        }
        for engine, run in runs.items()
    }
    body = [
        "## The cost of OpenTelemetry (`python -m bench.telemetry`)",
        "",
        "New-key and replay throughput of `bench/app.py`'s `/ext` route "
        "(`@idem.idempotent()`, one order written per request) under gunicorn, "
        f"{WORKERS} sync workers per variant, with each OpenTelemetry set-up below made in "
        "every worker (`bench/telemetry_app.py`). Every variant's gunicorn is started before "
        "the rounds; in each round every case runs once for "
        f"{args.duration:g} s with 6 connections from {results.load}: the new-key cases "
        "one after the other in a shuffled order, then the replay cases (the modes the "
        "other way round in the next round), so that a case and the baseline it is "
        "compared with run within seconds of each other.",
        "",
        "**The baseline is `api`**: opentelemetry-api installed and no SDK configured, what a "
        "user who adds the `otel` extra and nothing else runs. A ratio is a variant's "
        "requests/s over the baseline's of the same mode in the same round, median over "
        "the rounds; in brackets the same by CPU per request (the baseline's CPU time per "
        "request over the variant's: gunicorn's workers and, on PostgreSQL, the server's "
        "processes). Below 1 costs more. `no-api` / `api` is the API's own cost; `sdk` / "
        "`api` is the extension's cost with an SDK, since nothing else in those workers "
        "records anything; `sdk-flask` / `flask-only` is the extension's cost where the "
        "Flask instrumentation is installed too (both with the same SDK set-up), and "
        "`flask-only` / `api` what that instrumentation costs by itself. Logging is left as "
        "Python starts it (the root logger at WARNING) in every variant: the extension's "
        "INFO line per outcome is not written, only its level checked.",
        "",
        *facts.lines(),
        f"* {_versions()}; {instrumented()}",
        *(["* `--quick`: a check of the harness; its figures mean nothing"] if args.quick else []),
        f"* {args.rounds} round{'s' if args.rounds != 1 else ''}; engines: "
        + "; ".join(f"`{e}`: {ENGINES[e]}" for e in runs),
        *(f"* {note}" for note in results.notes),
        "",
        "### Ratios to `api`",
        "",
        *ratio_rows(runs),
        "",
        *verdicts(runs),
        "",
        "What each variant is:",
        "",
        *(f"* `{name}`: {what}" for name, what in VARIANTS.items()),
        "* `floor`: the hand-written floor of `python -m bench.run` (`/floor`, new key) on the "
        "`api` workers, against `api`'s new key: where the extension stands, for reference",
        "",
    ]
    for engine, run in runs.items():
        body += [f"### {engine}", "", *engine_rows(run), ""]
        if load := run.result.machine_load():
            body += [f"Machine: {load}.", ""]
        body += [
            "Set-up seen in the workers after the warm-up: "
            + "; ".join(f"`{v}`: {', '.join(seen)}" for v, seen in run.set_up.items()),
            "",
        ]
        if recorded := recorded_lines(run):
            body += ["Recorded by the extension's instruments (their figures, not ours):", ""]
            body += [line.lstrip() for line in recorded] + [""]
    body.append(harness.data_comment(NAME, data))
    return body


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--rounds", type=int, help="rounds (default 8; quick 1)")
    parser.add_argument(
        "--duration", type=float, help="seconds per case per round (default 3; quick 1)"
    )
    parser.add_argument(
        "--warm", type=float, help="seconds of warm-up per case (default 2; quick 1)"
    )
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help=f"comma-separated, of {','.join(ENGINES)}"
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    parser.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the hand-written floor too (--no-floor leaves it out)",
    )
    parser.add_argument("--load", choices=("auto", "wrk", "python"), default="auto")
    parser.add_argument("--seed", type=int, default=24, help="seed of the order in each round")
    parser.add_argument("--note", action="append", default=[], help="a line for the run's facts")
    return {"rounds": (1, 8), "duration": (1.0, 3.0), "warm": (1.0, 2.0)}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses unknown engines and variants; sets ``args.chosen`` (the engines),
    ``args.servers`` (the variants that can run here), ``args.notes`` (with why
    the others cannot) and ``args.generator`` (the load)."""
    args.chosen = [e for e in args.engines.split(",") if e]
    variants = [v for v in args.variants.split(",") if v]
    if set(args.chosen) - set(ENGINES) or not args.chosen:
        parser.error(f"--engines: choose from {', '.join(ENGINES)}")
    if set(variants) - set(VARIANTS) or API not in variants:
        parser.error(f"--variants: choose from {', '.join(VARIANTS)}, with {API} (the baseline)")
    args.notes, args.servers = list(args.note), []
    for variant in variants:
        if why := missing(variant):
            args.notes.append(f"`{variant}` not run: {why}.")
            say(f"note: {variant} not run: {why}")
        else:
            args.servers.append(variant)
    args.generator = make_generator(args.load)


def run_all(cluster: t.Any, args: argparse.Namespace) -> Results:
    """Every engine chosen: PostgreSQL's on the private ``cluster``."""
    load = args.generator
    scratch = Path(tempfile.mkdtemp(prefix="bench-telemetry-sqlite-"))
    try:
        urls = {
            "postgresql": cluster.url("psycopg2"),
            "psycopg": cluster.url("psycopg"),
            "sqlite": f"sqlite:///{scratch / 'bench.sqlite3'}",
        }
        postmaster = cluster.proc.pid if cluster.proc else None
        runs = {}
        for engine in args.chosen:
            on_pg = postmaster if engine != "sqlite" else None
            runs[engine] = run_engine(engine, urls[engine], on_pg, args.servers, load, args)
        return Results(runs, getattr(load, "version", load.name), args.notes)
    finally:
        load.close()
        shutil.rmtree(scratch, ignore_errors=True)


def main(argv: t.Sequence[str] | None = None) -> int:
    try:
        return harness.main(
            NAME, __doc__, argv, options, run_all, section, cluster=True, check=check
        )
    except LoadError as exc:
        say(f"FAILED: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
