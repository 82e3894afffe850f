"""Issue 17's benchmarks, all of them: ``python -m bench.run_more [--quick] ...``.

Runs, one after the other, each on a PostgreSQL of its own:
``bench.duplicates``, ``bench.conflict``, ``bench.cleanup``, ``bench.scale``
and ``bench.retention`` (each also runs alone: ``python -m bench.NAME``), each
writing its section of ``BENCHMARKS.md``; then draws
``bench/results-issue17.png`` (``bench.plot_more``) and writes the section that
introduces them and links the plot. Full sizes take about 25 minutes and about
4 GB of disk for a while (the 10,000,000 records of ``bench.scale``, dropped
after); ``--quick`` checks the harness in a couple of minutes.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import typing as t
from pathlib import Path

from bench import harness, plot_more

NAME = "bench.more"
MODULES = ["duplicates", "conflict", "cleanup", "scale", "retention"]


def intro(out: Path, plot: Path, quick: bool) -> list[str]:
    link = os.path.relpath(plot, out.resolve().parent)
    return [
        "## Duplicates, conflicts, cleanup, size and retention (`python -m bench.run_more`)",
        "",
        "The benchmarks of issue 17, each in a section of its own below, each on a private",
        "PostgreSQL cluster and each comparing against a baseline measured in the same run",
        f"(`python -m bench.run_more{' --quick' if quick else ''}` runs them all; "
        "`python -m bench.NAME` one; `bench/README.md` lists their options).",
        "",
        f"![losers' wait, the conflict path, writers' p99 with and without cleanup, claim "
        f"latency against table size]({link})",
    ]


def main(argv: t.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.run_more", description=__doc__.split("\n\n")[0]
    )
    harness.common_options(parser)
    parser.add_argument("--plot", type=Path, default=plot_more.DEFAULT_PLOT)
    parser.add_argument(
        "--only", default=",".join(MODULES), help=f"comma-separated, of {','.join(MODULES)}"
    )
    args = parser.parse_args(argv)
    chosen = [name for name in args.only.split(",") if name]
    unknown = set(chosen) - set(MODULES)
    if unknown:
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    harness.write_section(args.out, NAME, intro(args.out, args.plot, args.quick))
    common = ["--out", str(args.out), *(["--quick"] if args.quick else [])]
    for name in chosen:
        harness.say(f"== bench.{name}")
        module = importlib.import_module(f"bench.{name}")
        if module.main(common) != 0:
            return 1
    return plot_more.main(["--out", str(args.out), "--plot", str(args.plot)])


if __name__ == "__main__":
    sys.exit(main())
