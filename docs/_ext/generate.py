"""Write the Markdown of the generated sections of the documentation's pages.

The reference pages (configuration, CLI, API, problem types, the testing kit's reference)
are built by Sphinx from directives that read the package itself, and are read on GitHub
as plain Markdown, where a directive shows nothing. Each such section therefore holds
both: the directives, in an HTML comment that GitHub does not show, and below it their
rendering as plain Markdown, which GitHub shows::

    <!-- generated from the directives below by `python -m docs._ext.generate`:
    ```{idempotency-settings}
    ```
    -->
    ... Markdown ...
    <!-- end of generated -->

Sphinx renders the directives in place of the whole section (``idempotency_docs``
replaces it when it reads the page), so the site keeps its cross-references; this
module rewrites the Markdown below them. Run it from the repository root after changing
a setting, a command, a docstring or a directive::

    python -m docs._ext.generate          # rewrite the pages
    python -m docs._ext.generate --check  # exit 1, naming the pages, if one is stale

The Markdown comes from the same sources as the directives: ``config.SETTINGS`` for the
settings, the click commands' own ``--help`` for the CLI, the problem types' classes, and
for ``autodoc`` directives a Sphinx build of just those directives with the Markdown
builder of ``sphinx-markdown-builder``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from io import StringIO
from pathlib import Path

import click

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent
ROOT = DOCS.parent

sys.path.insert(0, str(HERE))
import idempotency_docs  # noqa: E402

from flask_idempotency import config, errors  # noqa: E402

COMMAND = "python -m docs._ext.generate"
SECTION = idempotency_docs.GENERATED
#: The width the CLI's help is wrapped to, whatever the terminal that runs this.
HELP_WIDTH = 92


@dataclass
class Section:
    """One generated section of a page: its directives and where it is."""

    page: Path
    start: int
    end: int
    source: str
    markdown: str = ""


def sections(pages: list[Path]) -> Iterator[Section]:
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for match in SECTION.finditer(text):
            yield Section(page, match.start(), match.end(), match["source"])


def pages_with_sections() -> list[Path]:
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if "_build" not in p.parts and idempotency_docs.GENERATED_START in p.read_text("utf-8")
    )


# Settings, problem types: from the package's tables.


def settings_markdown() -> str:
    parts = []
    for setting in config.SETTINGS:
        default = idempotency_docs.default_text(setting.default)
        parts.append(f"### `{setting.key}`\n\nDefault: {default}.\n\n{setting.doc.strip()}\n")
    return "\n".join(parts)


def problem_types_markdown() -> str:
    classes = idempotency_docs.problem_classes()
    rows = ["| type | status | title |", "|---|---|---|"]
    for slug in idempotency_docs.problem_slugs():
        status, title = idempotency_docs.problem_status_title(slug, classes)
        rows.append(f"| [{slug}]({slug}.md) | {status} | {title} |")
    return "\n".join(rows) + "\n"


def problem_facts_markdown(slug: str) -> str:
    classes = idempotency_docs.problem_classes()
    status, title = idempotency_docs.problem_status_title(slug, classes)
    if slug in classes:
        raised = f"`flask_idempotency.errors.{classes[slug].__name__}`"
    else:
        raised = "none: a replay's body, not an exception"
    return (
        "| | |\n|---|---|\n"
        f"| type | `{errors.PROBLEM_TYPE_BASE + slug}` |\n"
        f"| status | {status} |\n"
        f"| title | {title} |\n"
        f"| exception | {raised} |\n"
        "| content type | `application/problem+json` (RFC 9457) |\n"
    )


# The CLI: each command's --help, as a terminal shows it.

CLICK = re.compile(
    r"^\.\. click:: (?P<module>[\w.]+):(?P<attr>\w+)\n(?P<options>(?:   .*\n?)*)", re.M
)


def click_markdown(directive: str) -> str:
    match = CLICK.search(directive)
    assert match is not None, directive
    module = importlib.import_module(match["module"])
    group = getattr(module, match["attr"])
    prog = re.search(r":prog: (.+)", match["options"])
    assert prog is not None, "a .. click:: directive here needs :prog:"
    *parents, name = prog[1].split()
    root = None
    for parent in parents:
        root = click.Context(click.Group(parent), info_name=parent, parent=root)
    parts = []

    def walk(command: click.Command, info_name: str, parent: click.Context | None) -> None:
        ctx = click.Context(
            command,
            info_name=info_name,
            parent=parent,
            terminal_width=HELP_WIDTH,
            max_content_width=HELP_WIDTH,
        )
        parts.append(f"### {ctx.command_path}\n\n```text\n{command.get_help(ctx)}\n```\n")
        if isinstance(command, click.Group):
            for sub in command.list_commands(ctx):
                child = command.get_command(ctx, sub)
                if child is not None and not child.hidden:
                    walk(child, sub, ctx)

    walk(group, name, root)
    return "\n".join(parts)


# autodoc: a Sphinx build of the directives alone, with the Markdown builder.

CONF = """
import sys
sys.path[:0] = [{ext!r}, {root!r}]
exec(compile(open({conf!r}).read(), {conf!r}, "exec"))
extensions = [e for e in extensions if e not in ("pallets_sphinx_themes",)]
extensions.append("sphinx_markdown_builder")
html_theme = "alabaster"
html_context = {{}}
markdown_anchor_signatures = True
markdown_anchor_sections = False
# The docstrings' own quotes, as written (no typographic ones).
smartquotes = False
# Types in the signature's place would make the headings unreadable; the docstrings say
# what each parameter takes.
autodoc_typehints = "none"

from sphinx_markdown_builder.translator import MarkdownTranslator


class Translator(MarkdownTranslator):
    # The ``*`` of keyword-only parameters is an abbreviation node: its text is enough.
    def visit_abbreviation(self, node):
        pass

    def depart_abbreviation(self, node):
        pass


def setup(app):
    app.set_translator("markdown", Translator, override=True)
"""

DOC_LINK = re.compile(r"\]\(s(\d+)\.md(#[^)]*)?\)")
#: A value shown as ``<... object at 0x7f...>``: its address changes every run.
ADDRESS_VALUE = re.compile(r" \*= <[^>\n]* object at 0x[0-9a-f]+[^>\n]*>\*")


def autodoc_markdown(pending: list[Section]) -> None:
    """Render every autodoc section in one Sphinx build, one document each."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, "src"), Path(tmp, "out")
        src.mkdir()
        (src / "conf.py").write_text(
            CONF.format(ext=str(HERE), root=str(ROOT), conf=str(DOCS / "conf.py")),
            encoding="utf-8",
        )
        names = [f"s{i}" for i in range(len(pending))]
        toctree = "\n".join(names)
        (src / "index.md").write_text(f"# x\n\n```{{toctree}}\n{toctree}\n```\n", "utf-8")
        for name, section in zip(names, pending, strict=True):
            (src / f"{name}.md").write_text(f"# {name}\n\n{section.source}\n", "utf-8")
        from sphinx.cmd.build import build_main

        log = StringIO()
        with redirect_stdout(log), redirect_stderr(log):
            status = build_main(["-q", "-W", "-b", "markdown", str(src), str(out)])
        if status != 0:
            raise SystemExit(
                f"the Markdown build of the autodoc sections failed:\n{log.getvalue()}"
            )
        for i, section in enumerate(pending):
            text = (out / f"s{i}.md").read_text(encoding="utf-8")
            text = text.split("\n", 1)[1].lstrip("\n")  # the page's own title

            def link(match: re.Match[str], page: Path = section.page) -> str:
                target = pending[int(match[1])].page
                anchor = match[2] or ""
                if target == page:
                    return f"]({anchor or '#'})"
                return f"]({os.path.relpath(target, page.parent)}{anchor})"

            text = ADDRESS_VALUE.sub("", DOC_LINK.sub(link, text))
            section.markdown = text.rstrip() + "\n"


def render(all_sections: list[Section]) -> None:
    autodoc = []
    for section in all_sections:
        source = section.source.strip()
        if source == "```{idempotency-settings}\n```":
            section.markdown = settings_markdown()
        elif source == "```{problem-types}\n```":
            section.markdown = problem_types_markdown()
        elif source.startswith("```{problem-facts} "):
            section.markdown = problem_facts_markdown(source.split()[1])
        elif ".. click::" in source:
            section.markdown = click_markdown(source)
        elif source.startswith("```{eval-rst}"):
            autodoc.append(section)
        else:
            raise SystemExit(f"{section.page}: no Markdown rendering for {source!r}")
    if autodoc:
        autodoc_markdown(autodoc)


def generated(page: Path, page_sections: list[Section]) -> str:
    text = page.read_text(encoding="utf-8")
    parts, at = [], 0
    for section in page_sections:
        parts.append(text[at : section.start])
        parts.append(idempotency_docs.section_text(section.source, section.markdown))
        at = section.end
    parts.append(text[at:])
    return "".join(parts)


def stale_pages(write: bool) -> list[Path]:
    """The pages whose generated sections differ from what the sources give now."""
    pages = pages_with_sections()
    found = list(sections(pages))
    render(found)
    stale = []
    for page in pages:
        new = generated(page, [s for s in found if s.page == page])
        if new != page.read_text(encoding="utf-8"):
            stale.append(page)
            if write:
                page.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    stale = stale_pages(write=not args.check)
    for page in stale:
        verb = "is stale" if args.check else "rewritten"
        print(f"{page.relative_to(ROOT)}: {verb}")
    if args.check and stale:
        print(f"run `{COMMAND}` from the repository root to regenerate them")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
