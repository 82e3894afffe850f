"""Directives that render reference pages from the package itself, so they cannot drift.

``idempotency-settings``
    every setting of :data:`flask_idempotency.config.SETTINGS` as a ``confval``
    (key, default, meaning), in the table's order;
``problem-types``
    a table of every problem type the extension answers (slug, status, title),
    each linking to its page ``problems/<slug>``;
``problem-facts`` *slug*
    the facts of one problem type: its ``type`` URI, status, title and exception.

The text is generated as MyST Markdown and parsed in place, so the settings'
meanings are written in Markdown in ``config.py``.
"""

from __future__ import annotations

import re
import typing as t
from datetime import timedelta
from pathlib import Path

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

import flask_idempotency
from flask_idempotency import config, errors

PACKAGE = Path(flask_idempotency.__file__).resolve().parent

#: Problem types answered without an exception class: the slug in a literal
#: ``PROBLEM_TYPE_BASE + "<slug>"`` in the package's source, with its status and title.
UNCLASSED = {
    "response-not-stored": (
        "the original status",
        "The original response body was not kept",
    ),
}


def default_text(value: t.Any) -> str:
    """A setting's default as the documentation shows it."""
    if isinstance(value, timedelta):
        seconds = int(value.total_seconds())
        for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
            if seconds % size == 0 and (seconds != size or unit != "day"):  # 24 hours
                count = seconds // size
                return f"{count} {unit}{'' if count == 1 else 's'}"
    return f"`{value!r}`"


def problem_classes() -> dict[str, type[errors.ProblemError]]:
    """Every ProblemError subclass the package defines, by slug."""
    found: dict[str, type[errors.ProblemError]] = {}
    pending: list[type[errors.ProblemError]] = [errors.ProblemError]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("flask_idempotency"):
                found[sub.slug] = sub
                pending.append(sub)
    return found


SLUG_IN_SOURCE = re.compile(r'PROBLEM_TYPE_BASE\s*\+\s*"([a-z-]+)"')


def problem_slugs() -> list[str]:
    """Every problem type slug the extension answers: its exception classes'
    slugs and the literal ones in its source, sorted."""
    slugs = set(problem_classes())
    for path in PACKAGE.rglob("*.py"):
        slugs.update(SLUG_IN_SOURCE.findall(path.read_text(encoding="utf-8")))
    return sorted(slugs)


class _MarkdownDirective(SphinxDirective):
    def render(self, text: str) -> list[nodes.Node]:
        container = nodes.container()
        self.state.nested_parse(StringList(text.splitlines()), self.content_offset, container)
        return list(container.children)


class SettingsDirective(_MarkdownDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        self.env.note_dependency(config.__file__)
        parts = []
        for setting in config.SETTINGS:
            parts.append(
                f"````{{confval}} {setting.key}\n"
                f":default: {default_text(setting.default)}\n\n"
                f"{setting.doc}\n"
                "````\n"
            )
        return self.render("\n".join(parts))


class ProblemTypesDirective(_MarkdownDirective):
    has_content = False

    def run(self) -> list[nodes.Node]:
        classes = problem_classes()
        rows = ["| type | status | title |", "|---|---|---|"]
        for slug in problem_slugs():
            if slug in classes:
                status, title = str(classes[slug].code), classes[slug].title
            else:
                status, title = UNCLASSED[slug]
            rows.append(f"| {{doc}}`{slug} </problems/{slug}>` | {status} | {title} |")
        return self.render("\n".join(rows))


class ProblemFactsDirective(_MarkdownDirective):
    required_arguments = 1
    has_content = False

    def run(self) -> list[nodes.Node]:
        slug = self.arguments[0]
        classes = problem_classes()
        uri = errors.PROBLEM_TYPE_BASE + slug
        if slug in classes:
            cls = classes[slug]
            status, title = str(cls.code), cls.title
            raised = f"{{class}}`flask_idempotency.errors.{cls.__name__}`"
        elif slug in UNCLASSED:
            status, title = UNCLASSED[slug]
            raised = "none: a replay's body, not an exception"
        else:
            raise self.error(f"no problem type {slug!r} in flask_idempotency")
        return self.render(
            f"type\n: `{uri}`\n\n"
            f"status\n: {status}\n\n"
            f"title\n: {title}\n\n"
            f"exception\n: {raised}\n\n"
            "content type\n: `application/problem+json` (RFC 9457)\n"
        )


def setup(app: Sphinx) -> dict[str, t.Any]:
    app.add_directive("idempotency-settings", SettingsDirective)
    app.add_directive("problem-types", ProblemTypesDirective)
    app.add_directive("problem-facts", ProblemFactsDirective)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
