"""RELIABILITY.md: the run's facts, a summary table and each scenario's figures."""

from __future__ import annotations

import datetime as dt
import platform
import subprocess
import types
import typing as t
from pathlib import Path

from reliability import _harness as h


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=h.ROOT
    )
    return done.stdout.strip() or "unknown"


def _unprotected(result: h.Result) -> str:
    return " (no extension)" if result.expect_duplicates else ""


def _answers(result: h.Result) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(result.answers.items())) or "-"


def _faults(result: h.Result) -> str:
    return ", ".join(f"{k}: {v:,}" for k, v in sorted(result.faults.items())) or "-"


def write(
    path: Path,
    command: str,
    scenarios: t.Sequence[tuple[types.ModuleType, list[h.Result]]],
    *,
    short: bool,
    seconds: float,
) -> None:
    results = [r for _, rs in scenarios for r in rs]
    failed = [r for r in results if not r.passed]
    protected = [r for r in results if not r.expect_duplicates and not r.skipped]
    totals = {
        "duplicates": sum(r.duplicates for r in protected),
        "lost": sum(r.lost for r in results),
        "stuck": sum(r.stuck for r in results),
        "html_500": sum(r.html_500 for r in results),
        "unsettled": sum(r.unsettled for r in results),
    }
    lines = [
        "# Reliability",
        "",
        "Figures from the fault suite, `python -m reliability`: every scenario drives real",
        "processes (gunicorn, PostgreSQL, nginx, a broker) on this machine and counts what the",
        "database holds afterwards, not status codes. Regenerate with the command below.",
        "",
        "## Run",
        "",
        f"* command: `{command}`" + (" (the short version CI runs)" if short else ""),
        f"* date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {_commit()}",
        f"* Python {platform.python_version()}; {platform.machine()};"
        f" wall time {seconds / 60:.1f} min",
        f"* verdict: **{'all scenarios passed' if not failed else f'{len(failed)} FAILED'}**;"
        f" with the extension: {totals['duplicates']} duplicates, {totals['lost']} lost operations,"
        f" {totals['stuck']} stuck records, {totals['html_500']} HTML 500s,"
        f" {totals['unsettled']} unsettled operations",
        "",
        "## Summary",
        "",
        "| scenario | run | operations | attempts | faults | ledger rows | duplicates | lost"
        " | unsettled | stuck | HTML 500 | |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for module, rs in scenarios:
        for r in rs:
            verdict = "skipped" if r.skipped else ("pass" if r.passed else "**FAIL**")
            lines.append(
                f"| {module.NAME} | {r.title} | {r.operations:,} | {r.attempts:,} | {_faults(r)} |"
                f" {r.ledger_rows:,} | {r.duplicates:,}{_unprotected(r)} |"
                f" {r.lost} | {r.unsettled} | {r.stuck} | {r.html_500} | {verdict} |"
            )
    for module, rs in scenarios:
        lines += ["", f"## {module.TITLE}", "", module.DESCRIPTION.strip(), ""]
        for r in rs:
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
    path.write_text("\n".join(lines).rstrip() + "\n")
