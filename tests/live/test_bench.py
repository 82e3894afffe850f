"""The benchmark harness (``python -m bench.run``) runs end to end in a tiny mode,
and its wire proxy counts round trips as the drivers make them.

No timing is checked (timings depend on the machine): only that every variant ran,
answered, and made it into the table, with every answer 2xx; round trips are
counts, and those are checked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa

from bench.app import OPTIMISTIC_MISSING
from bench.harness import (
    data_comment,
    kept_sections,
    markers,
    read_data,
    times,
    write_section,
)
from bench.report import CLAIM_HOW
from bench.telemetry_app import VARIANTS as VARIANTS_OTEL
from bench.variants import CLAIM_PATHS, VARIANTS
from bench.wire import CountingProxy
from tests.conftest import POSTGRES_ENV, postgres_url
from tests.support import pgbouncer

ROOT = Path(__file__).resolve().parents[2]


def _harness(tmp_path: Path, *options: str, env: dict[str, str] | None = None) -> str:
    """``python -m bench.run`` in its tiny mode with ``options``; the file it wrote."""
    out = tmp_path / "BENCHMARKS.md"
    command = [
        sys.executable,
        "-m",
        "bench.run",
        "--quick",
        "--duration",
        "0.5",
        "--rounds",
        "1",
        "--no-memory",
        "--load",
        "python",
        "--out",
        str(out),
        "--plot",
        str(tmp_path / "results.png"),
        *options,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FAILED" not in done.stderr
    return out.read_text()


def _sections(text: str) -> dict[str, dict[str, list[str]]]:
    """The rows of every table under each ``###`` heading (by first cell), and of
    the sections after ``## The claim on psycopg 3`` under that name."""
    sections: dict[str, dict[str, list[str]]] = {}
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.startswith("### ") or line.startswith("## The claim"):
            rows = sections.setdefault(line.lstrip("# ").strip(), {})
        elif line.startswith("## "):
            rows = {}
        elif line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            rows.setdefault(cells[0], cells)
    return sections


def _expected(engine: str) -> list[str]:
    return [
        v.name for v in VARIANTS if v.runs_on(engine) and not (v.optimistic and OPTIMISTIC_MISSING)
    ]


@pytest.mark.slow
def test_harness_runs_every_variant(tmp_path: Path) -> None:
    text = _harness(tmp_path, "--engines", "sqlite")
    rows = _sections(text)["sqlite"]
    for name in _expected("sqlite"):
        requests = int(rows[name][6].replace(",", ""))
        assert requests > 0, rows[name]
    assert "ext-serial" not in rows  # the claim paths are psycopg 3's
    assert "no-key / plain" in text
    assert "ext-replay / floor-replay" in text


@pytest.mark.slow
def test_harness_on_both_postgresql_drivers(tmp_path: Path) -> None:
    """Both PostgreSQL engines: every variant answered, and the round trips are
    the claim's: the extension's one string and the pipeline as few as psycopg2's
    batch, one by one three more, and the comparison written out."""
    if pgbouncer.is_pooled(postgres_url()):
        pytest.skip(
            "not applicable behind a transaction pooler: it counts the drivers' round trips"
            " to the server (and psycopg's prepared statements), which the pooler relays"
            " and the pooled engines turn off"
        )
    # The suite's PostgreSQL, in a schema of the run's own.
    configured = os.environ.get(POSTGRES_ENV) or postgres_url()
    env = {**os.environ, POSTGRES_ENV: configured}
    text = _harness(tmp_path, "--engines", "postgresql,psycopg", env=env)
    sections = _sections(text)
    for engine in ("postgresql", "psycopg"):
        rows = sections[engine]
        for name in _expected(engine):
            assert int(rows[name][6].replace(",", "")) > 0, rows[name]
    assert "ext-serial" not in sections["postgresql"]

    def trips(engine: str, name: str) -> float:
        return float(sections[engine][name][5])

    reference = trips("postgresql", "ext")
    assert trips("psycopg", "ext") == reference
    assert trips("psycopg", "ext-pipeline") == reference
    assert trips("psycopg", "ext-serial") == reference + 3  # four statements, not one batch
    assert trips("psycopg", "ext-generic") > reference  # a statement per round trip
    assert trips("psycopg", "ext-nowait") == trips("postgresql", "ext-nowait")
    claims = sections["The claim on psycopg 3"]
    compared = [row[1] for row in claims.values() if row[0] in CLAIM_HOW.values()]
    assert compared == list(CLAIM_PATHS)
    assert "ext-pipeline / ext" in text
    listing = text[text.index("## Statements of one request on the wire (psycopg)") :]
    assert "[prepared _pg3_" in listing or "[parse]" in listing


@pytest.mark.slow
def test_outbox_bench_runs_every_relay_and_broker(pg_url: str, tmp_path: Path) -> None:
    """``python -m bench.outbox`` in a tiny mode: every latency variant and every
    embedded broker has a figure, and the section lands in the output file."""
    if pgbouncer.is_pooled(pg_url):
        pytest.skip(
            "not applicable behind a transaction pooler: bench/outbox.py times relays on"
            " engines of its own, set up for a direct connection (psycopg's prepared"
            " statements on)"
        )
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    command = [
        sys.executable,
        "-m",
        "bench.outbox",
        "--quick",
        "--events",
        "5",
        "--backlog",
        "50",
        "--no-rabbitmq",
        "--database-url",
        pg_url,
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    for name in ("cli-listen", "cli-poll", "scheduler-wake", "scheduler-poll"):
        assert float(rows[name].split("|")[2].replace(",", "")) > 0, rows[name]
    for broker in (
        "kombu filesystem",
        "kombu SQLAlchemy (SQLite)",
        "none (in-memory list, one event at a time)",
        "none (in-memory, pipelined), batches of 100",
        "none (in-memory, pipelined), batches of 1,000",
    ):
        assert float(rows[broker].split("|")[2].replace(",", "")) > 0, rows[broker]
    assert "RabbitMQ figures are missing" in text


@contextlib.contextmanager
def _driver_connection(url: str | sa.URL) -> t.Iterator[t.Any]:
    """The driver's own connection to ``url``, closed at the end."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            yield conn.connection.driver_connection
    finally:
        engine.dispose()


@pytest.fixture
def wire() -> t.Iterator[CountingProxy]:
    if pgbouncer.is_pooled(postgres_url()):
        pytest.skip(
            "not applicable behind a transaction pooler: it counts a driver's exchanges"
            " with the server on a connection of its own (psycopg's prepared statements"
            " among them, which the pooled engines turn off)"
        )
    with CountingProxy(postgres_url()) as proxy:
        yield proxy


def test_wire_counts_a_psycopg_pipeline_as_one_exchange(wire: CountingProxy) -> None:
    """psycopg 3: four statements in pipeline mode are one exchange; sent one by
    one, four; the capture shows each statement, marked as it travelled."""
    url = sa.make_url(wire.url()).set(drivername="postgresql+psycopg")
    with _driver_connection(url) as conn:
        conn.execute("SELECT 1")  # BEGIN: an exchange of its own
        statements = [f"SELECT %(v)s::int + {i}" for i in range(4)]
        wire.reset(capture=True)
        with conn.pipeline():
            cursors = [conn.cursor() for _ in statements]
            for cursor, sql in zip(cursors, statements, strict=True):
                cursor.execute(sql, {"v": 1})
        assert [c.fetchone()[0] for c in cursors] == [1, 2, 3, 4]
        assert wire.exchanges == 1
        assert wire.captured == [[f"[parse] SELECT $1::int + {i}" for i in range(4)]]

        wire.reset(capture=True)
        for sql in statements:
            conn.execute(sql, {"v": 1})
        assert wire.exchanges == 4
        assert [len(exchange) for exchange in wire.captured] == [1, 1, 1, 1]

        # Executed often enough, psycopg prepares a statement: a named Parse, then
        # only its name. Outside a pipeline preparing is an exchange of its own.
        wire.reset()
        for _ in range(5):
            conn.execute("SELECT %(v)s::int", {"v": 1})
        wire.reset(capture=True)
        conn.execute("SELECT %(v)s::int", {"v": 1})
        conn.execute("SELECT %(v)s::int", {"v": 1})
        assert wire.exchanges == 3
        (prepare,), (first,), (second,) = wire.captured
        name = prepare.split()[1].rstrip("]")
        assert prepare == f"[prepare {name}] SELECT $1::int"
        assert first == second == f"[prepared {name}] SELECT $1::int"


def test_wire_counts_a_psycopg2_batch_as_one_exchange(wire: CountingProxy) -> None:
    with _driver_connection(wire.url()) as conn:  # the suite's URL names psycopg2
        cursor = conn.cursor()
        cursor.execute("SELECT 1")  # BEGIN, then the statement
        wire.reset(capture=True)
        cursor.execute("SELECT %(v)s;\nSELECT %(v)s + 1;\nSELECT %(v)s + 2", {"v": 1})
        assert cursor.fetchone() == (3,)
        assert wire.exchanges == 1
        assert wire.captured == [["SELECT 1", "SELECT 1 + 1", "SELECT 1 + 2"]]


def _table(section: str) -> dict[str, list[str]]:
    """The rows of the Markdown tables in ``section``, by first cell."""
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            rows.setdefault(cells[0], cells)
    return rows


def _section(text: str, name: str) -> str:
    start, end = markers(name)
    assert text.count(start) == 1, name
    assert text.count(end) == 1, name
    return text.split(start, 1)[1].split(end, 1)[0]


@pytest.mark.slow
def test_issue17_benchmarks_run_and_report(tmp_path: Path) -> None:
    """``python -m bench.run_more --quick``: every benchmark of issue 17 runs at a
    tiny size on a PostgreSQL of its own, writes its section (kept apart from
    what the file held) with figures that parse, and the plot is drawn. Counts
    are checked (answers, ledger rows, dead tuples, records per key), never
    timings."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    plot = tmp_path / "results-issue17.png"
    command = [
        sys.executable,
        "-m",
        "bench.run_more",
        "--quick",
        "--out",
        str(out),
        "--plot",
        str(plot),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    data = read_data(text)
    assert f"]({plot.name})" in _section(text, "bench.more")

    # 2 rounds of 5 duplicates per variant: one view run per round, every loser
    # replayed (wait) or refused with a problem (fail-fast, unless it came late).
    duplicates = _table(_section(text, "bench.duplicates"))
    assert duplicates["wait"][6] == "201: 2, 201 replayed: 8"
    assert duplicates["wait"][7] == duplicates["fail-fast"][7] == "2 / 2"
    answers = dict(a.split(": ") for a in duplicates["fail-fast"][6].split(", "))
    assert answers["201"] == "2"
    assert int(answers.get("409", 0)) + int(answers.get("201 replayed", 0)) == 8
    assert len(data["bench.duplicates"]["wait"]["ratios"]) == 8

    # A failed plain insert leaves its tuple dead; ON CONFLICT DO NOTHING none.
    conflict = _table(_section(text, "bench.conflict"))
    assert conflict["savepoint"][4] == "10,000"
    assert conflict["on-conflict"][4] == conflict["store.claim"][4] == "0"
    assert data["bench.conflict"]["savepoint"]["pages"] > 0

    cleanup = _section(text, "bench.cleanup")
    rows = _table(cleanup)
    for batch in ("1,000", "10,000"):
        assert rows[batch][2] == "5,000"  # every expired record deleted (checked in the run)
        assert float(rows[batch][4].replace(",", "")) > 0
        assert f"* batch {batch}: writers' p99 during cleanup" in cleanup

    scale = _section(text, "bench.scale")
    assert set(data["bench.scale"]) >= {"small_claim_p50", "large_claim_p99"}
    assert scale.count("target within 1.2x") == 2

    retention = _section(text, "bench.retention")
    assert "* as is: **2 records** for one key" in retention
    assert data["bench.retention"]["boundary"] == {"as is": 2, "guarded": 1}
    rows = _table(retention)
    assert rows["partition DETACH + DROP"][8].endswith("→ 0")  # the partition's space is back
    assert set(data["bench.retention"]["price"]) == {
        "record table",
        "partitioned, as is",
        "partitioned, guarded",
    }
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.stat().st_size > 10_000


def test_sections_are_replaced_in_place_and_kept(tmp_path: Path) -> None:
    """A rerun replaces only its own section; ``bench.run`` keeps them all."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n")
    write_section(out, "bench.a", ["first a", data_comment("bench.a", {"x": 1})])
    write_section(out, "bench.b", ["b"])
    write_section(out, "bench.a", ["second a", data_comment("bench.a", {"x": 2})])
    text = out.read_text()
    assert "first a" not in text
    assert text.index("second a") < text.index("\nb\n")
    assert read_data(text) == {"bench.a": {"x": 2}}
    kept = kept_sections(out)
    assert kept.startswith(markers("bench.a")[0])
    assert kept.rstrip().endswith(markers("bench.b")[1])
    assert "# Benchmarks" not in kept
    # A figure that could not be had (no writer's operation overlapped a very short
    # cleanup) is written as null and shown as n/a, not refused.
    assert read_data(data_comment("bench.c", {"ratio": math.nan})) == {"bench.c": {"ratio": None}}
    assert times(math.nan) == "n/a"
    assert times(1.234) == "1.23x"


@pytest.mark.slow
def test_telemetry_bench_runs_every_variant(tmp_path: Path) -> None:
    """``python -m bench.telemetry --quick`` on SQLite and psycopg 3: every
    variant's gunicorn starts with its set-up (the run fails otherwise: an
    ``opentelemetry`` module in a ``no-api`` worker, an SDK in an ``api`` one),
    every case answers 2xx, and the section lands in the file with the rest of
    it kept. Counts are checked, never timings: when the extension has its
    instrumentation, the SDK and Prometheus variants saw its requests executed
    and replayed."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\nkept\n")
    command = [
        sys.executable,
        "-m",
        "bench.telemetry",
        "--quick",
        "--engines",
        "sqlite,psycopg",
        "--out",
        str(out),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n")
    section = _section(text, "bench.telemetry")
    data = read_data(text)["bench.telemetry"]
    variants = list(VARIANTS_OTEL)
    for engine in ("sqlite", "psycopg"):
        cases = data[engine]["cases"]
        assert set(cases) == {
            *variants,
            *(f"{variant} replay" for variant in variants),
            "floor",
        }
        rows = _table(section[section.index(f"### {engine}") :])
        for name in cases:
            assert int(rows[name][6].replace(",", "")) > 0, rows[name]
        assert cases["api"]["ratio"] == cases["api replay"]["ratio"] == 1.0
        assert "`no-api`: 0 opentelemetry modules" in section
        recorded = data[engine]["recorded"]
        assert set(recorded) == {"sdk", "sdk-flask", "flask-only", "prometheus"}
        assert recorded["flask-only"] == {}  # the extension's meter is a no-op one there
        if importlib.util.find_spec("flask_idempotency._telemetry") is not None:
            for variant in ("sdk", "sdk-flask", "prometheus"):
                assert recorded[variant]["executed"] > 0, recorded
                assert recorded[variant]["replayed"] > 0, recorded
    assert "`sdk` / `api`, new key (target at least 0.97" in section


@pytest.mark.slow
def test_profile_bench_keeps_both_labels(tmp_path: Path) -> None:
    """``python -m bench.profile`` samples the workers on every path, splits the
    CPU by package and keeps an earlier label's figures beside the new ones."""
    out = tmp_path / "BENCHMARKS.md"

    def run(label: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "bench.profile", "--engines", "sqlite"]
        # 2 s at 1,000 samples/s: enough samples of the workers on a machine the
        # other tests keep busy (a second at 250/s left some paths with none).
        command += ["--seconds", "2", "--rate", "1000", "--load", "python"]
        command += ["--label", label, "--out", str(out)]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)

    first = run("before")
    if first.returncode and "Permission denied" in first.stderr and "py-spy" in first.stderr:
        pytest.skip(f"py-spy may not attach to processes here: {first.stderr[-300:]}")
    assert first.returncode == 0, first.stdout + first.stderr
    second = run("after")
    assert second.returncode == 0, second.stdout + second.stderr
    data = read_data(out.read_text())["bench.profile"]
    assert set(data) == {"before", "after"}
    for label in ("before", "after"):
        paths = data[label]["sqlite"]
        assert set(paths) == {"new-key", "replay", "no-key", "floor", "floor-replay", "plain"}
        for path, profile in paths.items():
            assert profile["requests"] > 0, (label, path)
            assert profile["samples"] > 0, (label, path)
    # the extension's own frames are seen on its paths (summed over both labels:
    # one short window on a busy machine may catch few of a path's samples)
    ours = sum(
        data[label]["sqlite"][p]["packages"].get("extension", 0)
        for label in data
        for p in ("new-key", "replay")
    )
    assert ours > 0
    assert any(
        "Flow.run (flask_idempotency/_request/flow.py)" in data[label]["sqlite"][p]["inclusive"]
        for label in data
        for p in ("new-key", "replay")
    )
    section = out.read_text().split(markers("bench.profile")[0])[1]
    assert "| new-key | all |" in section
    assert "before µs/req | after µs/req" in section


def test_compiled_bench_times_both_builds(tmp_path: Path) -> None:
    """``python -m bench.compiled --quick`` builds the canonical JSON and the
    fingerprint with mypyc, and each round's processes import the build they
    are said to (the bench refuses a compiled figure from interpreted code)."""
    out = tmp_path / "BENCHMARKS.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.compiled", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode and "error: command 'gcc' failed" in done.stdout + done.stderr:
        pytest.skip(f"no C compiler for mypyc here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stdout + done.stderr
    [round_] = read_data(out.read_text())["bench.compiled"]["rounds"]
    for label in ("interpreted", "compiled"):
        assert set(round_[label]) == {"bench body", "schema order"}
        assert all(0 < value < 10_000 for value in round_[label].values())
    section = out.read_text().split(markers("bench.compiled")[0])[1]
    assert "| schema order |" in section
