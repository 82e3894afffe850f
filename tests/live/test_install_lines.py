"""Every ``pip install`` line of README.md and docs/ installs, in a fresh venv, what it says.

The project is on no package index, so a line naming the distribution alone
(``pip install "Flask-Idempotency[client]"``) cannot work for anyone. Each line is found
in the text (a new line is covered without touching this file), run as a reader would in
a venv of its own, made with ``python -m venv``, and then the modules its extras promise
must import. The placeholders a reader fills in are filled in here, the same on every page:

``path/to/flask-idempotency``
    a copy of this checkout (its working tree: what would be committed);
``<version>``
    the version in the name of the wheel that ``python -m build --wheel`` made from it;
``https://<your git host>/flask-idempotency.git``
    that copy as a git repository, on a ``main`` branch, reached through ``file://``
    (``file://localhost/...``: the pip of Python 3.11 refuses a URL without a host).

A line is run from the copy's root, where ``.`` and ``requirements-dev.txt`` are what the
README means. Pip's cache is used, so a second run is fast. Deselect with ``-m "not install"``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.live import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.install]

DOCUMENTS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if "_build" not in p.parts),
]
#: ``pip install`` and its arguments: to the end of the line or of the code span, and
#: before a following ``&&`` (the README chains the install with what runs next).
PIP_INSTALL = re.compile(r"pip install (?P<args>[^`\n]+)")

CHECKOUT = "path/to/flask-idempotency"
VERSION = "<version>"
GIT_URL = "https://<your git host>/flask-idempotency.git"

#: Lines this file does not run, each with why.
NOT_RUN: dict[str, str] = {
    "-r requirements-dev.txt": (
        "the first half of the README's test command, which .ci/run runs exactly as written"
        " on a clean clone before every test run (test_readme.py checks it is the same"
        " line); a fresh venv of its hundred-odd packages takes three minutes here"
    ),
}

#: What each extra promises a user can import once it is installed. Every extra the
#: wheel declares must be here, so a new extra is checked as soon as a page names it.
EXTRA_IMPORTS: dict[str, tuple[str, ...]] = {
    "postgresql": ("psycopg2",),
    "psycopg": ("psycopg",),
    "mysql": ("pymysql",),
    "client": ("requests", "flask_idempotency.client"),
    "kombu": ("kombu", "flask_idempotency.publishers"),
    "otel": ("opentelemetry.metrics", "opentelemetry.trace", "opentelemetry.propagate"),
    "testing": ("pytest", "flask_idempotency.testing", "flask_idempotency_pytest"),
    "forms": ("flask_wtf", "flask_idempotency.forms"),
    "openapi": ("apispec", "flask_idempotency.openapi"),
    "bench": ("matplotlib", "opentelemetry.sdk", "opentelemetry.exporter.prometheus"),
    "crypto": ("cryptography.hazmat.primitives.ciphers.aead",),
}
#: The other distributions a line names, with the module each provides.
PACKAGE_IMPORTS = {
    "build": "build",
    "flask-wtf": "flask_wtf",
    "pytest": "pytest",
    "opentelemetry-sdk": "opentelemetry.sdk",
    "opentelemetry-exporter-prometheus": "opentelemetry.exporter.prometheus",
}
EXTRAS = re.compile(r"\[([\w,]+)\]")


@dataclass(frozen=True)
class Line:
    """One documented ``pip install``: its arguments, and where it is written."""

    args: str
    places: tuple[str, ...]

    def argv(self, checkout: Path, wheel_version: str) -> list[str]:
        text = (
            self.args.replace(GIT_URL, f"file://localhost{checkout}")
            .replace(CHECKOUT, str(checkout))
            .replace(VERSION, wheel_version)
        )
        return shlex.split(text)


def install_lines() -> list[Line]:
    """Every distinct ``pip install`` line of the documents, in the order first met."""
    found: dict[str, list[str]] = {}
    for path in DOCUMENTS:
        text = path.read_text(encoding="utf-8")
        for match in PIP_INSTALL.finditer(text):
            args = match["args"].split("&&")[0].strip()
            line = text.count("\n", 0, match.start()) + 1
            found.setdefault(args, []).append(f"{path.relative_to(ROOT)}:{line}")
    return [Line(args, tuple(places)) for args, places in found.items()]


def expected_imports(line: Line, checkout: Path) -> list[str]:
    """The modules the line promises: the package (when it installs it), what its
    extras add, and the other packages it names."""
    modules: list[str] = []
    words = shlex.split(line.args)
    if "-r" in words:
        # A requirements file: the package with the extras of its own ``-e .[...]``
        # line, and pytest (the file is the tests' requirements).
        requirements = (checkout / words[words.index("-r") + 1]).read_text(encoding="utf-8")
        spec = next(r for r in requirements.splitlines() if r.startswith("-e ."))
        words = [spec.split(maxsplit=1)[1], "pytest"]
    for word in words:
        if word.startswith(("-", "git+")) or word == "@":
            continue
        if word in PACKAGE_IMPORTS:
            modules.append(PACKAGE_IMPORTS[word])
            continue
        assert word.startswith((".", CHECKOUT)) or word.lower().startswith("flask-idempotency["), (
            f"{line.places}: add {word!r} to PACKAGE_IMPORTS"
        )
        modules.append("flask_idempotency")
        extras = EXTRAS.search(word)
        for extra in extras[1].split(",") if extras else ():
            modules += EXTRA_IMPORTS[extra]
    return modules


def copy_checkout(dest: Path) -> Path:
    """The checkout's working tree (tracked and new files, not ignored ones) at ``dest``."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, names.split("\0")):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def run(argv: list[str], cwd: Path, timeout: float = 600) -> str:
    done = subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        # This process's venv must not leak into the fresh one.
        env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")},
    )
    if done.returncode != 0:
        raise AssertionError(
            f"$ {shlex.join(argv)}\n--- stdout\n{done.stdout[-4000:]}\n"
            f"--- stderr\n{done.stderr[-4000:]}"
        )
    return done.stdout


def test_every_line_is_found_and_understood() -> None:
    """The lines this file runs: each names a source a user has, never the bare
    distribution, and each extra it names is one this file can check."""
    lines = install_lines()
    assert any("README.md" in p for line in lines for p in line.places)
    for line in lines:
        if line.args in NOT_RUN:
            continue
        words = shlex.split(line.args)
        for word, after in zip(words, [*words[1:], ""], strict=True):
            # A name with no ``@ <url>`` after it would be looked up on an index.
            bare = re.fullmatch(r"(?i)flask[-_]idempotency(\[[\w,]*\])?", word)
            assert bare is None or after == "@", f"{line.places}: {word!r} is on no index"
        expected_imports(line, ROOT)
        for extras in EXTRAS.findall(line.args):
            assert set(extras.split(",")) <= set(EXTRA_IMPORTS), line.places
    assert set(NOT_RUN) <= {line.args for line in lines}, "NOT_RUN names a line no page has"


def test_every_line_installs_what_it_promises(tmp_path: Path) -> None:
    started = time.monotonic()
    # The wheel, built once as docs/installation.md builds it, in the copy's dist/.
    built = copy_checkout(tmp_path / "built")
    run([sys.executable, "-m", "build", "--wheel", str(built)], tmp_path)
    [wheel] = (built / "dist").glob("*.whl")
    name, wheel_version = wheel.name.split("-")[:2]
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"{name}-{wheel_version}.dist-info/METADATA").decode()
    declared = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    assert declared == set(EXTRA_IMPORTS), "EXTRA_IMPORTS must list every extra the wheel has"
    # The git URL's repository: the copy, committed on main.
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    run([*git, "init", "-q", "-b", "main"], built)
    run([*git, "add", "-A"], built)
    run([*git, "commit", "-q", "-m", "checkout"], built)

    lines = [line for line in install_lines() if line.args not in NOT_RUN]

    def install(index: int, line: Line) -> tuple[Line, str | None, float]:
        begun = time.monotonic()
        # Each line in a checkout of its own: an install from a source tree builds in it.
        checkout = copy_checkout(tmp_path / f"checkout-{index}")
        (checkout / "dist").mkdir()
        shutil.copy2(wheel, checkout / "dist" / wheel.name)
        if GIT_URL in line.args:
            checkout = built
        venv = tmp_path / f"venv-{index}"
        python = str(venv / "bin" / "python")
        try:
            # No pip of its own: this one installs into it (``--python``), which saves
            # seconds a line; what is installed is the same.
            run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
            pip = [sys.executable, "-m", "pip", "--python", python, "install"]
            run([*pip, *line.argv(checkout, wheel_version)], checkout)
            modules = expected_imports(line, checkout)
            script = (
                "import importlib, sys\n"
                f"for name in {modules!r}:\n"
                "    importlib.import_module(name)\n"
                "print(getattr(sys.modules.get('flask_idempotency'), '__file__', ''))\n"
            )
            # From elsewhere than the checkout, so the installed package is the one imported.
            where = Path(run([python, "-c", script], tmp_path).strip())
            editable = "-e" in shlex.split(line.args) or "-r" in shlex.split(line.args)
            if "flask_idempotency" in modules and not editable:
                assert where.is_relative_to(venv), f"imported {where}, not the installed one"
        except AssertionError as error:
            return line, str(error), time.monotonic() - begun
        return line, None, time.monotonic() - begun

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(install, range(len(lines)), lines))

    report = [
        f"{seconds:5.1f}s {'FAILED' if error else 'ok    '} pip install {line.args}"
        f"  ({', '.join(line.places)})"
        for line, error, seconds in results
    ]
    print("\n".join(report), f"\ntotal {time.monotonic() - started:.1f}s")
    failures = [f"{line.places}: {error}" for line, error, _ in results if error]
    assert not failures, "\n\n".join(failures)
