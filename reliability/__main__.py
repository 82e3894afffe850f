"""The fault suite: ``python -m reliability [--short] [--only a,b] [--out PATH] [--update]``.

Runs every scenario (or those named) against processes it starts on this machine,
prints a line per run as it ends, writes the report, and exits 1 when any scenario
failed (a duplicate, a lost operation, a stuck record, an HTML 500 or an unsettled
operation where the extension protects the route). ``--short`` is CI's version:
the same scenarios at a fraction of the volume.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

from reliability import _harness as h
from reliability import _report, scenarios
from reliability._context import Context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m reliability", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--short", action="store_true", help="the short version (CI)")
    parser.add_argument(
        "--only", default="", help="comma-separated scenario names: " + ", ".join(scenarios.ALL)
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="report path (default RELIABILITY.md; --short: none)"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="replace only the sections of the scenarios run; keep the others' from the report",
    )
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or scenarios.ALL
    unknown = set(names) - set(scenarios.ALL)
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(sorted(unknown))}")
    if not os.environ.get("XDG_RUNTIME_DIR"):  # pgserver's platformdirs wants one
        os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="reliability-run-")
    out = args.out if args.out is not None else (None if args.short else h.ROOT / "RELIABILITY.md")
    start = time.monotonic()
    done: list[tuple[types.ModuleType, list[h.Result]]] = []
    took: dict[str, float] = {}
    settings = {"max_connections": 300}
    with h.postgres(settings) as cluster:
        ctx = Context(h.Scale(args.short), cluster, settings)
        for name in names:
            module = scenarios.load(name)
            print(f"== {name}: {module.TITLE}", flush=True)
            began = time.monotonic()
            try:
                results = module.run(ctx)
            except Exception as exc:  # one scenario's crash is its failure, not the run's end
                crash = h.Result(f"{name}: crashed", "the scenario crashed")
                crash.failures.append("".join(traceback.format_exception_only(exc)).strip())
                traceback.print_exc()
                results = [crash]
            took[name] = time.monotonic() - began
            done.append((module, results))
    seconds = time.monotonic() - start
    results = [r for _, rs in done for r in rs]
    failed = [r for r in results if not r.passed]
    print(f"== {len(results)} runs in {seconds / 60:.1f} min; {len(failed)} failed", flush=True)
    for r in failed:
        print(f"FAILED: {r.line()}", flush=True)
    if out is not None:
        command = "python -m reliability " + shlex.join(argv if argv is not None else sys.argv[1:])
        sections = _report.load(out) if args.update else {}
        for section in _report.sections_of(command.strip(), done, short=args.short, seconds=took):
            sections[section.name] = section
        _report.write(out, list(sections.values()), scenarios.ALL)
        print(f"report: {out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
