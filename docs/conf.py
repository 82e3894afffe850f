"""Sphinx configuration: MyST pages, autodoc for the API, sphinx-click for the CLI,
and the Pallets theme the Flask extensions use. Built in CI with warnings as errors:
``python -m sphinx -W --keep-going -b html docs docs/_build/html``."""

from __future__ import annotations

import sys
from pathlib import Path

from pallets_sphinx_themes import ProjectLink

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))
sys.path.insert(0, str(HERE.parent))

import flask_idempotency  # noqa: E402

project = "Flask-Idempotency"
copyright = "2026, the Flask-Idempotency authors"
author = "the Flask-Idempotency authors"
release = flask_idempotency.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "myst_parser",
    "sphinx_click",
    "pallets_sphinx_themes",
    "idempotency_docs",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"

# Links to a heading of another page (`outbox.md#the-relay`) resolve to its anchor.
myst_heading_anchors = 4
myst_enable_extensions = ["deflist"]
# Only these domains resolve a Markdown link (the theme's click and jinja domains cannot).
myst_ref_domains = ["std", "py"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
# A method without a docstring of its own shows none, not its base class's (whose
# references point into another project's documentation).
autodoc_inherit_docstrings = False
# The annotations name types from other packages (Flask, SQLAlchemy, requests):
# without their inventories (no network in CI) they stay plain text, not warnings.
nitpicky = False

html_theme = "flask"
html_theme_options = {"index_sidebar_logo": False}
html_context = {
    "project_links": [
        ProjectLink("Source Code", "https://github.com/flask-idempotency/flask-idempotency/"),
        ProjectLink(
            "Issue Tracker", "https://github.com/flask-idempotency/flask-idempotency/issues/"
        ),
        ProjectLink("Changes", "https://flask-idempotency.readthedocs.io/en/latest/changelog.html"),
    ]
}
html_sidebars = {
    "index": ["project.html", "localtoc.html", "searchbox.html"],
    "**": ["localtoc.html", "relations.html", "searchbox.html"],
}
html_title = f"Flask-Idempotency Documentation ({version})"
html_show_sourcelink = False
