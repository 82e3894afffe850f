"""The figures, as Markdown tables (printed, and written to ``BENCHMARKS.md``) and
a plot (``bench/results.png``, when matplotlib is installed: ``pip install -e .[bench]``).

Every figure is a median over the rounds: requests/s, latency percentiles and CPU
per request of each variant; a ratio is the median of the per-round ratios (each
round runs both variants within seconds of each other, so a drift of the machine
hits both sides of a ratio alike).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import statistics
from pathlib import Path

from bench.probes import HotFigure, MemoryFigure, WireFigure
from bench.variants import CLAIM_PATHS, ENGINES, RATIOS, VARIANTS, Ratio, Variant

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
    #: Share of the machine's CPU time (all CPUs) that was busy during the run, and
    #: the share the server processes took; NaN if unknown.
    busy: float = math.nan
    server_share: float = math.nan


@dataclasses.dataclass
class EngineResult:
    engine: str
    variants: list[Variant]
    samples: dict[str, list[Sample]]
    wire: dict[str, WireFigure] | None = None
    hot: dict[str, HotFigure] | None = None
    #: One replay right after new keys on the same connection (PostgreSQL).
    replay_after_new: WireFigure | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    def median(self, name: str, field: str) -> float:
        values = [getattr(sample, field) for sample in self.samples[name]]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    def ratio(self, numerator: str, denominator: str, *, by_cpu: bool = False) -> float | None:
        """Median over the rounds of ``numerator``'s requests/s over ``denominator``'s;
        ``by_cpu``: of ``denominator``'s CPU per request over ``numerator``'s."""
        if by_cpu:
            return self.field_ratio(denominator, numerator, "cpu_ms")
        return self.field_ratio(numerator, denominator, "rate")

    def field_ratio(self, numerator: str, denominator: str, field: str) -> float | None:
        """Median over the rounds of ``numerator``'s ``field`` over ``denominator``'s
        in the same round."""
        values = self.field_ratios(numerator, denominator, field)
        return statistics.median(values) if values else None

    def field_ratios(self, numerator: str, denominator: str, field: str) -> list[float]:
        """``numerator``'s ``field`` over ``denominator``'s, round by round."""
        if numerator not in self.samples or denominator not in self.samples:
            return []
        pairs = zip(self.samples[numerator], self.samples[denominator], strict=True)
        values = [getattr(a, field) / getattr(b, field) for a, b in pairs if getattr(b, field) > 0]
        return [v for v in values if not math.isnan(v)]

    def machine_load(self) -> str | None:
        """How busy the machine was during this engine's rounds, in words."""
        busy = sorted(s.busy for v in self.samples.values() for s in v if not math.isnan(s.busy))
        ours = [s.server_share for v in self.samples.values() for s in v]
        ours = [v for v in ours if not math.isnan(v)]
        if not busy or not ours:
            return None
        return (
            f"the machine's CPUs were {statistics.median(busy):.0%} busy during a run "
            f"(median; {busy[0]:.0%} to {busy[-1]:.0%}), the server processes measured "
            f"{statistics.median(ours):.0%} of them; the rest is the load generator and "
            "whatever else ran on the machine"
        )


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
    #: The PostgreSQL drivers' versions, in words.
    drivers: str = ""
    load_before: str = "n/a"
    load_after: str = "n/a"
    #: Said by whoever ran it (``--note``).
    notes: list[str] = dataclasses.field(default_factory=list)


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
        if not ratio.runs_on(result.engine):
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


def gap_lines(result: EngineResult) -> list[str]:
    """For each ratio below its target: how much more server CPU per request
    (the medians in the table) the numerator used than its denominator, and how
    much the target leaves room for (where the run is CPU-bound, throughput goes
    as the inverse of CPU per request)."""
    lines = []
    for ratio in RATIOS:
        if ratio.target is None or not ratio.runs_on(result.engine):
            continue
        value = result.ratio(ratio.numerator, ratio.denominator)
        if value is None or ratio.met(value):
            continue
        ours, base = (
            result.median(name, "cpu_ms") * 1000 for name in (ratio.numerator, ratio.denominator)
        )
        if math.isnan(ours) or math.isnan(base):
            continue
        lines.append(gap_line(ratio, value, ours, base))
    return lines


def gap_line(ratio: Ratio, value: float, ours: float, base: float) -> str:
    """One line of :func:`gap_lines`: CPU per request in µs, ``ours`` against ``base``."""
    assert ratio.target is not None
    room = base * (1 / ratio.target - 1)
    allows = (
        f"the target leaves room for {room:,.0f} µs"
        if room > 0
        else f"the target asks for less CPU than {ratio.denominator}'s"
    )
    return (
        f"* {ratio.numerator} / {ratio.denominator} at {value:.3f}: {ratio.numerator} used "
        f"{ours - base:,.0f} µs of server CPU per request more than {ratio.denominator} "
        f"({base:,.0f} µs); {allows}"
    )


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


def _exchange_lines(statements: list[str], width: int = 160) -> list[str]:
    """One exchange as shown: each statement on a line of its own, the ones after
    the first marked ``+`` (they share the round trip)."""
    return [
        f"    {'  + ' if i else ''}{s if len(s) <= width else s[: width - 3] + '...'}"
        for i, s in enumerate(statements)
    ]


def statements_block(wire: dict[str, WireFigure]) -> str:
    parts = []
    for name, figure in wire.items():
        shown = "\n".join(line for e in figure.exchanges for line in _exchange_lines(e))
        parts.append(f"{name} ({figure.per_request:.2f} exchanges per request):\n\n{shown}\n")
    return "\n".join(parts)


def engine_section(result: EngineResult) -> str:
    parts = [f"### {result.engine}", "", ENGINES.get(result.engine, result.engine) + ".", ""]
    parts += [variant_table(result), "", ratio_table(result)]
    if gaps := gap_lines(result):
        parts += ["", 'Below a target, in CPU (see "What bounds the request path" below):']
        parts += ["", *gaps]
    if result.hot is not None:
        parts += ["", "HOT updates over a new-key phase per variant:", "", hot_table(result.hot)]
    if load := result.machine_load():
        parts += ["", f"Machine: {load}."]
    if result.notes:
        parts += [""] + [f"Note: {note}" for note in result.notes]
    return "\n".join(parts)


# -- the claim on psycopg 3 -------------------------------------------------------------

CLAIM_HOW = {
    "ext": "one string, psycopg.ClientCursor (the extension)",
    "ext-pipeline": "pipeline mode, bound on the server",
    "ext-serial": "one by one, a round trip each",
    "ext-generic": "the generic path (no batch)",
}


def _trips(result: EngineResult | None, name: str) -> float | None:
    if result is None or result.wire is None or name not in result.wire:
        return None
    return result.wire[name].per_request


def claim_table(result: EngineResult) -> str:
    """The claim paths side by side: figures, and ratios to the extension's own (``ext``)."""
    lines = [
        "| claim sent | variant | round trips/req | req/s | p50 ms | p99 ms | CPU ms/req "
        "| req/s vs ext | p50 vs ext | p99 vs ext | CPU/req vs ext |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in CLAIM_PATHS:
        figures = [_fmt(result.median(name, f), d) for f, d in FIELDS]
        ratios = [_fmt(result.field_ratio(name, "ext", f), 3) for f, _ in FIELDS]
        lines.append(
            f"| {CLAIM_HOW[name]} | {name} | {_fmt(_trips(result, name), 2)} | "
            + " | ".join(figures + ratios)
            + " |"
        )
    return "\n".join(lines)


FIELDS = (("rate", 0), ("p50_ms", 2), ("p99_ms", 2), ("cpu_ms", 2))


def _change(ratio: float | None, more: str, less: str, detail: str = "") -> str:
    """``ratio`` (a figure over ``ext``'s) as words: within 2% is no difference."""
    if ratio is None:
        return "not measured"
    if abs(ratio - 1) < 0.02:
        return f"the same within 2% ({ratio:.3f}{detail})"
    return f"{abs(ratio - 1):.0%} {more if ratio > 1 else less} ({ratio:.3f}{detail})"


def _claim_insert(result: EngineResult, name: str) -> str | None:
    """The claim's insert as it travelled in ``name``'s listing, if it is there."""
    if result.wire is None or name not in result.wire:
        return None
    sent = [
        s for e in result.wire[name].exchanges for s in e if "INSERT INTO idempotency_keys" in s
    ]
    return sent[0] if sent else None


def _prepared(result: EngineResult) -> str | None:
    """How the claim's insert travelled in ``ext``'s listing and in ``ext-pipeline``'s."""
    said = []
    ours = _claim_insert(result, "ext")
    if ours is not None and not ours.startswith("["):
        said.append(
            "The extension's claim travels as one simple query: its text with the values "
            "quoted into it (unmarked in the listing below), parsed and planned by the "
            "server at every claim."
        )
    elif ours is not None:
        said.append(f"The claim's insert in `ext` was sent as `{ours[:40]}...`.")
    piped = _claim_insert(result, "ext-pipeline")
    if piped is not None and piped.startswith("[prepared "):
        said.append(
            "In pipeline mode the claim is served by psycopg 3's automatic prepared "
            "statements: after five executions of the same text on a connection psycopg "
            "prepares it, and from then on the pipeline sends each statement's name and "
            "values only (`[prepared _pg3_N]` in the listing below)."
        )
    elif piped is not None:
        said.append(
            f"The claim's insert in `ext-pipeline` was sent as `{piped[:40]}...`, "
            "not as a prepared statement."
        )
    return " ".join(said) or None


def _against_ext(result: EngineResult, name: str) -> str:
    """``name``'s figures against ``ext``'s (the extension's) in the same rounds, in words."""
    ratio = functools.partial(result.field_ratio, name, "ext")
    rounds = result.field_ratios(name, "ext", "rate")
    spread = f"; {min(rounds):.2f} to {max(rounds):.2f} round by round" if rounds else ""
    return (
        f"throughput {_change(ratio('rate'), 'higher', 'lower', spread)}, "
        f"CPU per request {_change(ratio('cpu_ms'), 'more', 'less')}, "
        f"p50 {_change(ratio('p50_ms'), 'longer', 'shorter')}, "
        f"p99 {_change(ratio('p99_ms'), 'longer', 'shorter')}"
    )


#: A round trip between an app and its database on another host, for the arithmetic
#: below: within one data centre it is commonly a few tenths of a millisecond.
NETWORK_RTT_MS = 0.5


def _over_a_network(result: EngineResult) -> str | None:
    """What the round trips saved are worth once the database is on another host,
    beside the CPU the ways differ by, from the figures measured."""
    ours, serial = _trips(result, "ext"), _trips(result, "ext-serial")
    cpu = result.median("ext", "cpu_ms")
    cpu_serial = result.median("ext-serial", "cpu_ms")
    if ours is None or serial is None or math.isnan(cpu) or math.isnan(cpu_serial):
        return None
    return (
        "Here the database is on the same machine (loopback: no network time in a round "
        "trip, only the switch between processes), so the round trips weigh little beside "
        "the CPU, which other work shares. With the database on another host, each round "
        "trip adds the network's round trip time to every request: at "
        f"{NETWORK_RTT_MS} ms, one by one adds {(serial - ours) * NETWORK_RTT_MS:.1f} ms "
        "to each request's latency, "
        f"against a CPU difference of {cpu_serial - cpu:+.2f} ms per request measured here."
    )


def claim_section(results: list[EngineResult]) -> str | None:
    """The comparison issue 15 asks for: the claim's round trips on psycopg 3 and on
    psycopg2, and the ways to send it on psycopg 3 measured side by side."""
    by_engine = {r.engine: r for r in results}
    psycopg = by_engine.get("psycopg")
    if psycopg is None or not all(name in psycopg.samples for name in CLAIM_PATHS):
        return None
    psycopg2 = by_engine.get("postgresql")
    names = [v.name for v in VARIANTS if v.name in psycopg.samples]
    trips = [
        "| variant | psycopg2 | psycopg 3 |",
        "|---|---:|---:|",
        *(
            f"| {n} | {_fmt(_trips(psycopg2, n), 2)} | {_fmt(_trips(psycopg, n), 2)} |"
            for n in names
        ),
    ]
    ours, reference = _trips(psycopg, "ext"), _trips(psycopg2, "ext")
    piped, serial = _trips(psycopg, "ext-pipeline"), _trips(psycopg, "ext-serial")
    said = []
    if ours is not None and reference is not None:
        same = "as many as" if abs(ours - reference) < 0.005 else "against"
        said.append(
            "The extension sends the claim as one string through `psycopg.ClientCursor`: "
            f"`ext` takes {ours:.2f} round trips per request on psycopg 3, {same} "
            f"{reference:.2f} with psycopg2's batch, the reference."
        )
    if piped is not None:
        said.append(
            f"The same statements in pipeline mode (`ext-pipeline`) take {piped:.2f} round "
            f"trips: {_against_ext(psycopg, 'ext-pipeline')}."
        )
    if serial is not None and ours is not None:
        said.append(
            f"One by one the same statements take {serial:.2f} ({serial - ours:+.2f}): "
            f"{_against_ext(psycopg, 'ext-serial')}."
        )
    said.append(
        f"The extension's path where it has no batch (`ext-generic`) takes "
        f"{_fmt(_trips(psycopg, 'ext-generic'), 2)} round trips: "
        f"{_against_ext(psycopg, 'ext-generic')}."
    )
    if network := _over_a_network(psycopg):
        said.append(network)
    if prepared := _prepared(psycopg):
        said.append(prepared)
    parts = [
        "## The claim on psycopg 3",
        "",
        CLAIM_INTRO,
        "",
        "Round trips per request, the app in process (as in the tables above):",
        "",
        "\n".join(trips),
        "",
        "The ways to send the claim on psycopg 3, side by side in the same rounds (a `vs "
        "ext` column is the median over the rounds of the variant's figure over `ext`'s "
        "in the same round):",
        "",
        claim_table(psycopg),
        "",
        *(f"* {line}" for line in said),
        "",
        CLAIM_WHY,
    ]
    if replay := _replay_after_new(psycopg2, psycopg):
        parts += ["", replay]
    return "\n".join(parts)


def _replay_after_new(psycopg2: EngineResult | None, psycopg: EngineResult) -> str | None:
    """What a replay costs on a connection that served new keys just before."""
    ours = psycopg.replay_after_new
    if ours is None:
        return None
    theirs = psycopg2.replay_after_new if psycopg2 is not None else None
    reference = f" against {theirs.per_request:.0f} on psycopg2" if theirs is not None else ""
    shown = "\n".join(line for e in ours.exchanges for line in _exchange_lines(e))
    deallocates = any(s == "DEALLOCATE ALL" for e in ours.exchanges for s in e)
    why = (
        "psycopg 3 forgets its prepared statements at every `ROLLBACK` and deallocates them "
        "on the server (`DEALLOCATE ALL`, an exchange of its own), so the next five requests "
        "on that connection run unprepared, and each statement bound on the server costs "
        "one more exchange when psycopg prepares it again. "
        if deallocates
        else ""
    )
    return (
        "A replay ends its transaction with `ROLLBACK` (the replay variants above run "
        "back to back, so nothing is prepared when they start). "
        + why
        + f"One replay on a connection that served new keys just before: "
        f"{ours.per_request:.0f} exchanges on psycopg 3{reference}:\n\n{shown}\n"
    )


CLAIM_INTRO = """\
The claim is four statements: bound `lock_timeout` (`IDEMPOTENCY_WAIT`), insert the
record (`ON CONFLICT DO NOTHING`), restore the bound, read the record. psycopg2 binds
on the client and sends them as one `;`-joined string, one round trip. psycopg 3 binds
on the server, one statement per message, so the extension sends the four as one
string through `psycopg.ClientCursor` instead (psycopg quotes the values into the
text, simple query protocol: psycopg2's way), one round trip. `ext-pipeline` sends
them in psycopg's pipeline mode, bound on the server: all four, then one `Sync`,
answered together, one round trip too (the extension's way before; below, why not
now). `ext-serial` sends the same four one at a time on a regular cursor (bound on
the server); `ext-generic` is what the extension does where it has no batch
(`_fast_driver` patched to answer None for that route only, `bench/claim_paths.py`):
each statement through SQLAlchemy, compiled each time, the request's other
statements too. On both drivers the transaction's `BEGIN` is an exchange of its own
before the claim (in pipeline mode too: psycopg 3 sends it with a `Sync` of its own
and waits)."""

CLAIM_WHY = """\
Why the one string and not the pipeline: both are one round trip, but a pipeline ends
with a `Sync` followed by a `Flush`. PostgreSQL arms `idle_in_transaction_session_timeout`
when it sends ReadyForQuery, and the `Flush` arriving after it disarms the timer until
the next statement. A host cut off right after a pipelined claim sends no next
statement, so its claim would be held past the server's own setting (and past
`IDEMPOTENCY_CLAIM_IDLE_TIMEOUT`), for as long as TCP keeps the session. The one
string is a simple query: it ends with ReadyForQuery, and the timer runs. What the
pipeline would keep is psycopg 3's server-side binding: the values travel apart from
the text, and the text is the same at every claim, so psycopg prepares it on each
connection after five executions and the server skips parsing it (and planning it,
once PostgreSQL settles on a generic plan). The one string is quoted by psycopg on the
client, and parsed and planned by the server, at every claim. The figures above say
what that costs on this machine (`ext-pipeline / ext`); a difference within 2%, or
within the spread between rounds on a shared machine, is none."""


BOUNDS = """\
## What bounds the request path

Where a ratio above is below its target, the lines under its table say how many
microseconds of server CPU per request (gunicorn's workers and the PostgreSQL backends
together; SQLite runs inside the workers) stand between the figure and the target. It is
CPU, not waiting: the extension's round trips are the floor's or fewer (the round trips
column: a new key as many as the floor, the optimistic mode and a replay one fewer).

Where that CPU goes is in "Where the CPU goes" (`python -m bench.profile`, py-spy on the
workers, this round's changes before and after, side by side). What is left after them is
spread over dozens of calls of a few microseconds each, every one doing something the floor
does not promise and the extension does:

* whose key it is: the scope (the Authorization header or the session cookie, hashed), so
  one client never gets another's answer; the floor takes the key as sent, for everyone;
* the key checked (length, characters) and the request normalized: JSON compared as data
  (two spellings of one body are one request), the query and the media type counted, a
  schema's excluded fields left out; the floor hashes the raw bytes;
* the record: a fencing token and a lease (a request that outlived its lock cannot write
  over its successor's answer), the answer's headers, its expiry moved to the completion
  (on PostgreSQL an indexed column, so the completion's update is not a HOT one: see the
  HOT table), the wait for a duplicate's lock bounded in the claim's own batch;
* the session guard (a view that commits or rolls back the record with its work is caught),
  the signals, the telemetry hooks, `application/problem+json` for every failure, the
  replay's headers.

Compiling the computation does not close the gap: "A compiled fingerprint and canonical
JSON" (`python -m bench.compiled`) builds both with mypyc and measures the microseconds it
saves per request, against gaps of hundreds here: most of that work already runs in C (the
json module's encoder, hashlib), and the rest of a request's Python is calls between Flask,
SQLAlchemy's session and the extension, which a compiled module still makes through the
interpreter. Meeting 0.97 of the floor would mean the extension's whole per-request work, in
Python and in the database, fitting in the room the lines above give (about 3% of the
floor's CPU): less than Flask spends on dispatching a request. That is not a faster
implementation of the same guarantees but fewer of them, so the figures above are where
this round stops, and the profile is the evidence.
"""


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
  request at a time, through a counting TCP proxy (`bench/wire.py`) that reads the
  client's side of the protocol and counts each time the client sends a request after
  a reply: a simple query (psycopg2, which sends `BEGIN` as an exchange of its own, and
  the extension's claim on psycopg 3), a
  statement psycopg 3 binds on the server (`Parse`/`Bind`/`Execute` up to its
  `Sync`), or a psycopg 3 pipeline (several statements before one `Sync`: the server
  answers nothing before it). Connection setup is left out (warm-up requests first,
  then the counters are reset). The statements of one request are listed below.
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
* **machine**: `/proc/stat` over each run: the share of all CPUs' time that was busy,
  and the share the measured server processes took. The engines run one after the
  other, so figures of two engines were not measured side by side: compare each
  engine's ratios, not its figures with another's.
"""

LISTING_LEGEND = """\
Each line is one exchange; a `+` line was sent in the same exchange as the line above
it (a `;`-joined simple query, as psycopg2 sends a batch and the extension its claim
on psycopg 3, or a psycopg 3 pipeline). An unmarked statement is a simple query
(`Q`: its text, with the values in it). psycopg 3's statements are marked with how they
travelled: `[parse]` parsed, bound and executed (the values sent apart, as `$n`),
`[prepare _pg3_N]` prepared under a name, `[prepared _pg3_N]` executed from a
statement prepared earlier on the connection (only its name and values sent)."""


def markdown(
    facts: Facts,
    results: list[EngineResult],
    memory: MemoryFigure | None,
    notes: list[str],
) -> str:
    engines = {r.engine for r in results}
    variants = "\n".join(
        f"* `{v.name}`: `POST {v.path}`: {v.what}"
        + (f" (only on {', '.join(v.engines)})" if v.engines else "")
        for v in VARIANTS
        if any(v.runs_on(e) for e in engines)
    )
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
        f"* {facts.drivers}",
        f"* {facts.rounds} rounds, {facts.duration:g} s per variant per round, 6 connections",
        f"* load average (1 min) at the start {facts.load_before}, at the end {facts.load_after}",
        *(f"* {note}" for note in facts.notes),
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
    if claims := claim_section(results):
        parts += [claims, ""]
    if any(gap_lines(result) for result in results):
        parts += [BOUNDS]
    parts.append(EXPLANATION.replace("{variants}", variants))
    for result in results:
        if result.wire:
            parts += [
                f"## Statements of one request on the wire ({result.engine})",
                "",
                LISTING_LEGEND,
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
