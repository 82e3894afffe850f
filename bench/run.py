"""The benchmark, end to end: ``python -m bench.run [--quick] [--rounds N] ...``.

Starts PostgreSQL (embedded, or ``IDEMPOTENCY_TEST_POSTGRES_URL``) and gunicorn
(3 sync workers) serving ``bench/app.py``, drives every variant with 6
connections (wrk where installed, else Python) in interleaved rounds, measures
round trips on the wire, HOT updates and worker memory in phases of their own,
prints the tables and writes ``BENCHMARKS.md`` and ``bench/results.png``. The
engines, one after the other: PostgreSQL through psycopg2 (``postgresql``) and
through psycopg 3 (``psycopg``), and SQLite (``sqlite``).
Everything it starts listens on 127.0.0.1 and is stopped on the way out, also
after a failure, Ctrl-C or SIGTERM.

Absolute figures depend on the machine and on what else runs on it; the ratios
between variants measured side by side are the point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import math
import os
import platform
import random
import shlex
import shutil
import sqlite3
import sys
import tempfile
import typing as t
import uuid
from pathlib import Path

from bench import harness, probes, procstats, report
from bench.app import OPTIMISTIC_MISSING, reset_database
from bench.load import Generator, LoadError, PythonLoad, Target, Wrk, send_once
from bench.procstats import CpuMeter
from bench.servers import ROOT, Gunicorn, Postgres, stop_postgres
from bench.variants import ENGINES, POSTGRES_ENGINES, REPLAY_KEY, VARIANTS, Variant


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much each phase does: full, or ``--quick``."""

    rounds: int
    duration: float
    wire_requests: int
    hot_requests: int
    memory: tuple[int, int]


FULL = Sizes(rounds=6, duration=10, wire_requests=200, hot_requests=1000, memory=(5000, 50000))
QUICK = Sizes(rounds=3, duration=2, wire_requests=50, hot_requests=200, memory=(500, 5000))


def parse_args(argv: t.Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="short runs, to check the harness")
    parser.add_argument("--rounds", type=int, help="rounds (default 6; quick 3)")
    parser.add_argument(
        "--duration",
        type=float,
        help="seconds per variant per round (default 10; quick 2; wrk rounds to whole seconds)",
    )
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, in the order run (default {','.join(ENGINES)}): "
        "postgresql is PostgreSQL through psycopg2, psycopg through psycopg 3",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    parser.add_argument("--plot", type=Path, default=ROOT / "bench" / "results.png")
    parser.add_argument(
        "--memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the worker memory phase (--no-memory skips it)",
    )
    parser.add_argument(
        "--load",
        choices=("auto", "wrk", "python"),
        default="auto",
        help="load generator (auto: wrk where installed)",
    )
    parser.add_argument("--seed", type=int, default=8, help="seed of the variant order")
    parser.add_argument(
        "--note",
        action="append",
        default=[],
        help="a line for the run's facts in BENCHMARKS.md, such as what else ran on the "
        "machine (repeatable)",
    )
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown or not engines:
        parser.error(f"--engines: choose from {', '.join(ENGINES)}")
    args.engines = engines
    sizes = QUICK if args.quick else FULL
    args.rounds = args.rounds or sizes.rounds
    args.duration = args.duration or sizes.duration
    args.sizes = sizes
    return args


def _say(text: str) -> None:
    print(text, flush=True)


def make_generator(choice: str) -> Generator:
    if choice in ("auto", "wrk") and shutil.which("wrk"):
        return Wrk()
    if choice == "wrk":
        raise SystemExit("--load wrk: wrk is not installed (apt-get install wrk)")
    return PythonLoad()


def _target(port: int, variant: Variant) -> Target:
    return Target(port, variant.path, variant.key_mode, REPLAY_KEY)


def measure(
    load: Generator, target: Target, meter: CpuMeter, seconds: float, run_id: str
) -> report.Sample:
    """One variant's run in one round: its throughput and latency, and the CPU
    time ``meter``'s processes and the whole machine spent meanwhile."""
    before, machine_before = meter.snapshot(), procstats.machine_ticks()
    got = load.run(target, seconds, run_id)
    cpu = meter.seconds_between(before, meter.snapshot())
    busy, total = (b - a for a, b in zip(machine_before, procstats.machine_ticks(), strict=True))
    return report.Sample(
        got.requests,
        got.rate,
        got.p50_ms,
        got.p99_ms,
        cpu * 1000 / got.requests,
        busy=busy / total if total else math.nan,
        server_share=cpu / (total * procstats.CLOCK_TICK) if total else math.nan,
    )


def run_engine(
    engine: str,
    url: str,
    postgres: Postgres | None,
    load: Generator,
    args: argparse.Namespace,
) -> report.EngineResult:
    """Every variant on one engine, in rounds; then the wire and HOT phases (PostgreSQL)."""
    reset_database(url)
    variants = [
        v for v in VARIANTS if v.runs_on(engine) and not (v.optimistic and OPTIMISTIC_MISSING)
    ]
    result = report.EngineResult(engine, variants, {v.name: [] for v in variants})
    if OPTIMISTIC_MISSING:
        result.notes.append(f"ext-optimistic skipped: {OPTIMISTIC_MISSING}.")
        _say(f"[{engine}] note: ext-optimistic skipped: {OPTIMISTIC_MISSING}")
    run = uuid.uuid4().hex[:8]
    with Gunicorn(url, workers=3) as server:
        parents = {server.pid}
        if postgres is not None and postgres.postmaster_pid is not None:
            parents.add(postgres.postmaster_pid)
        elif postgres is not None:
            result.notes.append("PostgreSQL is not on this machine: CPU counts gunicorn only.")
        meter = CpuMeter(parents)
        for path in ("/floor", "/ext"):  # the record every replay finds
            status, body = send_once(Target(server.port, path, "fixed", REPLAY_KEY), REPLAY_KEY)
            if not 200 <= status < 300:
                raise LoadError(f"POST {path} (replay key): {status} {body!r}")
        warm = min(1.0, args.duration)
        for variant in variants:  # workers import, pools connect, caches fill
            load.run(_target(server.port, variant), warm, f"{run}-warm-{variant.name}")
        order = list(variants)
        rng = random.Random(args.seed)
        for round_no in range(1, args.rounds + 1):
            rng.shuffle(order)
            for variant in order:
                sample = measure(
                    load,
                    _target(server.port, variant),
                    meter,
                    args.duration,
                    f"{run}-{round_no}-{variant.name}",
                )
                result.samples[variant.name].append(sample)
                _say(
                    f"[{engine}] round {round_no}/{args.rounds} {variant.name:15} "
                    f"{sample.rate:8.0f} req/s  p50 {sample.p50_ms:6.2f} ms  "
                    f"p99 {sample.p99_ms:7.2f} ms  CPU {sample.cpu_ms:5.2f} ms/req"
                )
    if postgres is not None:
        _say(f"[{engine}] round trips on the wire ({args.sizes.wire_requests} requests each)")
        result.wire = probes.round_trips(url, variants, requests=args.sizes.wire_requests)
        ext = next(v for v in variants if v.name == "ext")
        result.replay_after_new = probes.replay_after_new_keys(url, ext)
        _say(f"[{engine}] HOT updates ({args.sizes.hot_requests} new-key requests each)")
        keyed = [v for v in variants if v.key_table is not None]
        result.hot = probes.hot_updates(
            url, postgres.major, keyed, requests=args.sizes.hot_requests
        )
    return result


def facts(
    argv: t.Sequence[str],
    args: argparse.Namespace,
    postgres: Postgres | None,
    load: Generator,
    load_before: str,
) -> report.Facts:
    return report.Facts(
        command=shlex.join(["python", "-m", "bench.run", *argv]),
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        cpus=os.cpu_count() or 0,
        cpu_model=harness.cpu_model(),
        python=platform.python_version(),
        postgresql=(f"{postgres.version} ({postgres.source})" if postgres else "not run"),
        sqlite=sqlite3.sqlite_version,
        gunicorn=importlib.metadata.version("gunicorn"),
        load=getattr(load, "version", load.name),
        commit=harness.git_commit(),
        rounds=args.rounds,
        duration=args.duration,
        drivers=_drivers(),
        load_before=load_before,
        load_after=f"{os.getloadavg()[0]:.2f}",
        notes=list(args.note),
    )


def _drivers() -> str:
    """The PostgreSQL drivers' versions, and libpq's under psycopg 3."""
    versions = []
    for name, dist in (("psycopg2", "psycopg2-binary"), ("psycopg 3", "psycopg")):
        try:
            versions.append(f"{name} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    with contextlib.suppress(ImportError):
        import psycopg

        libpq = psycopg.pq.version()
        # Only the benchmark's ext-pipeline variant uses pipeline mode (libpq 14+).
        pipeline = (
            "pipeline mode available, for ext-pipeline"
            if psycopg.Pipeline.is_supported()
            else "no pipeline mode: ext-pipeline cannot run"
        )
        versions.append(f"libpq {libpq // 10000}.{libpq % 100} under psycopg 3 ({pipeline})")
    return "drivers: " + ", ".join(versions) if versions else "drivers: none"


def main(argv: t.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    harness.exit_on_sigterm()
    try:
        with contextlib.ExitStack() as stack:
            return _main(argv, args, stack)
    except LoadError as exc:
        print(f"FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("interrupted; everything started was stopped", file=sys.stderr, flush=True)
        return 130


def _main(argv: list[str], args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    load_before = f"{os.getloadavg()[0]:.2f}"
    load = make_generator(args.load)
    stack.callback(load.close)
    _say(f"load generator: {getattr(load, 'version', load.name)}")
    postgres = None
    if set(POSTGRES_ENGINES) & set(args.engines):
        stack.callback(stop_postgres)
        postgres = Postgres.start()
        _say(f"PostgreSQL {postgres.version} ({postgres.source})")
    scratch = Path(tempfile.mkdtemp(prefix="bench-sqlite-"))
    stack.callback(shutil.rmtree, scratch, ignore_errors=True)
    urls = {"sqlite": f"sqlite:///{scratch / 'bench.sqlite3'}"}
    if postgres is not None:
        urls["postgresql"] = postgres.url_for("psycopg2")
        urls["psycopg"] = postgres.url_for("psycopg")
    results = []
    for engine in args.engines:
        on_postgres = postgres if engine in POSTGRES_ENGINES else None
        result = run_engine(engine, urls[engine], on_postgres, load, args)
        results.append(result)
        _say("\n" + report.engine_section(result) + "\n")
    memory = None
    notes = []
    if args.memory:
        engine = next((e for e in args.engines if e in POSTGRES_ENGINES), "sqlite")
        first, second = args.sizes.memory
        _say(f"[{engine}] worker memory: {first} and {second} new-key requests on /ext")
        python_load = load if isinstance(load, PythonLoad) else PythonLoad()
        if python_load is not load:
            stack.callback(python_load.close)
        memory = probes.worker_memory(urls[engine], python_load, first=first, second=second)
        notes.append(f"worker memory measured on {engine}, with the Python load generator.")
        _say("\n" + report.memory_table(memory) + "\n")
    text = report.markdown(facts(argv, args, postgres, load, load_before), results, memory, notes)
    # The sections other commands write (python -m bench.outbox, bench.run_more)
    # are kept.
    if kept := harness.kept_sections(args.out):
        text += "\n" + kept
    args.out.write_text(text)
    _say(f"wrote {args.out}")
    why_not = report.plot(args.plot, results)
    _say(f"note: {why_not}" if why_not else f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
