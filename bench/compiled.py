"""What a compiled fingerprint and canonical JSON would save:
``python -m bench.compiled [--quick] [--rounds N]``.

Issue 29 asks, where the request path cannot reach its hand-written floor in
Python, what an optional compiled fast path would take, measured. This builds
the two modules of the request path that do pure computation on the request,
``flask_idempotency/_request/canonical.py`` (canonical JSON) and
``fingerprint.py`` (what a schema loaded, as sent; the SHA-256 of method, path,
query, media type and body), with mypyc (part of mypy, in requirements-dev; a C
compiler is needed) in a copy of the package, and times what one keyed request
does with them, in two processes per round: the package as it is, and the copy
with the compiled modules. Each process reports the fastest of its blocks (on a
busy machine the least disturbed one) in microseconds per request; a figure is
the median over the rounds, and the saving is the interpreted figure minus the
compiled one of the same round (median). Nothing else of a request is timed: the
rest of its CPU (Flask, SQLAlchemy, the driver, gunicorn) would not change.

Two bodies: the benchmark app's (``bench.load.BODY``, no schema: what
``bench.run`` sends) and an order of 20 lines through a marshmallow schema.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

from bench import harness
from bench.load import BODY
from bench.servers import ROOT

NAME = "bench.compiled"
MODULES = ("flask_idempotency/_request/canonical.py", "flask_idempotency/_request/fingerprint.py")
OPTIONS = ["--ignore-missing-imports"]
#: What the request path does with the two modules, per body.
CASES = ("bench body", "schema order")


def _order() -> dict[str, t.Any]:
    lines = [{"sku": f"SKU-{i:04d}", "quantity": i % 5 + 1, "price": "19.99"} for i in range(20)]
    return {"customer": "c-1234", "currency": "EUR", "lines": lines, "note": "leave at door"}


def _work() -> dict[str, t.Callable[[], t.Any]]:
    """Per case, one request's use of the two modules, as the request path calls them."""
    from marshmallow import Schema, fields

    from flask_idempotency._request import fingerprint as fp
    from flask_idempotency._request.canonical import canonical_json

    class Line(Schema):
        sku = fields.String(required=True)
        quantity = fields.Integer(required=True)
        price = fields.Decimal(required=True, as_string=True)

    class Order(Schema):
        customer = fields.String(required=True)
        currency = fields.String(required=True)
        lines = fields.List(fields.Nested(Line), required=True)
        note = fields.String()

    schema = Order()
    body = json.loads(BODY)
    raw = _order()
    loaded = schema.load(raw)

    def bench_body() -> str:
        normalized = canonical_json(body)
        return fp.compute("POST", "/ext", (), normalized, "application/json")

    def schema_order() -> str:
        # What the schema loaded, limited to what was sent, as canonical JSON.
        normalized = canonical_json(fp.sent_only(schema, raw, loaded, ()))
        return fp.compute("POST", "/ext", (), normalized, "application/json")

    return {"bench body": bench_body, "schema order": schema_order}


def worker(blocks: int, calls: int) -> None:
    """In a process of its own: the fastest block of ``calls`` per case (µs per call)."""
    import flask_idempotency._request.canonical as canonical

    work = _work()
    figures: dict[str, float] = {}
    for case, run in work.items():
        best = float("inf")
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        figures[case] = best
    compiled = not (canonical.__file__ or "").endswith(".py")
    print(json.dumps({"compiled": compiled, "figures": figures}))


def build(where: Path) -> str:
    """A copy of the package in ``where`` with :data:`MODULES` built by mypyc;
    the build's output, for the error."""
    shutil.copytree(ROOT / "flask_idempotency", where / "flask_idempotency")
    for module in MODULES:
        # mypyc compiles no subclass of a built-in exception as a native class:
        # such classes stay Python classes (what they are now), in the copy only.
        source = where / module
        text = re.sub(
            r"^class (\w+)\((TypeError|ValueError|Exception)\):",
            r"@mypy_extensions.mypyc_attr(native_class=False)\nclass \1(\2):",
            source.read_text(),
            flags=re.M,
        )
        source.write_text(text.replace("\nimport ", "\nimport mypy_extensions\nimport ", 1))
    script = (
        "from setuptools import setup\n"
        "from mypyc.build import mypycify\n"
        # Untyped libraries (apscheduler) are Any to mypyc, as to our mypy run.
        f"setup(name='compiled', ext_modules=mypycify({OPTIONS + list(MODULES)!r},"
        " opt_level='3'),"
        " script_args=['build_ext', '--inplace'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=where, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"mypyc could not build {MODULES}:\n{done.stdout[-3000:]}{done.stderr}")
    for module in MODULES:
        # The sources go, so the extension modules are what imports.
        (where / module).unlink()
    return done.stdout


def _run_worker(path: Path, blocks: int, calls: int) -> dict[str, t.Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(ROOT)]))
    done = subprocess.run(
        [sys.executable, "-m", NAME, "--worker", "--blocks", str(blocks), "--calls", str(calls)],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return t.cast("dict[str, t.Any]", json.loads(done.stdout.strip().splitlines()[-1]))


def measure(args: argparse.Namespace) -> dict[str, t.Any]:
    with tempfile.TemporaryDirectory(prefix="bench-compiled-") as tmp:
        copy = Path(tmp)
        harness.say("building the two modules with mypyc ...")
        build(copy)
        rounds: list[dict[str, dict[str, float]]] = []
        for number in range(args.rounds):
            figures: dict[str, dict[str, float]] = {}
            for label, path in (("interpreted", ROOT), ("compiled", copy)):
                result = _run_worker(path, args.blocks, args.calls)
                if result["compiled"] != (label == "compiled"):
                    raise SystemExit(f"the {label} process imported the other build")
                figures[label] = result["figures"]
            rounds.append(figures)
            harness.say(
                f"round {number + 1}/{args.rounds} "
                + "  ".join(
                    f"{case}: {figures['interpreted'][case]:.2f} -> "
                    f"{figures['compiled'][case]:.2f} µs"
                    for case in CASES
                )
            )
    return {"rounds": rounds}


def section(results: dict[str, t.Any], facts: harness.Facts, args: argparse.Namespace) -> list[str]:
    rounds = results["rounds"]

    def median(label: str, case: str) -> float:
        return float(statistics.median(r[label][case] for r in rounds))

    lines = [
        "## A compiled fingerprint and canonical JSON (`python -m bench.compiled`)",
        "",
        *facts.lines(),
        f"* {args.rounds} rounds; per round and build a process of its own, the fastest of "
        f"{args.blocks} blocks of {args.calls} requests' work",
        "",
        "`canonical.py` and `fingerprint.py` built by mypyc (opt level 3) against the same "
        "modules interpreted; what one keyed request does with them (canonical JSON of the "
        "body, with a schema what it loaded as sent, then the fingerprint's SHA-256), in "
        "µs per request:",
        "",
        "| body | interpreted | compiled | saved | saved share |",
        "|---|---:|---:|---:|---:|",
    ]
    for case in CASES:
        before, after = median("interpreted", case), median("compiled", case)
        saved = statistics.median(r["interpreted"][case] - r["compiled"][case] for r in rounds)
        lines.append(
            f"| {case} | {before:.2f} | {after:.2f} | {saved:.2f} | {saved / before:.0%} |"
        )
    lines += [
        "",
        "Most of this work already runs in C (json's encoder, hashlib), so compiling the "
        "Python around it saves little next to the server CPU per request in "
        '`bench.run`\'s tables (milliseconds): see "What bounds the request path".',
        harness.data_comment(NAME, results),
    ]
    return lines


def main(argv: t.Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {NAME}", description=__doc__.split("\n\n")[0])
    harness.common_options(parser)
    parser.add_argument("--rounds", type=int, help="rounds (default 5; quick 1)")
    parser.add_argument("--blocks", type=int, help="blocks per process (default 20; quick 2)")
    parser.add_argument("--calls", type=int, help="requests per block (default 2,000; quick 100)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for option, quick, full in (("rounds", 1, 5), ("blocks", 2, 20), ("calls", 100, 2000)):
        setattr(args, option, getattr(args, option) or (quick if args.quick else full))
    if args.worker:
        worker(args.blocks, args.calls)
        return 0
    harness.exit_on_sigterm()
    facts = harness.Facts(
        command=" ".join([f"python -m {NAME}", *argv]),
        postgresql="",
        load_start=harness.load_average(),
    )
    results = measure(args)
    facts.end()
    text = harness.write_section(args.out, NAME, section(results, facts, args))
    print(text)
    harness.say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
