"""Every code block in README.md and in the documentation (docs/) runs as shown.

Python blocks run in order, in one namespace, as a reader following along would, on
each engine: the README's blocks (its Quickstart) in one sequence, the documentation's
pages in the order of their table of contents in another (the Quickstart's ``shop.py``
first, then the pages that continue it). Both run without a warning of the extension's
own. Shell blocks run through ``bash`` with this environment's ``bin`` on the PATH,
against the Quickstart saved as ``shop.py`` or the example app in a live server; the
few substitutions a reader would make (a path, a port) are made here too. JSON blocks
parse. Blocks that quote the example app are its code, character for character.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.live import ROOT, LiveServer

README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: A fenced block: its info string (a language, or a MyST directive such as
#: ``{toctree}``) and its body.
BLOCK = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
TOCTREE = re.compile(r"^```\{toctree\}[^\n]*\n(.*?)^```", re.S | re.M)
BIN = str(Path(sys.executable).parent)


def toctree_pages(index: Path = DOCS / "index.md") -> list[Path]:
    """The documentation's pages in the order of its tables of contents, depth first."""
    pages = [index]
    for tree in TOCTREE.findall(index.read_text(encoding="utf-8")):
        entries = [ln.strip() for ln in tree.splitlines() if ln.strip()]
        glob = ":glob:" in entries
        for entry in entries:
            if entry.startswith(":"):
                continue
            if glob and "*" in entry:
                found = sorted(index.parent.glob(entry + ".md"))
                pages += [page for page in found if page != index]
            else:
                pages += toctree_pages(index.parent / f"{entry}.md")
    return pages


PAGES = toctree_pages()
DOCUMENTS = [README, *PAGES]


def where(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(
    language: str | None = None, documents: t.Sequence[Path] = DOCUMENTS
) -> list[tuple[str, int, str, str]]:
    """(where, line, language, code) of every fenced block of ``documents``, in order.
    MyST directives (``{toctree}``, ``{eval-rst}``, ...) are not code, and are left out."""
    found = []
    for path in documents:
        text = path.read_text(encoding="utf-8")
        for match in BLOCK.finditer(text):
            lang = match.group(1)
            if lang.startswith("{"):
                continue
            line = text.count("\n", 0, match.start()) + 1
            if language is None or lang == language:
                found.append((where(path), line, lang, match.group(2)))
    return found


EXCERPT = re.compile(r"\A# (example_app/\w+\.py)\n")


def excerpt_of(code: str) -> str | None:
    """The example file a block quotes (its first line names it), or ``None``."""
    match = EXCERPT.match(code)
    return match.group(1) if match else None


def block_with(language: str, needle: str) -> str:
    """The one block holding ``needle`` (the README and a page may show the same block)."""
    matches = {code for _, _, lang, code in blocks(language) if needle in code}
    assert len(matches) == 1, f"expected one {language} block with {needle!r}, got {matches}"
    return matches.pop()


def sh(script: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    """Run a README shell block with ``bash -e``: every line must succeed."""
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=cwd,
        env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done.stdout


def quickstart(tmp_path: Path) -> Path:
    """The Quickstart saved as shop.py, as it says to."""
    (tmp_path / "shop.py").write_text(blocks("python", [DOCS / "quickstart.md"])[0][3])
    return tmp_path


def test_every_block_is_python_sh_or_json() -> None:
    # Each other language has its check: promql and yaml (the monitoring page's
    # dashboard and scrape configuration) in tests/unit/test_monitoring.py, sql
    # (tracing's ALTER for an older outbox) in tests/unit/test_tracing.py; text
    # is a drawing (a trace's spans), no code.
    # html+jinja (the forms page's templates) is parsed by Jinja below.
    assert {lang for _, _, lang, _ in blocks()} <= {
        "python",
        "sh",
        "json",
        "html+jinja",
        "promql",
        "yaml",
        "sql",
        "text",
    }
    assert len(blocks("python", [README])) >= 2
    assert len(blocks("python", PAGES)) >= 10


def test_every_page_is_in_the_table_of_contents() -> None:
    """So the pages' blocks all run below, in an order a reader meets them."""
    pages = {p for p in DOCS.rglob("*.md") if "_build" not in p.parts}
    assert pages == set(PAGES)
    assert len(PAGES) == len(set(PAGES))


def test_the_readme_quickstart_is_the_documentation_quickstart() -> None:
    readme = [code for _, _, _, code in blocks("python", [README])]
    docs = [code for _, _, _, code in blocks("python", [DOCS / "quickstart.md"])]
    assert readme[:2] == docs[:2]


SEQUENCES = {"readme": [README], "docs": PAGES}


def run_blocks(documents: t.Sequence[Path]) -> dict[str, t.Any]:
    """Run the Python blocks of ``documents`` in order in one namespace (as ``shop``)."""
    namespace: dict[str, t.Any] = {"__name__": "shop"}
    apps: list[t.Any] = []  # every app a block made: a later block may replace `app`
    try:
        for name, line, _, code in blocks("python", documents):
            if excerpt_of(code):
                continue  # quotes the example app; checked below, not run here
            exec(compile(code, f"{name}:{line}", "exec"), namespace)
            for value in list(namespace.values()):
                if type(value).__name__ == "Flask" and all(value is not a for a in apps):
                    apps.append(value)
    finally:
        # Each app's pooled connections closed, not left to the garbage collector
        # (psycopg 3 warns about an unclosed connection in whichever test it runs).
        for made in apps:
            with made.app_context():  # each app's own SQLAlchemy (docs/forms.md has two)
                made.extensions["sqlalchemy"].engine.dispose()
    return namespace


@pytest.mark.parametrize("sequence", sorted(SEQUENCES))
def test_python_blocks_run_in_order(
    sequence: str,
    fresh_database: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.chdir(tmp_path)
    if not fresh_database.startswith("sqlite"):
        monkeypatch.setenv("DATABASE_URL", fresh_database)
    caplog.set_level(logging.WARNING, logger="flask_idempotency")
    run_blocks(SEQUENCES[sequence])
    # The Quickstart's default database landed where it says.
    if fresh_database.startswith("sqlite"):
        assert (tmp_path / "instance" / "shop.db").exists()
    # The examples do what they recommend: no warning of the extension's own (such as
    # the one for callers that share one scope).
    assert [r.getMessage() for r in caplog.records if r.name.startswith("flask_idempotency")] == []


def test_the_quickstart_runs_again_and_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Run twice in a row on the same database file, as a reader would: the same
    answers (a fresh database each run), and nothing logged by the extension."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.DEBUG, logger="flask_idempotency")
    answers = []
    for _ in range(2):
        namespace = run_blocks([README])
        answers.append(namespace["first"].get_json())
    assert answers == [{"charge_id": 1}, {"charge_id": 1}]
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_excerpts_of_the_example_are_its_code() -> None:
    """The chain's code in the documentation is the example's, character for character,
    so what it shows is what the demo and tests/live/test_chain_live.py run."""
    quoted = [(name, line, code) for name, line, _, code in blocks("python") if excerpt_of(code)]
    assert len(quoted) >= 5
    for name, line, code in quoted:
        path = excerpt_of(code)
        assert path is not None
        body = code.split("\n", 1)[1]
        assert body.strip(), f"{name}:{line} quotes nothing"
        assert body in (ROOT / path).read_text() or _dedented_in(body, ROOT / path), (
            f"{name}:{line} is not {path}'s code"
        )


def _dedented_in(body: str, path: Path) -> bool:
    """``body`` appears in ``path`` at some indentation (a nested function)."""
    source = path.read_text()
    for indent in ("    ", "        "):
        indented = "\n".join(indent + ln if ln else ln for ln in body.split("\n"))
        if indented in source:
            return True
    return False


def test_json_blocks_parse() -> None:
    for _, _, _, code in blocks("json"):
        assert isinstance(json.loads(code), dict)


def test_the_test_command_is_what_ci_runs() -> None:
    [command] = [code.strip() for _, _, _, code in blocks("sh", [README]) if "pytest" in code]
    assert command in (ROOT / ".ci" / "run").read_text()


def test_the_example_command_runs(tmp_path: Path) -> None:
    [command] = [
        code.strip() for _, _, _, code in blocks("sh", [README]) if "example_app demo" in code
    ]
    run = command.split(" && ")[-1].replace(".venv/bin/python", sys.executable)
    out = sh(run, ROOT, {"EXAMPLE_BROKER_URL": "filesystem://"})
    assert "response lost, client retried   -> 201 replayed=true" in out
    assert "shipping skipped 1 duplicate(s)" in out
    assert "orders 2, charges 2, events 2, shipments 2" in out
    assert out.rstrip().endswith("OK")


def test_install_command_installs_this_package() -> None:
    command = block_with("sh", "path/to/flask-idempotency").strip()
    command = command.replace("path/to/flask-idempotency", str(ROOT)).replace(
        "pip install", f"{sys.executable} -m pip install --dry-run --no-deps"
    )
    assert "Would install Flask-Idempotency" in sh(command, ROOT, timeout=300)


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_block_against_the_example(tmp_path: Path) -> None:
    server = LiveServer("example", f"sqlite:///{tmp_path / 'example.sqlite3'}").start()
    try:
        script = block_with("sh", "curl").replace("127.0.0.1:5000", f"127.0.0.1:{server.port}")
        lines = script.strip().splitlines()
        post, ledger = "\n".join(lines[:-1]), lines[-1]
        first = sh(post, tmp_path)
        again = sh(post, tmp_path)
        assert first.startswith("HTTP/1.1 201")
        assert "Idempotent-Replayed: true" in again
        assert first.split("\n\n", 1)[1] == again.split("\n\n", 1)[1]
        assert json.loads(sh(ledger, tmp_path))["count"] == 1
    finally:
        server.stop()


def test_cli_block_against_the_quickstart(tmp_path: Path) -> None:
    shop = quickstart(tmp_path)
    make = (
        "from shop import app\n"
        "c = app.test_client()\n"
        "body = {'amount': 100, 'currency': 'EUR'}\n"
        "for user in ('alice', 'bob'):\n"
        "    r = c.post('/payments', json=body,"
        " headers={'Idempotency-Key': 'order-42', 'X-User': user})\n"
        "    assert r.status_code == 201, r.get_data()\n"
    )
    sh(f'{sys.executable} -c "{make}"', shop, {"PYTHONPATH": str(shop)})
    out = sh(block_with("sh", "idempotency show"), shop, {"PYTHONPATH": str(shop)})
    assert '"scope": "user:alice"' in out
    # The newest of the key's scopes (bob's) was found; completed, it is refused.
    assert "release: exit 1" in out
    remaining = sh("flask --app shop idempotency list --key order-42", shop)
    assert [r["scope"] for r in json.loads(remaining)] == ["user:bob", "user:alice"]


def test_exit_code_block_against_the_quickstart(tmp_path: Path) -> None:
    """purge -q says nothing when all is well; relay --once without a publisher
    exits 78 (misconfigured) with one line, which the block shows."""
    shop = quickstart(tmp_path)
    script = block_with("sh", "relay --once ||")
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=shop,
        env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(shop)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "relay: exit 78\n"
    [error] = done.stderr.splitlines()
    assert error.startswith("Error: no outbox publisher"), error


def test_migration_block(tmp_path: Path) -> None:
    shop = quickstart(tmp_path)
    source = (shop / "shop.py").read_text()
    # As the page says: add Migrate, leave db.create_all() out.
    source = source.replace(
        "    with app.app_context():\n        db.create_all()  # or your migrations\n", ""
    )
    assert "create_all" not in source
    source += "\nfrom flask_migrate import Migrate\n\nmigrate = Migrate(app, db)\n"
    (shop / "shop.py").write_text(source)
    sh(block_with("sh", "db upgrade"), shop, {"PYTHONPATH": str(shop)})
    engine = sa.create_engine(f"sqlite:///{shop / 'instance' / 'shop.db'}")
    try:
        assert {"charge", "idempotency_keys", "idempotency_job_locks"} <= set(
            sa.inspect(engine).get_table_names()
        )
    finally:
        engine.dispose()
    assert "No new upgrade operations detected" in sh(
        "flask --app shop db check 2>&1", shop, {"PYTHONPATH": str(shop)}
    )


def test_jobs_block_starts_the_web_app_and_the_scheduler(tmp_path: Path) -> None:
    shop = quickstart(tmp_path)
    web, jobs = (
        line.split("#")[0].strip()
        for line in block_with("sh", "idempotency scheduler").splitlines()
    )
    sh(web.replace("gunicorn", "gunicorn --check-config", 1), shop, {"PYTHONPATH": str(shop)})
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(shop)}
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {jobs}"], cwd=shop, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert "idempotency scheduler running" in proc.stdout.readline()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def test_each_template_block_parses() -> None:
    import jinja2

    templates = blocks("html+jinja")
    assert templates  # README and docs/forms.md show the form helper
    for name, line, _, code in templates:
        try:
            jinja2.Environment().parse(code)
        except jinja2.TemplateSyntaxError as exc:  # pragma: no cover - the failure's message
            pytest.fail(f"{name}:{line}: {exc}")
