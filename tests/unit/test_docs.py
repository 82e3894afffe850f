"""The documentation's references are complete: every setting and every problem type.

The configuration reference is rendered from ``flask_idempotency.config.SETTINGS`` and
each problem type has a page ``docs/problems/<slug>.md``; these tests build the site
(as CI does, warnings as errors) and check both against the package.
"""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flask_idempotency import config, errors
from tests.support.live import ROOT

DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "_ext"))
import idempotency_docs  # noqa: E402


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HTML site, built with warnings as errors."""
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", DOCS, out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_every_setting_is_declared_once_with_its_meaning() -> None:
    names = [setting.name for setting in config.SETTINGS]
    assert len(names) == len(set(names))
    assert list(config.DEFAULTS) == names
    for setting in config.SETTINGS:
        assert setting.key == config.PREFIX + setting.name
        assert setting.doc.strip().endswith("."), setting.key
        assert len(setting.doc.split()) >= 5, f"{setting.key} needs its meaning"


def test_the_configuration_reference_lists_every_key(site: Path) -> None:
    page = (site / "configuration.html").read_text(encoding="utf-8")
    listed = set(re.findall(r'id="confval-(IDEMPOTENCY_[A-Z_]+)"', page))
    assert listed == {config.PREFIX + name for name in config.DEFAULTS}
    for setting in config.SETTINGS:
        # The default shown is the default declared.
        shown = idempotency_docs.default_text(setting.default).strip("`")
        assert html.escape(shown, quote=False) in page, setting.key


def test_default_text() -> None:
    from datetime import timedelta

    assert idempotency_docs.default_text(timedelta(hours=24)) == "24 hours"
    assert idempotency_docs.default_text(timedelta(seconds=1)) == "1 second"
    assert idempotency_docs.default_text(timedelta(days=7)) == "7 days"
    assert idempotency_docs.default_text(None) == "`None`"
    assert idempotency_docs.default_text("Idempotency-Key") == "`'Idempotency-Key'`"


def _subclasses(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub, *_subclasses(sub)}
    return found


def test_every_problem_type_has_a_page_and_every_page_a_problem_type() -> None:
    slugs = {cls.slug for cls in _subclasses(errors.ProblemError)}
    # The one answered without an exception class (a replay whose body was not kept).
    assert "response-not-stored" not in slugs
    slugs.add("response-not-stored")
    assert set(idempotency_docs.problem_slugs()) == slugs
    pages = {p.stem for p in (DOCS / "problems").glob("*.md")} - {"index"}
    assert pages == slugs


@pytest.mark.parametrize("slug", idempotency_docs.problem_slugs())
def test_each_problem_page_names_its_type(site: Path, slug: str) -> None:
    source = (DOCS / "problems" / f"{slug}.md").read_text(encoding="utf-8")
    assert source.startswith(f"# {slug}\n")
    for section in ("## When it is answered", "## The body", "## What a client should do"):
        assert section in source, f"{slug}: {section}"
    page = (site / "problems" / f"{slug}.html").read_text(encoding="utf-8")
    assert errors.PROBLEM_TYPE_BASE + slug in page
    index = (site / "problems" / "index.html").read_text(encoding="utf-8")
    assert f'href="{slug}.html"' in index


def test_the_api_reference_documents_every_public_name(site: Path) -> None:
    """Each name a public module exports (its ``__all__``) has an entry in the API
    reference, under that module or the root, and the reference documents no name
    of a private module but as an alias of its public entry."""
    import importlib

    from sphinx.util.inventory import InventoryFile

    with (site / "objects.inv").open("rb") as stream:
        inventory = InventoryFile.load(stream, "", lambda base, uri: uri)
    documented = {name for entries in inventory.values() for name in entries}
    # A re-exported class is also listed under its defining module (autodoc's
    # canonical name, so that references by that path resolve), pointing at the
    # public entry; no private name has an entry of its own.
    private = {
        name: entries[name].uri
        for entries in inventory.values()
        for name in entries
        if "._" in name and not name.endswith("__")
    }
    assert all("#flask_idempotency." in uri and "._" not in uri for uri in private.values())
    from tests.unit.test_package import PUBLIC

    missing = []
    for module_name, names in PUBLIC.items():
        module = importlib.import_module(module_name)
        for name in names:
            value = getattr(module, name)
            if module_name == "flask_idempotency.cli":  # sphinx-click's page, docs/cli.md
                assert f".. click:: {module_name}:{name}" in (DOCS / "cli.md").read_text()
                continue
            if isinstance(value, type(importlib)):  # a module (flask_idempotency.signals)
                if value.__name__ not in documented:
                    missing.append(value.__name__)
                continue
            # Documented under this module, or under another public module that
            # exports the same object (the root's errors are documented in errors).
            homes = {
                f"{other}.{name}"
                for other, exported in PUBLIC.items()
                if name in exported and getattr(importlib.import_module(other), name) is value
            }
            if not homes & documented:
                missing.append(f"{module_name}.{name}")
    assert not missing, missing
