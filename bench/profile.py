"""Where a request's CPU goes under load: py-spy on the gunicorn workers.

``python -m bench.profile --label before`` (and later ``--label after``) serves
``bench/app.py`` with gunicorn (3 sync workers, as ``bench.run``), drives each
path with wrk (or the Python load) and samples every worker with py-spy
(``--subprocesses --nonblocking``; py-spy counts a thread only while it runs, so a
worker waiting for the database or the network is not sampled). It writes section
``bench.profile`` of BENCHMARKS.md: per engine and path, the CPU the workers' Python
spent per request (samples over the rate, divided by the requests answered), its
split by package (the extension, SQLAlchemy, Flask and Werkzeug, the driver, the
rest) and the top frames by own time and, for the extension's frames, by time
including what they call; the other label's figures are kept beside them, so one
section shows a change's before and after.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import typing as t
import uuid
from pathlib import Path

from bench import harness
from bench.app import reset_database
from bench.load import LoadError, PythonLoad, Target, Wrk, send_once
from bench.servers import ROOT, Gunicorn
from bench.variants import ENGINES, REPLAY_KEY

NAME = "bench.profile"
#: The paths profiled: (name, URL path, key mode, what).
PATHS = (
    ("new-key", "/ext", "new", "`@idem.idempotent()`, a new key each request"),
    ("replay", "/ext", "fixed", "the same route, a completed key: every request replays"),
    ("no-key", "/ext", "none", "the same route, no key"),
    ("floor", "/floor", "new", "the hand-written floor, a new key each request"),
    ("floor-replay", "/floor", "fixed", "the floor, a completed key"),
    ("plain", "/plain", "none", "no idempotency"),
)
#: Packages by the start of a frame's file, for the split (first match wins).
PACKAGES = (
    ("extension", ("flask_idempotency/",)),
    ("SQLAlchemy", ("sqlalchemy/", "flask_sqlalchemy/")),
    ("Flask, Werkzeug", ("flask/", "werkzeug/", "jinja2/", "blinker/", "itsdangerous/")),
    ("driver", ("psycopg2/", "psycopg/", "sqlite3/", "psycopg_c/", "psycopg_binary/")),
    ("gunicorn", ("gunicorn/",)),
    ("benchmark app", ("bench/",)),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::\d+)?\)$")
_PREFIXES = (str(ROOT) + "/", "site-packages/", "lib/python3.11/")


@dataclasses.dataclass
class Profile:
    """One path's samples on one engine."""

    requests: int
    samples: int
    rate: int
    own: collections.Counter[str]
    inclusive: collections.Counter[str]
    packages: collections.Counter[str]

    def ms_per_request(self, samples: int | None = None) -> float:
        count = self.samples if samples is None else samples
        return 1000.0 * count / self.rate / self.requests if self.requests else 0.0

    def as_data(self) -> dict[str, t.Any]:
        return {
            "requests": self.requests,
            "samples": self.samples,
            "rate": self.rate,
            "own": dict(self.own.most_common(40)),
            "inclusive": dict(self.inclusive.most_common(40)),
            "packages": dict(self.packages),
        }

    @classmethod
    def from_data(cls, data: dict[str, t.Any]) -> Profile:
        return cls(
            data["requests"],
            data["samples"],
            data["rate"],
            collections.Counter(data["own"]),
            collections.Counter(data["inclusive"]),
            collections.Counter(data["packages"]),
        )


#: Figures by label, engine and path.
Results = dict[str, dict[str, dict[str, Profile]]]


def _short(path: str) -> str:
    for prefix in _PREFIXES:
        if prefix in path:
            path = path.split(prefix, 1)[1]
    return path


def frame_name(frame: str) -> tuple[str, str]:
    """A py-spy frame ``func (file:line)`` as ``("func (file)", file)``."""
    match = _FRAME.match(frame)
    if match is None:
        return frame, ""
    file = _short(match["file"])
    return f"{match['func']} ({file})", file


def package_of(file: str) -> str:
    for name, starts in PACKAGES:
        if file.startswith(starts):
            return name
    return "other (stdlib, json, C)"


def read_raw(text: str, requests: int, rate: int) -> Profile:
    """py-spy's ``--format raw`` (one stack a line, its count last) as a Profile."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    packages: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [frame_name(f) for f in stack.split(";") if not f.startswith("process ")]
        if not frames:
            continue
        total += count
        leaf, leaf_file = frames[-1]
        own[leaf] += count
        packages[package_of(leaf_file)] += count
        for name in {name for name, file in frames if file.startswith("flask_idempotency/")}:
            inclusive[name] += count
    return Profile(requests, total, rate, own, inclusive, packages)


def profile_path(
    server: Gunicorn, load: t.Any, target: Target, seconds: float, rate: int
) -> Profile:
    """Drive ``target`` for ``seconds`` while py-spy samples every worker."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "profile.raw"
        proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(server.pid),
                "--subprocesses",
                "--nonblocking",
                "--gil",
                "--rate",
                str(rate),
                "--duration",
                str(round(seconds) + 1),
                "--format",
                "raw",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            result = load.run(target, seconds, f"profile-{uuid.uuid4().hex[:8]}")
        finally:
            _, err = proc.communicate(timeout=seconds + 60)
        if proc.returncode != 0 or not raw.exists():
            raise RuntimeError(f"py-spy failed ({proc.returncode}): {err}")
        # py-spy samples one second longer than the load ran: scale by the
        # requests answered in the load's own time, the idle tail adds no samples.
        return read_raw(raw.read_text(), result.requests, rate)


def run_engine(engine: str, url: str, load: t.Any, args: argparse.Namespace) -> dict[str, Profile]:
    reset_database(url)
    found: dict[str, Profile] = {}
    with Gunicorn(url, workers=3) as server:
        for path in ("/floor", "/ext"):  # the record every replay finds
            status, body = send_once(Target(server.port, path, "fixed", REPLAY_KEY), REPLAY_KEY)
            if not 200 <= status < 300:
                raise LoadError(f"POST {path} (replay key): {status} {body!r}")
        for name, path, mode, _ in PATHS:
            target = Target(server.port, path, t.cast(t.Any, mode), REPLAY_KEY)
            load.run(target, 1.0, f"warm-{uuid.uuid4().hex[:8]}")
            found[name] = profile_path(server, load, target, args.seconds, args.rate)
            harness.say(
                f"[{engine}] {name:13} {found[name].requests / args.seconds:7.0f} req/s "
                f"{found[name].ms_per_request():6.3f} ms of worker CPU per request"
            )
    return found


def _share(profile: Profile | None, samples: int) -> str:
    if profile is None or not profile.samples:
        return ""
    return f"{1000 * samples / profile.rate / profile.requests * 1000:.0f}"


def engine_lines(
    engine: str, data: dict[str, dict[str, Profile]], labels: list[str], top: int
) -> list[str]:
    lines = [f"### {engine}", "", ENGINES[engine] + ".", ""]
    header = " | ".join(f"{label} µs/req" for label in labels)
    lines += [
        "Worker CPU per request, by package of the running frame (µs):",
        "",
        "| path | package | " + header + " |",
        "|---|---|" + "---:|" * len(labels),
    ]
    for name, *_ in PATHS:
        runs = [data.get(label, {}).get(name) for label in labels]
        if not any(runs):
            continue
        total = " | ".join(f"**{1000 * r.ms_per_request():.0f}**" if r else "" for r in runs)
        lines.append(f"| {name} | all | {total} |")
        for package, _ in (*PACKAGES, ("other (stdlib, json, C)", ())):
            cells = " | ".join(_share(r, r.packages.get(package, 0)) if r else "" for r in runs)
            if any(r and r.packages.get(package) for r in runs):
                lines.append(f"| | {package} | {cells} |")
    for name in ("new-key", "replay", "no-key"):
        for kind in ("own", "inclusive"):
            runs = [data.get(label, {}).get(name) for label in labels]
            frames: list[str] = []
            for run in runs:
                for frame, _ in getattr(run, kind, collections.Counter()).most_common(top):
                    if frame not in frames:
                        frames.append(frame)
            if not frames:
                continue
            what = "own time" if kind == "own" else "the extension's frames, with their callees"
            lines += ["", f"{name}: top frames by {what} (µs per request):", ""]
            lines += ["| frame | " + header + " |", "|---|" + "---:|" * len(labels)]
            for frame in frames:
                cells = " | ".join(
                    _share(r, getattr(r, kind).get(frame, 0)) if r else "" for r in runs
                )
                lines.append(f"| `{frame}` | {cells} |")
    return [*lines, ""]


def section(results: Results, facts: harness.Facts, args: t.Any) -> list[str]:
    labels = sorted(results, key=lambda label: (label != "before", label))
    lines = [
        "## Where the CPU goes (`python -m bench.profile`)",
        "",
        *facts.lines(),
        f"* py-spy at {args.rate} samples/s on every gunicorn worker, {args.seconds:.0f} s per "
        "path under load; a worker waiting on the database or the network is not sampled",
        "",
    ]
    for engine in args.engines:
        data = {label: results[label].get(engine, {}) for label in labels}
        if any(data.values()):
            lines += engine_lines(engine, data, labels, args.top)
    stored = {
        label: {e: {p: prof.as_data() for p, prof in paths.items()} for e, paths in runs.items()}
        for label, runs in results.items()
    }
    return [*lines, harness.data_comment(NAME, stored)]


def options(parser: argparse.ArgumentParser) -> harness.Sizes:
    parser.add_argument("--label", default="after", help="before, after, or any name")
    parser.add_argument("--engines", default="postgresql,psycopg,sqlite")
    parser.add_argument("--seconds", type=float, default=10.0, help="per path (default 10)")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12, help="frames per table")
    parser.add_argument("--load", choices=("wrk", "python"), default=None)
    return {}


def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    args.engines = [e for e in args.engines.split(",") if e]
    unknown = set(args.engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines: {sorted(unknown)}")


def measure(server: harness.SharedPostgres, args: argparse.Namespace) -> Results:
    """This label's figures on every engine chosen, with the other labels'
    figures that ``args.out`` holds (PostgreSQL is started whatever the
    engines: the run's facts name its version)."""
    previous = harness.read_data(args.out.read_text() if args.out.exists() else "").get(NAME, {})
    results: Results = {
        label: {e: {p: Profile.from_data(d) for p, d in paths.items()} for e, paths in runs.items()}
        for label, runs in previous.items()
    }
    results[args.label] = {}
    use_wrk = args.load == "wrk" or (args.load is None and shutil.which("wrk"))
    load = Wrk() if use_wrk else PythonLoad()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for engine in args.engines:
                engine_url = (
                    f"sqlite:///{tmp}/profile.db"
                    if engine == "sqlite"
                    else server.url("psycopg2" if engine == "postgresql" else "psycopg")
                )
                results[args.label][engine] = run_engine(engine, engine_url, load, args)
    finally:
        load.close()
    return results


def main(argv: t.Sequence[str] | None = None) -> int:
    return harness.main(
        NAME,
        __doc__,
        argv,
        options,
        measure,
        section,
        cluster=True,
        check=check,
        server=harness.shared_server,
    )


if __name__ == "__main__":
    raise SystemExit(main())
