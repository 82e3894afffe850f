"""RELIABILITY.md: the runs' facts, a summary table and each scenario's figures.

The figures are also kept in the file, as JSON in a comment at its end, so that
``--update`` can run some scenarios again and replace only their sections: each
section says which command, commit and date produced it.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import platform
import re
import subprocess
import types
import typing as t
from pathlib import Path

from reliability import _harness as h

_DATA = re.compile(r"^<!-- reliability data: (.*) -->$", re.M)


@dataclasses.dataclass
class Section:
    """One scenario's results, with the facts of the run that produced them."""

    name: str
    title: str
    description: str
    command: str
    date: str
    commit: str
    short: bool
    seconds: float
    python: str
    results: list[h.Result]

    def to_json(self) -> dict[str, t.Any]:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, count) pairs,
        # counting the pairs.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["results"] = [
            {f.name: _plain(getattr(r, f.name)) for f in dataclasses.fields(r)}
            for r in self.results
        ]
        return data

    @classmethod
    def from_json(cls, data: dict[str, t.Any]) -> Section:
        results = []
        for raw in data.pop("results"):
            raw["answers"] = collections.Counter(raw["answers"])
            raw["faults"] = collections.Counter(raw["faults"])
            fields = {f.name for f in dataclasses.fields(h.Result)}
            results.append(h.Result(**{k: v for k, v in raw.items() if k in fields}))
        return cls(**data, results=results)


def _plain(value: t.Any) -> t.Any:
    """A result's field as JSON takes it (counters and lists copied as plain ones)."""
    if isinstance(value, dict):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list):
        return list(value)
    return value


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=h.ROOT
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "flask_idempotency", "reliability", "example_app"],
        capture_output=True,
        text=True,
        cwd=h.ROOT,
    )
    commit = done.stdout.strip() or "unknown"
    return commit + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def _unprotected(result: h.Result) -> str:
    return " (no extension)" if result.expect_duplicates else ""


def _answers(result: h.Result) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(result.answers.items())) or "-"


def _faults(result: h.Result) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(result.faults.items())) or "-"


def sections_of(
    command: str,
    done: t.Sequence[tuple[types.ModuleType, list[h.Result]]],
    *,
    short: bool,
    seconds: dict[str, float],
) -> list[Section]:
    """The sections of this run, one per scenario run."""
    date = f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
    commit = _commit()
    python = f"Python {platform.python_version()}; {platform.machine()}"
    return [
        Section(
            module.NAME,
            module.TITLE,
            module.DESCRIPTION.strip(),
            command,
            date,
            commit,
            short,
            seconds.get(module.NAME, 0.0),
            python,
            results,
        )
        for module, results in done
    ]


def load(path: Path) -> dict[str, Section]:
    """The sections kept in an existing report (none when there is no data)."""
    if not path.exists():
        return {}
    found = _DATA.search(path.read_text(encoding="utf-8"))
    if found is None:
        return {}
    return {s["name"]: Section.from_json(s) for s in json.loads(found.group(1))}


def write(path: Path, sections: t.Sequence[Section], order: t.Sequence[str]) -> None:
    """Write the report for ``sections``, in the scenarios' ``order``."""
    rank = {name: i for i, name in enumerate(order)}
    sections = sorted(sections, key=lambda s: rank.get(s.name, len(rank)))
    results = [r for s in sections for r in s.results]
    failed = [r for r in results if not r.passed]
    protected = [r for r in results if not r.expect_duplicates and not r.skipped]
    totals = {
        "duplicates": sum(r.duplicates for r in protected),
        "lost": sum(r.lost for r in results),
        "stuck": sum(r.stuck for r in results),
        "html_500": sum(r.html_500 for r in results),
        "unsettled": sum(r.unsettled for r in results),
    }
    skipped = [r for r in results if r.skipped]
    verdict = "all runs passed" if not failed else f"{len(failed)} runs FAILED"
    lines = [
        "# Reliability",
        "",
        "Figures from the fault suite, `python -m reliability` (see `reliability/README.md`):",
        "every scenario drives real processes (gunicorn, PostgreSQL, nginx, a broker, network",
        "namespaces) on one machine while it injects faults, then counts what the database holds,",
        "not status codes. `python -m reliability` regenerates the whole file;",
        "`python -m reliability --only NAME --update` one scenario's section.",
        "",
        f"**Verdict: {verdict}**"
        + (f" ({len(skipped)} skipped: their tools were missing)" if skipped else "")
        + f". With the extension: {totals['duplicates']} duplicates, {totals['lost']} lost"
        f" operations, {totals['stuck']} stuck records, {totals['html_500']} HTML 500s,"
        f" {totals['unsettled']} unsettled operations, over"
        f" {sum(r.operations for r in protected):,} operations and"
        f" {sum(sum(r.faults.values()) for r in results):,} injected faults.",
        "",
        "## Runs",
        "",
        "| scenario | command | date | commit | wall time |",
        "|---|---|---|---|---:|",
    ]
    for s in sections:
        command = f"`{s.command}`" + (" (short)" if s.short else "")
        minutes = f"{s.seconds / 60:.1f} min"
        lines.append(f"| {s.name} | {command} | {s.date} | {s.commit} | {minutes} |")
    lines += [
        "",
        f"{sections[0].python if sections else ''}.",
        "",
        "## Summary",
        "",
        "| scenario | run | operations | attempts | faults | ledger rows | duplicates | lost"
        " | unsettled | stuck | HTML 500 | |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in sections:
        for r in s.results:
            mark = "skipped" if r.skipped else ("pass" if r.passed else "**FAIL**")
            lines.append(
                f"| {s.name} | {r.title} | {r.operations:,} | {r.attempts:,} | {_faults(r)} |"
                f" {r.ledger_rows:,} | {r.duplicates:,}{_unprotected(r)} |"
                f" {r.lost} | {r.unsettled} | {r.stuck} | {r.html_500} | {mark} |"
            )
    for s in sections:
        lines += ["", f"## {s.title}", "", s.description, ""]
        for r in s.results:
            lines.append(
                f"**{r.title}** ({r.seconds:.0f} s)"
                + (f": skipped, {r.skipped}" if r.skipped else "")
            )
            lines.append("")
            if not r.skipped:
                lines.append(f"* answers by status: {_answers(r)}")
                lines.append(f"* faults injected: {_faults(r)}")
            for key, value in r.extra.items():
                lines.append(f"* {key}: {value}")
            for failure in r.failures:
                lines.append(f"* **failed check**: {failure}")
            for note in r.notes:
                lines.append(f"* {note}")
            lines.append("")
    data = json.dumps([s.to_json() for s in sections], default=str, separators=(",", ":"))
    lines += ["", f"<!-- reliability data: {data} -->"]
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
