"""The plot of issue 17's benchmarks: ``python -m bench.plot_more [--out FILE] [--plot PNG]``.

Reads the figures each section of ``BENCHMARKS.md`` carries (``bench.duplicates``,
``bench.conflict``, ``bench.cleanup``, ``bench.scale``, ``bench.retention``) and
draws them in one figure, ``bench/results-issue17.png``; a section missing
leaves its panel empty, with a note. Needs matplotlib (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import sys
import typing as t
from pathlib import Path

from bench import harness

DEFAULT_PLOT = harness.ROOT / "bench" / "results-issue17.png"


def plot(data: dict[str, dict[str, t.Any]], path: Path) -> str | None:
    """Draw ``data`` (:func:`bench.harness.read_data`) to ``path``; why not, or ``None``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e .[bench]): no plot"
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    (dup, conflict), (cleanup, scale) = axes

    def missing(ax: t.Any, name: str) -> None:
        ax.text(0.5, 0.5, f"no {name} section", ha="center", va="center", transform=ax.transAxes)

    if "bench.duplicates" in data:
        variants = data["bench.duplicates"]
        names = list(variants)
        dup.boxplot([variants[n]["ratios"] for n in names], showfliers=True)
        dup.set_xticks(range(1, len(names) + 1), names)
        dup.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        dup.set_ylabel("loser's time / winner's time")
        dup.set_title("Concurrent duplicates of one key: losers' wait")
    else:
        missing(dup, "bench.duplicates")

    if "bench.conflict" in data:
        variants = data["bench.conflict"]
        names = list(variants)
        xs = range(len(names))
        conflict.bar(
            [x - 0.2 for x in xs], [variants[n]["p50"] for n in names], 0.4, label="p50 ms"
        )
        conflict.bar(
            [x + 0.2 for x in xs], [variants[n]["p99"] for n in names], 0.4, label="p99 ms"
        )
        conflict.set_xticks(list(xs), names)
        conflict.set_ylabel("ms per duplicate")
        for x, n in zip(xs, names, strict=True):
            conflict.annotate(
                f"{variants[n]['dead']:,.0f} dead\nper 10k",
                (x, variants[n]["p99"]),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        conflict.set_ylim(top=max(variants[n]["p99"] for n in names) * 1.25)
        conflict.legend()
        conflict.set_title("The conflict path: latency, dead tuples")
    else:
        missing(conflict, "bench.conflict")

    # Writers' p99 during cleanup over their p99 without it, per round (the figure
    # the target judges; a median of each side would pair different rounds).
    kinds: list[tuple[str, list[float]]] = []
    for batch, figures in data.get("bench.cleanup", {}).items():
        kinds.append((f"purge, batch {batch}", figures.get("ratios", [figures["p99_ratio"]])))
    retention = data.get("bench.retention")
    if retention:
        kinds.append(("retention: purge", retention["deletes_ratios"]))
        kinds.append(("retention: drop partition", retention["drop_ratios"]))
    if kinds:
        for x, (_, ratios) in enumerate(kinds):
            ratios = [r for r in ratios if r is not None]
            if not ratios:  # no writer's operation overlapped a cleanup that short
                continue
            cleanup.scatter([x] * len(ratios), ratios, color="tab:blue", zorder=3)
            middle = sorted(ratios)[len(ratios) // 2]
            cleanup.hlines(middle, x - 0.25, x + 0.25, color="tab:orange", linewidth=2, zorder=2)
        cleanup.axhline(1.5, color="tab:red", linewidth=0.8, linestyle="--", label="target 1.5x")
        cleanup.axhline(1.0, color="grey", linewidth=0.8)
        cleanup.set_yscale("log")
        cleanup.set_xticks(range(len(kinds)), [k[0] for k in kinds], rotation=15, fontsize=8)
        cleanup.set_ylabel("writers' p99 during / without (per round; bar: median)")
        cleanup.legend()
        cleanup.set_title("Writers' p99 during cleanup against without it")
    else:
        missing(cleanup, "bench.cleanup")

    if "bench.scale" in data:
        s = data["bench.scale"]
        labels = [f"{s['small']:,} records", f"{s['large']:,} records"]
        xs = range(2)
        for offset, part, label in ((-0.3, "claim", "claim"), (0.1, "whole", "claim + commit")):
            for q, hatch in (("p50", ""), ("p99", "//")):
                values = [s[f"small_{part}_{q}"], s[f"large_{part}_{q}"]]
                scale.bar(
                    [x + offset + (0.2 if q == "p99" else 0) for x in xs],
                    values,
                    0.2,
                    hatch=hatch,
                    label=f"{label} {q}",
                )
        scale.set_xticks(list(xs), labels)
        scale.set_ylabel("ms")
        scale.legend(fontsize=8)
        scale.set_title("Claim latency against table size")
    else:
        missing(scale, "bench.scale")

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def main(argv: t.Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.plot_more", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=harness.DEFAULT_OUT, help="the file to read")
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT)
    args = parser.parse_args(argv)
    why_not = plot(harness.read_data(args.out.read_text()), args.plot)
    harness.say(f"note: {why_not}" if why_not else f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
