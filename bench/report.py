"""The figures, as Markdown tables (printed, and written to ``BENCHMARKS.md``) and
a plot (``bench/results.png``, when matplotlib is installed: ``pip install -e .[bench]``).

Every figure is a median over the rounds: requests/s, latency percentiles and CPU
per request of each variant; a ratio is the median of the per-round ratios (each
round runs both variants within seconds of each other, so a drift of the machine
hits both sides of a ratio alike).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import statistics
from pathlib import Path

from bench.probes import HotFigure, MemoryFigure, WireFigure
from bench.variants import RATIOS, VARIANTS, Variant

RSS_TARGET = 1.05


@dataclasses.dataclass(frozen=True)
class Sample:
    """One variant's run in one round."""

    requests: int
    rate: float
    p50_ms: float
    p99_ms: float
    #: CPU time of the server processes per request answered (ms); NaN if unknown.
    cpu_ms: float


@dataclasses.dataclass
class EngineResult:
    engine: str
    variants: list[Variant]
    samples: dict[str, list[Sample]]
    wire: dict[str, WireFigure] | None = None
    hot: dict[str, HotFigure] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def median(self, name: str, field: str) -> float:
        values = [getattr(sample, field) for sample in self.samples[name]]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def ratio(self, numerator: str, denominator: str, *, by_cpu: bool = False) -> float | None:
        """Median over the rounds of ``numerator``'s requests/s over ``denominator``'s;
        ``by_cpu``: of ``denominator``'s CPU per request over ``numerator``'s."""
        if numerator not in self.samples or denominator not in self.samples:
            return None
        pairs = zip(self.samples[numerator], self.samples[denominator], strict=True)
        if by_cpu:
            values = [b.cpu_ms / a.cpu_ms for a, b in pairs if a.cpu_ms > 0]
        else:
            values = [a.rate / b.rate for a, b in pairs if b.rate > 0]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else None


@dataclasses.dataclass
class Facts:
    """The machine and the run."""

    command: str
    date: str
    cpus: int
    cpu_model: str
    python: str
    postgresql: str
    sqlite: str
    gunicorn: str
    load: str
    commit: str
    rounds: int
    duration: float


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:,.{digits}f}"


def _verdict(met: bool | None) -> str:
    return "" if met is None else ("meets" if met else "**below**")


def variant_table(result: EngineResult) -> str:
    lines = [
        "| variant | req/s | p50 ms | p99 ms | CPU ms/req | round trips/req | requests | what |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for variant in result.variants:
        name = variant.name
        trips = "n/a"
        if result.wire is not None and name in result.wire:
            trips = _fmt(result.wire[name].per_request, 2)
        rate, p50, p99, cpu = (
            result.median(name, field) for field in ("rate", "p50_ms", "p99_ms", "cpu_ms")
        )
        lines.append(
            f"| {name} | {_fmt(rate, 0)} | {_fmt(p50, 2)} | {_fmt(p99, 2)} | {_fmt(cpu, 2)} "
            f"| {trips} | {sum(s.requests for s in result.samples[name]):,} | {variant.what} |"
        )
    return "\n".join(lines)


def ratio_table(result: EngineResult) -> str:
    lines = [
        "| ratio | throughput | target | | by CPU/req |",
        "|---|---:|---|---|---:|",
    ]
    for ratio in RATIOS:
        if ratio.engine not in (None, result.engine):
            continue
        value = result.ratio(ratio.numerator, ratio.denominator)
        if value is None:
            continue
        target = ""
        if ratio.target is not None:
            target = f"{'>' if ratio.strict else '>='} {ratio.target:.2f}"
        by_cpu = result.ratio(ratio.numerator, ratio.denominator, by_cpu=True)
        lines.append(
            f"| {ratio.numerator} / {ratio.denominator} | {value:.3f} | {target} "
            f"| {_verdict(ratio.met(value))} | {_fmt(by_cpu, 3)} |"
        )
    return "\n".join(lines)


def hot_table(hot: dict[str, HotFigure]) -> str:
    lines = [
        "| variant | table | requests | inserts | updates | HOT updates | HOT share | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, figure in hot.items():
        share = figure.hot_share
        shown = "n/a (no updates)" if share is None else f"{share:.1%}"
        verdict = "" if share is None or name == "floor" else _verdict(share >= 1.0)
        lines.append(
            f"| {name} | {figure.table} | {figure.requests} | {figure.inserts} "
            f"| {figure.updates} | {figure.hot_updates} | {shown} "
            f"| {'' if name == 'floor' else '100% ' + verdict} |"
        )
    return "\n".join(lines)


def memory_table(memory: MemoryFigure) -> str:
    return "\n".join(
        [
            "| requests | worker RSS (MiB) |",
            "|---:|---:|",
            f"| {memory.first:,} | {memory.rss_first_kib / 1024:.1f} |",
            f"| {memory.second:,} | {memory.rss_second_kib / 1024:.1f} |",
            "",
            f"RSS after {memory.second:,} / after {memory.first:,}: **{memory.ratio:.3f}** "
            f"(target <= {RSS_TARGET:.2f}: {_verdict(memory.ratio <= RSS_TARGET)})",
        ]
    )


def _exchange_lines(text: str, width: int = 160) -> list[str]:
    """One exchange as shown: each statement of a batch (``a; b``) on a line of its
    own, the ones after the first marked ``+`` (they share the round trip)."""
    statements = [s.strip() for s in text.split("; ") if s.strip()]
    return [
        f"    {'  + ' if i else ''}{s if len(s) <= width else s[: width - 3] + '...'}"
        for i, s in enumerate(statements)
    ]


def statements_block(wire: dict[str, WireFigure]) -> str:
    parts = []
    for name, figure in wire.items():
        shown = "\n".join(line for s in figure.statements for line in _exchange_lines(s))
        parts.append(f"{name} ({figure.per_request:.2f} exchanges per request):\n\n{shown}\n")
    return "\n".join(parts)


def engine_section(result: EngineResult) -> str:
    parts = [f"### {result.engine}", "", variant_table(result), "", ratio_table(result)]
    if result.hot is not None:
        parts += ["", "HOT updates over a new-key phase per variant:", "", hot_table(result.hot)]
    if result.notes:
        parts += [""] + [f"Note: {note}" for note in result.notes]
    return "\n".join(parts)


EXPLANATION = """\
## What each variant is

Every route writes one `orders` row (id, amount, note) in the Flask-SQLAlchemy session
and answers 201 `{"id": ...}` (`bench/app.py`). gunicorn serves them with 3 sync workers;
the engine options are Flask-SQLAlchemy's defaults (no `pool_pre_ping`; SQLite in its
default rollback-journal mode, which lets one writer at a time).

{variants}

## How each figure is measured

* **requests**: answered in all rounds, every one 2xx: any other answer (or a socket
  error) stops the run with an error.
* **req/s**: requests answered per second while 6 connections keep the server busy
  (wrk `-t2 -c6`, or 6 Python processes, one request at a time each, new connection per
  request). Each round runs every variant for the same time, in a new shuffled order;
  the figure is the median over the rounds. Any non-2xx answer stops the run.
* **p50 / p99 ms**: latency percentiles of the round (wrk: from writing the request to
  reading the answer; Python: from the connect), median over the rounds.
* **CPU ms/req**: CPU time (user + system, `/proc/<pid>/stat`) spent during the run by the
  gunicorn workers and by every child of the PostgreSQL postmaster (the backends and
  the WAL writer, checkpointer...), divided by the requests answered; median over the
  rounds. The load generator is not counted.
* **round trips/req**: PostgreSQL only, in a separate phase: the app in process, one
  request at a time, through a counting TCP proxy (`bench/wire.py`) that counts each
  time the client sends after a reply (psycopg2 sends `BEGIN` as an exchange of its
  own). Connection setup is left out (warm-up requests first, then the counters are
  reset). The statements of one request are listed below.
* **ratio, throughput**: median over the rounds of the ratio of the two variants'
  requests/s in that round; the target is the issue's. **by CPU/req**: median over the
  rounds of the second variant's CPU per request over the first's: the throughput ratio
  a CPU-bound server would show, and steadier than throughput when other work shares
  the machine.
* **HOT share**: PostgreSQL only: `n_tup_hot_upd / n_tup_upd` of the key table
  (`pg_stat_user_tables`) over a phase of new-key requests per variant (the app in
  process, one request at a time; counters read after the backend has reported them).
  An update is HOT when it changes no indexed column and fits the same page: it then
  writes no index entries.
* **worker RSS**: `VmRSS` of the only worker of a 1-worker gunicorn after the first and
  the second number of new-key requests on `/ext` (after a warm-up).
"""


def markdown(
    facts: Facts,
    results: list[EngineResult],
    memory: MemoryFigure | None,
    notes: list[str],
) -> str:
    variants = "\n".join(f"* `{v.name}`: `POST {v.path}`: {v.what}" for v in VARIANTS)
    parts = [
        "# Benchmarks",
        "",
        "Figures from `python -m bench.run` on one machine; compare ratios, not absolute",
        "numbers across machines. Regenerate them with the command below.",
        "",
        "## Machine and run",
        "",
        f"* command: `{facts.command}`",
        f"* date: {facts.date}; commit {facts.commit}",
        f"* CPUs: {facts.cpus} ({facts.cpu_model})",
        f"* Python {facts.python}; gunicorn {facts.gunicorn}; load: {facts.load}",
        f"* PostgreSQL: {facts.postgresql}; SQLite {facts.sqlite}",
        f"* {facts.rounds} rounds, {facts.duration:g} s per variant per round, 6 connections",
        "",
        "## Results",
        "",
    ]
    for result in results:
        parts += [engine_section(result), ""]
    if memory is not None:
        parts += ["### Worker memory", "", memory_table(memory), ""]
    if notes:
        parts += ["### Notes", ""] + [f"* {note}" for note in notes] + [""]
    parts.append(EXPLANATION.replace("{variants}", variants))
    for result in results:
        if result.wire:
            parts += [
                f"## Statements of one request on the wire ({result.engine})",
                "",
                "Each line is one exchange; a `+` line was sent in the same exchange as the",
                "line above it (statements psycopg2 sends as one batch).",
                "",
                statements_block(result.wire),
            ]
    return "\n".join(parts).rstrip() + "\n"


def plot(path: Path, results: list[EngineResult]) -> str | None:
    """Throughput and p50/p99 latency per variant, one row per engine; the reason
    when it cannot (matplotlib missing), else None."""
    try:
        # Imported by name: matplotlib is an optional extra (``bench``), absent in CI,
        # and mypy must pass with it and without it.
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
        ticker = importlib.import_module("matplotlib.ticker")
    except ImportError:
        return "matplotlib is not installed (pip install -e .[bench]): no plot written"
    figure, axes = plt.subplots(len(results), 2, figsize=(13, 4.2 * len(results)), squeeze=False)
    for row, result in zip(axes, results, strict=True):
        names = [v.name for v in result.variants]
        positions = list(range(len(names)))
        rates = [result.median(n, "rate") for n in names]
        row[0].bar(positions, rates, color="tab:blue")
        row[0].set_title(f"{result.engine}: throughput (req/s, median)")
        p50 = [result.median(n, "p50_ms") for n in names]
        p99 = [result.median(n, "p99_ms") for n in names]
        row[1].bar([p - 0.2 for p in positions], p50, width=0.4, label="p50")
        row[1].bar([p + 0.2 for p in positions], p99, width=0.4, label="p99")
        row[1].set_yscale("log")  # p99 can be 100 times p50 (SQLite's lock waits)
        row[1].yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        row[1].yaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
        row[1].yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
        row[1].set_title(f"{result.engine}: latency (ms, median, log scale)")
        row[1].legend()
        for axis in row:
            axis.set_xticks(positions)
            axis.set_xticklabels(names, rotation=30, ha="right")
            axis.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None
