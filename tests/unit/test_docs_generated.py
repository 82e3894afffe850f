"""The reference pages' Markdown is what the package gives now.

docs/configuration.md, cli.md, api.md, the problem types' pages and the testing kit's
reference are read on GitHub as Markdown, where Sphinx's directives show nothing: their
generated sections carry the rendering of those directives (docs/_ext/generate.py).
This fails when a setting, a command, a docstring or a problem type changed and the
pages were not regenerated, and says how to regenerate them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.live import ROOT

COMMAND = "python -m docs._ext.generate"


def test_generated_sections_are_current() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "docs._ext.generate", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"the generated documentation is stale; run `{COMMAND}` from the repository root"
        f" and commit the pages it rewrites:\n{done.stdout}{done.stderr}"
    )


def test_reference_pages_carry_their_content_as_markdown() -> None:
    """What GitHub shows of them: no page is only directives."""
    from flask_idempotency import config

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for setting in config.SETTINGS:
        assert f"### `{setting.key}`" in text
    cli = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert "Usage: flask idempotency release [OPTIONS] SCOPE KEY" in cli
    api = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert '<a id="flask_idempotency.Idempotency.idempotent"></a>' in api


def test_links_to_api_objects_reach_an_anchor() -> None:
    """A Markdown link to an object (``api.md#flask_idempotency.errors.KeyReusedError``)
    lands on GitHub only where a generated section wrote that anchor; Sphinx would not
    say (its unresolved Python references are no warnings here)."""
    import os
    import re

    docs = ROOT / "docs"
    pages = [p for p in docs.rglob("*.md") if "_build" not in p.parts]
    anchors = {p: set(re.findall(r'<a id="([^"]+)"></a>', p.read_text("utf-8"))) for p in pages}
    link = re.compile(
        r"\]\((?P<page>[\w./-]*\.md)?#(?P<anchor>(?:module-)?flask_idempotency[\w.]*)\)"
    )
    broken = []
    for page in pages:
        for match in link.finditer(page.read_text(encoding="utf-8")):
            target = page
            if match["page"]:
                target = Path(os.path.normpath(page.parent / match["page"]))
            if match["anchor"] not in anchors.get(target, set()):
                broken.append(f"{page.relative_to(ROOT)}: {match[0]}")
    assert not broken, "\n".join(broken)


def test_prose_has_no_sphinx_roles() -> None:
    """GitHub shows a role (``{class}`~flask_idempotency.errors.ProblemError` ``) as
    is: prose links to an object's anchor instead, which Sphinx reads as a reference."""
    import re

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    from idempotency_docs import GENERATED

    role = re.compile(r"(?<!`)\{[a-z]+(?::[a-z]+)?\}`")
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if "_build" in page.parts:
            continue
        text = GENERATED.sub("", page.read_text(encoding="utf-8"))
        text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        found += [f"{page.relative_to(ROOT)}: {m[0]}" for m in role.finditer(text)]
    assert not found, "\n".join(found)
